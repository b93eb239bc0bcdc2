"""PgQueuer, a peer Postgres job queue, draining the same rows in the same run.

A bench-only dependency (``pip install -e '.[bench]'``: pgqueuer and asyncpg).
Each cell installs PgQueuer's own schema into the cell's fresh database,
enqueues ``rows`` jobs carrying the same email-shaped payloads as the relay's
rows, and lets ``workers`` processes drain them with a no-op entrypoint through
PgQueuer's own dequeue and acknowledgement (``QueueManager.run(mode=drain)``).
The clock runs from all workers ready to the last worker's queue manager
returning (its acknowledgements flushed).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import make_url

from . import common

ENTRYPOINT = "bench"


def available() -> bool:
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
    except ImportError:
        return False
    return True


def _dsn(url: str) -> dict[str, Any]:
    u = make_url(url)
    params: dict[str, Any] = {"user": u.username or "postgres", "database": u.database}
    if "unix_sock" in u.query:  # an embedded server: asyncpg wants the socket's folder
        sock = str(u.query["unix_sock"])
        folder, _, name = sock.rpartition("/")
        params.update(host=folder, port=int(name.rsplit(".", 1)[1]))
    else:
        params.update(host=u.host or "127.0.0.1", port=u.port or 5432)
    if u.password:
        params["password"] = u.password
    return params


async def _seed(url: str, rows: int) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(**_dsn(url))
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        chunk = 1000
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            payloads = [
                json.dumps(common.python_payload(start + i), separators=(",", ":")).encode()
                for i in range(n)
            ]
            await queries.enqueue([ENTRYPOINT] * n, payloads, [0] * n)
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


def seed(url: str, rows: int) -> None:
    asyncio.run(_seed(url, rows))


def _counting_connection() -> Any:
    """An asyncpg connection class that counts the statements PgQueuer sends."""
    import asyncpg

    class Counting(asyncpg.Connection):  # type: ignore[misc]
        statements = 0

        async def execute(self, *args: Any, **kwargs: Any) -> Any:
            Counting.statements += 1
            return await super().execute(*args, **kwargs)

        async def executemany(self, *args: Any, **kwargs: Any) -> Any:
            Counting.statements += 1
            return await super().executemany(*args, **kwargs)

        async def fetch(self, *args: Any, **kwargs: Any) -> Any:
            Counting.statements += 1
            return await super().fetch(*args, **kwargs)

        async def fetchrow(self, *args: Any, **kwargs: Any) -> Any:
            Counting.statements += 1
            return await super().fetchrow(*args, **kwargs)

        async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
            Counting.statements += 1
            return await super().fetchval(*args, **kwargs)

    return Counting


async def _drain(url: str, batch: int, ready: Any, go: Any) -> dict[str, Any]:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    counting = _counting_connection()
    conn = await asyncpg.connect(**_dsn(url), connection_class=counting)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
    done = [0]

    @qm.entrypoint(ENTRYPOINT)
    async def noop(job: Any) -> None:
        json.loads(job.payload)  # what any consumer does with its payload
        done[0] += 1

    ready.put(True)
    statements0 = counting.statements
    while not go.is_set():  # a plain Event: do not block the loop
        await asyncio.sleep(0.001)
    started, cpu0 = time.monotonic(), time.process_time()
    await qm.run(
        dequeue_timeout=timedelta(milliseconds=50),
        batch_size=batch,
        mode=QueueExecutionMode.drain,
        log_aggregation_interval=timedelta(0),
    )
    finished, cpu = time.monotonic(), time.process_time() - cpu0
    await conn.close()
    return {
        "rows": done[0],
        "cpu_seconds": cpu,
        "started": started,
        "finished": finished,
        "statements": counting.statements - statements0,
    }


def _worker(url: str, batch: int, ready: Any, go: Any, out: Any) -> None:
    try:
        out.put(asyncio.run(_drain(url, batch, ready, go)))
    except BaseException as exc:  # report, never hang the parent
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        ready.put(False)


def run_cell(url: str, batch: int, workers: int, timeout: float = 600.0) -> dict[str, Any]:
    """Drain the seeded jobs with ``workers`` processes; rows per second over the whole run."""
    from .throughput import cpu_split, run_processes

    results, machine = run_processes(_worker, (url, batch), workers, timeout)
    rows = sum(r["rows"] for r in results)
    elapsed = max(r["finished"] for r in results) - min(r["started"] for r in results)
    return {
        "rows": rows,
        "seconds": elapsed,
        "rows_per_s": rows / elapsed if elapsed else 0.0,
        "statements": sum(r["statements"] for r in results),
        **cpu_split(results, machine, rows),
    }


def remaining_jobs(url: str) -> int:
    async def count() -> int:
        import asyncpg

        conn = await asyncpg.connect(**_dsn(url))
        try:
            return int(await conn.fetchval("SELECT count(*) FROM pgqueuer"))
        finally:
            await conn.close()

    return asyncio.run(count())
