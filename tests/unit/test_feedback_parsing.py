"""The feedback parser within bounds: whatever a record holds, it yields
notices or refuses the record with one of the errors the function counts;
nothing else escapes (no RecursionError, no crash on a wrong type)."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from outbox import feedback

EVENTS = Path(__file__).resolve().parents[2] / "events"
SAMPLES = [
    json.loads(
        json.loads((EVENTS / f"feedback-{kind}.json").read_text())["Records"][0]["Sns"]["Message"]
    )
    for kind in ("bounce", "complaint", "delivery")
]
COUNTED = (KeyError, TypeError, ValueError, AttributeError, RecursionError)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=30,
)
PATHS = st.lists(
    st.sampled_from(
        ["mail", "messageId", "bounce", "complaint", "delivery", "bouncedRecipients",
         "complainedRecipients", "recipients", "emailAddress", "eventType", "bounceType", 0]
    ),
    min_size=1,
    max_size=4,
)  # fmt: skip


def parse(notification: Any) -> list[Any] | None:
    try:
        return feedback.from_notification(notification)
    except COUNTED:
        return None


def replace(document: Any, path: list[Any], value: Any) -> Any:
    """``document`` with the value at ``path`` (as far as it exists) replaced."""
    document = copy.deepcopy(document)
    node = document
    for step in path[:-1]:
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            return document
    with contextlib.suppress(IndexError, TypeError):
        node[path[-1]] = value
    return document


@given(sample=st.sampled_from(SAMPLES), path=PATHS, value=JSON)
def test_a_sample_with_any_field_replaced_parses_or_is_refused(
    sample: dict[str, Any], path: list[Any], value: Any
) -> None:
    notices = parse(replace(sample, path, value))
    for notice in notices or []:
        assert notice.recipient and len(notice.recipient) <= 320
        assert notice.reason is None or len(notice.reason) <= 200


@given(message=JSON)
def test_any_json_message_is_parsed_or_refused(message: Any) -> None:
    event = {"Records": [{"Sns": {"Message": json.dumps(message)}}]}
    for notification in feedback.notifications(event):
        parse(notification)


def test_nesting_past_the_bound_is_refused_without_recursion() -> None:
    deep: Any = SAMPLES[0]
    for _ in range(50_000):
        deep = {"mail": deep}
    assert parse(deep) is None
    # json's own depth guard: the unreadable Message comes back as it was
    event = {"Records": [{"Sns": {"Message": "[" * 100_000 + "]" * 100_000}}]}
    (notification,) = feedback.notifications(event)
    assert isinstance(notification, str) and parse(notification) is None
