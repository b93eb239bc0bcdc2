"""Throughput: claim -> deliver -> settle, the relay against raw SQL on the same driver.

Every cell starts from a freshly created, vacuumed database holding ``rows``
due pending rows, and runs ``workers`` processes that drain it. A worker
connects and warms up first; the clock starts when all of them are ready and
stops when the last one finds nothing left to claim.

* baseline: pg8000 directly, autocommit: one SKIP LOCKED claim CTE, then one
  fenced ``= ANY(array)`` UPDATE that settles the batch as delivered.
* protocol: exactly the relay's own statements (the claim, the sender's
  fenced read of its rows, the settle that writes the attempt rows), their SQL
  text taken from ``outbox.store`` itself, run through ``pg8000.native`` with no
  framework around them: ``relay / protocol`` is the relay's own overhead.
* relay: the real dispatcher path (``dispatcher.dispatch_once`` ->
  ``store.claim``), the hand-off event (``HandOff.to_event``, JSON-encoded as
  the Lambda invoke would, then ``HandOff.from_event`` inside the sender), and
  the real ``sender.run``: the receipt (a compare-and-set UPDATE returning the
  payloads), the no-op provider, one batched fenced settle that writes the
  attempt rows.
* relay-read: the relay as it was before the receipt, for its cost: the same,
  but the sender takes its rows with the former fenced plain SELECT.
* worker: ``outbox worker``'s loop (``Worker.run_once``): claim, in-process
  hand-off, send and settle in one process.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

from . import common

LEASE_SECONDS = 120

BASELINE_CLAIM = """
    WITH due AS (
        SELECT id FROM outbox_message
        WHERE status = 'pending' AND available_at <= now()
        ORDER BY priority DESC, available_at, id
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox_message AS m
    SET status = 'claimed', claim_token = gen_random_uuid(), claimed_at = now(),
        lease_expires_at = now() + make_interval(secs => :lease)
    FROM due
    WHERE m.id = due.id AND m.status = 'pending'
    RETURNING m.id, m.claim_token
"""

BASELINE_SETTLE = """
    UPDATE outbox_message
    SET status = 'delivered', attempts = attempts + 1, claim_token = NULL,
        lease_expires_at = NULL, settled_at = now()
    WHERE id = ANY(CAST(:ids AS bigint[])) AND claim_token = ANY(CAST(:tokens AS uuid[]))
      AND status = 'claimed'
"""


class RoundTrips:
    """Counts pg8000's socket flushes in this process: each is one request/response exchange."""

    count = 0

    @classmethod
    def install(cls) -> None:
        import pg8000.core

        real = pg8000.core._flush
        if getattr(real, "_counted", False):
            return

        def counted(sock: Any) -> None:
            cls.count += 1
            real(sock)

        counted._counted = True  # type: ignore[attr-defined]
        pg8000.core._flush = counted


def _baseline_stepper(url: str, batch: int) -> tuple[Callable[[], int], Callable[[], None]]:
    import pg8000.native

    conn = pg8000.native.Connection(**common.native_params(url))
    common.no_delay(conn)  # the same socket setting as the relay's engine
    statements = [0]

    def step() -> int:
        from outbox.errors import moved_meanwhile

        while True:  # as the relay does: a row another worker moved is read again
            try:
                rows = conn.run(BASELINE_CLAIM, batch=batch, lease=float(LEASE_SECONDS))
                break
            except pg8000.native.DatabaseError as exc:
                if not moved_meanwhile(exc):
                    raise
                statements[0] += 1
        statements[0] += 1
        if not rows:
            return 0
        conn.run(
            BASELINE_SETTLE,
            ids=[r[0] for r in rows],
            tokens=[str(r[1]) for r in rows],
        )
        statements[0] += 1
        return len(rows)

    step.statements = statements  # type: ignore[attr-defined]
    return step, conn.close


def _protocol_stepper(url: str, batch: int) -> tuple[Callable[[], int], Callable[[], None]]:
    """The relay's three statements, verbatim from store.py, with nothing around them:
    the claim, the sender's receipt (payloads come back as text and are decoded here,
    as the sender does) and the settle that writes the attempt rows."""
    import pg8000.native

    from outbox import store

    conn = pg8000.native.Connection(**common.native_params(url))
    common.no_delay(conn)
    claim_sql, read_sql, settle_sql = (
        # what the relay runs while the claim's other gates are idle
        store.delivery._CLAIMS[store.delivery.LEAN, False].text,
        store.delivery._RECEIVE_CLAIMED.text,
        store.delivery._SETTLE.text,
    )
    backoff = {
        "backoff_base": 30.0,
        "backoff_cap": 1800.0,
        "default_max": 8,
        "max_deferrals": 20,
    }
    statements = [0]

    def step() -> int:
        from outbox.errors import moved_meanwhile

        while True:  # the relay's execute_fenced: a row another worker moved is read again
            try:
                claimed = conn.run(
                    claim_sql,
                    batch_size=batch,
                    lease_seconds=float(LEASE_SECONDS),
                    default_ttl=86400.0,
                )
                break
            except pg8000.native.DatabaseError as exc:
                if not moved_meanwhile(exc):
                    raise
                statements[0] += 1
        statements[0] += 1
        # the claim's answer (store.delivery._answer): its rows' fields (Claim's)
        # as JSON in its first row, with the form it names for the next claim
        claimed = claimed[0][0] or []
        if not claimed:
            return 0
        head, *payloads = conn.run(
            read_sql,
            ids=store.array_literal(f[0] for f in claimed),
            tokens=store.array_literal(f[2] for f in claimed),
            channel=common.CHANNEL,
            default_max=8,
        )
        # ClaimedMessage's fields but the payload, as JSON; then a row a payload
        rows = head[0] or []
        i_token = store.ClaimedMessage._fields.index("claim_token") - 1
        for row in payloads:
            json.loads(row[1])
        # store.settle's document: [id, token, outcome, error, provider_id, delay_s, duration_ms]
        settlements = json.dumps(
            [[f[0], f[i_token], "delivered", None, f"noop-{f[0]}", None, 0] for f in rows],
            separators=(",", ":"),
        )
        conn.run(settle_sql, settlements=settlements, rows=len(rows), **backoff)
        statements[0] += 2
        return len(claimed)

    step.statements = statements  # type: ignore[attr-defined]
    step.connection = conn  # type: ignore[attr-defined]
    return step, conn.close


def _protocol_one_trip_stepper(
    url: str, batch: int
) -> tuple[Callable[[], int], Callable[[], None]]:
    """The protocol baseline sending each statement as the relay's engine does, in
    one round trip (``db._execute_in_one_round_trip``), for the comparison in
    bench/README.md: not a cell of ``make bench``."""
    from outbox import db

    step, close = _protocol_stepper(url, batch)
    conn = step.connection  # type: ignore[attr-defined]
    db._execute_in_one_round_trip(conn, None)
    return step, close


def relay_parts(url: str, batch: int) -> tuple[Any, Any, Any, list[int]]:
    """The relay wired in process: (engine, invoker, settings, statement counter)."""
    import sqlalchemy as sa

    from outbox import sender
    from outbox.handoff import CallableInvoker
    from outbox.relay_settings import RelaySettings

    common.register_channel()
    engine = common.engine_for(url)
    statements = [0]

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _count(*args: Any) -> None:
        statements[0] += 1

    settings = RelaySettings(
        batch_size=batch,
        handoff_chunk_size=batch,  # one hand-off (one sender invocation) per claimed batch
        lease_seconds=LEASE_SECONDS,
    )

    def remaining() -> float:
        return 60.0

    def send(event: dict[str, Any]) -> None:
        # What the async Lambda invoke does to the event: JSON on the wire.
        wire = json.loads(json.dumps(event, separators=(",", ":")))
        sender.run(engine, wire, settings, remaining, channel_name=common.CHANNEL)

    invoker = CallableInvoker({common.CHANNEL: send})
    warm(engine, settings, connections=1)
    return engine, invoker, settings, statements


def warm(engine: Any, settings: Any, connections: int) -> None:
    """What a warm function (or a running ``outbox worker``) already has, made
    before the clock starts, as the raw steppers' connection is: the pool's
    connections, the channel's compiled validator and the send threads. The
    cold start is ``bench.coldstart``'s to measure."""
    import contextlib

    from outbox import channels, sendpool

    with contextlib.ExitStack() as stack:
        for _ in range(connections):
            stack.enter_context(engine.connect())
    channels.get(common.CHANNEL).validate(common.python_payload(1))
    sendpool.pools.get(settings.send_concurrency)


def _relay_stepper(url: str, batch: int) -> tuple[Callable[[], int], Callable[[], None]]:
    from outbox import dispatcher

    engine, invoker, settings, statements = relay_parts(url, batch)

    def step() -> int:
        report = dispatcher.dispatch_once(engine, invoker, settings)
        if report.claimed and report.handed_off != report.claimed:
            raise RuntimeError(f"hand-off lost claims: {report}")
        return report.claimed

    step.statements = statements  # type: ignore[attr-defined]
    return step, engine.dispose


def _worker_stepper(url: str, batch: int) -> tuple[Callable[[], int], Callable[[], None]]:
    """``outbox worker``: its whole loop (``Worker.run(until_empty=True)``) as one
    step: claim, send, and the batch's settle while the next batch is claimed.
    Two connections, as the command's engine has (it has four)."""
    import sqlalchemy as sa

    from outbox import observability
    from outbox.relay_settings import RelaySettings
    from outbox.worker import Worker

    common.register_channel()
    engine = common.engine_for(url, pool_size=2)
    statements = [0]

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _count(*args: Any) -> None:
        statements[0] += 1

    settings = RelaySettings(
        batch_size=batch, handoff_chunk_size=batch, lease_seconds=LEASE_SECONDS
    )
    worker = Worker(engine, settings, channels=[common.CHANNEL])
    warm(engine, settings, connections=2)
    # As the `outbox worker` command runs it: no metrics (it has no Lambda log
    # pipeline to carry EMF), for the rest of this worker process.
    suspended = observability.suspended()
    suspended.__enter__()

    # The loop reaps first: count that pass's statements here, to leave them out.
    worker.reap()
    reap_statements, statements[0] = statements[0], 0

    def step() -> int:
        if worker.report.batches:
            return 0  # the loop ran to the end of the backlog
        report = worker.run(until_empty=True)
        statements[0] -= reap_statements
        # One step for the harness; the loop's own count of claims, less the
        # last, empty one, for the figures per batch.
        step.batches = report.batches - 1  # type: ignore[attr-defined]
        return report.claimed

    def close() -> None:
        engine.dispose()
        suspended.__exit__(None, None, None)

    step.statements = statements  # type: ignore[attr-defined]
    return step, close


# The sender's read before the receipt (a plain fenced SELECT), kept here only
# to measure what the receipt costs: the ``relay-read`` cell.
FENCED_READ = """
    SELECT m.id, m.channel, CAST(m.payload AS text) AS payload, m.attempts + 1 AS attempt,
           COALESCE(m.max_attempts, :default_max) AS max_attempts,
           CAST(m.claim_token AS text) AS claim_token, m.dedupe_key, m.ordering_key,
           EXTRACT(EPOCH FROM m.lease_expires_at - now())::float8 AS lease_left
    FROM outbox_message AS m
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[])) AS h(id, token)
      ON m.id = h.id AND m.claim_token = h.token
    WHERE m.status = 'claimed' AND m.channel = :channel AND m.lease_expires_at > now()
    ORDER BY m.id
"""


def _relay_read_stepper(url: str, batch: int) -> tuple[Callable[[], int], Callable[[], None]]:
    import sqlalchemy as sa

    from outbox import store

    statement = store._sql.statement(FENCED_READ)

    def fenced_read(
        conn: sa.Connection, channel: str, claims: Any, default_max: int
    ) -> list[store.ClaimedMessage]:
        held = list(claims)
        rows = conn.execute(
            statement,
            {
                "ids": store.array_literal(c.id for c in held),
                "tokens": store.array_literal(c.claim_token for c in held),
                "channel": channel,
                "default_max": default_max,
            },
        ).all()
        return [
            store.ClaimedMessage(
                r.id,
                r.channel,
                r.payload,
                r.attempt,
                r.max_attempts,
                r.claim_token,
                r.dedupe_key,
                r.ordering_key,
                float(r.lease_left),
            )
            for r in rows
        ]

    store.receive_claimed = fenced_read  # type: ignore[assignment]  # this worker process only
    return _relay_stepper(url, batch)


STEPPERS = {
    "baseline": _baseline_stepper,
    "protocol": _protocol_stepper,
    "protocol-1rt": _protocol_one_trip_stepper,
    "relay": _relay_stepper,
    "relay-read": _relay_read_stepper,
    "worker": _worker_stepper,
}


def _worker(kind: str, url: str, batch: int, ready: Any, go: Any, out: Any) -> None:
    try:
        common.quiet_process()
        RoundTrips.install()
        step, close = STEPPERS[kind](url, batch)
        # What the relay's functions do at the end of their cold start (the
        # heap frozen, the collector's young threshold raised), done for
        # every kind alike.
        from outbox.runtime import cold_start_done

        cold_start_done()
        ready.put(True)
        go.wait()
        # Warm-up happened before the barrier: the connection, imports, the
        # statement caches and the channel's compiled validator.
        trips0, started, cpu0 = RoundTrips.count, time.monotonic(), time.process_time()
        done = batches = 0
        trips_before_empty = RoundTrips.count
        while True:
            trips_before_empty = RoundTrips.count
            n = step()
            if n == 0:
                break
            done += n
            batches += 1
        finished, cpu = time.monotonic(), time.process_time() - cpu0
        out.put(
            {
                "rows": done,
                "cpu_seconds": cpu,
                "batches": getattr(step, "batches", batches),
                "started": started,
                "finished": finished,
                "statements": step.statements[0],  # type: ignore[attr-defined]
                "round_trips": trips_before_empty - trips0,
            }
        )
        close()
    except BaseException as exc:  # report, never hang the parent
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        ready.put(False)


def _get(queue: Any, procs: list[Any], timeout: float) -> Any:
    """queue.get, but give up early when a worker died without a word."""
    import queue as queue_module

    deadline = time.monotonic() + timeout
    while True:
        try:
            return queue.get(timeout=0.5)
        except queue_module.Empty:
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                try:
                    return queue.get(timeout=1)
                except queue_module.Empty:
                    raise RuntimeError("a benchmark worker died or hung") from None


def run_processes(
    target: Any, args: tuple[Any, ...], workers: int, timeout: float
) -> tuple[list[Any], float | None]:
    """Start ``workers`` processes of ``target(*args, ready, go, out)``, release them
    together once all are ready, and return what each put on ``out``, and the
    CPU seconds the whole machine spent meanwhile (``common.machine_busy_seconds``)."""
    # fork: the parent holds no connections here, and a forked worker needs no
    # importable __main__ (pytest, python -c, scripts all work).
    ctx = mp.get_context("fork")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=target, args=(*args, ready, go, out), daemon=True)
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not _get(ready, procs, 120):
                break
        busy0 = common.machine_busy_seconds()
        go.set()
        results = [_get(out, procs, timeout) for _ in procs]
        busy1 = common.machine_busy_seconds()
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"benchmark worker failed: {errors[0]}")
    return results, None if busy0 is None or busy1 is None else busy1 - busy0


def cpu_split(results: list[Any], machine: float | None, rows: int) -> dict[str, Any]:
    """The drain's CPU per 100 rows: its own processes' (``cpu_seconds`` of
    each result, the drain's window only: no imports, no seeding) and the rest
    of the machine's meanwhile (Postgres, its WAL writer, and anything else
    running), in milliseconds. Where CPU is the limit (both cores busy), the
    sum says which of two kinds can go faster, and this split says where."""
    client = sum(r["cpu_seconds"] for r in results)
    split: dict[str, Any] = {
        "client_cpu_ms_per_100": round(client * 1e5 / rows, 2) if rows else None
    }
    split["rest_cpu_ms_per_100"] = (
        None if machine is None or not rows else round(max(machine - client, 0.0) * 1e5 / rows, 2)
    )
    return split


def run_cell(
    url: str, kind: str, batch: int, workers: int, timeout: float = 600.0
) -> dict[str, Any]:
    """Drain the database with ``workers`` processes; rows per second over the whole run."""
    results, machine = run_processes(_worker, (kind, url, batch), workers, timeout)
    rows = sum(r["rows"] for r in results)
    batches = sum(r["batches"] for r in results)
    # Claims that came back empty end each worker's loop: count them apart.
    elapsed = max(r["finished"] for r in results) - min(r["started"] for r in results)
    statements = sum(r["statements"] for r in results) - workers  # minus the final empty claims
    trips = sum(r["round_trips"] for r in results)
    return {
        "rows": rows,
        "seconds": elapsed,
        "rows_per_s": rows / elapsed if elapsed > 0 else 0.0,
        "batches": batches,
        "statements": statements,
        "statements_per_batch": statements / batches if batches else 0.0,
        "round_trips_per_batch": trips / batches if batches else 0.0,
        **cpu_split(results, machine, rows),
    }
