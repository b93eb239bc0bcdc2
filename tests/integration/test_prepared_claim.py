"""The worker's prepared claim (``store._sql.prepared``): the same rows as the
statement it prepares, planned once a connection, bounded, and a fresh
connection prepares it again. And its kept settle (``db.keep_statements_prepared``):
parsed once a session, the same outcomes, again after a row moved, and a
connection that failed goes with what it kept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import store
from outbox.db import MAX_KEPT_PER_CONNECTION, create_engine, keep_statements_prepared
from outbox.relay_settings import DatabaseSettings
from support import EMAIL


@pytest.fixture
def one_connection(engine: sa.Engine, database_url: str) -> Iterator[sa.Engine]:
    """An engine of one connection (a session of its own) over the test tables."""
    own = create_engine(DatabaseSettings(url=database_url, sslmode="disable"), autocommit=True)
    try:
        yield own
    finally:
        own.dispose()


def prepared_here(conn: sa.Connection) -> list[sa.Row[Any]]:
    return list(
        conn.execute(
            sa.text("SELECT * FROM pg_prepared_statements WHERE name LIKE 'outbox%' ORDER BY name")
        )
    )


def backlog(engine: sa.Engine) -> None:
    """Rows the claim must choose among: priorities, channels, a row not yet
    due, an ordering key's head and the row behind it, a tenant's rows."""
    with engine.begin() as conn:
        for i in range(12):
            outbox.enqueue(conn, "email", EMAIL, priority=i % 3)
        for _ in range(4):
            outbox.enqueue(
                conn, "webhook", {"url": "https://example.com/h", "event_type": "t", "body": {}}
            )
        outbox.enqueue(conn, "email", EMAIL, priority=9, delay=60)
        outbox.enqueue(conn, "email", EMAIL, ordering_key="order-1")
        outbox.enqueue(conn, "email", EMAIL, ordering_key="order-1")
        for _ in range(3):
            outbox.enqueue(conn, "email", EMAIL, tenant="acme")


def claimed_in_turn(engine: sa.Engine, prepare: bool, **kwargs: Any) -> list[list[Any]]:
    """Every batch of 5 a claimer takes until none is left, in a transaction
    rolled back after (each run starts from the same rows)."""
    with engine.connect() as conn:
        conn.begin()
        batches = []
        while batch := store.claim_and_receive(conn, 5, 120, 5, prepare=prepare, **kwargs):
            batches.append([(m.id, m.channel, m.attempt, m.payload) for m in batch])
        conn.rollback()
    return batches


@pytest.mark.parametrize("channels", [None, ["email"]])
@pytest.mark.parametrize("tenant_paused", [False, True], ids=["lean", "full"])
def test_the_prepared_claim_takes_the_rows_the_plain_one_does(
    engine: sa.Engine, channels: list[str] | None, tenant_paused: bool
) -> None:
    backlog(engine)
    if tenant_paused:  # the claim with the tenants' channel parts in it
        with engine.begin() as conn:
            store.pause_tenant_channel(conn, "acme", "email", "test")
    plain = claimed_in_turn(engine, False, channels=channels, default_ttl_seconds=86400.0)
    prepared = claimed_in_turn(engine, True, channels=channels, default_ttl_seconds=86400.0)
    assert prepared == plain
    taken = [i for batch in plain for i, *_ in batch]
    assert len(taken) == len(set(taken)) > 5
    # 22 rows: one not due, one behind its ordering key's head
    assert len(taken) == 22 - 2 - 3 * tenant_paused - 4 * (channels is not None)


def test_a_connection_prepares_the_claim_once_and_plans_it_once(one_connection: sa.Engine) -> None:
    backlog(one_connection)
    with one_connection.connect() as conn:
        # The engine's first claim is the lean one, which finds that it does
        # not fit (two tenants have rows due) and claims nothing; the full
        # claim follows at once, and every claim after it is the full one.
        for _ in range(4):
            assert len(store.claim(conn, 2, 120, prepare=True)) == 2
        statements = prepared_here(conn)
        assert len(statements) == 2
        lean, full = sorted(statements, key=lambda s: len(s.statement))
        assert "WITH RECURSIVE" in full.statement and "WITH RECURSIVE" not in lean.statement
        if "generic_plans" in statements[0]._fields:  # PostgreSQL 14 and later
            # no parameter left to plan for: one plan, kept (a custom plan is
            # one made for an execution's values)
            assert [(s.generic_plans, s.custom_plans) for s in (lean, full)] == [(1, 0), (4, 0)]
        # The same claim with other values is another statement.
        store.claim(conn, 3, 120, prepare=True)
        assert len(prepared_here(conn)) == 3


def test_a_fresh_connection_prepares_the_claim_again(one_connection: sa.Engine) -> None:
    """SQLAlchemy's ``info`` of a connection lives as long as the connection:
    after one is replaced (an error, a recycle), the new session has no
    statement of the old one's, and the claim prepares it again."""
    backlog(one_connection)
    with one_connection.connect() as conn:
        store.claim(conn, 2, 120, prepare=True)
        before = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        conn.invalidate()
    with one_connection.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() != before
        assert prepared_here(conn) == []
        assert len(store.claim(conn, 2, 120, prepare=True)) == 2
        assert len(prepared_here(conn)) == 1  # the lean claim (the engine knows now)


def test_a_connection_prepares_a_bounded_number_of_claims(one_connection: sa.Engine) -> None:
    """A caller that changes its batch size every claim runs the claims past
    the bound unprepared, instead of growing the session without end."""
    backlog(one_connection)
    bound = store._sql.MAX_PREPARED_PER_CONNECTION
    with one_connection.connect() as conn:
        taken = [
            c.id for size in range(1, bound + 4) for c in store.claim(conn, size, 120, prepare=True)
        ]
        assert len(prepared_here(conn)) == bound
    assert len(taken) == len(set(taken)) == 22 - 2


def test_a_value_with_no_plain_spelling_runs_the_claim_unprepared(
    one_connection: sa.Engine,
) -> None:
    """Values are written into the prepared text only where they cannot
    change it (numbers, NULL, text without quotes or backslashes): a channel
    filter with a quote in it is bound as a parameter, as without ``prepare``."""
    backlog(one_connection)
    with one_connection.connect() as conn:
        assert store.claim(conn, 5, 120, channels=["it's", "email"], prepare=True) != []
        assert prepared_here(conn) == []
        with pytest.raises(ValueError):
            store.claim(conn, 0, 120, prepare=True)
        assert prepared_here(conn) == []


@pytest.fixture
def refused_as_moved(engine: sa.Engine) -> Iterator[Any]:
    """Claims that Postgres refuses with its "moved to another partition"
    error (the same SQLSTATE and message) their first ``n`` runs on a
    connection: a trigger on the live rows raises it when a row's status
    changes (claimed, settled),
    ``n`` read from the connection's own ``test.moved_runs``."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE SEQUENCE test_moved_runs"))
        conn.execute(
            sa.text(
                """CREATE FUNCTION test_moved_refusal() RETURNS trigger
                LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
                BEGIN
                    IF NEW.status IS DISTINCT FROM OLD.status
                       AND nextval('public.test_moved_runs')
                           <= CAST(current_setting('test.moved_runs', true) AS int) THEN
                        RAISE EXCEPTION USING ERRCODE = '40001', MESSAGE =
                            'tuple to be locked was already moved to another '
                            'partition due to concurrent update';
                    END IF;
                    RETURN NEW;
                END $$"""
            )
        )
        conn.execute(
            sa.text(
                "CREATE TRIGGER test_moved_refusal BEFORE UPDATE ON outbox_message_live"
                " FOR EACH ROW EXECUTE FUNCTION test_moved_refusal()"
            )
        )

    def refuse(conn: sa.Connection, n: int) -> None:
        conn.execute(sa.text("ALTER SEQUENCE public.test_moved_runs RESTART"))
        conn.execute(sa.text(f"SET test.moved_runs = {int(n)}"))

    try:
        yield refuse
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TRIGGER test_moved_refusal ON outbox_message_live"))
            conn.execute(sa.text("DROP FUNCTION test_moved_refusal()"))
            conn.execute(sa.text("DROP SEQUENCE test_moved_runs"))


@pytest.mark.parametrize("prepare", [False, True], ids=["plain", "prepared"])
def test_a_claim_runs_again_after_each_row_moved_under_it(
    one_connection: sa.Engine, refused_as_moved: Any, prepare: bool
) -> None:
    """Four workers at batch 1000 with a receiver that answers at once (the
    bench): within one claim's statement other claimers took and settled rows
    it had read as pending, and the claim was refused as "moved" three runs in
    a row, which failed the batch (the runs a fenced write gets). A claim runs
    again up to ``CLAIM_RUNS_AFTER_A_MOVE`` times, each run a new snapshot
    without the rows that moved."""
    backlog(one_connection)
    runs = store._sql.CLAIM_RUNS_AFTER_A_MOVE
    assert runs > store._sql.RUNS_AFTER_A_MOVE
    with one_connection.connect() as conn:
        refused_as_moved(conn, runs - 1)
        assert len(store.claim(conn, 2, 120, prepare=prepare)) == 2
        assert len(store.claim_and_receive(conn, 2, 120, 5, prepare=prepare)) == 2
        refused_as_moved(conn, runs)
        with pytest.raises(sa.exc.DBAPIError, match="moved to another partition"):
            store.claim(conn, 2, 120, prepare=prepare)
    with one_connection.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT count(*) FROM outbox_message WHERE status = 'claimed'")
            ).scalar_one()
            == 4
        )


@pytest.mark.parametrize("setting", [None, "true", "false"])
def test_the_worker_prepares_its_claim_unless_told_not_to(
    engine: sa.Engine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    setting: str | None,
) -> None:
    """WORKER_PREPARED_CLAIM (default true): the worker's connections hold its
    claim prepared after a run, or, set false, none (a pooler in transaction
    mode would lose it); the rows are delivered either way."""
    from outbox.worker import Worker
    from support import ScriptedChannel, install_channel, settings, statuses

    if setting is None:
        monkeypatch.delenv("WORKER_PREPARED_CLAIM", raising=False)
    else:
        monkeypatch.setenv("WORKER_PREPARED_CLAIM", setting)
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        ids = [outbox.enqueue(conn, "scripted", {"n": i}) for i in range(7)]
    own = create_engine(
        DatabaseSettings(url=database_url, sslmode="disable"), pool_size=2, autocommit=True
    )
    try:
        worker = Worker(own, settings(batch_size=3), reap_interval_seconds=3600)
        worker.run(until_empty=True)
        held = []
        with own.connect() as first, own.connect() as second:  # the pool's two sessions
            for conn in (first, second):
                held += [r.name for r in prepared_here(conn)]
    finally:
        own.dispose()
    assert (held != []) is (setting != "false"), held
    # its settle too, kept by the protocol's name (db.keep_statements_prepared)
    assert any(name.startswith("outbox_p") for name in held) is (setting != "false"), held
    assert len(ids) == 7 and statuses(engine) == {"delivered": 7}


def settle_all(conn: sa.Connection, claims: list[store.Claim]) -> dict[int, str]:
    return store.settle(
        conn,
        [store.Settlement(c.id, c.claim_token, "delivered", duration_ms=1) for c in claims],
        store.Backoff(30, 1800, 8),
    )


@pytest.mark.parametrize("keep", [False, True], ids=["unnamed", "kept"])
def test_a_connection_that_keeps_statements_parses_the_settle_once(
    one_connection: sa.Engine, keep: bool
) -> None:
    """A session that keeps statements holds the settle as one named statement,
    planned for its values five times and then once, for every batch; one
    that does not keeps nothing. The outcomes are the same."""
    backlog(one_connection)
    if keep:
        keep_statements_prepared(one_connection)
        keep_statements_prepared(one_connection)  # once is enough: one listener
        assert len(one_connection.pool.dispatch.checkout) == 2  # and _ping_when_idle's
    settled: dict[int, str] = {}
    with one_connection.connect() as conn:
        for _ in range(8):
            claims = store.claim(conn, 2, 120)
            assert len(claims) == 2
            settled |= settle_all(conn, claims)
        kept = [r for r in prepared_here(conn) if r.name.startswith("outbox_p")]
    assert len(settled) == 16 and set(settled.values()) == {"delivered"}
    if not keep:
        assert kept == []
        return
    assert [r.name for r in kept] == ["outbox_p0"]
    assert kept[0].statement.startswith(store._sql.KEPT_PREPARED_MARK)
    if "generic_plans" in kept[0]._fields:  # PostgreSQL 14 and later
        assert (kept[0].custom_plans, kept[0].generic_plans) == (5, 3)


def test_a_kept_settle_runs_again_after_a_row_moved_under_it(
    one_connection: sa.Engine, refused_as_moved: Any
) -> None:
    """A run refused for a row moved meanwhile leaves the connection and what
    it kept: the next run binds the same statement, and the fence decides."""
    backlog(one_connection)
    keep_statements_prepared(one_connection)
    with one_connection.connect() as conn:
        claims = store.claim(conn, 2, 120)
        refused_as_moved(conn, store._sql.RUNS_AFTER_A_MOVE - 1)
        pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        assert set(settle_all(conn, claims).values()) == {"delivered"}
        assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() == pid
        assert [r.name for r in prepared_here(conn) if r.name.startswith("outbox_p")] == [
            "outbox_p0"
        ]


def test_a_kept_settle_that_fails_leaves_with_its_connection(one_connection: sa.Engine) -> None:
    """Bad input to a kept statement fails as it does unnamed, changes
    nothing, and the connection goes (every error but a moved row's): the next
    session parses the statement again under the same name."""
    backlog(one_connection)
    keep_statements_prepared(one_connection)
    with one_connection.connect() as conn:
        claims = store.claim(conn, 2, 120)
        settle_all(conn, store.claim(conn, 1, 120))  # kept now
        pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with pytest.raises(sa.exc.DBAPIError, match="uuid"):
            store.settle(
                conn,
                [store.Settlement(claims[0].id, "not-a-token", "delivered")],
                store.Backoff(30, 1800, 8),
            )
    with one_connection.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() != pid
        assert prepared_here(conn) == []
        assert set(settle_all(conn, claims).values()) == {"delivered"}
        assert [r.name for r in prepared_here(conn)] == ["outbox_p0"]


def test_a_connection_keeps_a_bounded_number_of_statements(one_connection: sa.Engine) -> None:
    """Past the bound a marked statement runs unnamed, as any other."""
    keep_statements_prepared(one_connection)
    marked = [
        store._sql.statement(f"SELECT {i} + CAST(:n AS int)", kept_prepared=True)
        for i in range(MAX_KEPT_PER_CONNECTION + 2)
    ]
    with one_connection.connect() as conn:
        assert [conn.execute(m, {"n": 1}).scalar_one() for m in marked] == [
            i + 1 for i in range(len(marked))
        ]
        assert len(prepared_here(conn)) == MAX_KEPT_PER_CONNECTION


@pytest.mark.parametrize("how", ["DEALLOCATE ALL", "DISCARD ALL"])
def test_a_kept_settle_whose_statement_went_is_parsed_again(
    one_connection: sa.Engine, how: str
) -> None:
    """Someone deallocated the session's statements (a pooler's reset, an
    operator): on the relay's autocommit connections the settle binds a name
    that is gone, which fails before anything runs; it is parsed again and
    runs, on the same session."""
    backlog(one_connection)
    keep_statements_prepared(one_connection)
    with one_connection.connect() as conn:
        settle_all(conn, store.claim(conn, 1, 120))  # kept now
        claims = store.claim(conn, 2, 120)
        pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        conn.exec_driver_sql(how)
        assert prepared_here(conn) == []
        assert set(settle_all(conn, claims).values()) == {"delivered"}
        assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() == pid
        assert [r.name for r in prepared_here(conn)] == ["outbox_p0"]


def test_a_kept_settle_whose_statement_went_inside_a_transaction_fails_alone(
    engine: sa.Engine, database_url: str
) -> None:
    """Inside a transaction block the failed bind aborts the transaction, so
    the settle is not run again there: it fails, nothing is written, and the
    next session parses it again."""
    backlog(engine)
    own = create_engine(DatabaseSettings(url=database_url, sslmode="disable"))
    keep_statements_prepared(own)
    try:
        with own.connect() as conn:
            with conn.begin():
                settle_all(conn, store.claim(conn, 1, 120))  # kept now
                claims = store.claim(conn, 2, 120)
            conn.exec_driver_sql("DEALLOCATE ALL")
            conn.commit()
            with pytest.raises(sa.exc.DBAPIError, match="26000"), conn.begin():
                settle_all(conn, claims)
        with own.connect() as conn, conn.begin():
            statuses = conn.execute(
                sa.text("SELECT status FROM outbox_message WHERE id = ANY(:ids)"),
                {"ids": [c.id for c in claims]},
            ).scalars()
            assert set(statuses) == {"claimed"}
            assert set(settle_all(conn, claims).values()) == {"delivered"}
    finally:
        own.dispose()
