"""A planted overload of a built-in never runs inside the relay's functions
(issue 31, finding 2).

A role with no outbox grant but CREATE on the relay's schema (what PUBLIC has
on ``public`` up to PostgreSQL 14; this PostgreSQL 15 reproduces it with a
grant) creates overloads that match the relay's calls better than the
built-ins (``nextval(text)`` for ``nextval('...')``, ``convert_to(text,
text)`` for ``convert_to(message, 'UTF8')``, ``hashtextextended(text,
integer)``, ``currval(text)``), each copying what it sees into its loot. Then
every way in (both SQL doors, ``outbox.enqueue``, ``outbox.enqueue_many``)
runs with a dedupe key, an ordering key and a cooldown: the built-ins run,
nothing is copied. A second test reads every installed function of the
relay's schema and finds no call left unqualified that ``pg_catalog``
defines, so a later migration is held to the same rule.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import outbox
from outbox.migrations.builtins import SPECIAL_FORMS, calls, qualify, unqualified_calls
from support import EMAIL

PLANTED = """
CREATE TABLE public.loot_{s} (what text);
GRANT INSERT, SELECT ON public.loot_{s} TO PUBLIC;
CREATE FUNCTION public.nextval(name text) RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO public.loot_{s} SELECT 'nextval ' || name; RETURN 1; END $$;
CREATE FUNCTION public.currval(name text) RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO public.loot_{s} SELECT 'currval ' || name; RETURN 1; END $$;
CREATE FUNCTION public.hashtextextended(what text, seed integer) RETURNS bigint
LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO public.loot_{s} SELECT 'hash ' || what; RETURN 1; END $$;
CREATE FUNCTION public.convert_to(what text, encoding text) RETURNS bytea
LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO public.loot_{s} SELECT 'convert_to ' || what; RETURN '\\x00'; END $$;
GRANT EXECUTE ON FUNCTION public.nextval(text), public.currval(text),
    public.hashtextextended(text, integer), public.convert_to(text, text) TO PUBLIC;
"""

UNPLANT = """
DROP FUNCTION IF EXISTS public.nextval(text), public.currval(text),
    public.hashtextextended(text, integer), public.convert_to(text, text);
DROP TABLE IF EXISTS public.loot_{s};
"""


def login_engine(database_url: str, user: str) -> sa.Engine:
    return sa.create_engine(make_url(database_url).set(username=user, password="x"))


@pytest.fixture
def planter(engine: sa.Engine, database_url: str) -> Iterator[str]:
    """An attacker's role with CREATE on the relay's schema and no outbox
    grant; its overloads planted. Yields the suffix of its loot table."""
    suffix = uuid.uuid4().hex[:8]
    role = f"planter_{suffix}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(sa.text(f"GRANT CREATE ON SCHEMA public TO {role}"))
    attacker = login_engine(database_url, role)
    try:
        with attacker.begin() as conn:
            conn.execute(sa.text(PLANTED.format(s=suffix)))
        yield suffix
    finally:
        attacker.dispose()
        with engine.begin() as conn:
            conn.execute(sa.text(UNPLANT.format(s=suffix)))
            conn.execute(sa.text(f"REVOKE CREATE ON SCHEMA public FROM {role}"))
            conn.execute(sa.text(f"DROP ROLE {role}"))


def test_a_planted_overload_never_runs_in_any_way_in(
    engine: sa.Engine, database_url: str, planter: str
) -> None:
    suffix = uuid.uuid4().hex[:8]
    producer_role = f"producer_{suffix}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {producer_role} LOGIN IN ROLE outbox_producer"))
    producer = login_engine(database_url, producer_role)
    try:
        with producer.begin() as conn:
            first = outbox.enqueue(
                conn, "email", EMAIL, dedupe_key="order-1", ordering_key="customer-1"
            )
            outbox.enqueue(
                conn, "email", EMAIL, ordering_key="customer-1", cooldown=60, cooldown_key="c-1"
            )
            outbox.enqueue_many(
                conn,
                [
                    {
                        "channel": "sms",
                        "payload": {"to": "+15555550100", "message": "hi"},
                        "ordering_key": "customer-2",
                        "dedupe_key": "sms-1",
                    }
                ],
            )
            by_sql = conn.execute(
                sa.text(
                    "SELECT public.outbox_enqueue('email', CAST(:p AS jsonb), "
                    "dedupe_key => 'order-2', ordering_key => 'customer-3', "
                    "cooldown => interval '60 seconds', cooldown_key => 'c-2')"
                ),
                {"p": json.dumps(EMAIL)},
            ).scalar_one()
            many = conn.execute(
                sa.text(
                    "SELECT id FROM public.outbox_enqueue_many(ARRAY['email'], "
                    "jsonb_build_array(CAST(:p AS jsonb)), ARRAY['order-3'], "
                    "ARRAY['customer-4'], NULL, NULL, NULL, NULL, NULL, NULL, "
                    "ARRAY[60.0], ARRAY['c-3'], ARRAY['wait'])"
                ),
                {"p": json.dumps(EMAIL)},
            ).scalar_one()
    finally:
        producer.dispose()
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP ROLE {producer_role}"))
    with engine.connect() as conn:
        loot = conn.execute(sa.text(f"SELECT what FROM public.loot_{planter}")).scalars().all()
        ids = conn.execute(sa.text("SELECT id FROM outbox_message ORDER BY id")).scalars().all()
    assert loot == []
    assert first in ids and by_sql in ids and many in ids and len(set(ids)) == 5


def _relay_functions(engine: sa.Engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [
            (row.proname, row.prosrc)
            for row in conn.execute(
                sa.text(
                    "SELECT proname, prosrc FROM pg_proc WHERE prokind = 'f' "
                    "AND pronamespace = current_schema()::regnamespace "
                    "AND proname LIKE 'outbox\\_%'"
                )
            )
        ]


def _builtins(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text(
                    "SELECT proname FROM pg_proc WHERE pronamespace = 'pg_catalog'::regnamespace"
                )
            ).scalars()
        )


def test_no_installed_function_calls_a_built_in_unqualified(engine: sa.Engine) -> None:
    builtins = _builtins(engine)
    functions = _relay_functions(engine)
    assert len(functions) > 20
    found = {
        name: sorted(set(unqualified_calls(source)) & builtins)
        for name, source in functions
        if set(unqualified_calls(source)) & builtins
    }
    assert found == {}
    # the lister does see calls: every function but the trivial ones calls something
    assert sum(1 for _, source in functions if any(True for _ in calls(source))) > 15


def test_the_wake_trigger_script_calls_built_ins_qualified(engine: sa.Engine) -> None:
    """``wake_on_enqueue.sql`` is installed outside the migrations: its
    function bodies are held to the same rule as they are written."""
    script = Path(outbox.__file__).with_name("sql").joinpath("wake_on_enqueue.sql").read_text()
    bodies = re.findall(r"AS \$\$(.*?)\$\$;", script, re.DOTALL)
    assert len(bodies) == 2
    builtins = _builtins(engine)
    assert [sorted(set(unqualified_calls(b)) & builtins) for b in bodies] == [[], []]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("SELECT nextval('s')", "SELECT pg_catalog.nextval('s')"),
        # not in literals, quoted names, comments or dollar quotes
        ("SELECT 'now()' -- now()\n, \"now\"(), $x$now()$x$", None),
        # already qualified, another schema's, a type's modifier, a column list
        (
            "SELECT pg_catalog.now(), aws_lambda.invoke(1), CAST(x AS numeric(3)), y::varchar(2)",
            None,
        ),
        ("INSERT INTO t (a) SELECT * FROM f(1) AS r(a int)", None),
        # the special forms the grammar resolves in pg_catalog itself
        ("SELECT substring(u FROM '^x'), extract(epoch FROM t)", None),
        (
            "SELECT count(*), lower(btrim(a))",
            "SELECT pg_catalog.count(*), pg_catalog.lower(pg_catalog.btrim(a))",
        ),
    ],
)
def test_qualify_rewrites_calls_only(body: str, expected: str | None) -> None:
    names = {"nextval", "now", "count", "lower", "btrim", "numeric", "substring", "extract"}
    assert qualify(body, names) == (body if expected is None else expected)
    assert "substring" in SPECIAL_FORMS
