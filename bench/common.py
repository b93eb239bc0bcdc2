"""What every part of the harness shares: databases, seed data, the no-op channel."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox.channels import Deadline, Message, Outcome, SchemaChannel
from outbox_cli.devdb import LOCAL_POSTGRES, pg8000_url

CHANNEL = "bench"


# --- the no-op provider --------------------------------------------------------


class NoopChannel(SchemaChannel):
    """A provider that accepts everything at once: what is left is the relay's own cost.

    Its schema is the email channel's shape, so validation costs what it would.
    """

    name = CHANNEL
    schema: Mapping[str, Any] = {
        "type": "object",
        "required": ["from", "to", "subject"],
        "properties": {
            "from": {"type": "string", "pattern": "^[^@\\s]+@[^@\\s]+$"},
            "to": {
                "type": "array",
                "minItems": 1,
                "maxItems": 50,
                "items": {"type": "string", "pattern": "^[^@\\s]+@[^@\\s]+$"},
            },
            "subject": {"type": "string", "maxLength": 998},
            "text": {"type": "string"},
        },
    }

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        return Outcome.delivered(f"noop-{message.id}")


def register_channel() -> None:
    from outbox import channels

    channels.register(CHANNEL, lambda: NoopChannel())


def quiet_process() -> Callable[[], None]:
    """Send the relay's JSON logs and metric blobs nowhere (they are still formatted,
    as they would be in Lambda, but the terminal stays readable). Returns an undo."""
    import logging
    import sys

    import outbox.observability  # noqa: F401 - creates the "outbox" logger's handler

    devnull = open(os.devnull, "w")  # noqa: SIM115 - closed by the undo
    saved_stdout = sys.stdout
    sys.stdout = devnull
    streams = []
    for handler in logging.getLogger("outbox").handlers:
        if isinstance(handler, logging.StreamHandler):
            streams.append((handler, handler.setStream(devnull)))

    def undo() -> None:
        sys.stdout = saved_stdout
        for handler, stream in streams:
            handler.setStream(stream)
        devnull.close()

    return undo


# --- payloads --------------------------------------------------------------------

# A realistic email payload of 0.3 to 1 KB, made by the database itself so that
# seeding hundreds of thousands of rows stays one INSERT ... SELECT.
PAYLOAD_SQL = """
    jsonb_build_object(
        'from', 'shop@example.com',
        'to', jsonb_build_array('customer' || g || '@example.net'),
        'subject', 'Your order ' || g || ' has shipped',
        'text', left(repeat(md5(g::text) || ' ', 40),
                     {min_text} + mod(g::bigint * 7919, {spread})::int)
    )
"""


def payload_sql(min_text: int = 180, spread: int = 700) -> str:
    return PAYLOAD_SQL.format(min_text=min_text, spread=spread)


def python_payload(i: int) -> dict[str, Any]:
    """The same shape as PAYLOAD_SQL, built in Python (for the producer benchmarks)."""
    import hashlib

    text = (hashlib.md5(str(i).encode()).hexdigest() + " ") * 40  # noqa: S324 - filler text
    return {
        "from": "shop@example.com",
        "to": [f"customer{i}@example.net"],
        "subject": f"Your order {i} has shipped",
        "text": text[: 180 + (i * 7919) % 700],
    }


# --- databases ---------------------------------------------------------------------


def server_url() -> str:
    """The Postgres server to create the benchmark databases on."""
    return pg8000_url(os.environ.get("DATABASE_URL") or LOCAL_POSTGRES)


def url_for(server: str, database: str) -> str:
    return make_url(server).set(database=database).render_as_string(hide_password=False)


def no_delay(connection: Any) -> None:
    """TCP_NODELAY on a pg8000 connection, as the relay's engine sets it (outbox.db)."""
    from outbox.db import _no_delay

    _no_delay(connection, None)


def native_params(url: str) -> dict[str, Any]:
    """Keyword arguments for ``pg8000.native.Connection`` from a URL."""
    u = make_url(url)
    params: dict[str, Any] = {
        "user": u.username or "postgres",
        "host": u.host or "127.0.0.1",
        "port": u.port or 5432,
        "database": u.database,
        "application_name": "outbox-bench",
    }
    if u.password:
        params["password"] = u.password
    if "unix_sock" in u.query:  # an embedded server (outbox_cli.devdb) listens on a socket file
        params.pop("host"), params.pop("port")
        params["unix_sock"] = u.query["unix_sock"]
    return params


class Databases:
    """Throwaway databases on one server: a migrated template, then one fresh copy per cell."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.admin = sa.create_engine(
            server, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool, hide_parameters=True
        )
        self.prefix = f"outbox_bench_{uuid.uuid4().hex[:8]}"
        self.template = f"{self.prefix}_tpl"
        self._made: list[str] = []

    def _execute(self, sql: str) -> None:
        with self.admin.connect() as conn:
            conn.execute(sa.text(sql))

    def prepare_template(self) -> None:
        """Create and migrate the template once; each cell copies it (CREATE DATABASE ...
        TEMPLATE)."""
        from outbox import migrate
        from outbox.db import create_engine
        from outbox.relay_settings import DatabaseSettings

        self._execute(f'CREATE DATABASE "{self.template}"')
        self._made.append(self.template)
        engine = create_engine(
            DatabaseSettings(url=url_for(self.server, self.template), sslmode="disable")
        )
        try:
            migrate.upgrade(engine)
        finally:
            engine.dispose()

    @contextlib.contextmanager
    def fresh(self, label: str) -> Iterator[str]:
        """A freshly created, migrated database for one cell; dropped afterwards."""
        name = f"{self.prefix}_{label}"[:63]
        self._execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        try:
            yield url_for(self.server, name)
        finally:
            self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        for name in self._made:
            self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.admin.dispose()


def engine_for(url: str, pool_size: int = 1) -> sa.Engine:
    """The relay's own engine configuration (outbox.db.create_engine, as Runtime builds it)."""
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings

    return create_engine(
        DatabaseSettings(url=url, sslmode="disable"), pool_size=pool_size, autocommit=True
    )


def seed_pending(url: str, rows: int, *, vacuum: bool = True) -> None:
    """``rows`` due pending rows with realistic payloads, then VACUUM ANALYZE."""
    engine = sa.create_engine(
        url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool, hide_parameters=True
    )
    try:
        with engine.connect() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO outbox_message (channel, payload, available_at) "
                    f"SELECT :channel, {payload_sql()}, now() - interval '1 second' "
                    "FROM generate_series(1, :rows) AS g"
                ),
                {"channel": CHANNEL, "rows": rows},
            )
            if vacuum:
                conn.execute(sa.text("VACUUM ANALYZE outbox_message"))
                conn.execute(sa.text("VACUUM ANALYZE outbox_attempt"))
    finally:
        engine.dispose()


def count_status(url: str) -> dict[str, int]:
    engine = sa.create_engine(url, poolclass=sa.NullPool, hide_parameters=True)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT status, count(*) FROM outbox_message GROUP BY status")
            ).all()
        return {r[0]: r[1] for r in rows}
    finally:
        engine.dispose()


# --- statistics ----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), nearest-rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (every core,
    every process: /proc/stat's user, nice, system, irq and softirq); None
    where there is no /proc. The difference over a drain, less the drain's
    own processes' CPU, is what the rest of the machine spent meanwhile:
    on the bench machines, Postgres."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


@dataclass
class Stopwatch:
    started: float = 0.0

    def __enter__(self) -> Stopwatch:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.started

    elapsed: float = 0.0
