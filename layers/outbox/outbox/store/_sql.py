"""How the store's statements are written and their parameters encoded.

pg8000 escapes every element of a list parameter character by character, and
scans the whole statement text for placeholders on every execute. So every
statement of the store is built by :func:`statement` (its layout removed
once, at import), and every parameter follows one convention:

* a list of ids, tokens, channels or statuses travels as one ready array
  literal (:func:`array_literal`) that the SQL casts (``CAST(:ids AS bigint[])``);
* a batch of rows with free text in it travels as one JSON document
  (:func:`json_document`) that the SQL unpacks (``jsonb_to_recordset``, or
  for the settle, the hot path, ``jsonb_array_elements`` of arrays);
* scalars are plain bound parameters.

Filters an operator gives are checked here, against closed sets, before they
reach a statement (:func:`check_channels`, :func:`check_statuses`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import sqlalchemy as sa

from ..errors import moved_meanwhile
from ..states import STATUSES, Status

# The comment that marks a statement to be kept prepared (``statement``); no
# colon in it, which a driver's named placeholders would read as one.
KEPT_PREPARED_MARK = "/* outbox kept prepared */ "


def statement(text: str, kept_prepared: bool = False) -> sa.TextClause:
    """A statement with its comments and indentation removed (same SQL, fewer
    characters). ``kept_prepared``: marked to be kept prepared on the
    connections of a process that holds its sessions
    (``db.keep_statements_prepared``), for a statement of the hot path whose
    values change every time (the settle).

    The layout is removed line by line, so a statement that this would change
    is refused with ValueError when it is built (at import): ``--`` inside a
    quoted literal or name (the cut would end the statement inside it), or a
    literal that runs across lines (joining them would change its text)."""
    lines = (_without_comment(line).strip() for line in text.splitlines())
    mark = KEPT_PREPARED_MARK if kept_prepared else ""
    return sa.text(mark + " ".join(line for line in lines if line))


def _without_comment(line: str) -> str:
    """The line up to its ``--`` comment. Quotes are paired within the line
    (a doubled quote inside a literal closes and reopens it, which is the same
    thing here); the store uses no dollar-quoted or backslash-escaped strings."""
    if "'" not in line and '"' not in line:  # most lines: no literal to step over
        return line.split("--", 1)[0]
    quote = ""  # the quote character of the literal or name we are in
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
            elif line.startswith("--", i):
                raise ValueError(f"'--' inside a quoted literal or name: {line.strip()!r}")
        elif char in "'\"":
            quote = char
        elif line.startswith("--", i):
            return line[:i]
    if quote:
        raise ValueError(f"a quoted literal or name across lines: {line.strip()!r}")
    return line


def array_literal(values: Iterable[Any]) -> str:
    """A Postgres array literal, every element but ints and UUIDs quoted, bound
    as one text parameter that the SQL casts (``CAST(:ids AS bigint[])``, ``uuid[]``,
    ``text[]``). One string instead of pg8000's per-element escaping of a list;
    and pg8000's list adapter leaves ``null`` in any case but ``NULL`` unquoted,
    which Postgres reads as a NULL element: a key "null" would silently vanish.
    A value that is no id or UUID is still refused, by Postgres, at the cast."""

    def element(v: Any) -> str:
        if v is None:
            return "NULL"
        if type(v) is int or type(v) is uuid.UUID:  # ids and tokens: nothing to escape
            return str(v)
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    return "{" + ",".join(element(v) for v in values) + "}"


def json_document(rows: Any) -> str:
    """Rows (or any JSON value) as one compact JSON text parameter."""
    return json.dumps(rows, separators=(",", ":"))


# The table's CHECK constraint on outbox_message.channel.
CHANNEL_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


def check_channels(channels: Sequence[str] | None) -> None:
    """ValueError for the first value that cannot be a channel's name."""
    bad = [c for c in channels or () if not isinstance(c, str) or not CHANNEL_NAME.match(c)]
    if bad:
        raise ValueError(f"not a channel name: {bad[0]!r}")


def check_statuses(
    statuses: Sequence[str] | None, allowed: Collection[Status] = STATUSES, verb: str = "use"
) -> list[Status]:
    """The statuses as members of ``allowed``; ValueError naming the choices
    for the first that is not one (``Status.parse``)."""
    return [Status.parse(s, allowed, verb) for s in statuses or ()]


# A bind parameter in a statement's text, as sa.text finds them.
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")

# The most statements one connection prepares (a caller that varies its batch
# size runs the rest unprepared, instead of growing the session without bound).
MAX_PREPARED_PER_CONNECTION = 8


def _sql_literal(value: Any) -> str | None:
    """The value as SQL text, or None when it has no plain spelling here."""
    if value is None:
        return "NULL"
    if type(value) is int:
        return str(value)
    if type(value) is float and math.isfinite(value):
        return repr(value)
    if type(value) is str and "'" not in value and "\\" not in value:
        return f"'{value}'"
    return None


def prepared(
    conn: sa.Connection, stmt: sa.TextClause, params: dict[str, Any]
) -> sa.TextClause | None:
    """``EXECUTE`` of the statement with these values written into its text,
    prepared once on this connection (``PREPARE``; None: run it as it is).

    For a statement run again and again with the same values (a worker's claim:
    its batch size, lease and channels are its configuration), this saves the
    planning and the sending of its text, most of a small claim's time. With no
    parameter left, Postgres plans it once, with those values, and keeps that
    plan (a generic plan that is the custom one), until DDL or ANALYZE on its
    tables makes it plan again. The statement lives as long as the session:
    SQLAlchemy's ``info`` of the DBAPI connection says which are prepared, and
    a new connection starts with none. Not for a session a pooler shares
    between clients per transaction (PgBouncer's transaction mode); RDS Proxy
    pins such a session to its client."""
    written = _written_in(stmt.text, tuple(sorted(params.items())))
    if written is None:
        return None
    execute, body = written
    done: set[str] = conn.connection.info.setdefault("outbox_prepared", set())
    if execute.text not in done:
        if len(done) >= MAX_PREPARED_PER_CONNECTION:
            return None
        conn.exec_driver_sql(f"PREPARE {execute.text[len('EXECUTE ') :]} AS {body}")
        done.add(execute.text)
    return execute


@functools.lru_cache(maxsize=64)
def _written_in(text: str, params: tuple[tuple[str, Any], ...]) -> tuple[sa.TextClause, str] | None:
    """(the ``EXECUTE`` statement, the text to prepare) for ``text`` with these
    values written in; None when one has no plain spelling. Remembered: the
    same claim comes again every batch, and this reads its whole text."""
    given = dict(params)
    values: dict[str, str] = {}
    for name in set(_BIND.findall(text)):
        literal = _sql_literal(given[name])
        if literal is None:
            return None
        values[name] = literal
    body = _BIND.sub(lambda m: values[m.group(1)], text)
    name = "outbox_" + hashlib.sha256(body.encode()).hexdigest()[:24]
    return sa.text(f"EXECUTE {name}"), body


# How many times a fenced write runs, the first included, while Postgres
# refuses it for a row moved meanwhile.
RUNS_AFTER_A_MOVE = 3
# A claim's: it reads every due row's head of the index, and while it runs
# other claimers may take and settle (move) rows it read as pending, again
# in each run under load (four workers at batch 1000 with a receiver that
# answers at once were refused three runs in a row). Each run reads a new
# snapshot, without the rows that moved.
CLAIM_RUNS_AFTER_A_MOVE = 10


def execute_fenced(
    conn: sa.Connection, stmt: Any, params: dict[str, Any], runs: int = RUNS_AFTER_A_MOVE
) -> list[sa.Row[Any]]:
    """Run a fenced write (or lock), and again (at most ``runs`` times in all)
    when a row it waited for was moved meanwhile: the next run reads the row
    where it went, and the fence decides (a settle finds its claim gone and
    writes nothing). On the relay's autocommit connections the failed
    statement left nothing to undo; inside a transaction it runs in a
    savepoint. The connection stays (``outbox.db`` keeps it for this error
    alone: the server's whole answer was read)."""
    raw = conn.connection.dbapi_connection
    in_transaction = not getattr(raw, "autocommit", False)
    for run in range(1, runs + 1):
        try:
            if not in_transaction:
                return list(conn.execute(stmt, params).all())
            with conn.begin_nested():
                return list(conn.execute(stmt, params).all())
        except sa.exc.DBAPIError as exc:
            if run == runs or not moved_meanwhile(exc.orig):
                raise
    raise AssertionError("unreachable")
