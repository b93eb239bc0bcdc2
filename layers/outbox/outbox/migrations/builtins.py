"""Built-in calls named ``pg_catalog.*`` in the relay's SQL functions.

A function's pinned ``search_path`` (the relay's schema, then ``pg_temp``)
stops an object in another schema from standing in for the relay's own, but
not an overload in the relay's schema that matches a call better than the
built-in: ``nextval('outbox_message_id_seq')`` passes an unknown literal,
which a planted ``nextval(text)`` takes before ``pg_catalog.nextval(regclass)``
(the CVE-2018-1058 pattern). Where any role may create in that schema (PUBLIC
has CREATE on ``public`` up to PostgreSQL 14), a SECURITY DEFINER function
would then run the planter's code with its owner's rights. A call written
``pg_catalog.nextval(...)`` resolves in ``pg_catalog`` alone.

:func:`qualify` rewrites a function body so that every call of a built-in
function is qualified; :func:`unqualified_calls` lists the calls that are not
(a test holds every installed function to "only the relay's own"). Both read
the body with a small tokenizer that knows SQL's strings, quoted names,
dollar quotes and comments, so nothing inside a literal or a comment moves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import sqlalchemy as sa

# Keywords spelt like calls: their SQL-standard forms (``substring(x FROM re)``,
# ``extract(epoch FROM t)``) parse only unqualified, and the grammar itself
# turns them into calls of the ``pg_catalog`` functions.
SPECIAL_FORMS = frozenset({"substring", "extract", "position", "overlay", "trim", "normalize"})

# Names that follow a word after which a parenthesis is not a call: a table's
# or alias's column list (``INSERT INTO t (...)``, ``AS r(a, b)``), a type's
# modifier (``numeric(10, 2)``), ``EXECUTE FUNCTION f()`` in a trigger.
_NOT_A_CALL_AFTER = frozenset({"into", "as", "table", "function", "procedure", "type", "update"})


class Token(NamedTuple):
    kind: str  # "word", "quoted", "string", "comment", "space", "punct"
    text: str
    start: int


_TOKEN = re.compile(
    r"""
      (?P<space>\s+)
    | (?P<comment>--[^\n]*|/\*.*?\*/)
    | (?P<dollar>\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$)
    | (?P<string>[EeBbXxUu]?'(?:[^']|'')*')
    | (?P<quoted>"(?:[^"]|"")*")
    | (?P<word>[A-Za-z_][A-Za-z0-9_$]*)
    | (?P<punct>::|.)
    """,
    re.VERBOSE | re.DOTALL,
)


def tokens(sql: str) -> Iterator[Token]:
    """The SQL's tokens, a dollar-quoted literal as one string token."""
    position = 0
    while position < len(sql):
        match = _TOKEN.match(sql, position)
        assert match is not None  # the last alternative matches any character
        kind = match.lastgroup or "punct"
        if kind == "dollar":
            delimiter = match.group()
            end = sql.find(delimiter, match.end())
            end = len(sql) if end < 0 else end + len(delimiter)
            yield Token("string", sql[position:end], position)
            position = end
            continue
        yield Token(kind, match.group(), position)
        position = match.end()


class Call(NamedTuple):
    name: str  # lower case, as Postgres folds it
    start: int  # where the name starts in the body


def calls(body: str) -> Iterator[Call]:
    """The unqualified ``name(`` calls in a function body (a PL/pgSQL or SQL
    body, without its dollar quotes)."""
    significant = [t for t in tokens(body) if t.kind not in ("space", "comment")]
    for index, token in enumerate(significant):
        if token.kind != "word" or index + 1 >= len(significant):
            continue
        if significant[index + 1].text != "(":
            continue
        before = significant[index - 1] if index else None
        if before is not None and (
            before.text in (".", "::")
            or (before.kind == "word" and before.text.lower() in _NOT_A_CALL_AFTER)
        ):
            continue
        yield Call(token.text.lower(), token.start)


def qualify(body: str, builtins: Iterable[str]) -> str:
    """The body with every unqualified call of a name in ``builtins`` written
    ``pg_catalog.name(``."""
    names = frozenset(builtins) - SPECIAL_FORMS
    pieces = []
    last = 0
    for call in calls(body):
        if call.name in names:
            pieces.append(body[last : call.start])
            pieces.append("pg_catalog.")
            last = call.start
    pieces.append(body[last:])
    return "".join(pieces)


def unqualified_calls(body: str) -> list[str]:
    """The names called without a schema, the special forms left out."""
    return [c.name for c in calls(body) if c.name not in SPECIAL_FORMS]


_BODY = re.compile(r"(AS\s+)(\$[A-Za-z_]*\$)(.*)(\2)", re.DOTALL)


def qualify_definition(definition: str, builtins: Iterable[str]) -> str:
    """A ``pg_get_functiondef`` text with its body qualified (``qualify``)."""
    match = _BODY.search(definition)
    if match is None:
        raise ValueError("no dollar-quoted body in the function's definition")
    body = qualify(match.group(3), builtins)
    return definition[: match.start(3)] + body + definition[match.end(3) :]


# The built-in functions: pg_catalog's, but those that are also type names
# (``numeric(10, 2)`` is a type's modifier in a declaration, not a call).
_BUILTINS = """
    SELECT DISTINCT p.proname FROM pg_catalog.pg_proc AS p
    WHERE p.pronamespace = 'pg_catalog'::pg_catalog.regnamespace
      AND p.proname NOT IN (SELECT t.typname FROM pg_catalog.pg_type AS t
                            WHERE t.typnamespace = 'pg_catalog'::pg_catalog.regnamespace)
"""

_RELAY_FUNCTIONS = """
    SELECT p.oid, pg_catalog.pg_get_functiondef(p.oid) AS definition
    FROM pg_catalog.pg_proc AS p
    WHERE p.pronamespace = pg_catalog.current_schema()::pg_catalog.regnamespace
      AND p.proname LIKE 'outbox\\_%' AND p.prokind = 'f'
    ORDER BY p.oid
"""


def qualify_installed_functions(connection: sa.Connection) -> int:
    """Re-create each ``outbox_*`` function of the current schema with its
    built-in calls qualified; returns how many changed. Grants, owner,
    SECURITY DEFINER and the pinned search_path are kept (CREATE OR REPLACE
    keeps the first two; the definition carries the others)."""
    builtins = connection.execute(sa.text(_BUILTINS)).scalars().all()
    changed = 0
    for row in connection.execute(sa.text(_RELAY_FUNCTIONS)).all():
        qualified = qualify_definition(row.definition, builtins)
        if qualified != row.definition:
            connection.exec_driver_sql(qualified)
            changed += 1
    return changed
