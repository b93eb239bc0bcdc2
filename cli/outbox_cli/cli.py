"""The ``outbox`` command: operate the relay against its database.

    outbox migrate | enqueue | status | list | show | history | redrive | cancel | uncancel
    outbox prune
    outbox pause CHANNEL | resume CHANNEL
    outbox worker            the relay in one process (dispatcher, senders, reaper)
    outbox invoke FN EVENT   run a function of template.yaml in process (no Docker;
                             --claim N for a live event)

The database is ``--database-url``, else ``DATABASE_URL`` (or the functions'
``DB_SECRET_ARN`` / ``DB_IAM_USER`` settings). Every command takes ``--json``
(the shapes are in ``render``). A bad argument or an unknown id prints one
error, exits non-zero and changes nothing. Commands that change many rows
chosen by a filter (redrive --status, cancel --channel, prune) show what
they would change and ask first: ``--yes`` skips the question, ``--dry-run``
only shows; without a terminal to ask on they refuse unless given ``--yes``.

This module parses and checks arguments and calls ``outbox.store``; how the
results look is ``render``'s. No Lambda handler imports this package.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import sqlalchemy as sa

import outbox
from outbox.errors import (
    UNDEFINED_OBJECT_SQLSTATES,
    ConfigError,
    SchemaMissing,
    ValidationError,
)
from outbox.errors import sqlstate as error_sqlstate
from outbox.handoff import MAX_MESSAGES_PER_EVENT
from outbox.settings import BATCH_SIZE, RETENTION_DAYS, read_all
from outbox.states import (
    CANCELLABLE_STATUSES,
    REDRIVABLE_STATUSES,
    STATUSES,
    TERMINAL_STATUSES,
    UNRESOLVED_STATUSES,
    Status,
)

from . import missing_extra
from .render import (
    destination_label,
    emit_json,
    inert,
    render_change,
    render_destinations,
    render_enqueued,
    render_error,
    render_history,
    render_message,
    render_messages,
    render_revision,
    render_status,
    render_tenant_status,
    render_tenants,
    render_worker_report,
)
from .render import jsonable as _jsonable

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


# --- errors: one line, or one JSON object under --json ------------------------


class CommandError(click.ClickException):
    """A command that cannot do what it was asked; nothing was changed.

    ``kind`` names the class of error for programs (the JSON ``error.kind``):
    bad_argument, not_found, conflict, confirmation_required, aborted,
    config, schema_missing, database_unavailable (no server answered),
    database_login_refused (the server refused the user or its password),
    database_missing (the server has no such database), database_tls_refused
    (TLS asked for, the server has none), database, failed."""

    exit_code = 1

    def __init__(self, message: str, kind: str = "failed") -> None:
        super().__init__(message)
        self.kind = kind


class BadArgument(CommandError):
    """A bad argument (or a refusal to act on one): exit 2, as click does for usage errors."""

    exit_code = 2

    def __init__(self, message: str, kind: str = "bad_argument") -> None:
        super().__init__(message, kind)


def fail(message: str, code: int = 1, kind: str | None = None) -> NoReturn:
    """Stop with one error: exit 2 for bad arguments, 1 for everything else."""
    if code == 2:
        raise BadArgument(message, kind or "bad_argument")
    raise CommandError(message, kind or "failed")


def require_extra(what: str, extra: str, *modules: str) -> None:
    """Stop with one line naming the extra to install when a module is missing."""
    problem = missing_extra(what, extra, *modules)
    if problem is not None:
        fail(problem, 1, "missing_extra")


def _wants_json(args: Sequence[str] | None) -> bool:
    return "--json" in (sys.argv[1:] if args is None else args)


class OneLineGroup(click.Group):
    """Errors come out as a single ``Error: ...`` line on stderr, or as one
    JSON object on stdout when the command line has ``--json``."""

    def main(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        standalone = kwargs.pop("standalone_mode", True)
        try:
            return super().main(args, *rest, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        except click.ClickException as exc:
            if not standalone:
                raise
            message = exc.format_message()
            if type(exc).__name__ == "NoArgsIsHelpError":  # click >= 8.2: `outbox` alone
                click.echo(message, err=True)
                sys.exit(exc.exit_code)
            if isinstance(exc, CommandError):
                kind = exc.kind
            else:  # click's own usage errors: bad options, unknown commands
                kind = "bad_argument" if exc.exit_code == 2 else "failed"
            render_error(kind, message.replace("\n", " "), _wants_json(args))
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            if not standalone:
                raise
            render_error("aborted", "aborted", _wants_json(args))
            sys.exit(130)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")(f)


def dry_run_option(f: F) -> F:
    return click.option("--dry-run", is_flag=True, help="Show what would change; change nothing.")(
        f
    )


def yes_option(f: F) -> F:
    return click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")(f)


# --- the database ------------------------------------------------------------

_DATABASE_URL_HELP = (
    "postgresql://user:password@host:port/db, any driver (psycopg, pg8000...), "
    "libpq's ?sslmode= and sslrootcert= understood (default: DATABASE_URL)."
)


def _take_database_url(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:  # given after the command: it wins over one given before it
        ctx.obj = Options(database_url=value)


def database_url_option(f: F) -> F:
    """``--database-url`` after the command too (``outbox status --database-url ...``)."""
    return click.option(
        "--database-url",
        default=None,
        metavar="URL",
        expose_value=False,
        callback=_take_database_url,
        help=_DATABASE_URL_HELP,
    )(f)


@dataclass(frozen=True)
class Options:
    """What the group's options give every command."""

    database_url: str | None = None


def _options() -> Options:
    ctx = click.get_current_context(silent=True)
    found = ctx.find_object(Options) if ctx is not None else None
    return found or Options()


def _environment() -> Mapping[str, str]:
    """The process environment, with ``--database-url`` in place of DATABASE_URL."""
    url = _options().database_url
    if url is None:
        return os.environ
    env = {k: v for k, v in os.environ.items() if k not in ("DB_SECRET_ARN", "DB_IAM_USER")}
    env["DATABASE_URL"] = url
    return env


def _engine(autocommit: bool = False) -> sa.Engine:
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings

    env = _environment()
    try:
        settings = DatabaseSettings.from_env(env)
    except ConfigError as exc:
        fail(str(exc), 2, "config")
    try:
        if settings.url and env.get("PGPASSWORD"):
            # libpq's fallback, which users expect of a Postgres URL: the
            # URL's own password wins.
            url = sa.engine.make_url(settings.url)
            if url.password is None:
                url = url.set(password=env["PGPASSWORD"])
                settings = replace(settings, url=url.render_as_string(hide_password=False))
        return create_engine(settings, pool_size=4, autocommit=autocommit)
    except sa.exc.ArgumentError as exc:
        fail(f"the database URL is not valid: {exc}", 2)


@contextmanager
def database(*, autocommit: bool = False) -> Iterator[sa.Engine]:
    """The engine for a command. ``autocommit`` for the worker, whose
    state-machine statements are each atomic (as in the Lambda functions)."""
    engine = _engine(autocommit)
    try:
        yield engine
    except SchemaMissing as exc:  # from outbox.enqueue
        fail(str(exc), 1, "schema_missing")
    except sa.exc.DBAPIError as exc:
        message = _db_message(exc)
        fields = _server_fields(exc)
        sqlstate = str(fields.get("C", "")) if fields else error_sqlstate(exc)
        # The server answered and refused the session: the network is fine,
        # the credentials or the database name are not.
        if sqlstate.startswith("28"):
            fail(f"the database refused the login: {message}", 1, "database_login_refused")
        if sqlstate == "3D000":
            fail(f"no such database: {message}", 1, "database_missing")
        if "refuses SSL" in message:  # pg8000's words: the server answered, without TLS
            fail(
                "the database server does not offer TLS, which the URL's sslmode asks for "
                "(a local server without TLS: sslmode=disable)",
                1,
                "database_tls_refused",
            )
        if sqlstate in UNDEFINED_OBJECT_SQLSTATES:
            fail(str(SchemaMissing()), 1, "schema_missing")
        if "no password was provided" in message:  # pg8000's words (and outbox.db's)
            fail(
                "the server asks for a password and DATABASE_URL has none "
                "(set it in the URL or PGPASSWORD)",
                2,
                "database_password_missing",
            )
        if isinstance(exc, sa.exc.InterfaceError) or (
            exc.connection_invalidated and not _server_reported(exc)
        ):
            message = _unreachable(exc, engine.url) or message
            fail(f"cannot reach the database: {message}", 1, "database_unavailable")
        fail(f"database error: {message}", 1, "database")
    finally:
        engine.dispose()


def _unreachable(exc: sa.exc.DBAPIError, url: sa.URL) -> str | None:
    """Why no server answered, in a user's words (pg8000's say "Can't create a
    connection to host ... (timeout is 30.0 and source_address is None)"), or
    None when the driver's error names no reason we know."""
    socket_path = url.query.get("unix_sock")
    where = str(socket_path) if socket_path else f"{url.host or 'localhost'}:{url.port or 5432}"
    for cause in _chain(exc.orig):
        if isinstance(cause, ConnectionRefusedError | FileNotFoundError):
            return f"nothing is listening at {where}"
        if isinstance(cause, socket.gaierror):
            return f"unknown host {url.host!r}"
        if isinstance(cause, TimeoutError):
            timeout = _connect_timeout()
            within = f" within {timeout:g} s (DB_CONNECT_TIMEOUT)" if timeout else ""
            return f"no answer from {where}{within}"
    return None


def _connect_timeout() -> float | None:
    from outbox.relay_settings import DatabaseSettings

    try:
        return DatabaseSettings.from_env(_environment()).connect_timeout
    except ConfigError:
        return None


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    """An error and the ones it was raised from or during, innermost last."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _server_fields(exc: sa.exc.DBAPIError) -> dict[str, Any] | None:
    """The fields of the server's error response (pg8000 passes them as its
    exception's argument: 'C' the SQLSTATE, 'M' the message), or None when the
    error is the driver's own (no server answered).

    The chain is searched: pg8000 closes a connection the server refused by
    sending it Terminate, and on a unix socket (the embedded Postgres) the
    server has hung up by then, so the error raised is "network error" from
    a broken pipe, with the server's answer in its context."""
    for cause in _chain(exc.orig):
        args: tuple[Any, ...] = cause.args
        if args and isinstance(args[0], dict):
            return args[0]
    return None


def _server_reported(exc: sa.exc.DBAPIError) -> bool:
    """The server answered with an error; the engine still discards such a
    connection, but the database was reached."""
    return _server_fields(exc) is not None


def _db_message(exc: sa.exc.DBAPIError) -> str:
    """The server's message, else the driver's, on one line."""
    fields = _server_fields(exc)
    if fields and fields.get("M"):
        return str(fields["M"])
    return (str(exc.orig) or type(exc.orig).__name__).splitlines()[0]


def _split(values: Sequence[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _registered_channels(values: Sequence[str]) -> list[str] | None:
    """Channels this process can send (the worker's filter): registered ones only."""
    from outbox import channels as registry

    wanted = _split(values)
    unknown = sorted(set(wanted) - set(registry.names()))
    if unknown:
        fail(f"unknown channel {unknown[0]!r}; known: {', '.join(registry.names())}", 2)
    return wanted or None


def _channels(conn: sa.Connection, values: Sequence[str]) -> list[str] | None:
    """Channel filters: a channel the relay has registered, or any channel
    with messages in the database (a custom one this process does not load).
    A name that is neither is most likely a typo: refused, naming the known ones."""
    from outbox import channels as registry
    from outbox import store

    wanted = _split(values)
    try:
        unregistered = sorted(set(wanted) - set(registry.names()))
        unknown = sorted(set(unregistered) - store.channels_with_rows(conn, unregistered))
    except ValueError as exc:
        fail(str(exc), 2)
    if unknown:
        fail(
            f"unknown channel {unknown[0]!r}: not registered and no messages; "
            f"known: {', '.join(registry.names())}",
            2,
        )
    return wanted or None


def _statuses(values: Sequence[str], allowed: Sequence[Status], verb: str) -> list[Status]:
    """``--status`` values (repeated or a,b), each one of ``allowed``."""
    try:
        return [Status.parse(v, allowed, verb) for v in _split(values)]
    except ValueError as exc:
        fail(str(exc), 2)


def _tenant_option(help_text: str) -> Callable[[F], F]:
    def option(f: F) -> F:
        return click.option("--tenant", default=None, metavar="TENANT", help=help_text)(f)

    return option


def _tenant(value: str | None) -> str | None:
    """A tenant's name as the doors take it, or exit 2 saying why not."""
    from outbox.tenants import check_tenant

    try:
        return check_tenant(value)
    except ValidationError as exc:
        fail(str(exc), 2)


def _check_ids(ids: Sequence[int]) -> list[int]:
    from outbox.handoff import MAX_MESSAGE_ID

    bad = [i for i in ids if not 1 <= i <= MAX_MESSAGE_ID]
    if bad:
        fail(f"message ids are positive integers up to {MAX_MESSAGE_ID}, got {bad[0]}", 2)
    return sorted(set(ids))


def _stdin_is_a_terminal() -> bool:
    return sys.stdin.isatty()


def confirm(question: str, yes: bool) -> None:
    """Go on only when the operator agrees: ``--yes``, or "y" at the prompt.
    Without a terminal to ask on, refuse rather than guess."""
    if yes:
        return
    if not _stdin_is_a_terminal():
        fail(
            f"{question}: refusing without --yes (no terminal to confirm on); "
            "--dry-run shows what would change",
            2,
            "confirmation_required",
        )
    if not click.confirm(f"{question}?", default=False, err=True):
        fail("not confirmed: nothing changed", 1, "aborted")


# --- the commands --------------------------------------------------------------


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(outbox.__version__, "--version", "-V", prog_name="outbox")
@click.option(
    "--database-url",
    default=None,
    metavar="URL",
    help=_DATABASE_URL_HELP,
)
@click.pass_context
def cli(ctx: click.Context, database_url: str | None) -> None:
    """Operate the outbox relay (the database is --database-url or DATABASE_URL)."""
    ctx.obj = Options(database_url=database_url or None)


@cli.command()
@database_url_option
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Print the SQL the upgrade would run on this database; change nothing.",
)
@click.option(
    "--check",
    is_flag=True,
    help="Change nothing; exit 1, saying how far behind, unless the schema is at the latest "
    "revision.",
)
@click.option(
    "--fix",
    is_flag=True,
    help="Revoke CREATE on the relay's schema from PUBLIC and every role but its owner and "
    "the migrator, instead of refusing to migrate.",
)
@json_option
def migrate(as_sql: bool, check: bool, fix: bool, as_json: bool) -> None:
    """Bring the outbox schema to the latest revision.

    --sql prints the statements instead (from the database's current
    revision); --check only says whether the schema is current (for a deploy
    pipeline: exit 0 when it is, 1 when it is behind). A schema that other
    roles may create in (PUBLIC may, on public, up to PostgreSQL 14) is
    refused, exit 2; --fix revokes that first."""
    from outbox import migrate as migrations

    if as_sql and check:
        fail("give --sql or --check, not both", 2)
    if fix and (as_sql or check):
        fail("--fix changes the schema: give it without --sql or --check", 2)
    if not (as_sql or check):
        with database() as engine:
            if fix:
                with engine.begin() as connection:
                    revoked = migrations.check_schema_creators(connection, fix=True)
                if revoked:
                    click.echo(f"revoked CREATE on the schema from {', '.join(revoked)}", err=True)
            try:
                previous, revision = migrations.upgrade_from(engine)
            except migrations.UnsafeSchema as exc:
                fail(str(exc), 2, "schema_unsafe")
        render_revision(previous, revision, as_json)
        return
    with database() as engine:
        revision = migrations.current(engine)
    head = migrations.head()
    try:
        behind = migrations.pending(revision)
    except migrations.UnknownRevision:
        fail(
            f"the schema is at revision {revision}, which this release does not know "
            "(a newer release migrated it?)",
            1,
            "schema_unknown",
        )
    if as_sql:
        click.echo(
            migrations.upgrade_sql(revision)
            if behind
            else f"-- the schema is at revision {head}: nothing to run"
        )
        return
    if as_json:
        emit_json({"revision": revision, "head": head, "behind": len(behind)})
    elif behind:
        where = f"at revision {revision}" if revision else "missing (no revision)"
        click.echo(
            f"the schema is {where}, {len(behind)} revision(s) behind {head}: run `outbox migrate`",
            err=True,
        )
    else:
        click.echo(f"schema at revision {head}: current")
    if behind:
        sys.exit(1)


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
@database_url_option
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
@click.option(
    "--cooldown",
    type=Duration(),
    default=None,
    help="At most one message of --cooldown-key delivered within this window (1h).",
)
@click.option("--cooldown-key", default=None, help="The key the cooldown is counted per.")
@click.option(
    "--on-cooldown",
    type=click.Choice(["wait", "suppress"]),
    default="wait",
    show_default=True,
    help="Inside another message's window: wait for its end, or end suppressed.",
)
@_tenant_option("The customer the message is for (its keys and secrets are its own).")
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
    cooldown: float | None,
    cooldown_key: str | None,
    on_cooldown: str,
    tenant: str | None,
    as_json: bool,
) -> None:
    """Enqueue one message (validated like outbox.enqueue); prints its id."""
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
                    cooldown=cooldown,
                    cooldown_key=cooldown_key,
                    on_cooldown=on_cooldown,
                    tenant=_tenant(tenant),
                    return_created=True,
                )
        except ValidationError as exc:  # DedupeConflict too: nothing was written
            fail(str(exc), 2)
    render_enqueued(message_id, channel, created, as_json)


@cli.command()
@database_url_option
@click.option(
    "--by",
    type=click.Choice(["channel", "tenant"]),
    default="channel",
    show_default=True,
    help="tenant: per tenant, due, the oldest due age, in flight, delivered, unresolved.",
)
@json_option
def status(by: str, as_json: bool) -> None:
    """Messages per channel and status, oldest due age, claims past their lease,
    pending messages held behind a failed row of their ordering key, paused
    channels, the destinations that throttled (rate, pauses), and the oldest
    snapshot that holds back vacuum in the database."""
    from outbox import store

    if by == "tenant":
        with database() as engine, engine.connect() as conn:
            render_tenant_status(store.tenant_status(conn), as_json)
        return
    with database() as engine, engine.connect() as conn:
        groups = store.channel_status_counts(conn)
        backlog = store.backlog(conn)
        paused = store.paused_channels(conn)
        tenant_paused = [t for t in store.tenant_channels(conn) if t.paused]
        destinations = store.destination_figures(conn)
        snapshot = store.oldest_snapshot(conn)
    render_status(groups, backlog, STATUSES, as_json, paused, destinations, snapshot, tenant_paused)


@cli.command("list")
@database_url_option
@click.option("--status", "statuses", multiple=True, help="Filter by status (repeat or a,b).")
@click.option("--channel", "channels_", multiple=True, help="Filter by channel (repeat or a,b).")
@click.option("--dedupe-key", default=None, help="Only the messages with this dedupe key.")
@click.option("--ordering-key", default=None, help="Only the messages with this ordering key.")
@_tenant_option("Only this tenant's messages.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option(
    "--after",
    "after_id",
    type=click.IntRange(1),
    default=None,
    metavar="ID",
    help="Continue a listing after this id (the next_after of the previous page).",
)
@json_option
def list_(
    statuses: tuple[str, ...],
    channels_: tuple[str, ...],
    dedupe_key: str | None,
    ordering_key: str | None,
    tenant: str | None,
    limit: int,
    after_id: int | None,
    as_json: bool,
) -> None:
    """Messages, newest first, optionally filtered; a page at a time."""
    from outbox import store

    wanted = _statuses(statuses, STATUSES, "list")
    with database() as engine, engine.connect() as conn:
        rows = store.list_messages(
            conn,
            wanted or None,
            _channels(conn, channels_),
            limit,
            dedupe_key=dedupe_key,
            ordering_key=ordering_key,
            tenant=_tenant(tenant),
            after_id=after_id,
        )
    render_messages(rows, rows[-1].id if len(rows) == limit else None, as_json)


@cli.command()
@database_url_option
@click.argument("message_id", type=int)
@_tenant_option("Only if it is this tenant's message (an operator serving one customer).")
@json_option
def show(message_id: int, tenant: str | None, as_json: bool) -> None:
    """One message (payload included) and its attempt history."""
    from outbox import store

    _check_ids([message_id])
    wanted = _tenant(tenant)
    with database() as engine, engine.connect() as conn:
        row = store.get_message(conn, message_id)
        if row is not None and wanted is not None and (row.tenant or "") != wanted:
            row = None  # another tenant's message is not found, as no message is
        history = store.attempt_history(conn, message_id) if row else []
    if row is None:
        fail(
            f"no message with id {message_id}" + (f" of tenant {wanted!r}" if wanted else ""),
            1,
            "not_found",
        )
    message = dict(row._mapping)
    message["payload"] = _stored_payload(message["payload"])
    render_message(message, [dict(a._mapping) for a in history], as_json)


def _stored_payload(text: str) -> Any:
    """The payload decoded, or, when it is beyond the payload limits (a row
    written past the producer), its stored JSON text as it is."""
    from outbox.payloads import decode

    try:
        return decode(text)
    except ValidationError:
        return text


def _locked_ids(conn: sa.Connection, ids: list[int], allowed: Sequence[str], verb: str) -> None:
    """Every id must exist and be in an allowed state, or nothing changes."""
    from outbox import store

    found = store.statuses_of(conn, ids)
    missing = [i for i in ids if i not in found]
    if missing:
        fail(f"unknown message id(s): {', '.join(map(str, missing))}", 1, "not_found")
    wrong = {i: s for i, s in found.items() if s not in allowed}
    if wrong:
        listed = ", ".join(f"{i} is {s}" for i, s in sorted(wrong.items()))
        fail(
            f"cannot {verb} ({listed}): {verb} applies only to {', '.join(allowed)} messages",
            1,
            "conflict",
        )


def _change(
    action: str,
    ids: tuple[int, ...],
    selected: Callable[[sa.Connection], list[int]] | None,
    allowed: Sequence[str],
    apply: Callable[[sa.Connection, list[int]], set[int]],
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Redrive or cancel: the given ids (all must qualify, or nothing changes),
    or the ids a filter selects (shown and confirmed first). Changes exactly
    those rows, each only if still in an allowed state."""
    with database() as engine, engine.begin() as conn:
        if ids:
            chosen = _check_ids(ids)
            _locked_ids(conn, chosen, allowed, action)
        else:
            assert selected is not None
            chosen = selected(conn)
            if chosen and not dry_run:
                confirm(f"{action} {len(chosen)} message(s)", yes)
        if dry_run:
            conn.rollback()
            render_change(action, len(chosen), chosen, True, as_json)
            return
        done = sorted(apply(conn, chosen))
    render_change(action, len(done), done, False, as_json)


@cli.command()
@database_url_option
@click.argument("ids", nargs=-1, type=int)
@click.option("--status", "statuses", multiple=True, help="Redrive every message in this status.")
@click.option("--channel", "channels_", multiple=True, help="With --status: only these channels.")
@click.option(
    "--since", type=Duration(), default=None, help="With --status: settled this recently."
)
@_tenant_option("With --status: only this tenant's messages.")
@dry_run_option
@yes_option
@json_option
def redrive(
    ids: tuple[int, ...],
    statuses: tuple[str, ...],
    channels_: tuple[str, ...],
    since: float | None,
    tenant: str | None,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Send dead, failed or expired messages again: a fresh set of attempts,
    numbered on from the last one; the history stays.

    Either IDS, or --status dead|failed|expired with optional --channel and
    --since (asks first: --yes skips the question, --dry-run only shows).
    """
    from outbox import store

    allowed = REDRIVABLE_STATUSES
    wanted = _statuses(statuses, allowed, "redrive")
    if ids and (wanted or channels_ or since is not None or tenant is not None):
        fail("give either message ids or --status/--channel/--since/--tenant, not both", 2)
    if not ids and not wanted:
        fail(f"give message ids, or --status {' or '.join(allowed)}", 2)

    def selected(conn: sa.Connection) -> list[int]:
        return store.matching_ids(
            conn, wanted, _channels(conn, channels_), since, tenant=_tenant(tenant)
        )

    _change("redrive", ids, selected, allowed, store.redrive, dry_run, yes, as_json)


@cli.command()
@database_url_option
@click.argument("ids", nargs=-1, type=int)
@click.option("--channel", "channels_", multiple=True, help="Cancel the pending messages of these.")
@click.option("--ordering-key", default=None, help="Cancel the pending messages with this key.")
@click.option("--dedupe-key", default=None, help="Cancel the pending messages with this key.")
@_tenant_option("Cancel the pending messages of this tenant (with the keys: its keys).")
@click.option("--reason", default="cancelled by operator", show_default=True)
@dry_run_option
@yes_option
@json_option
def cancel(
    ids: tuple[int, ...],
    channels_: tuple[str, ...],
    ordering_key: str | None,
    dedupe_key: str | None,
    tenant: str | None,
    reason: str,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Cancel messages (undo with `outbox uncancel`).

    Either IDS: pending ones, or failed, dead or expired ones holding their
    ordering key (its later messages then go); all must qualify, or nothing
    changes. Or every pending message matching --channel, --ordering-key and
    --dedupe-key (asks first: --yes skips the question, --dry-run only shows).
    """
    from outbox import store

    filtered = bool(channels_ or ordering_key or dedupe_key or tenant is not None)
    if ids and filtered:
        fail(
            "give either message ids or --channel/--ordering-key/--dedupe-key/--tenant, not both",
            2,
        )
    if not ids and not filtered:
        fail("give message IDS, or --channel, --ordering-key, --dedupe-key or --tenant", 2)

    def selected(conn: sa.Connection) -> list[int]:
        return store.matching_ids(
            conn,
            ["pending"],
            _channels(conn, channels_),
            ordering_key=ordering_key,
            dedupe_key=dedupe_key,
            tenant=_tenant(tenant),
        )

    def apply(conn: sa.Connection, chosen: list[int]) -> set[int]:
        return store.cancel(conn, chosen, reason)

    allowed = CANCELLABLE_STATUSES
    _change("cancel", ids, selected, allowed, apply, dry_run, yes, as_json)


@cli.command()
@database_url_option
@click.argument("ids", nargs=-1, type=int, required=True)
@dry_run_option
@json_option
def uncancel(ids: tuple[int, ...], dry_run: bool, as_json: bool) -> None:
    """Undo `outbox cancel`: cancelled messages IDS go back to pending, with a
    fresh set of attempts numbered on from the last one; the history stays.

    All must be cancelled, or nothing changes. A message with an ordering key
    stays cancelled once a later message of its key has gone ahead (it would
    be delivered out of order)."""
    from outbox import store

    def apply(conn: sa.Connection, chosen: list[int]) -> set[int]:
        done = store.uncancel(conn, chosen)
        overtaken = sorted(set(chosen) - done)
        if overtaken:  # raised inside the transaction: nothing changes
            fail(
                f"cannot uncancel {', '.join(map(str, overtaken))}: a later message of "
                "its ordering key has gone ahead",
                1,
                "conflict",
            )
        return done

    _change("uncancel", ids, None, [Status.CANCELLED], apply, dry_run, True, as_json)


@cli.command()
@database_url_option
@click.option(
    "--older-than",
    type=Duration(),
    default=None,
    help="e.g. 7d: settled before then (default: RETENTION_DAYS, the reaper's window).",
)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    help="Only these terminal statuses (default: all but failed, dead and expired).",
)
@dry_run_option
@yes_option
@json_option
def prune(
    older_than: float | None, statuses: tuple[str, ...], dry_run: bool, yes: bool, as_json: bool
) -> None:
    """Delete terminal messages settled longer ago than --older-than (by
    default RETENTION_DAYS, the window the reaper prunes by).

    Their attempt history stays for `outbox history` (the reaper prunes it
    after ATTEMPT_RETENTION_DAYS), and so do their dedupe keys (DEDUPE_WINDOW_DAYS).

    Counts them and asks first: --yes skips the question, --dry-run only counts."""
    from outbox import store

    # Without --status, what the reaper's routine retention prunes: failed, dead
    # and expired rows wait for an operator, who names them to prune them.
    wanted = _statuses(statuses, TERMINAL_STATUSES, "prune") or [
        s for s in TERMINAL_STATUSES if s not in UNRESOLVED_STATUSES
    ]
    if older_than is None:
        try:
            older_than = RETENTION_DAYS.read(os.environ) * 86400.0
        except ConfigError as exc:
            fail(str(exc), 2, "config")
    total = 0
    with database() as engine:
        with engine.connect() as conn:
            cutoff = store.prune_cutoff(conn, older_than)
            count = store.count_prunable(conn, cutoff, wanted)
        if dry_run or count == 0:
            render_change("prune", count, None, dry_run, as_json)
            return
        confirm(f"delete {count} message(s) settled before {cutoff:%Y-%m-%d %H:%M:%S %Z}", yes)
        # No more than was counted and confirmed: a row that reached a
        # prunable status since the count stays for the next prune.
        while total < count:
            batch = min(PRUNE_BATCH, count - total)
            with engine.begin() as conn:
                deleted = store.prune_settled_before(conn, cutoff, batch, wanted)
            total += deleted
            if deleted < batch:
                break
    render_change("prune", total, None, False, as_json)


@cli.command()
@database_url_option
@click.option(
    "--recipient",
    required=True,
    help="Email address, phone number, endpoint ARN, webhook URL, queue URL or bus name.",
)
@click.option("--channel", "channels_", multiple=True, help="Only these channels (repeat or a,b).")
@_tenant_option("Only this tenant's attempts (its send log; kept after its messages).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@json_option
def history(
    recipient: str, channels_: tuple[str, ...], tenant: str | None, limit: int, as_json: bool
) -> None:
    """Did they get it? The attempts that went to a recipient, newest first.

    The address is fingerprinted in the database with the installation's key,
    as at enqueue, and matched against the attempt history (kept for
    ATTEMPT_RETENTION_DAYS, after the messages themselves are pruned). The
    address is never stored, logged or printed."""
    from outbox import channels as registry
    from outbox import store

    if not recipient.strip():
        fail("--recipient must not be empty", 2)
    with database() as engine, engine.connect() as conn:
        wanted = _channels(conn, channels_) or registry.names()
        rows = store.recipient_history(conn, recipient, wanted, limit, tenant=_tenant(tenant))
    render_history(rows, as_json)


# --- pause and resume a channel ------------------------------------------------


def _pausable_channel(conn: sa.Connection, channel: str) -> str:
    """A channel the relay knows, or one with rows in the outbox; else exit 2."""
    from outbox import channels as registry
    from outbox import store

    try:
        known = channel in registry.names() or store.channels_with_rows(conn, [channel])
    except ValueError as exc:  # not a channel's name at all
        fail(str(exc), 2)
    if not known:
        fail(
            f"unknown channel {channel!r}: not registered and no messages; "
            f"known: {', '.join(registry.names())}",
            2,
        )
    return channel


def _tenant_key(tenant: str | None) -> dict[str, str]:
    """A command's JSON names the tenant only when it was for one (the answer
    for a whole channel stays as it was)."""
    return {} if tenant is None else {"tenant": tenant}


def _for_tenant(tenant: str | None) -> str:
    """How a command's answer names the tenant it was for, if one."""
    return "" if tenant is None else f" for tenant {inert(tenant)}"


@cli.command()
@database_url_option
@click.argument("channel")
@click.option("--reason", default=None, help="Why, shown by `outbox status`.")
@_tenant_option("Only this tenant's messages of CHANNEL (nobody else's wait).")
@json_option
def pause(channel: str, reason: str | None, tenant: str | None, as_json: bool) -> None:
    """Stop claiming CHANNEL's messages: they stay pending, no attempt counted.

    Batches a sender is already sending finish; claims handed off but not yet
    taken by a sender go back pending, not started. Undo with `outbox resume`.
    With --tenant, only that tenant's messages of CHANNEL wait (`outbox tenant
    pause` holds all of a tenant's channels)."""
    from outbox import store

    tenant = _tenant(tenant)
    with database() as engine, engine.begin() as conn:
        channel = _pausable_channel(conn, channel)
        try:
            newly = (
                store.pause_channel(conn, channel, reason)
                if tenant is None
                else store.pause_tenant_channel(conn, tenant, channel, reason)
            )
        except ValueError as exc:
            fail(str(exc), 2)
    if as_json:
        emit_json({"channel": channel, **_tenant_key(tenant), "paused": True, "changed": newly})
    else:
        said = "paused" if newly else "was already paused"
        click.echo(f"channel {channel}{_for_tenant(tenant)} {said}")


@cli.command()
@database_url_option
@click.argument("channel")
@_tenant_option("Only this tenant's messages of CHANNEL (paused with `pause --tenant`).")
@json_option
def resume(channel: str, tenant: str | None, as_json: bool) -> None:
    """Claim CHANNEL's messages again."""
    from outbox import store

    tenant = _tenant(tenant)
    with database() as engine, engine.begin() as conn:
        try:
            was_paused = (
                store.resume_channel(conn, channel)
                if tenant is None
                else store.resume_tenant_channel(conn, tenant, channel)
            )
        except ValueError as exc:
            fail(str(exc), 2)
    if as_json:
        emit_json(
            {"channel": channel, **_tenant_key(tenant), "paused": False, "changed": was_paused}
        )
    else:
        said = "resumed" if was_paused else "was not paused"
        click.echo(f"channel {inert(channel)}{_for_tenant(tenant)} {said}")


# --- rate limits ---------------------------------------------------------------


@cli.group()
def limit() -> None:
    """Rate limits per channel and destination, shared by every dispatcher and
    worker (docs/how-to/rate-limits.md)."""


def _destination_option(f: F) -> F:
    return click.option(
        "--destination",
        default="",
        show_default="the account; for webhook and sqs, the whole channel",
        help="The destination's key: a webhook's host[:port], an SQS queue URL, an event bus; "
        "'*': all the channel's destinations together.",
    )(f)


def _limit_tenant_option(f: F) -> F:
    return _tenant_option(
        "This tenant's messages of CHANNEL, all its destinations together (not with "
        "--destination); everyone else's are not held by it."
    )(f)


def _tenant_or_destination(tenant: str | None, destination: str) -> str | None:
    """The tenant of a limit command, checked; a limit is a tenant's or a
    destination's, not both."""
    if tenant is not None and destination:
        fail(
            "give --tenant or --destination, not both: a tenant's limit holds all its "
            "destinations of the channel",
            2,
        )
    return _tenant(tenant)


@limit.command("set")
@click.argument("channel")
@_destination_option
@_limit_tenant_option
@click.option("--rate", type=float, required=True, help="Messages a second.")
@click.option("--burst", type=float, default=None, help="Messages at once (default: a second's).")
@json_option
def limit_set(
    channel: str,
    destination: str,
    tenant: str | None,
    rate: float,
    burst: float | None,
    as_json: bool,
) -> None:
    """Hold CHANNEL (or one of its destinations, or a tenant's messages of it)
    to RATE messages a second."""
    from outbox import store

    tenant = _tenant_or_destination(tenant, destination)
    with database() as engine, engine.begin() as conn:
        _pausable_channel(conn, channel)
        try:
            if tenant is not None:
                rate, burst = store.set_tenant_limit(conn, tenant, channel, rate, burst)
            else:
                destination = store.check_destination(channel, destination)
                rate, burst = store.set_limit(conn, channel, destination, rate, burst)
        except ValueError as exc:
            fail(str(exc), 2)
    if tenant is not None:
        if as_json:
            emit_json({"channel": channel, "tenant": tenant, "rate": rate, "burst": burst})
        else:
            click.echo(
                f"{inert(channel)}{_for_tenant(tenant)}: at most {rate:g}/s, {burst:g} at once"
            )
    elif as_json:
        emit_json({"channel": channel, "destination": destination, "rate": rate, "burst": burst})
    else:
        where = destination_label(destination)
        click.echo(f"{inert(channel)} {where}: at most {rate:g}/s, {burst:g} at once")


@limit.command("clear")
@click.argument("channel")
@_destination_option
@click.option(
    "--learned",
    is_flag=True,
    help="Also forget what the relay learned of it (its rate, pause and bucket): it is "
    "asked at full speed again. The reaper forgets that by itself 15 minutes after the "
    "last throttling answer.",
)
@_limit_tenant_option
@json_option
def limit_clear(
    channel: str, destination: str, learned: bool, tenant: str | None, as_json: bool
) -> None:
    """Remove CHANNEL's (or its destination's, or a tenant's) limit."""
    from outbox import store

    tenant = _tenant_or_destination(tenant, destination)
    if tenant is not None:
        if learned:
            fail("--learned is a destination's: a tenant's limit learns nothing", 2)
        with database() as engine, engine.begin() as conn:
            try:
                cleared = store.clear_tenant_limit(conn, tenant, channel)
            except ValueError as exc:
                fail(str(exc), 2)
        if as_json:
            emit_json({"channel": channel, "tenant": tenant, "changed": cleared})
        else:
            click.echo("limit cleared" if cleared else "no limit was set")
        return
    with database() as engine, engine.begin() as conn:
        try:
            destination = store.check_destination(channel, destination)
            cleared = store.clear_limit(conn, channel, destination)
            forgotten = learned and store.forget_learned(conn, channel, destination)
        except ValueError as exc:
            fail(str(exc), 2)
    if as_json:
        emit_json(
            {
                "channel": channel,
                "destination": destination,
                "changed": cleared or forgotten,
                "limit_cleared": cleared,
                "learned_forgotten": forgotten,
            }
        )
        return
    said = ["limit cleared" if cleared else "no limit was set"]
    if learned:
        said.append("learned rate forgotten" if forgotten else "nothing was learned")
    click.echo("; ".join(said))


@limit.command("show")
@json_option
def limit_show(as_json: bool) -> None:
    """The limits set, and what the relay learned of each destination's rate."""
    from outbox import store

    with database() as engine, engine.connect() as conn:
        destinations = store.destination_figures(conn)
        tenants = [t for t in store.tenant_channels(conn) if t.limit_rate is not None]
    render_destinations(destinations, as_json, tenants)


# --- tenants -------------------------------------------------------------------


@cli.group()
def tenant() -> None:
    """Tenants: their weight in the claim's fair share, a pause, a producer role
    bound to one, the webhook secrets that are theirs (docs/how-to/tenants.md)."""


def _tenant_argument(f: F) -> F:
    return click.argument("tenant_name", metavar="TENANT")(f)


def _tenant_done(what: dict[str, Any], said: str, as_json: bool) -> None:
    if as_json:
        emit_json(what)
    else:
        click.echo(said)


@tenant.command("show")
@click.argument("tenant_name", metavar="[TENANT]", required=False)
@json_option
def tenant_show(tenant_name: str | None, as_json: bool) -> None:
    """What is set for each tenant (or TENANT): weight, pause, roles, secrets."""
    from outbox import store

    name = _tenant(tenant_name)
    with database() as engine, engine.connect() as conn:
        render_tenants(
            store.tenant_settings(conn, name), as_json, store.tenant_channels(conn, name)
        )


def _set_tenant(tenant_name: str, said: str, as_json: bool, **change: Any) -> None:
    """Write one of a tenant's settings (``change``: weight= or paused=)."""
    from outbox import store

    name = str(_tenant(tenant_name))
    with database() as engine, engine.begin() as conn:
        store.set_tenant(conn, name, **change)
    _tenant_done({"tenant": name, **change}, f"{name}: {said}", as_json)


@tenant.command("set")
@_tenant_argument
@click.option(
    "--weight",
    type=click.IntRange(1, 1000),
    required=True,
    help="Its share of each batch against the others' (1 each by default).",
)
@json_option
def tenant_set(tenant_name: str, weight: int, as_json: bool) -> None:
    """Give TENANT a weight in the claim's fair share."""
    _set_tenant(tenant_name, f"weight {weight}", as_json, weight=weight)


@tenant.command("pause")
@_tenant_argument
@json_option
def tenant_pause(tenant_name: str, as_json: bool) -> None:
    """Hold TENANT's messages (they wait, pending; nobody else's do)."""
    _set_tenant(tenant_name, "paused", as_json, paused=True)


@tenant.command("resume")
@_tenant_argument
@json_option
def tenant_resume(tenant_name: str, as_json: bool) -> None:
    """Let TENANT's messages go again."""
    _set_tenant(tenant_name, "resumed", as_json, paused=False)


@tenant.command("bind")
@click.argument("role")
@_tenant_argument
@json_option
def tenant_bind(role: str, tenant_name: str, as_json: bool) -> None:
    """Bind the database ROLE a producer logs in as to TENANT: the doors write
    TENANT for it and refuse any other."""
    from outbox import store

    name = _tenant(tenant_name)
    with database() as engine, engine.begin() as conn:
        try:
            store.bind_role(conn, role, str(name))
        except ValueError as exc:
            fail(str(exc), 2)
    _tenant_done({"role": role, "tenant": name}, f"{inert(role)}: bound to {name}", as_json)


@tenant.command("unbind")
@click.argument("role")
@json_option
def tenant_unbind(role: str, as_json: bool) -> None:
    """Unbind ROLE: it may name any tenant again."""
    from outbox import store

    with database() as engine, engine.begin() as conn:
        changed = store.unbind_role(conn, role)
    said = f"{inert(role)}: " + ("unbound" if changed else "was not bound")
    _tenant_done({"role": role, "changed": changed}, said, as_json)


@tenant.command("secret")
@click.argument("secret_id")
@_tenant_argument
@json_option
def tenant_secret(secret_id: str, tenant_name: str, as_json: bool) -> None:
    """Make the webhook signing secret SECRET_ID (a payload's secret_id) TENANT's
    alone: only its messages may name it, and its messages no other."""
    from outbox import store

    name = _tenant(tenant_name)
    with database() as engine, engine.begin() as conn:
        store.map_secret(conn, secret_id, str(name))
    said = f"{inert(secret_id)}: {name}'s signing secret"
    _tenant_done({"secret_id": secret_id, "tenant": name}, said, as_json)


@tenant.command("unsecret")
@click.argument("secret_id")
@json_option
def tenant_unsecret(secret_id: str, as_json: bool) -> None:
    """Make SECRET_ID no tenant's: only messages without a tenant may name it."""
    from outbox import store

    with database() as engine, engine.begin() as conn:
        changed = store.unmap_secret(conn, secret_id)
    said = f"{inert(secret_id)}: " + ("no tenant's now" if changed else "was no tenant's")
    _tenant_done({"secret_id": secret_id, "changed": changed}, said, as_json)


# --- worker --------------------------------------------------------------------


@cli.command()
@database_url_option
@click.option("--once", is_flag=True, help="Claim and send one batch, then exit.")
@click.option("--until-empty", is_flag=True, help="Exit when nothing is due any more.")
@click.option(
    "--batch-size",
    type=click.IntRange(BATCH_SIZE.low, BATCH_SIZE.high),
    default=None,
    help="Rows per claim (BATCH_SIZE for this run).",
)
@click.option("--channels", "channels_", default=None, help="Only these channels (a,b).")
@click.option(
    "--reap-interval",
    type=Duration(),
    default=30.0,
    show_default=True,
    help="How often the worker's reaper step runs (stale claims, deliver-by times, "
    "outcome events, pruning).",
)
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

    require_extra("outbox worker", "worker", "aws_lambda_powertools", "boto3")
    from outbox.relay_settings import OutcomeEventSettings, RelaySettings
    from outbox.worker import Worker

    try:
        settings = RelaySettings.from_env(os.environ)
        outcome_events = OutcomeEventSettings.from_env(os.environ)
        read_all(os.environ)  # the channels' too, as a function's cold start does
    except ConfigError as exc:
        fail(str(exc), 2, "config")
    if batch_size is not None:
        settings = dataclasses.replace(settings, batch_size=batch_size)
    wanted = _registered_channels([channels_]) if channels_ else None
    from outbox import channels as registry

    try:
        settings.check_rate_limit_channels(registry.names())
    except ConfigError as exc:
        fail(str(exc), 2, "config")

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not as_json:
            click.echo(f"{signal.Signals(signum).name}: finishing the batch in hand", err=True)
        stop.set()

    from outbox import observability
    from outbox.runtime import cold_start_done
    from outbox_cli.invoke import logs_to_stderr

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        # The relay's log records are diagnostics, beside the errors: stdout
        # is the report (`outbox worker --json | jq`).
        with observability.suspended(), logs_to_stderr(), database(autocommit=True) as engine:
            cold_start_done()  # what the setup made lives as long as the worker
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
    render_worker_report(dataclasses.asdict(report), as_json)


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
    type=click.IntRange(1, MAX_MESSAGES_PER_EVENT),
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
    require_extra(
        "outbox invoke", "local", "yaml", "samtranslator", "aws_lambda_powertools", "boto3"
    )
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
            invoke.refuse_custom_resource_event(spec, event)
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
        if not as_json:  # under --json the error object below is the one document
            click.echo(json.dumps(outcome.error))
        error_type = outcome.error["errorType"]
        message = " ".join((outcome.summary or outcome.error["errorMessage"]).split())
        if outcome.phase == "init":
            fail(f"{spec.logical_id} failed at init: {error_type}: {message}")
        fail(f"{spec.logical_id} raised {error_type}: {message}")
    click.echo(json.dumps(_jsonable(outcome.result), indent=None if as_json else 2))
    never_live = outcome.result.get("unknown") if isinstance(outcome.result, dict) else None
    if never_live:  # the function logs it at INFO, below the template's log level
        click.echo(
            f"no such claim for id(s) {', '.join(map(str, never_live))}: the event's "
            "claims were never live here (events/ samples carry placeholder claim tokens); "
            f"`outbox invoke {spec.logical_id} --claim N` claims due messages for a live event",
            err=True,
        )
    if outcome.timed_out:
        fail(
            f"{spec.logical_id} ran {outcome.duration_seconds:.2f}s, past its "
            f"{spec.timeout_seconds:g}s Timeout: Lambda would have stopped it"
        )


def main() -> None:
    cli(prog_name="outbox")


if __name__ == "__main__":  # pragma: no cover
    main()
