"""The ``outbox`` command: operate the relay against ``DATABASE_URL``.

    outbox migrate | enqueue | status | list | show | history | redrive | cancel | prune
    outbox pause CHANNEL | resume CHANNEL
    outbox worker            the relay in one process (dispatcher, senders, reaper)
    outbox invoke FN EVENT   run a function of template.yaml in process (no Docker;
                             --claim N for a live event)

Every command takes ``--json``. A bad argument or an unknown id prints one
line on stderr, exits non-zero and changes nothing.

This module is for operators and development only: no Lambda handler imports it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import sqlalchemy as sa

from .errors import ConfigError, ValidationError

F = TypeVar("F", bound=Callable[..., Any])

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
PRUNE_BATCH = 5000


def parse_duration(text: str) -> float:
    """'90', '45s', '30m', '12h', '7d', '2w' -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise click.BadParameter(f"{text!r} is not a duration like 45s, 30m, 12h, 7d or 2w")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


class Duration(click.ParamType):
    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)


class OneLineGroup(click.Group):
    """Errors come out as a single ``Error: ...`` line on stderr."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        standalone = kwargs.pop("standalone_mode", True)
        try:
            return super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        except click.ClickException as exc:
            if not standalone:
                raise
            message = exc.format_message()
            if type(exc).__name__ == "NoArgsIsHelpError":  # click >= 8.2: `outbox` alone
                click.echo(message, err=True)
                sys.exit(exc.exit_code)
            message = message.replace("\n", " ")
            click.echo(f"Error: {message}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            if not standalone:
                raise
            click.echo("Aborted.", err=True)
            sys.exit(130)


class BadArgument(click.ClickException):
    """A bad argument: exit 2, as click does for usage errors."""

    exit_code = 2


def fail(message: str, code: int = 1) -> NoReturn:
    """Stop with one error line: 2 for bad arguments, 1 for everything else."""
    raise (BadArgument if code == 2 else click.ClickException)(message)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")(f)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def emit_json(value: Any) -> None:
    click.echo(json.dumps(_jsonable(value), indent=2, ensure_ascii=False))


def console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=max(100, Console().width))


# --- the database ------------------------------------------------------------


def _engine(autocommit: bool = False) -> sa.Engine:
    from .config import DatabaseSettings
    from .db import create_engine

    try:
        settings = DatabaseSettings.from_env(os.environ)
    except ConfigError as exc:
        fail(str(exc))
    return create_engine(settings, pool_size=4, autocommit=autocommit)


@contextmanager
def database(*, autocommit: bool = False) -> Iterator[sa.Engine]:
    """The engine for a command. ``autocommit`` for the worker, whose
    state-machine statements are each atomic (as in the Lambda functions)."""
    engine = _engine(autocommit)
    try:
        yield engine
    except sa.exc.DBAPIError as exc:
        message = _db_message(exc)
        if "outbox_message" in message and "does not exist" in message:
            fail("the outbox tables do not exist yet: run `outbox migrate` first")
        if isinstance(exc, sa.exc.InterfaceError) or (
            exc.connection_invalidated and not _server_reported(exc)
        ):
            fail(f"cannot reach the database: {message}")
        fail(f"database error: {message}")
    finally:
        engine.dispose()


def _server_reported(exc: sa.exc.DBAPIError) -> bool:
    """The server answered with an error (pg8000 carries its fields in a dict);
    the engine still discards such a connection, but the database was reached."""
    args: tuple[Any, ...] = getattr(exc.orig, "args", ())
    return bool(args) and isinstance(args[0], dict)


def _db_message(exc: sa.exc.DBAPIError) -> str:
    """The server's message (pg8000 carries it in a dict), on one line."""
    args = getattr(exc.orig, "args", ())
    if args and isinstance(args[0], dict) and args[0].get("M"):
        return str(args[0]["M"])
    return (str(exc.orig) or type(exc.orig).__name__).splitlines()[0]


def _row_dict(row: sa.Row[Any]) -> dict[str, Any]:
    return dict(row._mapping)


def _split(values: Sequence[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _channels(values: Sequence[str]) -> list[str] | None:
    """Channel filters, each one the relay knows (checked before any query)."""
    from . import channels as registry

    wanted = _split(values)
    unknown = sorted(set(wanted) - set(registry.names()))
    if unknown:
        fail(f"unknown channel {unknown[0]!r}; known: {', '.join(registry.names())}", 2)
    return wanted or None


def _check_ids(ids: Sequence[int]) -> list[int]:
    from .handoff import MAX_MESSAGE_ID

    bad = [i for i in ids if not 1 <= i <= MAX_MESSAGE_ID]
    if bad:
        fail(f"message ids are positive integers up to {MAX_MESSAGE_ID}, got {bad[0]}", 2)
    return sorted(set(ids))


# --- the commands --------------------------------------------------------------


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Operate the outbox relay (the database is DATABASE_URL)."""


@cli.command()
@json_option
def migrate(as_json: bool) -> None:
    """Bring the outbox schema to the latest revision."""
    from . import migrate as migrations

    with database() as engine:
        revision = migrations.upgrade(engine)
    if as_json:
        emit_json({"revision": revision})
    else:
        click.echo(f"schema at revision {revision}")


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"{what} is not valid JSON: {exc}", 2)


def _read_json_file(path: str, what: str) -> Any:
    """JSON from a file (``-`` for stdin); bad input is one clear line and exit 2."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"cannot read {what} {path}: {exc.strerror or exc}", 2)
    return _parse_json(text, f"{what} {path}")


def _read_payload(text: str) -> Any:
    if text.startswith("@"):
        return _read_json_file(text[1:], "payload file")
    return _parse_json(text, "--payload")


@cli.command()
@click.option("--channel", required=True, help="The channel, e.g. email.")
@click.option("--payload", required=True, help="The payload as JSON, or @file (@- for stdin).")
@click.option(
    "--dedupe-key",
    default=None,
    help="Names the event: a repeat for the same recipient and payload returns the same id.",
)
@click.option("--ordering-key", default=None, help="Delivered one at a time, in order, per key.")
@click.option("--priority", type=int, default=0, show_default=True)
@click.option("--delay", type=Duration(), default=None, help="Not before this long (45s, 10m, 1h).")
@click.option("--max-attempts", type=int, default=None, help="Overrides the relay's default.")
@click.option(
    "--ttl", type=Duration(), default=None, help="Expire if not delivered this long after due."
)
@click.option(
    "--on-predecessor-failure",
    type=click.Choice(["hold", "cancel"]),
    default="hold",
    show_default=True,
    help="When an earlier message of the ordering key fails: wait for an operator, or cancel.",
)
@json_option
def enqueue(
    channel: str,
    payload: str,
    dedupe_key: str | None,
    ordering_key: str | None,
    priority: int,
    delay: float | None,
    max_attempts: int | None,
    ttl: float | None,
    on_predecessor_failure: str,
    as_json: bool,
) -> None:
    """Enqueue one message (validated like outbox.enqueue); prints its id."""
    import outbox

    body = _read_payload(payload)
    with database() as engine:
        try:
            with engine.begin() as conn:
                message_id, created = outbox.enqueue(
                    conn,
                    channel,
                    body,
                    dedupe_key=dedupe_key,
                    ordering_key=ordering_key,
                    priority=priority,
                    delay=delay,
                    max_attempts=max_attempts,
                    ttl=ttl,
                    on_predecessor_failure=on_predecessor_failure,
                    return_created=True,
                )
        except ValidationError as exc:  # DedupeConflict too: nothing was written
            fail(str(exc), 2)
    if as_json:
        # created false: a replay of its dedupe key, the existing message's id
        emit_json({"id": message_id, "channel": channel, "created": created})
    else:
        click.echo(message_id)


@cli.command()
@json_option
def status(as_json: bool) -> None:
    """Messages per channel and status, oldest due age, claims past their lease,
    and pending messages held behind a failed row of their ordering key."""
    from . import store

    with database() as engine, engine.connect() as conn:
        groups = store.channel_status_counts(conn)
        backlog = store.backlog(conn)
        paused = store.paused_channels(conn)
    if as_json:
        emit_json(
            {
                "channels": [
                    {
                        "channel": g.channel,
                        "status": g.status,
                        "count": g.count,
                        "oldest_due_age_seconds": round(g.oldest_due_age_seconds, 3),
                        "expired_claims": g.expired_claims,
                    }
                    for g in groups
                ],
                "pending": backlog.pending,
                "due": backlog.due,
                "oldest_due_age_seconds": round(backlog.oldest_due_age_seconds, 3),
                "claimed": backlog.claimed,
                "expired_claims": backlog.expired_claims,
                "dead": backlog.dead,
                "held": backlog.held,
                "paused_channels": [
                    {"channel": p.channel, "reason": p.reason, "paused_at": p.paused_at}
                    for p in paused
                ],
            }
        )
        return
    print_status_table(groups)
    for p in paused:
        why = f": {p.reason}" if p.reason else ""
        since = p.paused_at.isoformat(timespec="seconds")
        click.echo(f"channel {p.channel} is PAUSED since {since}{why} (outbox resume {p.channel})")
    click.echo(
        f"pending {backlog.pending} (due {backlog.due}, oldest due "
        f"{backlog.oldest_due_age_seconds:.1f}s), claimed {backlog.claimed} "
        f"({backlog.expired_claims} past their lease), dead {backlog.dead}"
    )
    if backlog.held:
        click.echo(
            f"held {backlog.held}: pending behind a failed, dead or expired message of their "
            "ordering key; redrive or cancel that message to let them go"
        )


def print_status_table(groups: Sequence[Any], title: str = "messages") -> None:
    from rich.table import Table

    from .store import STATUSES

    counts: dict[str, dict[str, int]] = {}
    for g in groups:
        counts.setdefault(g.channel, {})[g.status] = g.count
    shown = [s for s in STATUSES if any(s in c for c in counts.values())] or ["pending"]
    table = Table(title=title)
    table.add_column("channel")
    for s in shown:
        table.add_column(s, justify="right")
    table.add_column("total", justify="right")
    for channel, by_status in sorted(counts.items()):
        table.add_row(
            channel, *(str(by_status.get(s, 0)) for s in shown), str(sum(by_status.values()))
        )
    console().print(table)


_LIST_COLUMNS = ("id", "channel", "status", "attempts", "priority", "created_at", "last_error")


@cli.command("list")
@click.option("--status", "statuses", multiple=True, help="Filter by status (repeat or a,b).")
@click.option("--channel", "channels_", multiple=True, help="Filter by channel (repeat or a,b).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@json_option
def list_(statuses: tuple[str, ...], channels_: tuple[str, ...], limit: int, as_json: bool) -> None:
    """The newest messages, optionally filtered."""
    from rich.table import Table

    from . import store

    wanted = _split(statuses)
    bad = sorted(set(wanted) - set(store.STATUSES))
    if bad:
        fail(f"unknown status {bad[0]!r}; choose from {', '.join(store.STATUSES)}", 2)
    with database() as engine, engine.connect() as conn:
        rows = store.list_messages(conn, wanted or None, _channels(channels_), limit)
    if as_json:
        emit_json([_row_dict(r) for r in rows])
        return
    table = Table()
    for column in _LIST_COLUMNS:
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(
            str(r.id),
            r.channel,
            r.status,
            str(r.attempts),
            str(r.priority),
            r.created_at.isoformat(timespec="seconds"),
            r.last_error or "",
        )
    console().print(table)


@cli.command()
@click.argument("message_id", type=int)
@json_option
def show(message_id: int, as_json: bool) -> None:
    """One message (payload included) and its attempt history."""
    from . import store

    _check_ids([message_id])
    with database() as engine, engine.connect() as conn:
        row = store.get_message(conn, message_id)
        history = store.attempt_history(conn, message_id) if row else []
    if row is None:
        fail(f"no message with id {message_id}")
    message = _row_dict(row)
    message["payload"] = _stored_payload(message["payload"])
    if as_json:
        emit_json({"message": message, "attempts": [_row_dict(a) for a in history]})
        return
    print_message(message, [_row_dict(a) for a in history])


def _stored_payload(text: str) -> Any:
    """The payload decoded, or, when it is beyond the payload limits (a row
    written past the producer), its stored JSON text as it is."""
    from .payloads import decode

    try:
        return decode(text)
    except ValidationError:
        return text


def print_message(message: Mapping[str, Any], history: Sequence[Mapping[str, Any]]) -> None:
    from rich.table import Table

    out = console()
    fields = Table(show_header=False, title=f"message {message['id']}")
    fields.add_column(style="bold")
    fields.add_column(overflow="fold")
    for key, value in message.items():
        if value is None:
            continue
        if key == "payload":
            shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        else:
            shown = _jsonable(value)
        fields.add_row(key, str(shown))
    out.print(fields)
    attempts = Table(title="attempts")
    for column in ("attempt", "outcome", "error", "provider_message_id", "finished_at", "ms"):
        attempts.add_column(column, overflow="fold")
    for a in history:
        attempts.add_row(
            str(a["attempt"]),
            a["outcome"],
            a["error"] or "",
            a["provider_message_id"] or "",
            a["finished_at"].isoformat(timespec="seconds"),
            "" if a["duration_ms"] is None else str(a["duration_ms"]),
        )
    out.print(attempts)


def _locked_ids(conn: sa.Connection, ids: list[int], allowed: Sequence[str], verb: str) -> None:
    """Every id must exist and be in an allowed state, or nothing changes."""
    from . import store

    found = store.statuses_of(conn, ids)
    missing = [i for i in ids if i not in found]
    if missing:
        fail(f"unknown message id(s): {', '.join(map(str, missing))}")
    wrong = {i: s for i, s in found.items() if s not in allowed}
    if wrong:
        listed = ", ".join(f"{i} is {s}" for i, s in sorted(wrong.items()))
        fail(f"cannot {verb} ({listed}); only {' or '.join(allowed)} messages can be")


@cli.command()
@click.argument("ids", nargs=-1, type=int)
@click.option("--status", "statuses", multiple=True, help="Redrive every message in this status.")
@click.option("--channel", "channels_", multiple=True, help="With --status: only these channels.")
@click.option(
    "--since", type=Duration(), default=None, help="With --status: settled this recently."
)
@json_option
def redrive(
    ids: tuple[int, ...],
    statuses: tuple[str, ...],
    channels_: tuple[str, ...],
    since: float | None,
    as_json: bool,
) -> None:
    """Send dead, failed or expired messages again (attempts reset, history kept).

    Either IDS, or --status dead|failed|expired with optional --channel and --since.
    """
    from . import store

    wanted = _split(statuses)
    if ids and (wanted or channels_ or since is not None):
        fail("give either message ids or --status/--channel/--since, not both", 2)
    if not ids and not wanted:
        fail("give message ids, or --status dead (or failed, expired)", 2)
    bad = sorted(set(wanted) - set(store.REDRIVABLE_STATUSES))
    if bad:
        fail(
            f"cannot redrive status {bad[0]!r}; choose from {', '.join(store.REDRIVABLE_STATUSES)}",
            2,
        )
    with database() as engine, engine.begin() as conn:
        if ids:
            wanted_ids = _check_ids(ids)
            _locked_ids(conn, wanted_ids, store.REDRIVABLE_STATUSES, "redrive")
            done = store.redrive(conn, wanted_ids)
        else:
            done = store.redrive_matching(conn, wanted, _channels(channels_), since)
    _report("redriven", sorted(done), as_json)


@cli.command()
@click.argument("ids", nargs=-1, type=int, required=True)
@click.option("--reason", default="cancelled by operator", show_default=True)
@json_option
def cancel(ids: tuple[int, ...], reason: str, as_json: bool) -> None:
    """Cancel messages: pending ones, or failed, dead or expired ones holding
    their ordering key (its later messages then go). All ids must qualify, or
    nothing changes."""
    from . import store

    wanted = _check_ids(ids)
    with database() as engine, engine.begin() as conn:
        _locked_ids(conn, wanted, store.CANCELLABLE_STATUSES, "cancel")
        done = store.cancel(conn, wanted, reason)
    _report("cancelled", sorted(done), as_json)


def _report(verb: str, ids: list[int], as_json: bool) -> None:
    if as_json:
        emit_json({verb: ids, "count": len(ids)})
    else:
        click.echo(
            f"{verb} {len(ids)} message(s)" + (f": {', '.join(map(str, ids))}" if ids else "")
        )


@cli.command()
@click.option("--older-than", type=Duration(), required=True, help="e.g. 7d: settled before then.")
@click.option("--status", "statuses", multiple=True, help="Only these terminal statuses.")
@json_option
def prune(older_than: float, statuses: tuple[str, ...], as_json: bool) -> None:
    """Delete terminal messages settled before the window.

    Their attempt history stays for `outbox history` (the reaper prunes it
    after ATTEMPT_RETENTION_DAYS), and so do their dedupe keys (DEDUPE_WINDOW_DAYS)."""
    from . import store

    wanted = _split(statuses) or list(store.TERMINAL_STATUSES)
    bad = sorted(set(wanted) - set(store.TERMINAL_STATUSES))
    if bad:
        fail(f"cannot prune status {bad[0]!r}; choose from {', '.join(store.TERMINAL_STATUSES)}", 2)
    total = 0
    with database() as engine:
        while True:
            with engine.begin() as conn:
                deleted = store.prune(conn, older_than, PRUNE_BATCH, wanted)
            total += deleted
            if deleted < PRUNE_BATCH:
                break
    if as_json:
        emit_json({"pruned": total})
    else:
        click.echo(f"pruned {total} message(s)")


_HISTORY_COLUMNS = (
    "finished_at",
    "channel",
    "message_id",
    "attempt",
    "outcome",
    "error",
    "provider_message_id",
    "message_status",
)


@cli.command()
@click.option(
    "--recipient",
    required=True,
    help="Email address, phone number, endpoint ARN, webhook URL, queue URL or bus name.",
)
@click.option("--channel", "channels_", multiple=True, help="Only these channels (repeat or a,b).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@json_option
def history(recipient: str, channels_: tuple[str, ...], limit: int, as_json: bool) -> None:
    """Did they get it? The attempts that went to a recipient, newest first.

    The address is fingerprinted in the database with the installation's key,
    as at enqueue, and matched against the attempt history (kept for
    ATTEMPT_RETENTION_DAYS, after the messages themselves are pruned). The
    address is never stored, logged or printed."""
    from rich.table import Table

    from . import channels as registry
    from . import store

    if not recipient.strip():
        fail("--recipient must not be empty", 2)
    wanted = _channels(channels_) or registry.names()
    with database() as engine, engine.connect() as conn:
        rows = store.recipient_history(conn, recipient, wanted, limit)
    if as_json:
        emit_json([_row_dict(r) for r in rows])
        return
    table = Table(title=f"attempts, newest first ({len(rows)})")
    for column in _HISTORY_COLUMNS:
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(
            r.finished_at.isoformat(timespec="seconds"),
            r.channel,
            str(r.message_id),
            str(r.attempt),
            r.outcome,
            r.error or "",
            r.provider_message_id or "",
            r.message_status or "(pruned)",
        )
    console().print(table)


# --- pause and resume a channel ------------------------------------------------


def _pausable_channel(conn: sa.Connection, channel: str) -> str:
    """A channel the relay knows, or one with rows in the outbox; else exit 2."""
    from . import channels as registry
    from . import store

    try:
        store._check_channels([channel])
    except ValueError as exc:
        fail(str(exc), 2)
    if channel not in registry.names() and not store.channel_has_rows(conn, channel):
        fail(
            f"unknown channel {channel!r}: not registered and no messages; "
            f"known: {', '.join(registry.names())}",
            2,
        )
    return channel


@cli.command()
@click.argument("channel")
@click.option("--reason", default=None, help="Why, shown by `outbox status`.")
@json_option
def pause(channel: str, reason: str | None, as_json: bool) -> None:
    """Stop claiming CHANNEL's messages: they stay pending, no attempt counted.

    Claims taken before the pause finish normally. Undo with `outbox resume`."""
    from . import store

    with database() as engine, engine.begin() as conn:
        newly = store.pause_channel(conn, _pausable_channel(conn, channel), reason)
    if as_json:
        emit_json({"channel": channel, "paused": True, "changed": newly})
    else:
        click.echo(f"channel {channel} {'paused' if newly else 'was already paused'}")


@cli.command()
@click.argument("channel")
@json_option
def resume(channel: str, as_json: bool) -> None:
    """Claim CHANNEL's messages again."""
    from . import store

    with database() as engine, engine.begin() as conn:
        try:
            was_paused = store.resume_channel(conn, channel)
        except ValueError as exc:
            fail(str(exc), 2)
    if as_json:
        emit_json({"channel": channel, "paused": False, "changed": was_paused})
    else:
        click.echo(f"channel {channel} {'resumed' if was_paused else 'was not paused'}")


# --- worker --------------------------------------------------------------------


@cli.command()
@click.option("--once", is_flag=True, help="Claim and send one batch, then exit.")
@click.option("--until-empty", is_flag=True, help="Exit when nothing is due any more.")
@click.option("--batch-size", type=click.IntRange(1, 10_000), default=None, help="Rows per claim.")
@click.option("--channels", "channels_", default=None, help="Only these channels (a,b).")
@click.option("--reap-interval", type=Duration(), default=30.0, show_default=True)
@json_option
def worker(
    once: bool,
    until_empty: bool,
    batch_size: int | None,
    channels_: str | None,
    reap_interval: float,
    as_json: bool,
) -> None:
    """Run dispatcher, senders and reaper in this process until SIGTERM/SIGINT.

    Settings come from the same environment variables as the functions
    (BATCH_SIZE, LEASE_SECONDS, MAX_ATTEMPTS, ...). Several workers may run at once.
    """
    import dataclasses

    from .config import OutcomeEventSettings, RelaySettings
    from .worker import Worker

    try:
        settings = RelaySettings.from_env(os.environ)
        outcome_events = OutcomeEventSettings.from_env(os.environ)
    except ConfigError as exc:
        fail(str(exc), 2)
    if batch_size is not None:
        settings = dataclasses.replace(settings, batch_size=batch_size)
    wanted = _channels([channels_]) if channels_ else None

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not as_json:
            click.echo(f"{signal.Signals(signum).name}: finishing the batch in hand", err=True)
        stop.set()

    from . import observability

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with observability.suspended(), database(autocommit=True) as engine:
            report = Worker(
                engine,
                settings,
                channels=wanted,
                stop=stop,
                reap_interval_seconds=reap_interval,
                outcome_events=outcome_events,
            ).run(once=once, until_empty=until_empty)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    summary = dataclasses.asdict(report)
    if as_json:
        emit_json(summary)
    else:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(report.statuses.items())) or "none"
        click.echo(
            f"worker stopped: {report.batches} batch(es), claimed {report.claimed}, "
            f"released {report.released}, reaped {report.reaped}; settled: {statuses}"
        )


# --- invoke --------------------------------------------------------------------


@cli.command("invoke")
@click.argument("function")
@click.argument("event_file", required=False)
@click.option(
    "--env-vars",
    "env_vars_file",
    default=None,
    help='SAM-format env file (JSON): {"Parameters": {...}, "<Function>": {...}}.',
)
@click.option(
    "--parameter-overrides",
    "parameter_overrides",
    multiple=True,
    help="Template parameters, SAM syntax: 'Key=Value Key2=Value2' "
    "(or ParameterKey=Key,ParameterValue=Value).",
)
@click.option(
    "--claim",
    "claim_limit",
    type=click.IntRange(1, 1000),
    default=None,
    help="Claim up to N due messages of the function's channel and pass them as the "
    "hand-off event (a live event; instead of EVENT_FILE).",
)
@click.option(
    "--template",
    "-t",
    "template_file",
    default="template.yaml",
    show_default=True,
    help="The SAM template.",
)
@json_option
def invoke_(
    function: str,
    event_file: str | None,
    env_vars_file: str | None,
    parameter_overrides: tuple[str, ...],
    claim_limit: int | None,
    template_file: str,
    as_json: bool,
) -> None:
    """Run FUNCTION of template.yaml in process with EVENT_FILE (- for stdin)
    and print its JSON result: `sam local invoke` without Docker.

    The result is JSON either way; --json prints it on one line."""
    from . import invoke

    if (event_file is None) == (claim_limit is None):
        fail("give either EVENT_FILE or --claim N", 2)
    template_path = Path(template_file)
    try:
        template = invoke.load_template(template_path)
        overrides = invoke.parse_parameter_overrides(parameter_overrides)
        env_vars = _read_json_file(env_vars_file, "env vars file") if env_vars_file else {}
        if not isinstance(env_vars, dict) or not all(
            isinstance(v, dict) for v in env_vars.values()
        ):
            fail(f"env vars file {env_vars_file} must map Parameters or a function to an object", 2)
        spec = invoke.function_spec(
            template, template_path.resolve().parent, function, env_vars, None, overrides
        )
        event: Any
        if claim_limit is not None:
            channel = invoke.channel_of(template, spec.logical_id, overrides)
            if channel is None:
                fail(
                    f"--claim: {spec.logical_id} is not a channel function (no CHANNEL_FUNCTIONS "
                    "map of the template names it)",
                    2,
                )
            event = invoke.claim_event(
                channel, claim_limit, lambda line: click.echo(line, err=True)
            )
        else:
            event = _read_json_file(str(event_file), "event file")
    except invoke.InvokeError as exc:
        fail(str(exc), 2)
    for name, reason in sorted(spec.unresolved.items()):
        click.echo(f"note: {name} left unset: {reason}", err=True)
    for section in spec.ignored_env_sections:
        click.echo(f"note: env vars file section {section!r} names no function: ignored", err=True)
    click.echo(invoke.banner(spec), err=True)
    try:
        outcome = invoke.invoke(spec, event, progress=lambda line: click.echo(line, err=True))
    except invoke.InvokeError as exc:
        fail(str(exc))
    if outcome.error is not None:
        click.echo(outcome.traceback or "", err=True, nl=False)
        click.echo(json.dumps(outcome.error))
        error_type = outcome.error["errorType"]
        message = " ".join((outcome.summary or outcome.error["errorMessage"]).split())
        if outcome.phase == "init":
            fail(f"{spec.logical_id} failed at init: {error_type}: {message}")
        fail(f"{spec.logical_id} raised {error_type}: {message}")
    click.echo(json.dumps(_jsonable(outcome.result), indent=None if as_json else 2))
    if outcome.timed_out:
        fail(
            f"{spec.logical_id} ran {outcome.duration_seconds:.2f}s, past its "
            f"{spec.timeout_seconds:g}s Timeout: Lambda would have stopped it"
        )


def main() -> None:
    cli(prog_name="outbox")


if __name__ == "__main__":  # pragma: no cover
    main()
