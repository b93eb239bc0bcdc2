"""Tenants (issue 33; docs/how-to/tenants.md): keys that are a tenant's own,
signing secrets per tenant, a producer role bound to one tenant. Every way in
is tried: ``outbox.enqueue``, ``enqueue_many`` and both SQL doors."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import outbox
from outbox import DedupeConflict, ValidationError, sender, store
from outbox.channels import Outcome
from support import EMAIL, claim, forget_statistics, make_due, receive, row

BACKOFF = store.Backoff(1, 60, 5)
WEBHOOK = {"url": "https://hooks.example.com/in", "event_type": "order.shipped", "body": {}}


def signed(secret_id: str) -> dict[str, Any]:
    return {**WEBHOOK, "secret_id": secret_id}


def tenants_of(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT id, tenant FROM outbox_message")).all())


def settle(engine: sa.Engine, claims: list[store.Claim], outcome: str) -> None:
    with engine.begin() as conn:
        store.settle(
            conn, [store.Settlement(c.id, c.claim_token, outcome, "boom") for c in claims], BACKOFF
        )


def test_two_tenants_may_use_one_dedupe_key_and_each_replays_its_own(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        a = outbox.enqueue(conn, "email", EMAIL, dedupe_key="welcome", tenant="acme")
        b = outbox.enqueue(conn, "email", EMAIL, dedupe_key="welcome", tenant="beta")
        none = outbox.enqueue(conn, "email", EMAIL, dedupe_key="welcome")
        assert len({a, b, none}) == 3
        assert outbox.enqueue(conn, "email", EMAIL, dedupe_key="welcome", tenant="acme") == a
        replayed = outbox.enqueue_many(
            conn, [{"channel": "email", "payload": EMAIL, "dedupe_key": "welcome"}], tenant="beta"
        )
        assert replayed == [b]
    with pytest.raises(DedupeConflict), engine.begin() as conn:
        outbox.enqueue(
            conn, "email", {**EMAIL, "subject": "other"}, dedupe_key="welcome", tenant="acme"
        )
    assert tenants_of(engine) == {a: "acme", b: "beta", none: ""}


def test_enqueue_many_takes_a_tenant_per_message_or_one_for_the_call(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        ids = outbox.enqueue_many(
            conn,
            [
                {"channel": "email", "payload": EMAIL},
                {"channel": "email", "payload": EMAIL, "tenant": "beta"},
            ],
            tenant="acme",
        )
    assert tenants_of(engine) == {ids[0]: "acme", ids[1]: "beta"}
    assert ids == sorted(ids)


@pytest.mark.parametrize("bad", ["", "a b", "-x", "x" * 65, "é", 7])
def test_a_malformed_tenant_is_refused_and_nothing_is_written(engine: sa.Engine, bad: Any) -> None:
    with pytest.raises(ValidationError) as refused, engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL, tenant=bad)
    assert refused.value.field == "tenant"
    if isinstance(bad, str) and bad:
        with pytest.raises(sa.exc.DBAPIError, match="tenant: must be"), engine.begin() as conn:
            conn.execute(
                sa.text("SELECT outbox_enqueue('email', CAST(:p AS jsonb), tenant => :t)"),
                {"p": json.dumps(EMAIL), "t": bad},
            )
    assert tenants_of(engine) == {}


def test_one_tenants_cooldown_key_never_holds_anothers(engine: sa.Engine) -> None:
    cooldown = {
        "cooldown": timedelta(days=366),
        "cooldown_key": "digest",
        "on_cooldown": "suppress",
    }
    with engine.begin() as conn:
        first = outbox.enqueue(conn, "email", EMAIL, tenant="acme", **cooldown)
    settle(engine, claim(engine), "delivered")
    with engine.begin() as conn:
        same_tenant = outbox.enqueue(conn, "email", EMAIL, tenant="acme", **cooldown)
        other_tenant = outbox.enqueue(conn, "email", EMAIL, tenant="beta", **cooldown)
    claimed = claim(engine)
    assert [c.id for c in claimed] == [other_tenant]
    with engine.connect() as conn:
        assert row(conn, first).status == "delivered"
        assert row(conn, same_tenant).status == "suppressed"


def test_a_failed_head_holds_its_own_tenants_ordering_key_only(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        head = outbox.enqueue(conn, "email", EMAIL, ordering_key="order-1", tenant="acme")
        held = outbox.enqueue(conn, "email", EMAIL, ordering_key="order-1", tenant="acme")
        other = outbox.enqueue(conn, "email", EMAIL, ordering_key="order-1", tenant="beta")
    # one row of each tenant's key at a time: both heads, not acme's second
    first = claim(engine)
    assert sorted(c.id for c in first) == [head, other]
    settle(engine, [c for c in first if c.id == head], "failed")
    settle(engine, [c for c in first if c.id == other], "delivered")
    with engine.begin() as conn:
        later = outbox.enqueue(conn, "email", EMAIL, ordering_key="order-1", tenant="beta")
    make_due(engine)
    # acme's failed head holds acme's key; beta's key goes on
    assert [c.id for c in claim(engine)] == [later]
    with engine.connect() as conn:
        assert row(conn, held).status == "pending"


@pytest.fixture
def producer_login(engine: sa.Engine, database_url: str) -> Iterator[tuple[str, sa.Engine]]:
    """A producer's login role (the producer grants, nothing else), and an
    engine that connects as it."""
    role = f"shop_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN IN ROLE outbox_producer"))
    login = sa.create_engine(make_url(database_url).set(username=role, password="x"))
    try:
        yield role, login
    finally:
        login.dispose()
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP ROLE {role}"))


def test_a_role_bound_to_a_tenant_writes_that_tenant_and_no_other(
    engine: sa.Engine, producer_login: tuple[str, sa.Engine]
) -> None:
    role, login = producer_login
    with engine.begin() as conn:
        store.bind_role(conn, role, "acme")
    with login.begin() as conn:
        mine = outbox.enqueue(conn, "email", EMAIL)
        named = outbox.enqueue(conn, "email", EMAIL, tenant="acme")
        by_sql = conn.execute(
            sa.text("SELECT outbox_enqueue('email', CAST(:p AS jsonb))"), {"p": json.dumps(EMAIL)}
        ).scalar_one()
    for attempt in (
        lambda c: outbox.enqueue(c, "email", EMAIL, tenant="beta"),
        lambda c: outbox.enqueue_many(c, [{"channel": "email", "payload": EMAIL}], tenant="beta"),
    ):
        with pytest.raises(ValidationError, match="bound to"), login.begin() as conn:
            attempt(conn)
    with pytest.raises(sa.exc.DBAPIError, match="bound to"), login.begin() as conn:
        conn.execute(
            sa.text("SELECT outbox_enqueue('email', CAST(:p AS jsonb), tenant => 'beta')"),
            {"p": json.dumps(EMAIL)},
        )
    assert tenants_of(engine) == {mine: "acme", named: "acme", by_sql: "acme"}
    with pytest.raises(sa.exc.ProgrammingError), login.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_tenant_role"))  # producers get the door only


def test_a_bound_producer_cannot_learn_whether_another_tenants_keys_or_secrets_exist(
    engine: sa.Engine, producer_login: tuple[str, sa.Engine]
) -> None:
    """beta's dedupe key, cooldown key and ordering key are invisible to a
    producer bound to acme: the same answer as for a key nobody uses (a new
    message, nothing conflicts, waits or is held); beta's secret is refused in
    the very words of a secret that does not exist."""
    role, login = producer_login
    with engine.begin() as conn:
        store.bind_role(conn, role, "acme")
        store.map_secret(conn, "beta-key", "beta")
        theirs = outbox.enqueue(
            conn, "email", {**EMAIL, "subject": "beta's"}, dedupe_key="order-7", tenant="beta",
            ordering_key="customer-1", cooldown=timedelta(days=1), cooldown_key="digest",
        )  # fmt: skip
        theirs_8 = outbox.enqueue(
            conn, "email", {**EMAIL, "subject": "beta's"}, dedupe_key="order-8", tenant="beta"
        )
    with login.begin() as conn:
        mine = outbox.enqueue(
            conn, "email", EMAIL, dedupe_key="order-7", ordering_key="customer-1",
            cooldown=timedelta(days=1), cooldown_key="digest",
        )  # fmt: skip
        by_sql = conn.execute(
            sa.text("SELECT outbox_enqueue('email', CAST(:p AS jsonb), dedupe_key => 'order-8')"),
            {"p": json.dumps(EMAIL)},
        ).scalar_one()
    assert tenants_of(engine) == {theirs: "beta", theirs_8: "beta", mine: "acme", by_sql: "acme"}

    def refusal(secret_id: str) -> str:
        with pytest.raises(ValidationError) as error, login.begin() as conn:
            outbox.enqueue(conn, "webhook", signed(secret_id))
        with pytest.raises(sa.exc.DBAPIError) as sql_error, login.begin() as conn:
            conn.execute(
                sa.text("SELECT outbox_enqueue('webhook', CAST(:p AS jsonb))"),
                {"p": json.dumps(signed(secret_id))},
            )
        return f"{error.value} | {str(sql_error.value.orig).replace(secret_id, '?')}"

    assert refusal("beta-key") == refusal("no-such-key")
    # Claimed in one batch: neither's ordering or cooldown key holds the other.
    assert {c.id for c in claim(engine)} == {theirs, theirs_8, mine, by_sql}


def test_a_message_may_name_only_its_own_tenants_signing_secret(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        store.map_secret(conn, "acme-key", "acme")
        ok = outbox.enqueue(conn, "webhook", signed("acme-key"), tenant="acme")
        unmapped = outbox.enqueue(conn, "webhook", signed("shared-key"))
    refused = [
        ("beta", "acme-key"),  # another tenant's secret
        (None, "acme-key"),  # no tenant, a tenant's secret
        ("acme", "shared-key"),  # a tenant, a secret that is nobody's
    ]
    for tenant, secret_id in refused:
        with pytest.raises(ValidationError) as error, engine.begin() as conn:
            outbox.enqueue(conn, "webhook", signed(secret_id), tenant=tenant)
        assert error.value.field == "payload.secret_id"
        with pytest.raises(sa.exc.DBAPIError, match="secret_id"), engine.begin() as conn:
            conn.execute(
                sa.text("SELECT outbox_enqueue('webhook', CAST(:p AS jsonb), tenant => :t)"),
                {"p": json.dumps(signed(secret_id)), "t": tenant},
            )
    assert set(tenants_of(engine)) == {ok, unmapped}


def test_a_row_whose_secret_changed_tenant_since_it_was_written_fails_unsigned(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        store.map_secret(conn, "acme-key", "acme")
        written = outbox.enqueue(conn, "webhook", signed("acme-key"), tenant="acme")
        store.map_secret(conn, "acme-key", "beta")  # the operator moved it since
    (received,) = receive(engine, claim(engine), "webhook")
    assert received.id == written and received.secret_refused

    class NeverSends:
        name = "webhook"

        def validate(self, payload: Any) -> None: ...

        def send(self, message: Any, deadline: Any) -> Outcome:
            raise AssertionError("a refused secret must not be used")

    outcome, duration = sender._send_one(NeverSends(), received, sender.Deadline(30))  # type: ignore[arg-type]
    assert outcome.kind == "failed" and "tenant" in (outcome.error or "")
    assert duration is None


def enqueue_for(engine: sa.Engine, tenant: str | None, n: int, **fields: Any) -> list[int]:
    with engine.begin() as conn:
        return outbox.enqueue_many(
            conn, [{"channel": "email", "payload": EMAIL, **fields}] * n, tenant=tenant
        )


def claimed_by_tenant(engine: sa.Engine, claims: list[store.Claim]) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT tenant, count(*) FROM outbox_message "
                "WHERE id = ANY(CAST(:ids AS bigint[])) GROUP BY tenant"
            ),
            {"ids": store.array_literal([c.id for c in claims])},
        ).all()
    return dict(rows)


def test_a_tenants_campaign_does_not_keep_another_tenants_rows_waiting(engine: sa.Engine) -> None:
    campaign = enqueue_for(engine, "acme", 3000, priority=10)
    reset = enqueue_for(engine, "beta", 5)  # later, and of a lower priority
    make_due(engine)
    first = [c.id for c in claim(engine, batch=100)]
    assert set(reset) <= set(first)
    assert len(first) == 100 and len(set(first) & set(campaign)) == 95


def test_a_tenant_alone_gets_the_whole_batch_in_priority_order(engine: sa.Engine) -> None:
    low = enqueue_for(engine, "acme", 150)
    high = enqueue_for(engine, "acme", 50, priority=5)
    make_due(engine)
    first = [c.id for c in claim(engine, batch=100)]
    assert len(first) == 100 and set(high) <= set(first)
    assert set(first) - set(high) == set(low[:50])


@pytest.mark.parametrize("tenants", [2, 50])
def test_tenants_with_backlogs_share_each_batch_by_weight(engine: sa.Engine, tenants: int) -> None:
    """With more tenants than a turn holds (50 against TENANTS_PER_CLAIM), the
    turn goes round them: the shares hold over a few turns (here 3,000 rows,
    some 4 turns), not within each claim."""
    names = [f"t{i:02d}" for i in range(tenants)]
    claims = 10 if tenants <= store.delivery.TENANTS_PER_CLAIM else 30
    total_weight = tenants + 2
    for name in names:  # each one's backlog after the one before: the oldest first
        enqueue_for(engine, name, claims * 100 * 3 // total_weight + 20)
    with engine.begin() as conn:
        store.set_tenant(conn, names[0], weight=3)
    make_due(engine)
    counts: dict[str, int] = {}
    for _ in range(claims):
        for tenant, n in claimed_by_tenant(engine, claim(engine, batch=100)).items():
            counts[tenant] = counts.get(tenant, 0) + n
    for name in names:
        weight = 3 if name == names[0] else 1
        expected = claims * 100 * weight / total_weight
        assert abs(counts.get(name, 0) - expected) <= 0.1 * expected, (name, counts)


def test_a_paused_tenants_rows_wait_and_nobody_elses_do(engine: sa.Engine) -> None:
    paused = enqueue_for(engine, "acme", 10)
    others = enqueue_for(engine, "beta", 3) + enqueue_for(engine, None, 2)
    with engine.begin() as conn:
        store.set_tenant(conn, "acme", paused=True)
    make_due(engine)
    assert sorted(c.id for c in claim(engine)) == sorted(others)
    with engine.begin() as conn:
        store.set_tenant(conn, "acme", paused=False)
    assert sorted(c.id for c in claim(engine)) == paused


def enqueue_hooks_for(engine: sa.Engine, tenant: str | None, n: int, host: str) -> list[int]:
    hook = {**WEBHOOK, "url": f"https://{host}/in"}
    with engine.begin() as conn:
        return outbox.enqueue_many(
            conn, [{"channel": "webhook", "payload": hook}] * n, tenant=tenant
        )


def test_a_tenants_paused_channel_waits_and_its_other_channels_and_everyone_else_go(
    engine: sa.Engine,
) -> None:
    held = enqueue_for(engine, "acme", 5)
    acme_hooks = enqueue_hooks_for(engine, "acme", 2, "a.example")
    others = enqueue_for(engine, "beta", 3) + enqueue_for(engine, None, 2)
    with engine.begin() as conn:
        store.pause_tenant_channel(conn, "acme", "email", "their SES is in review")
        [paused] = store.tenant_channels(conn, "acme")
    assert (paused.channel, paused.paused, paused.reason) == (
        "email",
        True,
        "their SES is in review",
    )
    make_due(engine)
    assert sorted(c.id for c in claim(engine)) == sorted(acme_hooks + others)
    assert claim(engine) == []
    with engine.begin() as conn:
        assert store.resume_tenant_channel(conn, "acme", "email")
        assert not store.resume_tenant_channel(conn, "acme", "email")
        assert store.tenant_channels(conn) == []  # nothing left set: the row went
    assert sorted(c.id for c in claim(engine)) == held


def test_a_tenants_channel_limit_holds_its_rows_across_destinations_and_nobody_elses(
    engine: sa.Engine,
) -> None:
    """acme's webhooks to three receivers are held to acme's limit together;
    beta's webhooks and acme's email are not."""
    acme = [i for host in ("a.example", "b.example", "c.example")
            for i in enqueue_hooks_for(engine, "acme", 20, host)]  # fmt: skip
    acme_mail = enqueue_for(engine, "acme", 5)
    beta = enqueue_hooks_for(engine, "beta", 10, "a.example")
    with engine.begin() as conn:
        assert store.set_tenant_limit(conn, "acme", "webhook", 0.001, 4) == (0.001, 4)
    make_due(engine)
    first = {c.id for c in claim(engine, batch=100)}
    assert len(first & set(acme)) == 4  # the burst, whatever the destinations
    assert set(beta) | set(acme_mail) <= first
    assert {c.id for c in claim(engine, batch=100)} == set()  # the bucket is empty
    with engine.begin() as conn:
        [limit] = store.tenant_channels(conn, "acme")
        assert limit.tokens is not None and limit.tokens < 1
        assert store.clear_tenant_limit(conn, "acme", "webhook")
        assert not store.clear_tenant_limit(conn, "acme", "webhook")
    assert len({c.id for c in claim(engine, batch=100)}) == len(acme) - 4


def test_a_tenants_limited_backlog_never_hides_its_other_channels(engine: sa.Engine) -> None:
    """Its webhooks, first in the claim order and far past the batch, are
    left to their bucket's scan: the tenant's email behind them goes."""
    enqueue_hooks_for(engine, "acme", 500, "a.example")
    mail = enqueue_for(engine, "acme", 5)
    with engine.begin() as conn:
        store.set_tenant_limit(conn, "acme", "webhook", 0.001, 2)
    make_due(engine)
    first = {c.id for c in claim(engine, batch=50)}
    assert set(mail) <= first and len(first) == 7


def claimed_together(engine: sa.Engine, claimers: int) -> list[int]:
    """``claimers`` threads released at once, each claiming 5 batches of 50:
    every id they claimed (a failure in any of them fails the test)."""
    import threading

    got: list[list[int]] = []
    failures: list[BaseException] = []
    start = threading.Barrier(claimers)

    def claimer() -> None:
        try:
            start.wait()
            got.append([c.id for _ in range(5) for c in claim(engine, batch=50)])
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=claimer) for _ in range(claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    return [i for ids in got for i in ids]


def test_concurrent_claimers_never_exceed_a_tenants_channel_limit(engine: sa.Engine) -> None:

    for host in ("a.example", "b.example"):
        enqueue_hooks_for(engine, "acme", 150, host)
    enqueue_hooks_for(engine, "beta", 100, "a.example")
    with engine.begin() as conn:
        store.set_tenant_limit(conn, "acme", "webhook", 5, 5)
        since = conn.execute(sa.text("SELECT now()")).scalar_one()
    make_due(engine)
    claimed_together(engine, claimers=6)
    with engine.connect() as conn:
        taken, last = conn.execute(
            sa.text(
                "SELECT count(*), max(claimed_at) FROM outbox_message "
                "WHERE status = 'claimed' AND tenant = 'acme'"
            )
        ).one()
        beta = conn.execute(
            sa.text(
                "SELECT count(*) FROM outbox_message WHERE status = 'claimed' AND tenant = 'beta'"
            )
        ).scalar_one()
    # The burst, plus the refill over the claims' span by the database's clock.
    span = (last - since).total_seconds()
    assert 5 <= taken <= 5 + 5 * span + 1e-9
    assert beta == 100


def limit_acme_webhook_elsewhere(engine: sa.Engine) -> None:
    """Another process's `outbox limit set webhook --tenant acme --rate 0.001
    --burst 2`, written straight to the table: this process is not told."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_tenant_channel "
                "(tenant, channel, limit_rate, limit_burst, tokens, tokens_at) "
                "VALUES ('acme', 'webhook', 0.001, 2, 2, now())"
            )
        )


def test_a_limit_another_process_set_holds_at_once_after_a_lean_claim(
    engine: sa.Engine,
) -> None:
    """A relay whose claim's gates are idle (one tenant, no limit, no pause)
    claims with the lean claim, which checks in its own snapshot that it
    fits: a limit set elsewhere is found by the next claim, which claims
    nothing itself and runs the full claim at once."""
    enqueue_hooks_for(engine, "acme", 10, "a.example")
    make_due(engine)
    assert len(claim(engine, batch=1)) == 1
    assert store.delivery._claim_form_seen[engine] == store.delivery.LEAN
    limit_acme_webhook_elsewhere(engine)
    assert len(claim(engine, batch=100)) == 2  # the limit's burst, not the 9 left
    assert store.delivery._claim_form_seen[engine] == store.delivery.FULL_WITH_TENANT_CHANNELS


def test_a_limit_another_process_set_holds_from_the_claim_after_the_one_that_finds_it(
    engine: sa.Engine,
) -> None:
    """A relay that claims with the full claim (two tenants share the batch)
    but without the tenants' channel parts (none is paused or limited): each
    claim's own last row says whether one is set now, so a limit set
    elsewhere holds from the claim after the first that finds it."""
    enqueue_hooks_for(engine, "acme", 10, "a.example")
    enqueue_hooks_for(engine, "beta", 10, "b.example")
    make_due(engine)
    claim(engine, batch=2)
    assert store.delivery._claim_form_seen[engine] == store.delivery.FULL
    limit_acme_webhook_elsewhere(engine)
    claim(engine, batch=2)  # the claim that finds it
    assert store.delivery._claim_form_seen[engine] == store.delivery.FULL_WITH_TENANT_CHANNELS
    assert claimed_by_tenant(engine, claim(engine, batch=100)) == {"acme": 2, "beta": 8}


def test_an_engines_first_claim_heeds_a_limit_set_before_it_started(engine: sa.Engine) -> None:
    """A process that starts (a Lambda cold start) after a tenant's channel
    was limited starts with the lean claim, which finds that it does not fit
    and claims nothing; the full claim that follows at once holds the limit."""
    enqueue_hooks_for(engine, "acme", 10, "a.example")
    make_due(engine)
    limit_acme_webhook_elsewhere(engine)
    store.delivery._claim_form_seen.clear()  # what a new process knows
    assert len(claim(engine, batch=100)) == 2  # the limit's burst


def test_a_sleeping_relay_wakes_for_a_tenants_next_token(engine: sa.Engine) -> None:
    enqueue_hooks_for(engine, "acme", 3, "a.example")
    with engine.begin() as conn:
        store.set_tenant_limit(conn, "acme", "webhook", 2, 1)
    make_due(engine)
    assert len(claim(engine)) == 1
    with engine.begin() as conn:
        wake = store.next_wake(conn)
    assert wake.next_resume is not None
    assert 0 < (wake.next_resume - wake.now).total_seconds() <= 0.5


@pytest.mark.parametrize(
    ("tenant", "channel", "rate", "problem"),
    [
        ("", "webhook", 1, "tenant"),
        ("bad tenant", "webhook", 1, "tenant"),
        ("acme", "Not A Channel", 1, "channel"),
        ("acme", "webhook", 0, "rate"),
        ("acme", "webhook", float("nan"), "rate"),
    ],
)
def test_a_bad_tenant_limit_is_refused_and_changes_nothing(
    engine: sa.Engine, tenant: str, channel: str, rate: float, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem), engine.begin() as conn:
        store.set_tenant_limit(conn, tenant, channel, rate)
    with engine.connect() as conn:
        assert store.tenant_channels(conn) == []


def test_an_outcome_event_carries_the_messages_tenant(engine: sa.Engine) -> None:
    from outbox import outcomes

    enqueue_for(engine, "acme", 1)
    enqueue_for(engine, None, 1)
    settle(engine, claim(engine), "failed")
    with engine.begin() as conn:
        events = store.take_outcome_events(conn, 10, 60)
    assert sorted((e.tenant or "") for e in events) == ["", "acme"]
    details = [outcomes.detail(e) for e in events]
    assert sorted(str(d["tenant"]) for d in details) == ["None", "acme"]


@pytest.mark.parametrize("analyzed", [True, False])
@pytest.mark.parametrize("tenants", [1, 2])
def test_the_claim_beside_a_large_backlog_stays_below_jit_above_cost(
    engine: sa.Engine, tenants: int, analyzed: bool
) -> None:
    """A per-tenant LIMIT the planner could not read (each tenant's share) was
    costed as a tenth of a 100,000-row backlog: over jit_above_cost, 320 ms
    of JIT compilation a claim for 5 ms of work."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload, tenant) "
                "SELECT 'email', CAST(:p AS jsonb), 't' || CAST(mod(g, :tenants) AS text) "
                "FROM generate_series(1, 100000) AS g"
            ),
            {"p": json.dumps(EMAIL), "tenants": tenants},
        )
        if analyzed:
            conn.execute(sa.text("ANALYZE outbox_message_live"))
        else:  # as on a table autovacuum has not analyzed yet (TRUNCATE keeps them)
            forget_statistics(conn)
        for statement in store.delivery._CLAIMS.values():
            plan = conn.execute(
                sa.text("EXPLAIN (FORMAT JSON) " + statement.text),
                {"batch_size": 100, "lease_seconds": 120.0, "default_ttl": 86400.0,
                 "channels": "{email}"},
            ).scalar_one()  # fmt: skip
            jit_above = float(conn.execute(sa.text("SHOW jit_above_cost")).scalar_one())
            assert plan[0]["Plan"]["Total Cost"] < jit_above, json.dumps(plan)[:2000]


def test_concurrent_claimers_sharing_tenants_never_claim_a_row_twice(engine: sa.Engine) -> None:

    for name in ("acme", "beta", "gamma"):
        enqueue_for(engine, name, 400)
    make_due(engine)
    every = claimed_together(engine, claimers=4)
    # none twice (a claimer may find fewer than 50 while the others hold candidates)
    assert len(every) == len(set(every)) > 0
    with engine.connect() as conn:
        claimed = conn.execute(
            sa.text("SELECT count(*) FROM outbox_message WHERE status = 'claimed'")
        ).scalar_one()
    assert claimed == len(every)


# --- metrics by tenant ------------------------------------------------------------


def tenant_metrics(engine: sa.Engine, capsys: pytest.CaptureFixture[str], **kw: Any) -> Any:
    """The reaper's EMF records that carry the tenant dimension, by tenant."""
    from outbox import observability, reaper
    from support import settings

    observability.flush_metrics()
    capsys.readouterr()
    observability.log_metrics(lambda e, c: reaper.run(engine, settings(), lambda: 30.0, **kw))(
        {}, None
    )
    records = [
        json.loads(line)
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("{") and '"_aws"' in line
    ]
    return {r["tenant"]: r for r in records if "tenant" in r}


def test_the_backlog_of_the_busiest_tenants_is_published_by_name_and_the_rest_as_one(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """A series per tenant would be one per customer, each billed: the busiest
    TENANT_METRICS tenants by name, every other tenant summed in one."""
    top = store.TENANT_METRICS
    for i in range(top + 3):  # t00 has the most due rows, t12 the fewest
        enqueue_for(engine, f"t{i:02}", top + 3 - i)
    enqueue_for(engine, None, 50)  # no tenant: counted in the relay's totals only
    enqueue_for(engine, "later", 40, delay=3600)  # not due: not a backlog yet
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET available_at = available_at - interval '5 minutes' WHERE tenant = 't12'"
            )
        )
    published = tenant_metrics(engine, capsys)
    named = {f"t{i:02}" for i in range(top)}
    assert set(published) == named | {store.OTHER_TENANTS}
    assert published["t00"]["PendingMessages"] == [top + 3]
    assert published["t09"]["PendingMessages"] == [4]
    # t10, t11 and t12: 3 + 2 + 1 rows; the oldest is t12's, five minutes old.
    other = published[store.OTHER_TENANTS]
    assert other["PendingMessages"] == [6]
    assert other["OldestPendingAgeSeconds"][0] >= 300
    assert published["t00"]["OldestPendingAgeSeconds"][0] < 300
    dimensions = {
        frozenset(d)
        for r in published.values()
        for d in r["_aws"]["CloudWatchMetrics"][0]["Dimensions"]
    }
    assert dimensions == {frozenset({"service", "tenant"})}


def test_a_relay_without_tenants_publishes_no_tenant_series(
    engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue_for(engine, None, 5)
    assert tenant_metrics(engine, capsys) == {}


# --- the send log per tenant ------------------------------------------------------


def test_did_x_get_it_is_answered_per_tenant_after_the_messages_are_pruned(
    engine: sa.Engine,
) -> None:
    """Two tenants email one address: each tenant's send log shows its own
    attempts only, also once the messages are gone (the log outlives them)."""
    (a,) = enqueue_for(engine, "acme", 1)
    (b,) = enqueue_for(engine, "beta", 1)
    (none,) = enqueue_for(engine, None, 1)
    claims = claim(engine, lease=60)
    settle(engine, [c for c in claims if c.id == a], "delivered")
    settle(engine, [c for c in claims if c.id != a], "failed")
    address = EMAIL["to"][0]
    with engine.begin() as conn:

        def log(tenant: str | None) -> list[tuple[int, str]]:
            rows = store.recipient_history(conn, address, ["email"], tenant=tenant)
            return [(r.message_id, r.outcome) for r in rows]

        assert log("acme") == [(a, "delivered")]
        assert log("beta") == [(b, "failed")]
        assert log("") == [(none, "failed")]  # no tenant's
        assert sorted(log(None)) == sorted([(a, "delivered"), (b, "failed"), (none, "failed")])
        conn.execute(sa.text("DELETE FROM outbox_message"))  # pruned: the attempts stay
        assert log("acme") == [(a, "delivered")] and log("beta") == [(b, "failed")]
