"""Rate limits as an operator or the configuration writes them: the checks
every limit passes before it is stored, and the ``RATE_LIMITS`` syntax
(docs/how-to/rate-limits.md).

Pure standard library: ``outbox.settings`` parses ``RATE_LIMITS`` with it,
and the producer package imports that module. The statements that store a
limit are ``store.rates``'s.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any, NamedTuple

# Limits are held to these, as the table is.
MAX_LIMIT_RATE = 100_000.0
MAX_LIMIT_BURST = 1_000_000.0

# Where a limit came from, the highest precedence first: an operator's
# ``outbox limit set`` (until ``outbox limit clear``), the ``RATE_LIMITS``
# setting (applied at cold start), the provider's own figure (SES's
# ``MaxSendRate``, for email when neither says).
OPERATOR = "operator"
CONFIG = "config"
PROVIDER = "provider"
LIMIT_SOURCES = (OPERATOR, CONFIG, PROVIDER)

CHANNEL_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


class RateLimit(NamedTuple):
    """One limit: ``channel``'s ``destination`` ('' the account) held to
    ``rate`` messages a second, ``burst`` at once."""

    channel: str
    destination: str
    rate: float
    burst: float

    def spelt(self) -> str:
        """As ``RATE_LIMITS`` writes it."""
        key = f"{self.channel}:{self.destination}" if self.destination else self.channel
        return f"{key}={self.rate:g}/{self.burst:g}"


def check_limit(rate: Any, burst: Any = None) -> tuple[float, float]:
    """(rate, burst) as numbers the table holds, or ValueError saying why: a
    rate in (0, MAX_LIMIT_RATE] messages a second; a burst in [1,
    MAX_LIMIT_BURST] (default: one second's worth, at least one)."""
    rate = _finite("rate", rate)
    if not 0 < rate <= MAX_LIMIT_RATE:
        raise ValueError(f"rate must be above 0 and at most {MAX_LIMIT_RATE:g} a second")
    if burst is None:
        burst = max(1.0, rate)
    burst = _finite("burst", burst)
    if not 1 <= burst <= MAX_LIMIT_BURST:
        raise ValueError(f"burst must be between 1 and {MAX_LIMIT_BURST:g} messages")
    return rate, burst


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number")
    return number


# A webhook destination once canonical: a host name (DNS allows "_") or a
# bracketed IPv6 address, then an optional port (what outbox_destination_of
# makes of a URL: migration 0019).
_HOST_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_WEBHOOK_DESTINATION = re.compile(
    rf"^(?:{_HOST_LABEL}(?:\.{_HOST_LABEL})*|\[[0-9a-f:.]+\])"
    r"(?::(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3}))?$"
)
_HOST_AND_PORT = re.compile(r"^(\[[^\]]*\]|[^:]*)(?::([0-9]+))?$")
# The full stops IDNA reads as dots besides "." (ideographic, full-width, halfwidth).
_IDNA_DOTS = str.maketrans("\u3002\uff0e\uff61", "...")


def webhook_destination(host_and_port: str) -> str:
    """A receiver's ``host[:port]`` as the relay keys it, the same as
    ``outbox_destination_of`` makes of a URL: lower case, no trailing dot, a
    host outside ASCII in its IDNA form (NFKC, each such label ``xn--`` and its
    Punycode), the port without leading zeros and left out when it is 443
    (webhooks are HTTPS). Spelled another way, one receiver would have several
    keys, and a limit on one would not hold the others."""
    match = _HOST_AND_PORT.match(host_and_port.strip())
    if not match:
        return host_and_port.strip().lower()
    host = match.group(1).lower().rstrip(".")
    if not host.isascii():
        host = unicodedata.normalize("NFKC", host.translate(_IDNA_DOTS)).lower()
        host = ".".join(
            label if label.isascii() else "xn--" + label.encode("punycode").decode("ascii")
            for label in host.split(".")
        ).rstrip(".")
    port = str(int(match.group(2))) if match.group(2) else ""
    return host if port in ("", "443") else f"{host}:{port}"


# Channels whose every message goes to one destination: the account ('').
ACCOUNT_CHANNELS = ("email", "sms", "push")
# The key of a limit on a whole channel, all its destinations together (no
# message's destination is ever this: not a host, a queue URL or a bus name).
CHANNEL_WIDE = "*"
# Channels whose every message names its destination, so that naming none
# in a limit means the channel as a whole.
NAMED_DESTINATION_CHANNELS = ("webhook", "sqs")
MAX_DESTINATION_CHARS = 2048


def check_destination(channel: str, destination: str) -> str:
    """``destination`` as ``channel``'s rows carry it, or ValueError saying
    what it should be: a webhook's receiver ``host[:port]`` (canonical:
    ``webhook_destination``), ''
    (the account) for email, SMS and push; for the others any key up to
    ``MAX_DESTINATION_CHARS`` without control characters ('' included).

    ``CHANNEL_WIDE`` ('*') limits a channel with many destinations as a whole;
    so does no destination for webhook and SQS, whose messages all name one
    (for EventBridge, '' is the relay's default bus)."""
    if destination.strip() == CHANNEL_WIDE and channel not in ACCOUNT_CHANNELS:
        return CHANNEL_WIDE
    if channel in NAMED_DESTINATION_CHANNELS and not destination.strip():
        return CHANNEL_WIDE
    if channel == "webhook":
        key = webhook_destination(destination)
        if not _WEBHOOK_DESTINATION.match(key):
            raise ValueError(
                "a webhook destination is the receiver's host[:port] "
                "(hooks.example.com, hooks.example.com:8443)"
            )
        return key
    if channel in ACCOUNT_CHANNELS:
        if destination:
            raise ValueError(f"{channel} has one destination, the account: give none")
        return ""
    if len(destination) > MAX_DESTINATION_CHARS or any(
        ord(c) < 32 or ord(c) == 127 for c in destination
    ):
        raise ValueError(
            f"a destination is at most {MAX_DESTINATION_CHARS} characters, "
            "with no control characters"
        )
    return destination


def parse_rate_limits(text: str) -> tuple[RateLimit, ...]:
    """``RATE_LIMITS``'s value: comma-separated ``CHANNEL[:DESTINATION]=RATE[/BURST]``
    (``email=14, sms=1/3, webhook:hooks.example.com=10/20``), RATE messages a
    second, BURST at once (default: a second's worth). ValueError naming the
    item for anything else, a channel named twice for one destination included.

    The destination is everything between the first ``:`` and the last ``=``,
    so a webhook's ``host:port``, a queue URL or a bus ARN is written as is."""
    limits: dict[tuple[str, str], RateLimit] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, equals, value = item.rpartition("=")
        if not equals or not key.strip():
            raise ValueError(f"{item!r}: write CHANNEL[:DESTINATION]=RATE[/BURST]")
        channel, _, destination = key.strip().partition(":")
        channel = channel.strip()
        if not CHANNEL_NAME.match(channel):
            raise ValueError(f"{item!r}: {channel!r} is not a channel name")
        rate_text, slash, burst_text = value.strip().partition("/")
        try:
            rate = _number(rate_text)
            burst = _number(burst_text) if slash else None
            destination = check_destination(channel, destination.strip())
            rate, burst = check_limit(rate, burst)
        except ValueError as exc:
            raise ValueError(f"{item!r}: {exc}") from None
        if (channel, destination) in limits:
            raise ValueError(f"{item!r}: {key.strip()} is named twice")
        limits[channel, destination] = RateLimit(channel, destination, rate, burst)
    return tuple(limits.values())


def _number(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a number") from None
