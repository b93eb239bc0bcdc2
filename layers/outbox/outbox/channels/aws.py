"""Helpers shared by the channels that call AWS through boto3."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from ..settings import PROVIDER_READ_TIMEOUT_SECONDS
from . import Outcome, SchemaChannel

# botocore's own retries would sleep past our deadline and hide throttling from
# the classification; one try per send, and the relay decides what comes next.
_CONNECT_TIMEOUT = 3.0


def client(service: str) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=_CONNECT_TIMEOUT,
        read_timeout=PROVIDER_READ_TIMEOUT_SECONDS.read(os.environ),
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=32,
    )
    return boto3.client(service, config=config)  # type: ignore[call-overload]


def error_code(exc: BaseException) -> str | None:
    """The AWS error code of a botocore ClientError, else None."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code else None
    return None


def describe(exc: BaseException) -> str:
    """A log- and database-safe description: the error code and class, no message
    text (provider messages can echo addresses or payload fragments)."""
    code = error_code(exc)
    return f"{type(exc).__name__}: {code}" if code else type(exc).__name__


def error_message(exc: BaseException) -> str:
    """The AWS error's message text ('' when none), to compare against a known
    phrase only: never logged or stored (it can echo addresses)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Message") or "")
    return ""


def error_codes(exc: BaseException) -> set[str]:
    """Every code an AWS error answers to: ``Code`` and, for the JSON-protocol
    services that keep their old query codes (SQS), ``QueryErrorCode`` too."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return set()
    error = response.get("Error", {})
    return {str(error[k]) for k in ("Code", "QueryErrorCode") if error.get(k)}


def is_throttling(codes: set[str]) -> bool:
    """Whether an AWS answer means "slow down" (the account's rate, not the message)."""
    return any("Throttl" in c or c in _THROTTLING_CODES for c in codes)


_THROTTLING_CODES = {
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "SlowDown",
    "ProvisionedThroughputExceededException",
    "LimitExceededException",
}


THROTTLE_DELAY_SECONDS = 5.0


def classify(exc: BaseException, failed: Collection[str]) -> Outcome:
    """The common AWS table: throttling pauses the destination (the account's
    or the queue's rate, not the message), a code in ``failed`` is permanent,
    anything else (5xx, KMS trouble, timeouts, resets) is worth another attempt."""
    codes = error_codes(exc)
    error = describe(exc)
    if is_throttling(codes):
        return Outcome.throttled(error)
    if codes & set(failed):
        return Outcome.failed(error)
    return Outcome.retry(error)


class AwsChannel(SchemaChannel):
    """A channel over one boto3 client, made on first use (or handed in by tests)."""

    service: str = ""

    def __init__(self, client: Any = None) -> None:
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = client(self.service)
        return self._client
