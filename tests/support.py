"""Helpers shared by the tests (importable as ``support``)."""

from __future__ import annotations

import datetime as dt
import re
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import outbox
from outbox import channels, sender, store
from outbox.channels import Deadline, Message, Outcome, SchemaChannel
from outbox.handoff import HandOff
from outbox.relay_settings import RelaySettings

EMAIL = {
    "from": "relay@example.com",
    "to": ["someone@example.net"],
    "subject": "Your order shipped",
    "text": "It is on its way.",
}


class LambdaContext:
    """The parts of the Lambda context the handlers use, with a real deadline."""

    def __init__(self, timeout_seconds: float = 30.0, name: str = "test-function") -> None:
        self._deadline = time.monotonic() + timeout_seconds
        self.function_name = name
        self.function_version = "$LATEST"
        self.invoked_function_arn = f"arn:aws:lambda:us-east-1:123456789012:function:{name}"
        self.memory_limit_in_mb = 256
        self.aws_request_id = str(uuid.uuid4())
        self.log_group_name = f"/aws/lambda/{name}"
        self.log_stream_name = "test"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def settings(**overrides: Any) -> RelaySettings:
    base: dict[str, Any] = {
        "batch_size": 100,
        "lease_seconds": 120,
        "max_attempts": 3,
        "backoff_base_seconds": 1.0,
        "backoff_cap_seconds": 60.0,
        "poll_interval_seconds": 0.05,
        "settle_margin_seconds": 0.5,
    }
    base.update(overrides)
    return RelaySettings(**base)


@dataclass
class ScriptedChannel(SchemaChannel):
    """A channel whose answers the test decides, recording every send it accepts."""

    name: str = "scripted"
    answers: list[Outcome | Exception | float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        answer: Outcome | Exception | float = (
            self.answers.pop(0) if self.answers else Outcome.delivered()
        )
        if isinstance(answer, float):  # hang this long
            time.sleep(answer)
            answer = Outcome.delivered(f"late-{message.id}")
        if isinstance(answer, Exception):
            raise answer
        if answer.kind == "delivered":
            self.sent.append(message.id)
            if answer.provider_message_id is None:
                answer = Outcome.delivered(f"p-{message.id}")
        return answer


def install_channel(channel: Any) -> Any:
    channels.register(channel.name, lambda: channel)
    return channel


def enqueue(
    db: sa.Engine | sa.Connection,
    n: int = 1,
    channel: str = "email",
    payload: Any = None,
    **fields: Any,
) -> list[int]:
    """``n`` messages for ``channel`` in one statement, each with ``fields``
    (ordering_key, max_attempts, delay, ...): in the caller's transaction when
    ``db`` is a connection, else in one of its own. The payload is ``payload``,
    else ScriptedChannel's ``{"n": i}`` for the scripted channel and EMAIL for
    any other."""

    def example(i: int) -> Any:
        if payload is not None:
            return payload
        return {"n": i} if channel == "scripted" else EMAIL

    messages = [{"channel": channel, "payload": example(i), **fields} for i in range(n)]
    if isinstance(db, sa.Connection):
        return outbox.enqueue_many(db, messages)
    with db.begin() as conn:
        return outbox.enqueue_many(conn, messages)


def claim(
    engine: sa.Engine, batch: int = 100, lease: float = 120, **options: Any
) -> list[store.Claim]:
    """What a dispatcher pass claims (``options``: store.claim's channels,
    default_ttl_seconds), in a transaction of its own."""
    with engine.begin() as conn:
        return store.claim(conn, batch, lease, **options)


def claim_plans(conn: sa.Connection) -> list[Any]:
    """``EXPLAIN (FORMAT JSON)`` of each form of the dispatcher's claim of
    every channel (store/delivery.py: lean, full, full with the tenants'
    channel parts), at batch 100."""
    return [
        conn.execute(
            sa.text("EXPLAIN (FORMAT JSON) " + statement.text),
            {"batch_size": 100, "lease_seconds": 120.0, "default_ttl": 86400.0},
        ).scalar_one()
        for (_, channels), statement in store.delivery._CLAIMS.items()
        if not channels
    ]


def claim_ids(engine: sa.Engine, batch: int = 100) -> list[int]:
    """The ids ``claim`` claims, in its order."""
    return [c.id for c in claim(engine, batch)]


def send(
    engine: sa.Engine, claims: list[store.Claim], remaining: float = 30, **overrides: Any
) -> sender.SendReport:
    """The sender function's run over these claims, handed off as one event of
    their channel (the scripted one when there are none), with ``remaining``
    seconds of Lambda time running out and ``settings(**overrides)``."""
    channel = claims[0].channel if claims else "scripted"
    ctx = LambdaContext(remaining)
    return sender.run(
        engine,
        HandOff(channel, tuple(claims)).to_event(),
        settings(**overrides),
        lambda: ctx.get_remaining_time_in_millis() / 1000,
    )


def settle_all(engine: sa.Engine, outcome: str, error: str = "boom") -> list[int]:
    """Claim every due row and settle it with ``outcome``; returns their ids."""
    with engine.begin() as conn:
        claims = store.claim(conn, 1000, 60)
        store.settle(
            conn,
            [store.Settlement(c.id, c.claim_token, outcome, error=error) for c in claims],
            settings().backoff(),
        )
    return [c.id for c in claims]


def db_now(engine: sa.Engine) -> dt.datetime:
    """The database clock. Read before and after a call, it bounds the now()
    of every transaction the call ran: what the call wrote can be checked
    against those bounds instead of against a later transaction's clock."""
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT now()")).scalar_one()


def wait_after_settle(conn: sa.Connection, message_id: int) -> float:
    """Seconds from the settle that last wrote the message (its last attempt's
    finish time, that transaction's now()) to its available_at: the wait the
    settle chose, whenever it is read. Read against a later transaction's now(),
    a busy machine would shorten it."""
    return float(
        conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM m.available_at - a.finished_at)"
                " FROM outbox_message m JOIN outbox_attempt a ON a.message_id = m.id"
                " WHERE m.id = :id ORDER BY a.id DESC LIMIT 1"
            ),
            {"id": message_id},
        ).scalar_one()
    )


def insert_raw(db: sa.Engine | sa.Connection, channel: str, payload_json: str) -> int:
    """A row written past the producer's checks (raw SQL), as a bug or a hand
    in the database could leave it: in the caller's transaction when ``db``
    is a connection, else in one of its own."""
    if not isinstance(db, sa.Connection):
        with db.begin() as conn:
            return insert_raw(conn, channel, payload_json)
    return int(
        db.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) "
                "VALUES (:c, CAST(:p AS jsonb)) RETURNING id"
            ),
            {"c": channel, "p": payload_json},
        ).scalar_one()
    )


def wait_until(
    condition: Callable[[], bool],
    seconds: float = 120,
    process: subprocess.Popen[str] | None = None,
) -> bool:
    """Poll ``condition`` until it holds (True) or ``seconds`` pass (False);
    ``process``, when given, must keep running meanwhile (its output is the
    failure). A generous bound on the test, never a verdict on its speed: a
    busy machine takes long to start a process and reach a receiver."""
    deadline = time.monotonic() + seconds
    while not condition():
        if process is not None:
            assert process.poll() is None, process.communicate()
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def waits_on_a_lock(
    engine: sa.Engine, thread: threading.Thread, kind: str | None = None, seconds: float = 30
) -> bool:
    """Whether ``thread`` comes to wait on a lock in the test database (a
    session of it shows wait_event_type 'Lock', and wait_event ``kind`` when
    given: 'advisory', 'transactionid', ...), polled until it does, the thread
    ends, or ``seconds`` pass: the server's word that it waited, where a fixed
    pause would only guess how long a busy machine takes to get there."""
    deadline = time.monotonic() + seconds
    while thread.is_alive() and time.monotonic() < deadline:
        with engine.connect() as probe:
            waiting = probe.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    " AND (CAST(:kind AS text) IS NULL OR wait_event = :kind)"
                ),
                {"kind": kind},
            ).scalar_one()
        if waiting:
            return True
        thread.join(0.02)
    return False


def row(conn: sa.Connection, message_id: int) -> sa.Row[Any]:
    return conn.execute(
        sa.text("SELECT * FROM outbox_message WHERE id = :id"), {"id": message_id}
    ).one()


def attempts(conn: sa.Connection, message_id: int) -> list[sa.Row[Any]]:
    return conn.execute(
        sa.text("SELECT * FROM outbox_attempt WHERE message_id = :id ORDER BY id"),
        {"id": message_id},
    ).all()


def statuses(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(
            conn.execute(
                sa.text("SELECT status, count(*) FROM outbox_message GROUP BY status")
            ).all()  # type: ignore[arg-type]
        )


def expire_leases(engine: sa.Engine, ids: list[int] | None = None) -> None:
    """Move leases into the past, as the database clock would after the lease ran out."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET lease_expires_at = now() - interval '1 second', "
                "claimed_at = now() - interval '10 minutes' "
                "WHERE status = 'claimed' AND (CAST(:ids AS bigint[]) IS NULL OR id = ANY(CAST(:ids AS bigint[])))"
            ),
            {"ids": ids},
        )


def receive(engine: sa.Engine, claims: Any, channel: str | None = None) -> list[Any]:
    """Take the sender's receipt of these claims (a sender started them): a
    lease that then runs out counts an attempt."""
    claims = list(claims)
    if not claims:
        return []
    with engine.begin() as conn:
        return store.receive_claimed(conn, channel or claims[0].channel, claims, 5)


def forget_statistics(conn: sa.Connection) -> None:
    """Drop the planner's statistics of outbox_message's partitions, as on a
    table autovacuum has not analyzed yet (TRUNCATE keeps them; superuser)."""
    conn.execute(
        sa.text(
            "DELETE FROM pg_catalog.pg_statistic WHERE starelid IN "
            "(SELECT relid FROM pg_catalog.pg_partition_tree('outbox_message'))"
        )
    )


def make_due(engine: sa.Engine) -> None:
    """Pretend every backoff has passed."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_message SET available_at = now() WHERE status = 'pending'")
        )


@dataclass(frozen=True)
class LocalCA:
    """A throwaway CA (trustme) and a server certificate it signed, as PEM files."""

    ca_file: Path
    cert_file: Path  # the server certificate chain
    key_file: Path

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context


def make_ca(
    directory: Path, names: tuple[str, ...] = ("webhook.test", "localhost", "127.0.0.1")
) -> LocalCA:
    """A CA and a server certificate for ``names``, written into ``directory``."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(*names)
    local = LocalCA(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    ca.cert_pem.write_to_path(str(local.ca_file))
    local.cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(local.key_file))
    return local


@dataclass(frozen=True)
class ConfigurationRow:
    """One row of the configuration reference's settings table."""

    variables: tuple[str, ...]  # the backticked names of its first cell; () for "—"
    parameter: str  # the template parameter cell, as written
    default: str  # the default cell, as written
    line: str


ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIGURATION_HEADER = "| environment variable | template parameter | default | meaning |"


def doc_sql(name: str) -> str:
    """The docs' SQL block marked ``<!-- test: <name> -->`` (the database
    recipes: tests run them as written), on whichever page holds it."""
    for page in sorted(DOCS.rglob("*.md")):
        block = doc_blocks(page).get(name)
        if block is not None:
            return block.code
    raise ValueError(f"no block marked '<!-- test: {name} -->' under {DOCS}")


def configuration_rows(text: str) -> list[ConfigurationRow]:
    """The rows of the table under CONFIGURATION_HEADER (in the generated
    reference, docgen.configuration.settings_table); ValueError when the header
    or a row's four cells are not there."""
    _, found, rest = text.partition(CONFIGURATION_HEADER + "\n")
    if not found:
        raise ValueError(f"no table headed {CONFIGURATION_HEADER}")
    lines = []
    for line in rest.splitlines()[1:]:  # after the |---| line
        if not line.startswith("|"):
            break
        lines.append(line)
    rows = []
    for line in lines:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) != 4:
            raise ValueError(f"a Configuration row without four cells: {line}")
        variables = tuple(re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[0]))
        rows.append(ConfigurationRow(variables, cells[1], cells[2], line))
    return rows


@dataclass(frozen=True)
class DocBlock:
    """A fenced block of a docs page that the tests run: the page marks it with
    ``<!-- test: NAME -->`` on the line before its opening fence."""

    name: str
    language: str
    code: str


def doc_blocks(page: Path) -> dict[str, DocBlock]:
    """The marked blocks of a page, by name."""
    found: dict[str, DocBlock] = {}
    pattern = r"<!-- test: ([a-z0-9-]+) -->\n```(\w*)[^\n]*\n(.*?)\n```"
    for match in re.finditer(pattern, page.read_text(), re.S):
        found[match[1]] = DocBlock(match[1], match[2], match[3] + "\n")
    return found


def documented_default(cell: str) -> str:
    """What a default cell states: a leading `value` or number, else "" (blank,
    or prose such as "empty" or "system roots" for a setting without one)."""
    match = re.match(r"`([^`]*)`|(-?\d+(?:\.\d+)?)(?![\w.])", cell)
    if match is None:
        return ""
    return match[1] if match[1] is not None else match[2]
