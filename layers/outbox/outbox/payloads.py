"""The bounded shape of a payload, checked at enqueue and again when a sender
decodes a row.

JSON parsers and encoders recurse: a payload nested a few thousand levels
deep is accepted by one Python and crashes another (and, read by the
database driver, it once left a connection half-read). So a payload's shape
is bounded, the same on every Python: nesting depth, keys per object,
elements per array and values in all. The walk is iterative: checking a
hostile payload cannot itself hit the recursion limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from .errors import ValidationError

# The byte length of the jsonb's text (what Postgres stores and gives back,
# what the enqueue functions measure, and what ``stored_size`` computes).
MAX_PAYLOAD_BYTES = 256 * 1024
# The stored text a sender reads is the database's rendering of the jsonb,
# which adds a space after every ":" and ",": at most twice the canonical
# text, since each value takes at least one byte and one separator.
MAX_STORED_BYTES = 2 * MAX_PAYLOAD_BYTES
MAX_DEPTH = 32
MAX_OBJECT_KEYS = 1_000
MAX_ARRAY_LENGTH = 10_000
# Any JSON document of MAX_PAYLOAD_BYTES holds fewer values than this; the
# cap stops the walk over a huge in-memory structure early.
MAX_VALUES = 100_000

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,39}$")


def _child(path: str, key: Any) -> str:
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{path}[{key}]"
    if isinstance(key, str) and _IDENTIFIER.match(key):
        return f"{path}.{key}"
    return f"{path}[…]"  # a key that is long or odd stays out of the message


# A container's place in the document: (parent's trail, key), None at the top.
# Kept as links and spelt out only for an error: naming every node on the
# way was most of the walk's cost.
_Trail = tuple[Any, Any] | None
# What json.loads makes, tested by type first: the ABC's isinstance is slow.
_SCALARS = frozenset({str, int, float, bool, type(None)})
_CONTAINERS = (Mapping, list, tuple)


def _path(field: str, trail: _Trail) -> str:
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    path = field
    for key in reversed(keys):
        path = _child(path, key)
    return path


def check_shape(value: Any, field: str = "payload") -> None:
    """Raise ValidationError naming the first container that breaks a limit."""
    stack: list[tuple[Any, int, _Trail]] = [(value, 1, None)]
    seen = 1
    while stack:
        node, depth, trail = stack.pop()
        if isinstance(node, dict | Mapping):  # dict first: cheaper than the ABC
            items: Any = node.items()
            size, limit, what = len(node), MAX_OBJECT_KEYS, "keys"
        elif isinstance(node, list | tuple):
            items = enumerate(node)
            size, limit, what = len(node), MAX_ARRAY_LENGTH, "elements"
        else:
            continue  # a scalar at the top
        if depth > MAX_DEPTH:
            raise ValidationError(_path(field, trail), f"is nested deeper than {MAX_DEPTH} levels")
        if size > limit:
            raise ValidationError(_path(field, trail), f"has {size} {what}; the limit is {limit}")
        seen += size
        if seen > MAX_VALUES:
            raise ValidationError(field, f"holds more than {MAX_VALUES} values")
        # Only containers go on the stack; a scalar child has nothing to check.
        stack.extend(
            (child, depth + 1, (trail, key))
            for key, child in items
            if type(child) not in _SCALARS and isinstance(child, _CONTAINERS)
        )


# A text this short cannot break a count limit: an object member takes at
# least four characters and a separator (`"":0,`), an array element at least
# two, any value one. MAX_OBJECT_KEYS is the tightest of the three.
_SHORT_TEXT = 5 * MAX_OBJECT_KEYS


# A float that Python writes in exponent notation, or a negative zero: the
# only values whose jsonb text differs from Python's (it may also match
# inside a string, which only costs the walk below).
_FLOAT_HINT = re.compile(r"[0-9][eE][-+]?[0-9]|-0\.0")


def stored_size(value: Any, text: str | None = None) -> int:
    """The byte length of ``value``'s text as Postgres's jsonb writes it, the
    one measure of the size limit: ``", "`` and ``": "`` between items,
    strings escaped as Python escapes them, and numbers in positional
    notation (``1e-07`` is stored as ``0.0000001``, ``1e+16`` as
    ``10000000000000000``, ``-0.0`` as ``0.0``). ``text``: ``value`` already
    dumped with those separators (``outbox.store.payload_json``)."""
    if text is None:
        text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)
    size = len(text.encode("utf-8"))
    if _FLOAT_HINT.search(text):
        size += _float_difference(value)
    return size


def _float_difference(value: Any) -> int:
    """Bytes jsonb's numbers take beyond Python's ``repr`` of the floats in ``value``."""
    difference = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, float):
            written = repr(node)
            stored = "0.0" if node == 0 else format(Decimal(written), "f")
            difference += len(stored) - len(written)
        elif isinstance(node, dict | Mapping):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return difference


def _within_limits_by_its_text(text: str | bytes) -> bool:
    """True when the text alone proves the decoded value keeps every limit, so
    the walk can be skipped (most payloads: the walk costs as much as decoding
    them). Every container opens with a bracket, so its nesting is at most the
    brackets the text holds, counting those inside strings too."""
    if len(text) > _SHORT_TEXT:
        return False
    if isinstance(text, str):
        return text.count("{") + text.count("[") <= MAX_DEPTH
    return text.count(b"{") + text.count(b"[") <= MAX_DEPTH


def decode(text: str | bytes | None) -> Any:
    """A stored payload, read as text, decoded and checked; a row that cannot
    be decoded, or is far past the size limit (written past the producer),
    raises ValidationError for that row alone. None: a text the receipt left
    in the database, far past the limit."""
    if text is None:
        raise ValidationError("payload", f"is over the {MAX_PAYLOAD_BYTES // 1024} KiB limit")
    size = len(text)
    if size > MAX_STORED_BYTES // 4 and isinstance(text, str):
        size = len(text.encode())  # only a long text can have too many bytes
    if size > MAX_STORED_BYTES:
        raise ValidationError("payload", f"is over the {MAX_PAYLOAD_BYTES // 1024} KiB limit")
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValidationError("payload", f"is nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, TypeError) as exc:
        raise ValidationError("payload", f"is not valid JSON ({type(exc).__name__})") from None
    if not _within_limits_by_its_text(text):
        check_shape(value)
    return value
