"""The state machine of docs/design.md as a Python model, checked step by step
against the real database while Hypothesis drives claim, hand-off (the
sender's receipt: each claim taken once), settle (every outcome, with current
and stale tokens; deferrals counted and capped), lease expiry, reap (an
attempt counted only after a receipt), deliver-by expiry, the ordering-key
hold and cancel policy, redrive, cancel and prune in random interleavings, with
dedupe keys (replays, conflicts, the window's end) among them.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import outbox
from outbox import channels, states, store
from outbox.channels import SchemaChannel
from support import expire_leases

DEFAULT_MAX = 3
MAX_DEFERRALS = 2
# Backoff and deferral floor of zero: a retried or deferred row is due at
# once, so the model need not know the clock.
BACKOFF = store.Backoff(
    0.0, 0.0, DEFAULT_MAX, max_deferrals=MAX_DEFERRALS, min_deferral_seconds=0.0
)
TERMINAL = {"delivered", "failed", "dead", "suppressed", "cancelled", "expired"}
HOLDING = {"failed", "dead", "expired"}
LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)  # a deliver-by time that has passed


class ModelChannel(SchemaChannel):
    name = "model"
    schema = {"type": "object"}


@dataclass
class Row:
    id: int
    priority: int
    ordering_key: str | None
    max_attempts: int | None
    policy: str = "hold"  # on_predecessor_failure
    overdue: bool = False  # its deliver-by time has passed
    status: str = "pending"
    attempts: int = 0
    attempts_at_redrive: int = 0  # the numbering goes on; the budget starts again
    deferrals: int = 0
    token: uuid.UUID | None = None
    received: bool = False  # a sender took this claim's receipt
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
            conn.execute(
                sa.text("TRUNCATE outbox_attempt, outbox_message, outbox_dedupe RESTART IDENTITY")
            )
        self.rows: dict[int, Row] = {}
        self.tokens: list[tuple[int, uuid.UUID]] = []  # every claim ever issued
        self.clock = itertools.count(1)
        # attempt rows of pruned messages: the send log outlives its messages
        self.pruned_attempt_rows = 0
        # dedupe key -> (payload variant, message id); the model channel has no
        # recipient of its own, so its scope is (channel, key). Keys outlive
        # pruned messages until the window ends (release_keys).
        self.keys: dict[str, tuple[int, int]] = {}

    # --- helpers ---------------------------------------------------------

    def _heads(self) -> list[Row]:
        def blocked(r: Row) -> bool:
            return r.ordering_key is not None and any(
                p.ordering_key == r.ordering_key
                and p.id != r.id
                and (p.status == "claimed" or (p.id < r.id and p.status in ("pending", *HOLDING)))
                for p in self.rows.values()
            )

        due = [
            r
            for r in self.rows.values()
            if r.status == "pending" and not r.overdue and not blocked(r)
        ]
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
        policy=st.sampled_from(["hold", "hold", "cancel"]),
        overdue=st.sampled_from([False, False, False, True]),
    )
    def enqueue(
        self,
        n: int,
        priority: int,
        key: str | None,
        max_attempts: int | None,
        policy: str,
        overdue: bool,
    ) -> None:
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
                        "on_predecessor_failure": policy,
                        "expires_at": LONG_AGO if overdue else None,
                    }
                    for i in range(n)
                ],
            )
        stamp = next(self.clock)
        for message_id in ids:
            self.rows[message_id] = Row(
                message_id, priority, key, max_attempts, policy, overdue, due_stamp=stamp
            )

    @rule(key=st.sampled_from(["x", "y"]), variant=st.sampled_from([0, 0, 1]))
    def enqueue_keyed(self, key: str, variant: int) -> None:
        """A replay returns the existing id and writes nothing; another payload
        under a held key is refused and writes nothing; a free key is a new row."""
        held = self.keys.get(key)
        with self.engine.begin() as conn:
            try:
                result = outbox.enqueue(
                    conn, "model", {"v": variant}, dedupe_key=key, return_created=True
                )
            except outbox.DedupeConflict as exc:
                assert held is not None and held[0] != variant and exc.existing_id == held[1]
                return
        if held is not None:
            assert held[0] == variant and result == (held[1], False)
            return
        assert result.created and result.id not in self.rows
        self.keys[key] = (variant, result.id)
        self.rows[result.id] = Row(result.id, 0, None, None, due_stamp=next(self.clock))

    @rule()
    def release_keys(self) -> None:
        """The dedupe window ends (the reaper's prune_dedupe_keys)."""
        with self.engine.begin() as conn:
            released = store.prune_dedupe_keys(conn, 0, 1000)
        assert released == len(self.keys)
        self.keys.clear()

    @rule(batch=st.integers(1, 4))
    def claim(self, batch: int) -> None:
        expected = [r.id for r in self._heads()[:batch]]
        with self.engine.begin() as conn:
            claims = store.claim(conn, batch, 60)
        assert sorted(c.id for c in claims) == sorted(expected)
        for c in claims:
            r = self.rows[c.id]
            assert c.attempt == r.attempts + 1
            r.status, r.token, r.expired, r.received = "claimed", c.claim_token, False, False
            self.tokens.append((c.id, c.claim_token))

    @rule(data=st.data(), twice=st.booleans())
    def hand_off(self, data: st.DataObject, twice: bool) -> None:
        """The sender's receipt: only claims still held, not expired and not
        yet taken come back, once (a pair listed twice, or a duplicated event)."""
        pairs = self._pick_tokens(data)
        if twice:
            pairs = pairs + pairs
        with self.engine.begin() as conn:
            loaded = store.receive_claimed(
                conn, "model", [store.Claim(i, "model", t, 1) for i, t in pairs], DEFAULT_MAX
            )
        first_listed = list(dict.fromkeys(i for i, _ in pairs))
        owned = {
            i
            for i, t in set(pairs)
            if (r := self._owned(i, t)) is not None and not r.expired and not r.received
        }
        # in the order the event lists them (the claim's order, which the
        # sender's waves keep)
        expected = [i for i in first_listed if i in owned]
        assert [m.id for m in loaded] == expected
        for m in loaded:
            r = self.rows[m.id]
            # The claim and the receipt return the token as text (it only goes
            # into the event and back into fences).
            assert (m.attempt, m.max_attempts, m.claim_token) == (
                r.attempts + 1,
                r.limit,
                r.token,
            )
            r.received = True

    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        pairs = self._pick_tokens(data)
        # One settlement per row: a batch never settles a row twice.
        seen: set[int] = set()
        pairs = [(i, t) for i, t in pairs if not (i in seen or seen.add(i))]
        outcomes = [data.draw(st.sampled_from(states.SEND_OUTCOMES)) for _ in pairs]
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
            if outcome == "deferred" and r.deferrals < MAX_DEFERRALS:
                r.status = "pending"
                r.deferrals += 1
            elif outcome == "deferred":  # past the cap: counts an attempt, like a retry
                r.deferrals += 1
                r.attempts += 1
                r.status = "dead" if r.exhausted else "pending"
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
                if r.received:  # a sender started it: the attempt counts
                    r.attempts += 1
                    r.status = "dead" if r.exhausted else "pending"
                else:  # never started: no attempt
                    r.status = "pending"
                r.token, r.due_stamp = None, stamp
                r.attempt_rows += 1
                expected[r.id] = store.Reaped(r.status, r.received)
        assert result == expected

    @rule()
    def expire_overdue(self) -> None:
        """The reaper's sweep of pending rows past their deliver-by time."""
        with self.engine.begin() as conn:
            result = store.expire_overdue(conn, 100, BACKOFF)
        expected = set()
        for r in self.rows.values():
            if r.status == "pending" and r.overdue:
                r.status = "expired"
                r.attempt_rows += 1
                expected.add(r.id)
        assert result == expected

    @rule()
    def cancel_held(self) -> None:
        """The reaper cancels held rows whose producer asked for that."""
        with self.engine.begin() as conn:
            result = store.cancel_held(conn, 100)
        expected = set()
        for r in self.rows.values():
            if (
                r.status == "pending"
                and r.policy == "cancel"
                and any(
                    p.ordering_key == r.ordering_key and p.id < r.id and p.status in HOLDING
                    for p in self.rows.values()
                    if r.ordering_key is not None
                )
            ):
                expected.add(r.id)
        for i in expected:
            self.rows[i].status = "cancelled"
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
            if r is not None and r.status in HOLDING:
                r.status, r.attempts_at_redrive, r.deferrals, r.due_stamp = (
                    "pending",
                    r.attempts,
                    0,
                    stamp,
                )
                r.overdue = False  # a deliver-by time that has passed is lifted
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
            if r is not None and r.status in ("pending", *HOLDING):
                r.status = "cancelled"
                expected.add(i)
        assert result == expected

    @rule()
    def prune(self) -> None:
        # an operator's exact cutoff (``outbox prune --older-than 0s``): the
        # reaper's own retention goes by whole days (tests/integration/test_history.py)
        with self.engine.begin() as conn:
            cutoff = store.prune_cutoff(conn, 0)
            pruned = store.prune_settled_before(conn, cutoff, 1000, states.TERMINAL_STATUSES)
        doomed = [i for i, r in self.rows.items() if r.status in TERMINAL]
        assert pruned == len(doomed)
        for i in doomed:
            self.pruned_attempt_rows += self.rows.pop(i).attempt_rows

    # --- the check after every step -------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT m.id, m.status, m.attempts, m.deferrals, "
                    "CAST(m.claim_token AS text) AS claim_token, "
                    "m.status = 'claimed' AND m.received_at IS NOT NULL AS received, "
                    "m.settled_at IS NOT NULL AS settled, "
                    "(SELECT count(*) FROM outbox_attempt a WHERE a.message_id = m.id) "
                    "AS attempt_rows FROM outbox_message m ORDER BY m.id"
                )
            ).all()
            orphans = conn.execute(
                sa.text(
                    "SELECT count(*) FROM outbox_attempt a WHERE NOT EXISTS "
                    "(SELECT 1 FROM outbox_message m WHERE m.id = a.message_id)"
                )
            ).scalar_one()
        assert orphans == self.pruned_attempt_rows
        actual = {
            r.id: (
                r.status,
                r.attempts,
                r.deferrals,
                r.claim_token,
                r.received,
                r.settled,
                r.attempt_rows,
            )
            for r in rows
        }
        model = {
            r.id: (
                r.status,
                r.attempts,
                r.deferrals,
                r.token,
                r.status == "claimed" and r.received,
                r.status in TERMINAL,
                r.attempt_rows,
            )
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
