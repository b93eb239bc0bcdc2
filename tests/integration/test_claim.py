"""docs/design.md, invariant 1: the claim is a compare-and-set; no row is ever claimed twice at once."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import store
from support import EMAIL, claim_plans, enqueue


@pytest.mark.parametrize("prepare", [False, True], ids=["plain", "prepared"])
def test_eight_concurrent_claimers_claim_every_row_exactly_once(
    engine: sa.Engine, prepare: bool
) -> None:
    ids = enqueue(engine, 10_000)
    claimed: list[list[int]] = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def claimer(slot: int) -> None:
        start.wait()
        while True:
            with engine.begin() as conn:
                batch = store.claim(conn, 97, 120, prepare=prepare)
            if not batch:
                return
            claimed[slot].extend(c.id for c in batch)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = Counter(i for batch in claimed for i in batch)
    assert sorted(every) == sorted(ids)
    assert max(every.values()) == 1
    assert sum(1 for batch in claimed if batch) > 1, "the claimers did not overlap at all"
    with engine.connect() as conn:
        tokens = conn.execute(
            sa.text(
                "SELECT count(DISTINCT claim_token), count(*) FROM outbox_message WHERE status = 'claimed'"
            )
        ).one()
    assert tuple(tokens) == (10_000, 10_000)


def test_claim_is_bounded_ordered_and_skips_rows_not_due(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        low = outbox.enqueue(conn, "email", EMAIL, priority=0)
        high = outbox.enqueue(conn, "email", EMAIL, priority=9)
        later = outbox.enqueue(conn, "email", EMAIL, priority=9, delay=60)
        low2 = outbox.enqueue(conn, "email", EMAIL, priority=0)
    with engine.begin() as conn:
        first = store.claim(conn, 2, 30)
        second = store.claim(conn, 10, 30)
        third = store.claim(conn, 10, 30)
    assert sorted(c.id for c in first) == sorted([high, low])
    assert [c.id for c in second] == [low2]
    assert third == []
    assert later not in {c.id for c in first + second}
    assert all(c.attempt == 1 for c in first)


def test_claims_come_in_the_batchs_order_and_a_sender_keeps_it(engine: sa.Engine) -> None:
    """The claim returns its rows highest priority first and, with tenants, in
    the fair share's rounds; the dispatcher's events and the sender's waves of
    calls keep that order. Sorted by id instead, a tenant's one due row behind
    another's campaign, or an urgent row, went in the last wave of the last
    event (bench/README.md, the noisy neighbour: 3.4 times its idle latency)."""
    with engine.begin() as conn:
        campaign = outbox.enqueue_many(
            conn, [{"channel": "email", "payload": EMAIL}] * 40, tenant="a"
        )
        reset = outbox.enqueue(conn, "email", EMAIL, tenant="b")
        urgent = outbox.enqueue(conn, "email", EMAIL, tenant="a", priority=9)
    with engine.begin() as conn:
        claims = store.claim(conn, 10, 30)
    order = [c.id for c in claims]
    # Round one: a's first (its urgent row), b's one row; then a's in id order.
    assert order[:2] in ([urgent, reset], [reset, urgent])
    assert order[2:] == campaign[:8]
    # The receipt lists the rows in the event's order, whatever their ids.
    event = list(reversed(claims))
    with engine.begin() as conn:
        received = store.receive_claimed(conn, "email", event, 3)
    assert [r.id for r in received] == [c.id for c in event]


def test_claim_sets_the_lease_from_the_database_clock(engine: sa.Engine) -> None:
    enqueue(engine, 1)
    with engine.begin() as conn:
        store.claim(conn, 10, 90)
        lease, claimed_gap = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM lease_expires_at - now()), "
                "EXTRACT(EPOCH FROM now() - claimed_at) FROM outbox_message"
            )
        ).one()
    assert float(lease) == 90.0 and float(claimed_gap) == 0.0  # same transaction: same now()


def test_only_the_head_of_an_ordering_key_is_claimed(engine: sa.Engine) -> None:
    a1, a2, a3 = enqueue(engine, 3, ordering_key="customer-a")
    (b1,) = enqueue(engine, 1, ordering_key="customer-b")
    (free,) = enqueue(engine, 1)
    with engine.begin() as conn:
        first = {c.id for c in store.claim(conn, 100, 30)}
    assert first == {a1, b1, free}
    with engine.begin() as conn:
        assert store.claim(conn, 100, 30) == []  # a2 waits for a1 to finish
        token = dict(
            conn.execute(
                sa.text("SELECT id, claim_token FROM outbox_message WHERE id = :id"), {"id": a1}
            ).all()
        )  # type: ignore[arg-type]
        store.settle(conn, [store.Settlement(a1, token[a1], "delivered")], store.Backoff(1, 1, 3))
    with engine.begin() as conn:
        assert [c.id for c in store.claim(conn, 100, 30)] == [a2]
    assert a3 > a2


def test_channel_filter(engine: sa.Engine) -> None:
    enqueue(engine, 3)
    with engine.begin() as conn:
        assert store.claim(conn, 10, 30, channels=["sms"]) == []
        assert len(store.claim(conn, 10, 30, channels=["email"])) == 3


def test_the_claim_reads_the_due_index_in_claim_order_with_one_channel(engine: sa.Engine) -> None:
    """A backlog of one channel (a channel column with one value) once made the
    planner take the pause check for a filter that keeps almost nothing: it
    costed the claim as a walk of every pending row (JIT-compiled above
    100,000, 20 ms a claim) or sorted them all instead of reading the due index."""
    with engine.begin() as conn:
        insert_due(conn, 20000)
        conn.execute(sa.text("ANALYZE outbox_message"))
        for statement, params in [
            *((s, {}) for (_, channels), s in store.delivery._CLAIMS.items() if not channels),
            *(
                (s, {"default_max": 5})
                for (_, channels), s in store.delivery._CLAIMS_AND_RECEIPTS.items()
                if not channels
            ),
        ]:
            plan = conn.execute(
                sa.text("EXPLAIN (FORMAT JSON) " + statement.text),
                {"batch_size": 100, "lease_seconds": 120.0, "default_ttl": 86400.0, **params},
            ).scalar_one()
            text = json.dumps(plan)
            assert '"Index Name": "outbox_message_due"' in text, text
            # The only sorts are the fair share's, over the candidates (at most
            # twice the batch, or a batch per tenant in the turn): none reads
            # the message table itself but through a LIMIT.
            for sort in nodes(plan[0]["Plan"], "Sort"):
                unbounded = relations(sort, through_limit=False)
                assert not any(r.startswith("outbox_message") for r in unbounded), text
            assert plan[0]["Plan"]["Total Cost"] < 100_000, "above jit_above_cost"


def test_the_claims_one_tenant_check_stays_an_index_probe_as_the_live_rows_churn(
    engine: sa.Engine, database_url: str
) -> None:
    """The lean claim asks whether any pending row has a tenant other than the
    last one. Asked as an EXISTS over a range the planner cannot see (the
    bound is a subquery's), it assumed a third of the live rows match and,
    once the live partition had churned since its last vacuum (rows claimed,
    settled into history, new ones enqueued: every drain between two
    autovacuums, or while a long transaction holds vacuum back), read the
    whole partition instead of the per-tenant index on every claim: 8,268
    pages and 13 ms a claim beside 10,000 due rows (bench/README.md, "A fast
    provider on one thread, and the cells warmed")."""
    payload = "jsonb_build_object('text', repeat('x', 700))"  # a row of a real payload's size
    with autocommit(database_url) as conn:  # VACUUM runs outside a transaction
        insert_due(conn, 10000, payload)
        conn.execute(sa.text("VACUUM ANALYZE outbox_message"))
        for _ in range(2):  # a drain of 10,000 rows, as many enqueued meanwhile
            conn.execute(
                sa.text(
                    "UPDATE outbox_message SET status = 'claimed', claim_token = gen_random_uuid(), "
                    "claimed_at = now(), lease_expires_at = now() + interval '2 minutes' "
                    "WHERE id IN (SELECT id FROM outbox_message WHERE status = 'pending' "
                    "ORDER BY id LIMIT 5000)"
                )
            )
            conn.execute(
                sa.text(
                    "UPDATE outbox_message SET status = 'delivered', claim_token = NULL, "
                    "lease_expires_at = NULL, attempts = 1, settled_at = now() "
                    "WHERE status = 'claimed'"
                )
            )
            insert_due(conn, 5000, payload)
        plans = [
            conn.execute(
                sa.text("EXPLAIN (FORMAT JSON) " + statement.text),
                {"batch_size": 100, "lease_seconds": 120.0, "default_ttl": 86400.0, **params},
            ).scalar_one()
            for statement, params in [
                *((s, {}) for (_, channels), s in store.delivery._CLAIMS.items() if not channels),
                *(
                    (s, {"default_max": 5})
                    for (_, channels), s in store.delivery._CLAIMS_AND_RECEIPTS.items()
                    if not channels
                ),
            ]
        ]
    for plan in plans:
        scanned = [n["Relation Name"] for n in nodes(plan[0]["Plan"], "Seq Scan")]
        assert "outbox_message_live" not in scanned, json.dumps(plan)


def test_the_claims_one_tenant_check_steps_over_no_row_claimed_since_the_last_vacuum(
    engine: sa.Engine, database_url: str
) -> None:
    """The one-tenant check reads the per-tenant due index from its end, where
    the rows still to claim are: from its start it stepped over the entries of
    every row claimed since the last vacuum (992 buffers beside a busy day's
    200,000, on every claim), which are dead until the vacuum."""
    with autocommit(database_url) as conn:  # VACUUM runs outside a transaction
        insert_due(conn, 10000)
        conn.execute(sa.text("VACUUM ANALYZE outbox_message"))
        conn.execute(  # the oldest half claimed and settled: dead entries at the index's start
            sa.text(
                "UPDATE outbox_message SET status = 'claimed', claim_token = gen_random_uuid(), "
                "claimed_at = now(), lease_expires_at = now() + interval '2 minutes' "
                "WHERE id <= 5000"
            )
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET status = 'delivered', claim_token = NULL, "
                "lease_expires_at = NULL, attempts = 1, settled_at = now() "
                "WHERE status = 'claimed'"
            )
        )
        plan = conn.execute(
            sa.text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT " + store.delivery._LEAN_FITS)
        ).scalar_one()
        fits = conn.execute(sa.text("SELECT " + store.delivery._LEAN_FITS)).scalar_one()
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, tenant) VALUES ('email', '{}', 'b')"
            )
        )
        fits_with_two = conn.execute(sa.text("SELECT " + store.delivery._LEAN_FITS)).scalar_one()
    assert fits is True  # one tenant
    assert fits_with_two is False  # a second tenant has pending rows
    buffers = plan[0]["Plan"]["Shared Hit Blocks"] + plan[0]["Plan"]["Shared Read Blocks"]
    assert buffers < 100, json.dumps(plan)


@contextlib.contextmanager
def autocommit(database_url: str) -> Iterator[sa.Connection]:
    """A connection of its own outside every transaction, on an engine that
    is disposed of after (the shared engine's pooled connections keep what
    earlier tests left on them)."""
    own = sa.create_engine(database_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with own.connect() as conn:
            yield conn
    finally:
        own.dispose()


def nodes(plan: dict[str, Any], node_type: str) -> list[dict[str, Any]]:
    """Every node of ``node_type`` in an EXPLAIN (FORMAT JSON) plan tree."""
    found = [plan] if plan["Node Type"] == node_type else []
    for child in plan.get("Plans", []):
        found += nodes(child, node_type)
    return found


def relations(plan: dict[str, Any], through_limit: bool = True) -> set[str]:
    """The tables a plan node and the nodes under it read (``through_limit``
    False: only those read without a LIMIT between, an unbounded read)."""
    names = {plan["Relation Name"]} if "Relation Name" in plan else set()
    for child in plan.get("Plans", []):
        if through_limit or child["Node Type"] != "Limit":
            names |= relations(child, through_limit)
    return names


def test_the_claim_skips_exactly_the_rows_past_their_deliver_by_time(engine: sa.Engine) -> None:
    """The claim's deliver-by test is spelt for the planner; it must still mean
    (COALESCE(expires_at, available_at + default ttl) > now()) IS NOT FALSE."""
    cases = [
        (expires, due)
        for expires in ("now() - interval '1 minute'", "now() + interval '1 minute'", "NULL")
        for due in ("now() - interval '2 hours'", "now() - interval '1 second'")
    ]
    for ttl in (3600.0, None):
        with engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE outbox_attempt, outbox_message RESTART IDENTITY"))
            for expires, due in cases:
                conn.execute(
                    sa.text(
                        "INSERT INTO outbox_message (channel, payload, expires_at, available_at) "
                        f"VALUES ('email', '{{}}', {expires}, {due})"
                    )
                )
            expected = conn.execute(
                sa.text(
                    "SELECT id FROM outbox_message WHERE (COALESCE(expires_at, available_at "
                    "+ make_interval(secs => CAST(:ttl AS float8))) > now()) IS NOT FALSE"
                ),
                {"ttl": ttl},
            ).scalars()
            wanted = sorted(expected)
            claimed = sorted(c.id for c in store.claim(conn, 100, 120, default_ttl_seconds=ttl))
        assert claimed == wanted, (ttl, claimed, wanted)
        assert 0 < len(wanted) < len(cases)


def test_a_burst_on_a_table_analyzed_idle_is_claimed_by_id(engine: sa.Engine) -> None:
    """Statistics taken while nothing was pending (an idle table), then a burst:
    the claim's UPDATE must still look its batch up by id, not walk every
    pending row against it (that plan took 150 ms for a burst of 10,000)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, status, settled_at, attempts) "
                "SELECT 'email', '{}', 'delivered', now(), 1 FROM generate_series(1, 20000)"
            )
        )
        conn.execute(sa.text("ANALYZE outbox_message"))
        insert_due(conn, 2000)
        plans = claim_plans(conn)
    for plan in plans:
        text = json.dumps(plan)
        assert '"Index Name": "outbox_message_live_pkey"' in text, text
        # the claim reads the live rows alone, never the history's partitions
        assert "outbox_message_resolved" not in text, [
            line for line in re.findall(r'"Relation Name": "([a-z0-9_]+)"', text)
        ]
        # The due rows come from the claim-order index, not a walk channel by
        # channel (the per-channel index is only the scan of a channel limited
        # as a whole, channel_limited).
        (scan,) = [
            p for p in _subplans(plan[0]["Plan"]) if p.get("Subplan Name") == "CTE unbucketed"
        ]
        assert "outbox_message_due_by_channel" not in json.dumps(scan), text


def _subplans(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _subplans(child)


def settle_plan(
    conn: sa.Connection, claims: list[store.Claim], explain: str, generic: bool = False
) -> Any:
    """``explain`` (an EXPLAIN's options) of the settle of ``claims`` as delivered.
    ``generic``: of the plan Postgres keeps for the statement once prepared
    (``outbox worker`` keeps the settle prepared: db.keep_statements_prepared)."""
    document = json.dumps([[c.id, c.claim_token, "delivered", None, None, None, 1] for c in claims])
    backoff = store.Backoff(30, 1800, 8)
    params = {"settlements": document, "rows": len(claims), "max_deferrals": 20, **backoff.params()}
    text = store.delivery._SETTLE.text
    if not generic:
        return conn.execute(sa.text(explain + text), params).scalar_one()
    names = list(dict.fromkeys(re.findall(r"(?<![:\w]):(\w+)(?!:)", text)))
    numbered = re.sub(r"(?<![:\w]):(\w+)(?!:)", lambda m: f"${names.index(m[1]) + 1}", text)
    conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
    conn.exec_driver_sql(f"PREPARE settle_generic AS {numbered}")
    values = ", ".join(
        "'" + str(params[n]).replace("'", "''") + "'"
        if isinstance(params[n], str)
        else repr(params[n])
        for n in names
    )
    try:
        return conn.exec_driver_sql(f"{explain}EXECUTE settle_generic({values})").scalar_one()
    finally:
        conn.exec_driver_sql("DEALLOCATE settle_generic")


@pytest.mark.parametrize("generic", [False, True], ids=["planned", "kept"])
def test_a_small_settle_on_a_small_table_reads_rows_by_their_key(
    engine: sa.Engine, generic: bool
) -> None:
    """The planner guesses 100 rows for any set-returning function; told the
    batch's size, a settle of 32 rows against a table of 2,000 (a fresh or a
    well-pruned outbox) looks them up by id instead of scanning the table, and
    so does the generic plan of the settle kept prepared."""
    with engine.begin() as conn:
        # payloads of an email's size: 2,000 rows are some 200 pages
        insert_due(conn, 2000, payload="jsonb_build_object('text', repeat('x', 600))")
        claims = store.claim(conn, 32, 120)
        conn.execute(sa.text("ANALYZE outbox_message"))
        plan = settle_plan(conn, claims, "EXPLAIN (FORMAT JSON) ", generic)
    text = json.dumps(plan)
    assert '"Index Name": "outbox_message_live_pkey"' in text, text
    # the settle is planned against the live rows alone (its rows are claimed)
    assert "outbox_message_resolved" not in text, text
    scans = [
        node
        for node in _plan_nodes(plan[0]["Plan"])
        if node["Node Type"] == "Seq Scan"
        and node.get("Relation Name", "").startswith("outbox_message")
    ]
    assert scans == [], text


@pytest.mark.parametrize("generic", [False, True], ids=["planned", "kept"])
def test_a_settle_reads_its_document_once_on_statistics_taken_before_the_claim(
    engine: sa.Engine, generic: bool
) -> None:
    """The live partition's statistics are mostly taken with its rows pending
    (claims last seconds): `status = 'claimed'` was then estimated as next to
    no row, and the settle read the partition first, as one row, and unpacked
    its whole document again for each row it found (a batch of 100 on a
    table of 2,000: 20 ms of a 5 ms settle), as the receipt once did."""
    with engine.begin() as conn:
        insert_due(conn, 2000, payload="jsonb_build_object('text', repeat('x', 600))")
        conn.execute(sa.text("ANALYZE outbox_message"))
        claims = store.claim(conn, 100, 120)
        plan = settle_plan(conn, claims, "EXPLAIN (ANALYZE, FORMAT JSON) ", generic)
        conn.rollback()
    unpacked = [n for n in _plan_nodes(plan[0]["Plan"]) if n["Node Type"] == "Function Scan"]
    assert unpacked, json.dumps(plan)
    assert all(n["Actual Loops"] == 1 for n in unpacked), json.dumps(plan)


@pytest.mark.parametrize("which", ["receipt", "release"])
def test_the_claims_lookup_by_id_never_joins_every_row_to_every_claim(
    engine: sa.Engine, which: str
) -> None:
    """Statistics taken while the live rows were pending (claims last seconds,
    so they nearly always are): the receipt and the release of a thousand
    claims must not read the partition as one row and rescan the claims'
    unnest for each row it finds (a million comparisons, 85 ms a receipt)."""
    with engine.begin() as conn:
        insert_due(conn, 20_000)
        conn.execute(sa.text("ANALYZE outbox_message"))
        claims = store.claim(conn, 1000, 120)
        fence = store.delivery._fence_arrays(claims)
        statement, params = {
            "receipt": (store.delivery._RECEIVE_CLAIMED, {"channel": "email", "default_max": 5}),
            "release": (
                store.delivery._RELEASE,
                {"delay_seconds": 0.0, "reason": "test", "own_receipt": False},
            ),
        }[which]
        plan = conn.execute(
            sa.text("EXPLAIN (FORMAT JSON) " + statement.text), {**fence, **params}
        ).scalar_one()
    text = json.dumps(plan)
    for loop in nodes(plan[0]["Plan"], "Nested Loop"):
        inner = loop["Plans"][1]
        assert inner["Node Type"] != "Function Scan", text  # the claims, rescanned a row
    # The partition is read as what it holds, or probed by id.
    (message_scan,) = [
        n
        for n in _plan_nodes(plan[0]["Plan"])
        if n["Node Type"] != "ModifyTable"
        and n.get("Relation Name", "").startswith("outbox_message")
    ]
    assert message_scan["Plan Rows"] >= 1000 or message_scan["Node Type"] == "Index Scan", text


def insert_due(conn: sa.Connection, rows: int, payload: str = "'{}'") -> None:
    """``rows`` due email rows, in one statement (``payload``: an SQL expression)."""
    conn.execute(
        sa.text(
            "INSERT INTO outbox_message (channel, payload, available_at) "
            f"SELECT 'email', {payload}, now() - interval '1 second' "
            f"FROM generate_series(1, {int(rows)})"
        )
    )


def _plan_nodes(node: dict) -> list[dict]:
    return [node, *(n for child in node.get("Plans", []) for n in _plan_nodes(child))]


@pytest.mark.parametrize("batch", [0, -1, 2.5, True, "10", None, 10**9])
def test_a_bad_batch_size_is_refused_before_the_database(engine: sa.Engine, batch: Any) -> None:
    enqueue(engine, 3)
    with engine.begin() as conn:
        with pytest.raises(ValueError, match="batch_size must be a whole number from 1 to"):
            store.claim(conn, batch, 30)
        with pytest.raises(ValueError, match="batch_size must be a whole number from 1 to"):
            store.claim_and_receive(conn, batch, 30, 3)
        with pytest.raises(ValueError, match="lease_seconds must be"):
            store.claim(conn, 10, float("nan"))
        assert (
            conn.execute(
                sa.text("SELECT count(*) FROM outbox_message WHERE status = 'claimed'")
            ).scalar_one()
            == 0
        )


def insert_history(conn: sa.Connection, rows: int) -> None:
    """``rows`` settled rows shaped like the relay's own: claimed, received and
    settled, a deliver-by time (all past), 80 % email with an SES id, 0.5 %
    dead."""
    conn.execute(
        sa.text(
            "INSERT INTO outbox_message (channel, payload, status, available_at, created_at,"
            " claimed_at, received_at, settled_at, attempts, provider_message_id, expires_at)"
            " SELECT CASE WHEN mod(g, 5) = 0 THEN 'webhook' ELSE 'email' END, '{}',"
            " CASE WHEN mod(g, 200) = 0 THEN 'dead' ELSE 'delivered' END,"
            " now() - interval '20 days' + g * interval '1 second',"
            " now() - interval '20 days' + g * interval '1 second',"
            " now() - interval '20 days' + g * interval '1 second',"
            " now() - interval '20 days' + g * interval '1 second',"
            " now() - interval '20 days' + g * interval '2 seconds', 1,"
            " CASE WHEN mod(g, 5) <> 0 THEN 'ses-' || g END,"
            " now() - interval '19 days' + g * interval '1 second'"
            f" FROM generate_series(1, {int(rows)}) AS g"
        )
    )


@pytest.mark.parametrize("batch", [100, 1000])
def test_every_claim_form_walks_the_due_index_beside_history(engine: sa.Engine, batch: int) -> None:
    """Issue 30, item 2: beside months of settled rows a backlog after an
    outage made the planner estimate a sliver of due rows, leave the ordered
    walk of the due index for a read of every due row and a sort, and cross
    jit_above_cost (230 ms a claim beside 1M settled rows instead of 5). The
    table here has the same proportions, ten settled rows to one due, as the
    statistics see them after ANALYZE."""
    with engine.begin() as conn:
        insert_history(conn, 200_000)
        insert_due(conn, 20_000)
        conn.execute(sa.text("ANALYZE outbox_message"))
        jit_above = float(conn.execute(sa.text("SHOW jit_above_cost")).scalar_one())
        # every form of the claim (lean, full, with the tenants' channel
        # parts), of every channel and of one
        forms = [
            (statement, {"channels": "{email}"} if channels else {}, "outbox_message_due")
            for (_, channels), statement in store.delivery._CLAIMS.items()
        ] + [
            (
                statement,
                {"channels": "{email}", "default_max": 5} if channels else {"default_max": 5},
                "outbox_message_due",
            )
            for (_, channels), statement in store.delivery._CLAIMS_AND_RECEIPTS.items()
        ]
        for (statement, params, index), prepare in itertools.product(forms, (False, True)):
            values = {
                "batch_size": batch,
                "lease_seconds": 120.0,
                "default_ttl": 86400.0,
                **params,
            }
            if prepare:  # the plan the worker's prepared claim keeps (_sql.prepared)
                # (a fresh session's claims: this pooled one has others'; its
                # kept statements stay, as db.py's execute path knows them)
                for execute in conn.connection.info.pop("outbox_prepared", set()):
                    conn.exec_driver_sql("DEALLOCATE " + execute.removeprefix("EXECUTE "))
                execute = store._sql.prepared(conn, statement, values)
                assert execute is not None
                statement, values = execute, {}
            plan = conn.execute(
                sa.text("EXPLAIN (FORMAT JSON) " + statement.text), values
            ).scalar_one()
            text = json.dumps(plan)
            if index is not None:
                assert f'"Index Name": "{index}"' in text, text
            for sort in nodes(plan[0]["Plan"], "Sort"):
                assert not any(
                    r.startswith("outbox_message") for r in relations(sort, through_limit=False)
                ), text
            if batch <= 100:  # (at batch 1000 the walk itself may cost that much)
                assert plan[0]["Plan"]["Total Cost"] < jit_above, "above jit_above_cost"
