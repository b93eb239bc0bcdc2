"""The enums of ``outbox.states`` are the database's own names: the CHECK
constraints of the migrated schema allow exactly their members, and every
status or outcome the store's statements write or test is one of them."""

from __future__ import annotations

import re

import sqlalchemy as sa

from outbox import states, store
from outbox.states import AttemptOutcome, Status

# 'word' literals inside status = / status IN (...) / outcome = ... comparisons
# and THEN/ELSE branches that produce a status or an outcome.
_COMPARED = re.compile(r"\b(?:status|outcome)\s*(?:=|<>|IN\s*\()\s*((?:'[a-z_]+'\s*,?\s*)+)")
_WRITTEN = re.compile(
    r"\b(?:status|outcome)\s*=\s*'([a-z_]+)'|THEN\s+'([a-z_]+)'|ELSE\s+'([a-z_]+)'"
)


def _check_values(conn: sa.Connection, constraint: str) -> set[str]:
    definition = conn.execute(
        # (a partitioned table's constraint is each partition's too: read the parent's)
        sa.text(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conname = :name AND conislocal"
        ),
        {"name": constraint},
    ).scalar_one()
    return set(re.findall(r"'([a-z_]+)'::text", definition))


def test_the_schema_allows_exactly_the_enum_members(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        assert _check_values(conn, "outbox_message_status_check") == set(Status)
        assert _check_values(conn, "outbox_attempt_outcome_check") == set(AttemptOutcome)


def _statement_texts() -> list[str]:
    texts = []
    for module in (
        store.delivery,
        store.upkeep,
        store.enqueue,
        store.operator,
        store.feedback,
        store.outcome_events,
    ):
        texts += [v.text for v in vars(module).values() if isinstance(v, sa.TextClause)]
    return texts


def test_every_status_and_outcome_in_the_stores_sql_is_an_enum_member() -> None:
    texts = _statement_texts()
    assert len(texts) > 30  # the scan sees the statements
    known = set(Status) | set(AttemptOutcome)
    found: set[str] = set()
    for text in texts:
        for group in _COMPARED.findall(text):
            found |= set(re.findall(r"'([a-z_]+)'", group))
        for match in _WRITTEN.findall(text):
            found |= {m for m in match if m}
    assert found, "no literal found: the patterns no longer match the statements"
    assert found <= known, f"not a status or an outcome: {sorted(found - known)}"


def test_the_groups_are_made_of_members_and_parse_names_the_choices() -> None:
    assert set(states.TERMINAL_STATUSES) == set(Status) - {Status.PENDING, Status.CLAIMED}
    assert set(states.SEND_OUTCOMES) <= set(AttemptOutcome)
    assert Status.parse("dead", states.REDRIVABLE_STATUSES, "redrive") is Status.DEAD
    for bad, allowed, message in (
        ("lost", None, "unknown status 'lost'; choose from pending, claimed, delivered"),
        ("pending", states.REDRIVABLE_STATUSES, "cannot redrive status 'pending'; choose from"),
    ):
        try:
            Status.parse(bad, allowed, "redrive")
        except ValueError as exc:
            assert str(exc).startswith(message), exc
        else:
            raise AssertionError(f"{bad!r} was accepted")
