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
  or in parentheses after one (``ada@example.net (Ada Lovelace)``)
  -> ``<address>``. The domain goes with its address: a personal or small
  company's domain names a person as well as the local part does (a host
  name on its own, such as the refusing server's, is kept);
* a local part without its domain, as servers echo it: angle-bracketed
  (``<ada.lovelace>``, any word between ``<`` and ``>`` but the scrubber's own
  placeholders) or sendmail's ``ada.lovelace... User unknown`` after the SMTP
  codes -> ``<address>``;
* with ``about`` (the addresses the text is about: a bounce's recipient), that
  local part anywhere (``user ada.lovelace does not exist``) -> ``<address>``,
  and each word of it (``Ada``, ``Lovelace``: the name it usually spells,
  as a display name) -> ``<name>``;
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
from collections.abc import Iterable

ERROR_MAX_CHARS = 200

_AT = r"\s*(?:@|\uff20|%40|&\#0*64;|&\#x0*40;|[\(\[\{]\s*at\s*[\)\]\}])\s*"
_DOT = r"(?:\.|\s*[\(\[\{]\s*dot\s*[\)\]\}]\s*)"
# (an unquoted local part does not start with an apostrophe: 'ada@x' is quoted)
_LOCAL = (
    r"(?:\"[^\"\r\n]{0,128}\"|[A-Za-z0-9!#$&*+/=?^_`{|}~.%-][A-Za-z0-9!#$&'*+/=?^_`{|}~.%-]{0,127})"
)
_DOMAIN = rf"(?:\[[0-9A-Fa-f:.]{{1,64}}\]|[A-Za-z0-9-]{{1,63}}(?:{_DOT}[A-Za-z0-9-]{{1,63}})*)"
_ADDRESS = rf"{_LOCAL}{_AT}{_DOMAIN}"
_KEY_CHAR = r"[A-Za-z0-9_+/=-]"  # of a key or a signed link: letters, digits, base64
# A display name (quoted, or up to four capitalised words) and its
# angle-bracketed address; then any address on its own.
_DISPLAY_NAME = r"(?:\"[^\"\r\n]{0,128}\"\s*|(?:[A-Z][\w'.-]*\s+){1,4})"
_NAMED_ADDRESS = re.compile(rf"{_DISPLAY_NAME}?<\s*(?:mailto:)?{_ADDRESS}\s*>")
_BARE_ADDRESS = re.compile(rf"(?:mailto:)?{_ADDRESS}", re.IGNORECASE)
_PLACEHOLDERS = ("address", "name", "number", "url", "token")
# A local part alone between angle brackets (RCPT TO:<ada.lovelace>), with
# its display name; the scrubber's own placeholders are left as they are.
_NAMED_LOCAL = re.compile(
    rf"{_DISPLAY_NAME}?<\s*(?:mailto:)?(?!(?:{'|'.join(_PLACEHOLDERS)})>){_LOCAL}\s*>"
)
# Sendmail's "ada.lovelace... User unknown": the word before the ellipsis,
# where an address stands, right after the SMTP codes (or a "smtp;"; not
# after any colon: "error: timed out... retrying" is no address).
_SENDMAIL_LOCAL = re.compile(
    rf"(?P<lead>(?:;|\b[245]\d\d(?:[ -][245]\.\d{{1,3}}\.\d{{1,3}})?)\s*){_LOCAL}(?=\.\.\.)"
)
# A name in parentheses after an address: "ada@example.net (Ada Lovelace)".
_COMMENT_NAME = re.compile(
    r"(?P<lead><address>)\s*\((?:\"[^\"\r\n]{0,128}\"|[A-Z][\w'.-]*(?:,?\s+[A-Z][\w'.-]*){0,3})\)"
)
_ADDRESS_HINT = re.compile(_AT)  # no at sign in any spelling: no address to look for
_STEPS: tuple[tuple[re.Pattern[str], str], ...] = (
    # invisible and control characters first: nothing below may be split or
    # hidden by them (zero-width and direction marks go, the others are spaces)
    (re.compile(r"[\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]"), ""),
    (re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]"), " "),
    (re.compile(r"\b[a-z][a-z0-9+.-]{1,15}://\S+", re.IGNORECASE), "<url>"),
    (_NAMED_ADDRESS, "<address>"),
    (_BARE_ADDRESS, "<address>"),
    (_COMMENT_NAME, r"\g<lead>"),
    (_NAMED_LOCAL, "<address>"),
    (_SENDMAIL_LOCAL, r"\g<lead><address>"),
)
_TOKEN_STEPS: tuple[tuple[re.Pattern[str], str], ...] = (
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


def scrub(text: str, limit: int = ERROR_MAX_CHARS, about: Iterable[str] = ()) -> str:
    """``text`` without addresses, numbers, URLs or tokens, on one line, at
    most ``limit`` characters (an ellipsis says it was cut). ``about``: the
    addresses the text is about, whose local part and its words go wherever
    they are written."""
    text = text[: limit * 2]
    for pattern, replacement in _STEPS:
        if pattern in (_NAMED_ADDRESS, _BARE_ADDRESS) and not _ADDRESS_HINT.search(text):
            continue
        text = pattern.sub(replacement, text)
    for address in about:  # after the addresses: a whole address went as one
        text = _without_recipient(text, address)
    for pattern, replacement in _TOKEN_STEPS:
        text = pattern.sub(replacement, text)
    text = " ".join(_NUMBER.sub(_number, text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _without_recipient(text: str, address: str) -> str:
    """``text`` without ``address``'s local part (-> ``<address>``) or any word
    of it (-> ``<name>``), in any case. A word of two letters or more counts,
    digits alone do not (numbers have their own rule), nor does one of the
    words servers answer with (``recipient@``, ``user@``: a role, not a
    person, and the diagnostic needs the word)."""
    local, at, _domain = address.strip().rpartition("@")
    local = local.strip('"')
    if not at or not local or local.lower() in _SERVER_WORDS:
        return text
    edge = r"(?<![^\W_])(?<![<.+-])", r"(?![^\W_])(?![>+-])"
    text = re.sub(rf"{edge[0]}{re.escape(local)}{edge[1]}", "<address>", text, flags=re.I)
    words = {w for w in re.findall(r"[^\W_]{2,}", local) if not w.isdigit()}
    for word in sorted(words, key=len, reverse=True):
        if word.lower() not in _SERVER_WORDS:
            text = re.sub(
                rf"{edge[0]}(?<!<){re.escape(word)}(?!>){edge[1]}", "<name>", text, flags=re.I
            )
    return _NAME_RUN.sub("<name>", text)


# The words of SMTP replies and of the scrubber's placeholders, and the short
# words of English: never taken for a recipient's name.
_SERVER_WORDS = frozenset(
    [
        *_PLACEHOLDERS,
        "account", "accepted", "access", "action", "address", "administrator", "admin", "alias",
        "all", "an", "and", "are", "as", "at", "available", "bad", "be", "blocked", "by", "can",
        "delivery", "denied", "disabled", "do", "does", "domain", "email", "exist", "exceeded",
        "for", "from", "full", "host", "id", "if", "in", "inactive", "info", "invalid", "is", "it",
        "local", "mail", "mailbox", "message", "my", "no", "not", "of", "ok", "on", "or", "over",
        "policy", "postmaster", "quota", "received", "recipient", "refused", "rejected", "relay",
        "reply", "requested", "sender", "service", "smtp", "spam", "storage", "such", "support",
        "system", "table", "the", "this", "to", "too", "try", "unavailable", "unknown",
        "unrouteable", "user", "virtual", "was", "we",
    ]
)  # fmt: skip
_NAME_RUN = re.compile(r"<name>(?:[\s,]+<name>)+")  # "Lovelace, Ada": one name


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
