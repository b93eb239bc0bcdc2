"""A stored payload is held to the same shape limits whether the sender walks
the decoded value or its text alone shows the value keeps them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import payloads
from outbox.errors import ValidationError


def nested(depth: int, leaf: Any = 0) -> Any:
    value = leaf
    for n in range(depth):
        value = [value] if n % 2 else {"k": value}
    return value


def verdict(check: Any, value: Any) -> str | None:
    try:
        check(value)
    except ValidationError as exc:
        return exc.problem
    return None


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_a_short_payload_one_level_too_deep_is_refused(separators: tuple[str, str]) -> None:
    text = json.dumps(nested(payloads.MAX_DEPTH + 1), separators=separators)
    assert len(text) < 200
    with pytest.raises(ValidationError, match=f"nested deeper than {payloads.MAX_DEPTH}"):
        payloads.decode(text)
    with pytest.raises(ValidationError, match=f"nested deeper than {payloads.MAX_DEPTH}"):
        payloads.decode(text.encode())


def test_a_short_payload_at_the_depth_limit_is_accepted() -> None:
    value = nested(payloads.MAX_DEPTH)
    assert payloads.decode(json.dumps(value)) == value


def test_brackets_inside_strings_do_not_refuse_a_shallow_payload() -> None:
    value = {"subject": "[" * 100 + "{" * 100, "to": ["a@example.com"]}
    assert payloads.decode(json.dumps(value)) == value


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({f"k{i}": 0 for i in range(payloads.MAX_OBJECT_KEYS + 1)}, "keys"),
        ({"": 0, **{str(i): 0 for i in range(payloads.MAX_OBJECT_KEYS)}}, "keys"),
        ([0] * (payloads.MAX_ARRAY_LENGTH + 1), "elements"),
    ],
)
def test_the_shortest_text_past_a_count_limit_is_walked_and_refused(
    value: Any, problem: str
) -> None:
    text = json.dumps(value, separators=(",", ":"))
    assert len(text) > payloads._SHORT_TEXT
    with pytest.raises(ValidationError, match=problem):
        payloads.decode(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[{}]"', max_size=5),
    lambda children: (
        st.lists(children, max_size=40)
        | st.dictionaries(st.text(max_size=3), children, max_size=40)
    ),
    max_leaves=2_000,
)


# Around the depth limit too: a generated value wrapped 0 to 40 levels deep.
payloads_near_the_limits = st.builds(nested, st.integers(0, payloads.MAX_DEPTH + 8), json_values)


@settings(max_examples=400, deadline=None)
@given(payloads_near_the_limits, st.sampled_from([(",", ":"), (", ", ": ")]))
def test_decode_refuses_exactly_what_the_walk_refuses(
    value: Any, separators: tuple[str, str]
) -> None:
    text = json.dumps(value, separators=separators)
    assert verdict(payloads.decode, text) == verdict(payloads.check_shape, json.loads(text))
