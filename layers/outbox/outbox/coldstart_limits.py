"""What a cold start writes of the rate limits (docs/how-to/rate-limits.md):
the configured ones (``RATE_LIMITS``), by whatever claims (a dispatcher, an
``outbox worker``), and a provider's own figure (SES's ``MaxSendRate``) by
whatever sends to that provider first in a process.

Each is a few statements once per process, never per message. A provider
that cannot be asked costs a log line, never a send: the relay then keeps
learning the rate from the provider's throttling answers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from . import channels, store
from .limits import check_limit
from .relay_settings import RelaySettings

log = logging.getLogger(__name__)

# The longest the first send of a process waits for the provider's answer: a
# provider that hangs (its client's read timeout is the send's, seconds long)
# must not hold up the sends; the question is then given up.
PROVIDER_ANSWER_SECONDS = 2.0


def apply_configured_limits(
    engine: sa.Engine, settings: RelaySettings, served: Sequence[str] | None
) -> store.AppliedLimits:
    """Write ``RATE_LIMITS`` to the database, shared by every claimer; remove
    the limits it wrote before and no longer names on the ``served``
    channels (None: all). An operator's limit is left as it is."""
    with engine.begin() as conn:
        applied = store.apply_configured_limits(conn, settings.rate_limits, served)
    if applied.written or applied.removed:
        log.info(
            "rate limits from RATE_LIMITS applied",
            extra={"limits_written": applied.written, "limits_removed": applied.removed},
        )
    return applied


def refresh_provider_limit(engine: sa.Engine, channel_name: str) -> bool:
    """Ask ``channel_name``'s provider for its rate (a channel with a
    ``provider_rate_limit`` method, as email has) and store it as the limit
    of the channel's account, where no operator or configuration set one.
    True if stored. Any failure is logged once and swallowed."""
    try:
        channel = channels.get(channel_name)
        ask = getattr(channel, "provider_rate_limit", None)
        if ask is None:
            return False
        rate = _within(ask, PROVIDER_ANSWER_SECONDS)
        if rate is None:
            return False
        rate, burst = check_limit(rate)
        with engine.begin() as conn:
            return store.set_provider_limit(conn, channel_name, "", rate, burst)
    except Exception as exc:
        log.warning(
            "could not read the provider's sending rate; the relay learns it from "
            "throttling answers instead",
            extra={"channel": channel_name, "error": type(exc).__name__},
        )
        return False


def _within(ask: Callable[[], Any], seconds: float) -> Any:
    """``ask()``'s answer, or TimeoutError after ``seconds`` (the call goes on
    on a daemon thread, its answer dropped: botocore cannot be interrupted)."""
    answer: dict[str, Any] = {}

    def run() -> None:
        try:
            answer["value"] = ask()
        except Exception as exc:
            answer["error"] = exc

    thread = threading.Thread(target=run, name="provider-rate", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if "error" in answer:
        raise answer["error"]
    return answer.get("value")
