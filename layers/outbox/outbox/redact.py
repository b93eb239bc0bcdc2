"""The one scrubber for text the relay did not write: a provider's diagnostic
code, a custom channel's error, a remote server's answer.

Such text is stored (``last_error``, attempt errors), logged and published on
the event bus, so it must name nobody. ``scrub`` keeps what helps an operator
(SMTP status codes such as ``550`` and ``5.1.1``, the provider's fixed words)
and replaces what may name a person:

* e-mail addresses in every spelling seen in diagnostic codes: plain,
  quoted local parts (``"ada.lovelace"@example.net``), ``(at)``/``[at]``,
  ``%40``, ``&#64;``, a full-width at sign, ``(dot)`` for the dot, and the
  display name in front of an angle-bracketed address (``Ada Lovelace <...>``)
  -> ``<address>``;
* phone numbers (E.164 and national formats with spaces, dots, dashes or
  parentheses: seven digits or more) and runs of five digits or more
  (one-time codes, account numbers) -> ``<number>``;
* URLs (their paths and queries carry tokens and names) -> ``<url>``;
* long tokens of letters and digits (keys, signed links) -> ``<token>``;
* control characters -> a space, so the text stays one line; zero-width and
  text-direction characters are dropped.

The result is bounded (``limit`` characters) and so is the work: only the
first ``2 * limit`` characters are read.
"""

from __future__ import annotations

import re

ERROR_MAX_CHARS = 200

_AT = r"\s*(?:@|\uff20|%40|&\#0*64;|&\#x0*40;|[\(\[\{]\s*at\s*[\)\]\}])\s*"
_DOT = r"(?:\.|\s*[\(\[\{]\s*dot\s*[\)\]\}]\s*)"
_LOCAL = r"(?:\"[^\"\r\n]{0,128}\"|[A-Za-z0-9!#$&'*+/=?^_`{|}~.%-]{1,128})"
_DOMAIN = rf"(?:\[[0-9A-Fa-f:.]{{1,64}}\]|[A-Za-z0-9-]{{1,63}}(?:{_DOT}[A-Za-z0-9-]{{1,63}})*)"
_ADDRESS = rf"{_LOCAL}{_AT}{_DOMAIN}"
_KEY_CHAR = r"[A-Za-z0-9_+/=-]"  # of a key or a signed link: letters, digits, base64
# A display name (quoted, or up to four capitalised words) and its
# angle-bracketed address; then any address on its own.
_NAMED_ADDRESS = re.compile(
    rf"(?:\"[^\"\r\n]{{0,128}}\"\s*|(?:[A-Z][\w'.-]*\s+){{1,4}})?<\s*(?:mailto:)?{_ADDRESS}\s*>"
)
_BARE_ADDRESS = re.compile(rf"(?:mailto:)?{_ADDRESS}", re.IGNORECASE)
_ADDRESS_HINT = re.compile(_AT)  # no at sign in any spelling: no address to look for
_STEPS: tuple[tuple[re.Pattern[str], str], ...] = (
    # invisible and control characters first: nothing below may be split or
    # hidden by them (zero-width and direction marks go, the others are spaces)
    (re.compile(r"[\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]"), ""),
    (re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]"), " "),
    (re.compile(r"\b[a-z][a-z0-9+.-]{1,15}://\S+", re.IGNORECASE), "<url>"),
    (_NAMED_ADDRESS, "<address>"),
    (_BARE_ADDRESS, "<address>"),
    (
        re.compile(rf"(?<![\w<])(?={_KEY_CHAR}*\d)(?={_KEY_CHAR}*[A-Za-z]){_KEY_CHAR}{{24,}}"),
        "<token>",
    ),
)

# A number: groups of digits joined by one separator each (a space, a dot, a
# dash, a slash, parentheses), as phone numbers are written. SMTP codes at its
# head (a reply code such as 550, an enhanced status code such as 5.1.1) are
# kept; the rest is judged by its digits.
_NUMBER = re.compile(r"\+?\(?\d+(?:(?:[ ./-]|\) ?)\(?\d+)*\)?")
_SMTP_CODES = (re.compile(r"[245][0-5]\d"), re.compile(r"[245]\.\d{1,3}\.\d{1,3}"))
_MIN_PHONE_DIGITS = 7
_CODE_DIGITS = re.compile(r"\d{5,}")  # one-time codes, account numbers


def scrub(text: str, limit: int = ERROR_MAX_CHARS) -> str:
    """``text`` without addresses, numbers, URLs or tokens, on one line, at
    most ``limit`` characters (an ellipsis says it was cut)."""
    text = text[: limit * 2]
    for pattern, replacement in _STEPS:
        if pattern in (_NAMED_ADDRESS, _BARE_ADDRESS) and not _ADDRESS_HINT.search(text):
            continue
        text = pattern.sub(replacement, text)
    text = " ".join(_NUMBER.sub(_number, text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def scrub_optional(text: str | None, limit: int = ERROR_MAX_CHARS) -> str | None:
    return None if text is None else scrub(text, limit)


def _number(match: re.Match[str]) -> str:
    words = match.group().split()
    kept = []
    for code in _SMTP_CODES:  # at most one of each, in this order
        if words and code.fullmatch(words[0]):
            kept.append(words.pop(0))
    rest = " ".join(words)
    digits = sum(c.isdigit() for c in rest)
    if digits >= _MIN_PHONE_DIGITS or _CODE_DIGITS.search(rest):
        rest = "<number>"
    return " ".join([*kept, rest] if rest else kept)
