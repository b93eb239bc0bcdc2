"""The state machine of docs/design.md as a Python model, checked step by step
against the real database while Hypothesis drives claim, hand-off (the
sender's fenced load), settle (every outcome, with current and stale tokens),
lease expiry, reap, redrive, cancel and prune in random interleavings.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass

import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import outbox
from outbox import channels, store
from outbox.channels import SchemaChannel
from support import expire_leases

DEFAULT_MAX = 3
# Backoff of zero: a retried row is due at once, so the model need not know the clock.
BACKOFF = store.Backoff(0.0, 0.0, DEFAULT_MAX)
TERMINAL = {"delivered", "failed", "dead", "suppressed", "cancelled"}


class ModelChannel(SchemaChannel):
    name = "model"
    schema = {"type": "object"}


@dataclass
class Row:
    id: int
    priority: int
    ordering_key: str | None
    max_attempts: int | None
    status: str = "pending"
    attempts: int = 0
    attempts_at_redrive: int = 0  # the numbering goes on; the budget starts again
    token: uuid.UUID | None = None
    expired: bool = False
    due_stamp: int = 0  # the order of the statements that made it due (available_at)
    attempt_rows: int = 0

    @property
    def limit(self) -> int:
        return self.max_attempts or DEFAULT_MAX

    @property
    def exhausted(self) -> bool:
        return self.attempts - self.attempts_at_redrive >= self.limit


class OutboxModel(RuleBasedStateMachine):
    engine: sa.Engine  # set by the test

    def __init__(self) -> None:
        super().__init__()
        with self.engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE outbox_attempt, outbox_message RESTART IDENTITY"))
        self.rows: dict[int, Row] = {}
        self.tokens: list[tuple[int, uuid.UUID]] = []  # every claim ever issued
        self.clock = itertools.count(1)

    # --- helpers ---------------------------------------------------------

    def _heads(self) -> list[Row]:
        def blocked(r: Row) -> bool:
            return r.ordering_key is not None and any(
                p.ordering_key == r.ordering_key
                and p.id < r.id
                and p.status in ("pending", "claimed")
                for p in self.rows.values()
            )

        due = [r for r in self.rows.values() if r.status == "pending" and not blocked(r)]
        return sorted(due, key=lambda r: (-r.priority, r.due_stamp, r.id))

    def _owned(self, message_id: int, token: uuid.UUID) -> Row | None:
        r = self.rows.get(message_id)
        return r if r is not None and r.status == "claimed" and r.token == token else None

    def _pick_tokens(self, data: st.DataObject) -> list[tuple[int, uuid.UUID]]:
        # Half the time, prefer the dangerous case: stale tokens of rows that
        # are claimed again under a newer token.
        stale = [
            (i, t)
            for i, t in self.tokens
            if (r := self.rows.get(i)) is not None and r.status == "claimed" and r.token != t
        ]
        pool = stale if stale and data.draw(st.booleans()) else self.tokens
        if not pool:
            return []
        # Indexes into the issue order, never sorted by token: the draws must
        # not depend on the random UUIDs the database made.
        picked = data.draw(st.lists(st.integers(0, len(pool) - 1), max_size=4, unique=True))
        return [pool[i] for i in picked]

    # --- rules -----------------------------------------------------------

    @rule(
        n=st.integers(1, 3),
        priority=st.sampled_from([0, 0, 1]),
        key=st.sampled_from([None, None, "a", "b"]),
        max_attempts=st.sampled_from([None, 1, 2]),
    )
    def enqueue(self, n: int, priority: int, key: str | None, max_attempts: int | None) -> None:
        with self.engine.begin() as conn:
            ids = outbox.enqueue_many(
                conn,
                [
                    {
                        "channel": "model",
                        "payload": {"i": i},
                        "priority": priority,
                        "ordering_key": key,
                        "max_attempts": max_attempts,
                    }
                    for i in range(n)
                ],
            )
        stamp = next(self.clock)
        for message_id in ids:
            self.rows[message_id] = Row(message_id, priority, key, max_attempts, due_stamp=stamp)

    @rule(batch=st.integers(1, 4))
    def claim(self, batch: int) -> None:
        expected = [r.id for r in self._heads()[:batch]]
        with self.engine.begin() as conn:
            claims = store.claim(conn, batch, 60)
        assert sorted(c.id for c in claims) == sorted(expected)
        for c in claims:
            r = self.rows[c.id]
            assert c.attempt == r.attempts + 1
            r.status, r.token, r.expired = "claimed", c.claim_token, False
            self.tokens.append((c.id, c.claim_token))

    @rule(data=st.data())
    def hand_off(self, data: st.DataObject) -> None:
        """The sender's fenced load: only claims still held and not expired come back."""
        pairs = self._pick_tokens(data)
        with self.engine.begin() as conn:
            loaded = store.load_claimed(conn, "model", pairs, DEFAULT_MAX)
        expected = sorted(
            i for i, t in set(pairs) if (r := self._owned(i, t)) is not None and not r.expired
        )
        assert [m.id for m in loaded] == expected
        for m in loaded:
            r = self.rows[m.id]
            assert (m.attempt, m.max_attempts, m.claim_token) == (r.attempts + 1, r.limit, r.token)

    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        pairs = self._pick_tokens(data)
        # One settlement per row: a batch never settles a row twice.
        seen: set[int] = set()
        pairs = [(i, t) for i, t in pairs if not (i in seen or seen.add(i))]
        outcomes = [data.draw(st.sampled_from(store.SEND_OUTCOMES)) for _ in pairs]
        settlements = [
            store.Settlement(i, t, o, error=None if o == "delivered" else f"model {o}")
            for (i, t), o in zip(pairs, outcomes, strict=True)
        ]
        with self.engine.begin() as conn:
            result = store.settle(conn, settlements, BACKOFF)
        expected: dict[int, str] = {}
        stamp = next(self.clock)
        for (i, t), outcome in zip(pairs, outcomes, strict=True):
            r = self._owned(i, t)
            if r is None:
                continue  # a stale token: nothing may change
            if outcome == "deferred":
                r.status = "pending"
            else:
                r.attempts += 1
                if outcome == "retry":
                    r.status = "dead" if r.exhausted else "pending"
                else:
                    r.status = outcome
            r.token, r.due_stamp = None, stamp
            r.attempt_rows += 1
            expected[i] = r.status
        assert result == expected

    @rule()
    def expire(self) -> None:
        expire_leases(self.engine)
        for r in self.rows.values():
            if r.status == "claimed":
                r.expired = True

    @rule()
    def reap(self) -> None:
        with self.engine.begin() as conn:
            result = store.reap_expired(conn, 100, BACKOFF)
        expected = {}
        stamp = next(self.clock)
        for r in self.rows.values():
            if r.status == "claimed" and r.expired:
                r.attempts += 1
                r.status = "dead" if r.exhausted else "pending"
                r.token, r.due_stamp = None, stamp
                r.attempt_rows += 1
                expected[r.id] = r.status
        assert result == expected

    @rule(batch=st.integers(1, 4))
    def steal(self, batch: int) -> None:
        """A slow sender's lease runs out, the reaper releases it, another
        dispatcher claims it again: the old token is now stale."""
        self.expire()
        self.reap()
        self.claim(batch)

    @rule(data=st.data())
    def redrive(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.rows) or [0]), max_size=3))
        with self.engine.begin() as conn:
            result = store.redrive(conn, ids)
        stamp = next(self.clock)
        expected = set()
        for i in set(ids):
            r = self.rows.get(i)
            if r is not None and r.status in ("dead", "failed"):
                r.status, r.attempts_at_redrive, r.due_stamp = "pending", r.attempts, stamp
                expected.add(i)
        assert result == expected

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.rows) or [0]), max_size=3))
        with self.engine.begin() as conn:
            result = store.cancel(conn, ids, "model cancel")
        expected = set()
        for i in set(ids):
            r = self.rows.get(i)
            if r is not None and r.status == "pending":
                r.status = "cancelled"
                expected.add(i)
        assert result == expected

    @rule()
    def prune(self) -> None:
        with self.engine.begin() as conn:
            pruned = store.prune(conn, 0, 1000)
        doomed = [i for i, r in self.rows.items() if r.status in TERMINAL]
        assert pruned == len(doomed)
        for i in doomed:
            del self.rows[i]

    # --- the check after every step -------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT m.id, m.status, m.attempts, m.claim_token, m.settled_at IS NOT NULL "
                    "AS settled, (SELECT count(*) FROM outbox_attempt a WHERE a.message_id = m.id) "
                    "AS attempt_rows FROM outbox_message m ORDER BY m.id"
                )
            ).all()
            orphans = conn.execute(
                sa.text(
                    "SELECT count(*) FROM outbox_attempt a WHERE NOT EXISTS "
                    "(SELECT 1 FROM outbox_message m WHERE m.id = a.message_id)"
                )
            ).scalar_one()
        assert orphans == 0
        actual = {
            r.id: (r.status, r.attempts, r.claim_token, r.settled, r.attempt_rows) for r in rows
        }
        model = {
            r.id: (r.status, r.attempts, r.token, r.status in TERMINAL, r.attempt_rows)
            for r in self.rows.values()
        }
        assert actual == model


def test_state_machine_matches_the_model(engine: sa.Engine) -> None:
    channels.register("model", ModelChannel)
    OutboxModel.engine = engine
    run_state_machine_as_test(
        OutboxModel,
        settings=settings(
            max_examples=50,
            stateful_step_count=40,
            deadline=None,
            # No shrinking: a failing sequence is printed as found. Shrinking
            # replays against a database whose tokens differ every time.
            phases=(Phase.explicit, Phase.reuse, Phase.generate),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
