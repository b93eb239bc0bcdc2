"""One pooled SQLAlchemy engine per process, reused across Lambda invocations.

Credentials come from ``DATABASE_URL`` locally, or in AWS from a Secrets
Manager secret (RDS format, cached and re-read on rotation) or an RDS IAM auth
token minted per connection. TLS is verified whenever we are not on a local
URL: pg8000 talks plaintext unless it is handed an SSL context, so we always
hand it one. Nothing here issues a session ``SET``: that would pin the
connection behind RDS Proxy. The relay's ``search_path`` (its schema, then
``pg_temp``) is a startup parameter of each connection instead (a parameter
of its own: RDS Proxy refuses ``options``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
import ssl
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from . import aws
from .errors import ConfigError, moved_meanwhile, sqlstate
from .relay_settings import DatabaseSettings
from .store._sql import KEPT_PREPARED_MARK

_SECRET_MAX_AGE_SECONDS = 300


def tls_context(settings: DatabaseSettings) -> ssl.SSLContext:
    """A verifying context: the system roots (enough for RDS Proxy, whose
    certificates chain to Amazon Trust Services) plus an optional CA bundle
    (the RDS global bundle, for direct connections to an instance)."""
    context = ssl.create_default_context(cafile=settings.ca_bundle)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


# libpq's sslmode values a URL may carry, and how pg8000 is told (it takes an
# SSL context, not URL arguments). "prefer" and "allow" are refused: they fall
# back to plaintext when TLS fails, so an attacker in the path decides.
URL_SSLMODES = ("disable", "require", "verify-ca", "verify-full")
# The query arguments of a URL the relay understands: libpq's TLS ones, taken
# out, and pg8000's unix_sock (a socket path: the embedded Postgres), passed
# on. Anything else would reach pg8000's connect() as an unknown keyword.
_URL_ARGUMENTS = ("sslmode", "sslrootcert")
_PG8000_URL_ARGUMENTS = ("unix_sock",)


@dataclasses.dataclass(frozen=True)
class ParsedUrl:
    """A database URL as the relay connects with it."""

    url: URL  # always the pg8000 driver, without sslmode and sslrootcert
    sslmode: str | None  # the URL's own sslmode, if it gave one
    sslrootcert: str | None


def parse_database_url(text: str) -> ParsedUrl:
    """Any Postgres URL an application's SQLAlchemy takes (``postgresql://``,
    ``postgres://``, ``postgresql+psycopg://``, ``+psycopg2``, ``+pg8000``)
    connects with the relay's driver, pg8000; libpq's ``sslmode`` and
    ``sslrootcert`` become its TLS settings (pg8000's ``unix_sock`` passes
    through). Raises ConfigError naming
    DATABASE_URL, never echoing the URL (it may hold a password)."""
    try:
        url = make_url(text)
        port = url.port
    except (sa.exc.ArgumentError, ValueError, TypeError):
        raise ConfigError(
            "DATABASE_URL", "is not a valid URL (postgresql://user:password@host:port/database)"
        ) from None
    if url.get_backend_name() not in ("postgresql", "postgres"):
        raise ConfigError("DATABASE_URL", "must be a postgresql:// URL")
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError("DATABASE_URL", "has a port outside 1 to 65535")
    understood = (*_URL_ARGUMENTS, *_PG8000_URL_ARGUMENTS)
    unknown = sorted(set(url.query) - set(understood))
    if unknown:
        raise ConfigError(
            "DATABASE_URL",
            f"has the query argument {unknown[0]!r}; only {', '.join(understood)} are understood",
        )
    values = {k: url.query[k] for k in _URL_ARGUMENTS if k in url.query}
    if any(not isinstance(v, str) for v in values.values()):
        raise ConfigError("DATABASE_URL", "gives sslmode or sslrootcert more than once")
    sslmode = values.get("sslmode")
    if sslmode is not None and sslmode not in URL_SSLMODES:
        raise ConfigError(
            "DATABASE_URL",
            f"sslmode={sslmode} cannot be honoured: use one of {', '.join(URL_SSLMODES)} "
            "(prefer and allow would silently fall back to plaintext)",
        )
    return ParsedUrl(
        url=url.difference_update_query(_URL_ARGUMENTS).set(drivername="postgresql+pg8000"),
        sslmode=sslmode,
        sslrootcert=values.get("sslrootcert"),  # type: ignore[arg-type]
    )


def _url_tls_context(sslmode: str, cafile: str | None) -> ssl.SSLContext | None:
    """pg8000's TLS for libpq's sslmode: none, encrypted only, or verified
    (the CA; and for verify-full the host name too)."""
    if sslmode == "disable":
        return None
    context = ssl.create_default_context(cafile=cafile)
    context.check_hostname = sslmode == "verify-full"
    if sslmode == "require":  # libpq's require checks no certificate
        context.verify_mode = ssl.CERT_NONE
    return context


def _secret_credentials(secret_arn: str, force_fetch: bool = False) -> dict[str, Any]:
    from aws_lambda_powertools.utilities import parameters

    raw = parameters.get_secret(
        secret_arn, max_age=_SECRET_MAX_AGE_SECONDS, force_fetch=force_fetch
    )
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


# The database a connection without a named one opens (RDS's default, and libpq's
# for the user postgres).
_DEFAULT_DATABASE = "postgres"


def _base_url(settings: DatabaseSettings) -> URL:
    if settings.url:
        return parse_database_url(settings.url).url
    if settings.secret_arn:
        secret = _secret_credentials(settings.secret_arn)
        return URL.create(
            "postgresql+pg8000",
            username=secret["username"],
            host=settings.host or secret["host"],
            port=int(settings.port if settings.host else secret.get("port", settings.port)),
            # DB_NAME wins only when set: a DatabaseHost (a proxy) leaves the
            # secret's database as it is
            database=settings.name or secret.get("dbname") or _DEFAULT_DATABASE,
        )
    return URL.create(
        "postgresql+pg8000",
        username=settings.iam_user,
        host=settings.host,
        port=settings.port,
        database=settings.name or _DEFAULT_DATABASE,
    )


def search_path(schema: str) -> str:
    """The relay's names resolve in its own schema only: not in a schema named
    after the login user (``"$user"``, first on Postgres's default path), nor
    in ``pg_temp`` before it (listed last, it is searched last)."""
    return f'"{schema}", pg_temp'


def create_engine(
    settings: DatabaseSettings, *, pool_size: int = 1, autocommit: bool = False
) -> sa.Engine:
    """Build the engine. In Lambda one connection serves the whole invocation.

    ``autocommit``: every state-machine operation in ``store`` is one statement,
    atomic by itself, so the relay's functions run them without BEGIN/COMMIT
    (two round trips fewer each). Callers that need a multi-statement
    transaction (migrations, the operator CLI, your application) keep the default.
    """
    url = _base_url(settings)
    connect_args: dict[str, Any] = {
        "timeout": settings.connect_timeout,
        "application_name": "outbox-relay",
        "startup_params": {"search_path": search_path(settings.schema)},
    }
    parsed = parse_database_url(settings.url) if settings.url else None
    if parsed is not None and parsed.sslmode is not None:
        # The URL's own sslmode decides (libpq's convention); DB_CA_BUNDLE is
        # the CA unless the URL names one.
        context = _url_tls_context(parsed.sslmode, parsed.sslrootcert or settings.ca_bundle)
        if context is not None:
            connect_args["ssl_context"] = context
    elif settings.sslmode != "disable":
        connect_args["ssl_context"] = tls_context(settings)
    engine = sa.create_engine(
        url,
        connect_args=connect_args,
        pool_size=pool_size,
        max_overflow=0 if pool_size == 1 else pool_size,
        # No ping on every checkout (a round trip per transaction); see
        # _ping_when_idle for the check that replaces it.
        pool_pre_ping=False,
        # Below RDS Proxy's default idle client timeout, and short enough that a
        # rotated secret or an expired IAM token is picked up on reconnect.
        pool_recycle=600,
        # Errors and SQLAlchemy's own logs never carry bound parameters: they are
        # payloads (phone numbers, one-time codes) and claim tokens (invariant 8).
        hide_parameters=True,
        # Set as a driver attribute on each new connection: no SQL is sent.
        **({"isolation_level": "AUTOCOMMIT"} if autocommit else {}),
    )
    if settings.secret_arn or settings.iam_user:
        _mint_credentials_per_connection(engine, settings)
    _connect_errors_as_driver_errors(engine)
    sa.event.listen(engine, "connect", _no_delay)
    sa.event.listen(engine, "connect", _execute_in_one_round_trip)
    sa.event.listen(engine, "handle_error", _invalidate_after_any_error)
    _convert_each_statement_once()
    _ping_when_idle(engine)
    _commit_in_one_round_trip(engine)
    return engine


# A connection idle longer than this is checked before use: a Lambda thawed
# after minutes, or RDS Proxy closing idle clients, leaves a dead socket.
PING_AFTER_IDLE_SECONDS = 1.0


def _ping_when_idle(engine: sa.Engine) -> None:
    """SQLAlchemy's pre-ping, but only for a connection that sat idle: the
    dispatcher's loop and a sender's back-to-back transactions skip the round trip."""

    @sa.event.listens_for(engine, "checkin")
    def _idle_from(dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @sa.event.listens_for(engine, "checkout")
    def _check(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            # The pool discards this connection and checks out a fresh one.
            raise sa.exc.DisconnectionError() from exc


def _invalidate_after_any_error(context: sa.engine.ExceptionContext) -> None:
    """A connection whose statement raised is never used again.

    The driver decodes rows while it reads them: an exception it does not
    expect (a RecursionError decoding a deeply nested value, MemoryError, a
    signal) leaves the rest of the answer unread on the socket, and the next
    statement on that connection would read the previous one's results. A
    fresh connection costs one connect; a desynchronised one sends a message
    for another's claim. Only a real disconnect invalidates the whole pool.
    """
    if context.sqlalchemy_exception is not None:
        redact(context.sqlalchemy_exception)
    if context.is_disconnect or context.connection is None:
        return
    if moved_meanwhile(context.original_exception):
        # a whole error answer the server sent (the driver read it to the
        # end), which the store runs again in a savepoint (store._sql)
        return
    context.is_disconnect = True
    context.invalidate_pool_on_disconnect = False


# Fields of a Postgres error that can quote the data: DETAIL ("Failing row
# contains (...)", "Key (...)=(...)") and CONTEXT (which can quote a bound
# parameter's value). The message, code, hint and the names of the schema
# objects stay.
_DATA_FIELDS = ("D", "W", "q", "P", "p")


def redact(exc: BaseException) -> BaseException:
    """Strip bound parameters and quoted row data from a database error, in
    place: its text may reach a log line or a Lambda error report."""
    if isinstance(exc, sa.exc.StatementError):
        exc.hide_parameters = True
        exc.params = None
        # The driver's error and the ones it was raised from (pg8000 chains them).
        seen: set[int] = set()
        cause: BaseException | None = exc.orig
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            args = cause.args
            if args and isinstance(args[0], dict):
                fields = {k: v for k, v in args[0].items() if k not in _DATA_FIELDS}
                cause.args = (fields, *args[1:])
            cause = cause.__cause__ or cause.__context__
        if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None:
            # SQLAlchemy wrote the driver's text into its own message when it
            # built the error: write it again from the redacted fields.
            orig = exc.orig
            exc.args = (f"({type(orig).__module__}.{type(orig).__name__}) {orig}",)
    return exc


def _commit_in_one_round_trip(engine: sa.Engine) -> None:
    """pg8000 sends COMMIT through the extended protocol: parse, describe and
    execute, three round trips. COMMIT takes no parameters, so send it as one
    simple query: the same statement and errors, a third of the waiting."""

    def do_commit(dbapi_connection: Any) -> None:
        raw = getattr(dbapi_connection, "dbapi_connection", dbapi_connection)
        if getattr(raw, "autocommit", False):
            return  # each statement committed itself; nothing to send
        execute_simple = getattr(raw, "execute_simple", None)
        if execute_simple is None:  # not pg8000
            raw.commit()
        else:
            execute_simple("commit")

    engine.dialect.do_commit = do_commit  # type: ignore[method-assign]


def _convert_each_statement_once() -> None:
    """pg8000 rewrites a statement's ``%s`` placeholders to ``$n`` by scanning its
    text character by character on every execute: about a tenth of a batch's time
    in the relay, for the same few statement texts each time. For the positional
    styles the rewritten text depends on the text alone (the values pass through
    unchanged), so remember it. Other styles go through as before."""
    import pg8000.dbapi
    import pg8000.legacy  # pg8000.connect's connections, which SQLAlchemy uses

    convert = pg8000.dbapi.convert_paramstyle
    if getattr(convert, "_outbox_cached", False):
        return

    @functools.lru_cache(maxsize=512)
    def rewritten(style: str, query: str) -> str:
        return str(convert(style, query, ())[0])

    def convert_paramstyle(style: str, query: str, args: Any) -> tuple[str, Any]:
        if style in ("format", "numeric", "qmark"):
            return rewritten(style, query), args
        return convert(style, query, args)

    convert_paramstyle._outbox_cached = True  # type: ignore[attr-defined]
    convert_paramstyle.__wrapped_original__ = convert  # type: ignore[attr-defined]
    pg8000.dbapi.convert_paramstyle = convert_paramstyle
    pg8000.legacy.convert_paramstyle = convert_paramstyle


# What the one-round-trip path uses of pg8000's internals (the layer pins
# pg8000; a version without them keeps pg8000's own three exchanges).
_PG8000_INTERNALS = (
    "_create_message",
    "DatabaseError",
    "IDLE",
    "make_params",
    "Context",
    "_write",
    "_flush",
    "i_pack",
    "H_pack",
    "NULL_BYTE",
    "DESCRIBE",
    "PORTAL",
    "PARSE",
    "BIND",
    "EXECUTE_MSG",
    "FLUSH_MSG",
    "SYNC_MSG",
)
_CONNECTION_INTERNALS = (
    "execute_unnamed",
    "_transaction_status",
    "_send_message",
    "handle_messages",
    "py_types",
    "_client_encoding",
    "_sock",
)


def _execute_in_one_round_trip(dbapi_connection: Any, connection_record: Any) -> None:
    """pg8000 runs a statement with parameters as three request/response
    exchanges: Parse and Sync; Describe and Sync; Bind, Execute and Sync, each
    waited for before the next. The protocol lets all of it go in one message
    train that ends with one Sync (what libpq's PQexecParams sends): the
    server answers in order, the row description before the rows, and an error
    at any step skips to the Sync, so pg8000's reader takes the answers exactly
    as before. A Flush after Execute (as pg8000's own last exchange has) sends
    the rows before the commit at Sync waits for its WAL flush: the client
    decodes them meanwhile instead of after (without it, a claim on an idle
    machine took a tenth longer than pg8000's three exchanges). Still the
    unnamed statement (no prepared state to pin a connection behind RDS
    Proxy), a third of the waiting. Only for this
    engine's connections; COPY streams keep pg8000's own path.

    A statement marked ``KEPT_PREPARED_MARK`` on a connection that keeps
    statements (``keep_statements_prepared``) is parsed once, as a named
    statement, and only bound and executed after that: the same one train,
    without its parse and, once Postgres settles on a generic plan, without
    its planning."""
    import pg8000.core as core

    if (
        not isinstance(dbapi_connection, core.CoreConnection)
        or not all(hasattr(core, name) for name in _PG8000_INTERNALS)
        or not all(hasattr(dbapi_connection, name) for name in _CONNECTION_INTERNALS)
    ):
        return  # another driver, or a pg8000 whose internals moved: its own path
    original = dbapi_connection.execute_unnamed
    describe_portal = core._create_message(core.DESCRIBE, core.PORTAL + core.NULL_BYTE)

    def execute_unnamed(statement: str, vals: Any = (), oids: Any = (), stream: Any = None) -> Any:
        if stream is not None:
            return original(statement, vals=vals, oids=oids, stream=stream)
        conn = dbapi_connection
        # Encode every value before writing anything: a value pg8000 cannot
        # convert raises with nothing half-sent.
        params = core.make_params(conn.py_types, vals)
        parsed, statement_name = _statement_name(conn, statement)
        try:
            return run(statement, params, oids, parsed, statement_name)
        except core.DatabaseError as exc:
            if not parsed or sqlstate(exc) != "26000":
                raise
            # The kept statement is gone (DEALLOCATE ALL or DISCARD ALL in
            # this session): forget every name kept here. Its bind failed
            # before anything ran; outside a transaction block, nothing is
            # left to undo, so parse it again and run it.
            getattr(conn, _KEPT_ATTRIBUTE).clear()
            if conn._transaction_status != core.IDLE:
                raise
            parsed, statement_name = _statement_name(conn, statement)
            return run(statement, params, oids, parsed, statement_name)

    def run(statement: str, params: Any, oids: Any, parsed: bool, statement_name: bytes) -> Any:
        conn = dbapi_connection
        encoding = conn._client_encoding
        bind = bytearray(core.NULL_BYTE + statement_name + core.NULL_BYTE + core.H_pack(0))
        bind += core.H_pack(len(params))
        for value in params:
            if value is None:
                bind += core.i_pack(-1)
            else:
                encoded = value.encode(encoding)
                bind += core.i_pack(len(encoded)) + encoded
        bind += core.H_pack(0)  # every result column as text, as pg8000 reads them
        context = core.Context(statement)
        if not parsed:
            parse = bytearray(statement_name + core.NULL_BYTE + statement.encode(encoding))
            parse += core.NULL_BYTE + core.H_pack(len(oids))
            for oid in oids:
                parse += core.i_pack(0 if oid == -1 else oid)
            conn._send_message(core.PARSE, parse)
        conn._send_message(core.BIND, bind)
        core._write(conn._sock, describe_portal)
        core._write(conn._sock, core.EXECUTE_MSG)
        core._write(conn._sock, core.FLUSH_MSG)
        core._write(conn._sock, core.SYNC_MSG)
        core._flush(conn._sock)
        conn.handle_messages(context)
        return context

    dbapi_connection.execute_unnamed = execute_unnamed


# The most statements one connection keeps (the rest run unnamed, as before).
MAX_KEPT_PER_CONNECTION = 16
# The pg8000 connection's attribute that holds its kept statements' names.
_KEPT_ATTRIBUTE = "outbox_kept_statements"


def keep_statements_prepared(engine: sa.Engine) -> None:
    """From now on, this engine's connections keep the statements marked for
    it prepared, each for the life of its session: for a process that holds
    its sessions (``outbox worker``), never for one behind a pooler that
    hands sessions around per transaction (RDS Proxy pins a session that
    prepares). Postgres plans such a statement for its values five times, then
    keeps one generic plan when that costs no more."""
    if not sa.event.contains(engine, "checkout", _keep_statements):
        sa.event.listen(engine, "checkout", _keep_statements)


def _keep_statements(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    if not hasattr(dbapi_connection, _KEPT_ATTRIBUTE):
        setattr(dbapi_connection, _KEPT_ATTRIBUTE, {})


def _statement_name(dbapi_connection: Any, statement: str) -> tuple[bool, bytes]:
    """(whether it is parsed already, the name to parse and bind it as): a
    statement marked to be kept, on a connection that keeps statements, is
    named, the first time as it is parsed; any other is the unnamed one."""
    kept = getattr(dbapi_connection, _KEPT_ATTRIBUTE, None)
    if kept is None or not statement.startswith(KEPT_PREPARED_MARK):
        return False, b""
    name = kept.get(statement)
    if name is not None:
        return True, name
    if len(kept) >= MAX_KEPT_PER_CONNECTION:
        return False, b""
    # Named before the parse is sent: a parse or a run that fails raises, and
    # the connection goes with its names (_invalidate_after_any_error), but
    # for a row moved meanwhile (then the parse had succeeded).
    name = kept[statement] = b"outbox_p%d" % len(kept)
    return False, name


def _no_delay(dbapi_connection: Any, connection_record: Any) -> None:
    """Turn off Nagle's algorithm, as libpq does. pg8000 leaves it on, and a
    message that overflows its 8 KiB write buffer (a batch's parameters) then
    goes out in two segments, the second held back until the server's delayed
    ACK: about 40 ms lost on a statement that takes 3."""
    sock = getattr(dbapi_connection, "_usock", None)
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# What a connect without a password raises when the server asks for one (pg8000's
# words for the cleartext and MD5 requests, and ours for SCRAM).
NO_PASSWORD = "server requesting password authentication, but no password was provided"  # noqa: S105


def _connect_errors_as_driver_errors(engine: sa.Engine) -> None:
    """pg8000 (1.31) lets two failures of a connect escape as plain Python
    errors, which SQLAlchemy passes on unwrapped and a caller handling
    database errors never sees: a SCRAM request with no password is an
    AttributeError (it decodes None), and a server that accepts the
    connection and never answers a TimeoutError. Both become the driver's
    InterfaceError, with pg8000's own words for the first. The dialect's
    connect, not a do_connect listener: that would run before an
    application's own listeners and take their place."""
    import pg8000

    connect = engine.dialect.connect

    def connect_or_say_why(*cargs: Any, **cparams: Any) -> Any:
        try:
            return connect(*cargs, **cparams)
        except AttributeError as exc:
            if cparams.get("password") is not None:
                raise
            raise pg8000.InterfaceError(NO_PASSWORD) from exc
        except TimeoutError as exc:
            raise pg8000.InterfaceError("timeout") from exc

    engine.dialect.connect = connect_or_say_why  # type: ignore[method-assign]


def _mint_credentials_per_connection(engine: sa.Engine, settings: DatabaseSettings) -> None:
    @sa.event.listens_for(engine, "do_connect")
    def _provide_password(dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        if settings.secret_arn:
            cparams["password"] = _secret_credentials(settings.secret_arn)["password"]
        else:
            # from_env guarantees both with DB_IAM_USER
            assert settings.host is not None and settings.iam_user is not None
            cparams["password"] = aws.db_auth_token(settings.host, settings.port, settings.iam_user)
