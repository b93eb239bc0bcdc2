"""The claim's three forms (docs/design.md, Tenants): the lean claim while the
gates beyond a row's own are idle, the full one otherwise. The lean claim
checks in its own snapshot that it fits, so whatever another process set
since the last claim holds in the next."""

from __future__ import annotations

import itertools
from typing import Any

import sqlalchemy as sa

import outbox
from outbox import store
from outbox.store import delivery
from support import EMAIL, claim, make_due

PARAMS = {"batch_size": 40, "lease_seconds": 120.0, "default_ttl": 86400.0}


def hooks(engine: sa.Engine, n: int, host: str, tenant: str | None = None, **fields: Any) -> None:
    with engine.begin() as conn:
        outbox.enqueue_many(
            conn,
            [{"channel": "webhook", "payload": {**HOOK, "url": f"https://{host}/in"}, **fields}]
            * n,
            tenant=tenant,
        )


HOOK = {"url": "https://a.example/in", "event_type": "order.shipped", "body": {}}


def tenants(engine: sa.Engine, claims: list[store.Claim]) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(
            conn.execute(
                sa.text(
                    "SELECT tenant, count(*) FROM outbox_message "
                    "WHERE id = ANY(CAST(:ids AS bigint[])) GROUP BY tenant"
                ),
                {"ids": store.array_literal(c.id for c in claims)},
            ).all()
        )


def test_a_claimer_whose_last_claim_was_lean_shares_with_a_tenant_that_came_since(
    engine: sa.Engine,
) -> None:
    hooks(engine, 10, "a.example", tenant="acme")
    make_due(engine)
    assert len(claim(engine, batch=1)) == 1
    assert delivery._claim_form_seen[engine] == delivery.LEAN
    hooks(engine, 1, "b.example", tenant="beta")  # another process's commit
    make_due(engine)
    # acme's rows are older: only the fair share gives beta its row now
    assert tenants(engine, claim(engine, batch=2)) == {"acme": 1, "beta": 1}
    # (as the claim's snapshot saw it: beta's row still pending)
    assert delivery._claim_form_seen[engine] == delivery.FULL
    assert tenants(engine, claim(engine, batch=2)) == {"acme": 2}
    assert delivery._claim_form_seen[engine] == delivery.LEAN  # acme alone again


def test_a_claimer_whose_last_claim_was_lean_heeds_a_pause_and_a_limit_set_elsewhere(
    engine: sa.Engine,
) -> None:
    hooks(engine, 10, "a.example")
    hooks(engine, 10, "b.example")
    make_due(engine)
    assert len(claim(engine, batch=1)) == 1
    assert delivery._claim_form_seen[engine] == delivery.LEAN
    with engine.begin() as conn:  # another process: a throttle heard, a limit set
        conn.execute(
            sa.text(
                "INSERT INTO outbox_destination (channel, destination, paused_until) "
                "VALUES ('webhook', 'a.example', now() + interval '1 hour')"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_destination (channel, destination, limit_rate, limit_burst, "
                "limit_source, tokens, tokens_at) "
                "VALUES ('webhook', 'b.example', 0.001, 3, 'operator', 3, now())"
            )
        )
    claims = claim(engine, batch=100)
    assert len(claims) == 3  # b.example's burst; a.example waits for its pause
    assert delivery._claim_form_seen[engine] == delivery.FULL
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_destination"))
    assert len(claim(engine, batch=100)) == 19 - 3
    assert delivery._claim_form_seen[engine] == delivery.LEAN


def test_a_lean_claim_that_does_not_fit_claims_nothing(engine: sa.Engine) -> None:
    hooks(engine, 3, "a.example", tenant="acme")
    hooks(engine, 3, "a.example", tenant="beta")
    make_due(engine)
    with engine.begin() as conn:
        claimed, form = delivery._run_claim(
            conn, delivery._CLAIMS[delivery.LEAN, False], PARAMS, prepare=False
        )
        assert (claimed, form) == ([], delivery.FULL)
        claimed_now = "SELECT count(*) FROM outbox_message WHERE status = 'claimed'"
        assert conn.execute(sa.text(claimed_now)).scalar_one() == 0


def test_the_lean_claim_takes_the_batch_the_full_one_takes_while_it_fits(
    engine: sa.Engine,
) -> None:
    """Destinations' turns, priorities, an ordering key and a cooldown key:
    the same rows in the same order, whichever form claims them."""
    for i, host in itertools.product(range(3), ("a.example", "b.example", "c.example")):
        hooks(engine, 5 + i, host, priority=i % 2)
    hooks(engine, 4, "d.example", ordering_key="K")
    hooks(engine, 4, "e.example", cooldown_key="C", cooldown=60)
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 7)
    make_due(engine)
    batches = {}
    for form in (delivery.LEAN, delivery.FULL, delivery.FULL_WITH_TENANT_CHANNELS):
        for statements, extra in (
            (delivery._CLAIMS, {}),
            (delivery._CLAIMS_AND_RECEIPTS, {"default_max": 5}),
        ):
            with engine.connect() as conn, conn.begin() as tx:
                claimed, next_form = delivery._run_claim(
                    conn, statements[form, False], {**PARAMS, **extra}, prepare=False
                )
                tx.rollback()
            assert next_form == delivery.LEAN
            batches[form, bool(extra)] = [row[0] for row in claimed]
    (lean, *others) = batches.values()
    # the batch but the three rows of the cooldown key that wait for its holder
    assert len(lean) == PARAMS["batch_size"] - 3
    assert all(batch == lean for batch in others), batches
