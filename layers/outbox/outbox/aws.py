"""Every AWS client the relay makes, and the one reading of AWS errors.

Clients are made on first use by the module that needs them, so boto3 is
imported then and never at import: ``import outbox`` stays light, and a
function loads only the clients it calls. Every client makes one attempt per
call: botocore's own retries would sleep past the relay's deadlines and hide
throttling from the classification, and the relay decides what comes next.

Errors are read here only (``error_code``, ``error_codes``, ``describe``,
``is_throttling``, ...); what an error means for a message is the caller's
table (``outbox.channels.aws.classify`` for the channels).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from .settings import PROVIDER_READ_TIMEOUT_SECONDS

_CONNECT_TIMEOUT_SECONDS = 3.0


def _one_attempt(connect_timeout: float, read_timeout: float, **options: Any) -> Any:
    """A botocore ``Config`` that makes one attempt per call."""
    from botocore.config import Config

    return Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"total_max_attempts": 1, "mode": "standard"},
        **options,
    )


def client(service: str) -> Any:
    """A provider's client, for the channels and the relay's own calls
    (EventBridge, Scheduler, Secrets Manager): read timeout
    ``PROVIDER_READ_TIMEOUT_SECONDS``, one attempt."""
    import boto3

    config = _one_attempt(
        _CONNECT_TIMEOUT_SECONDS,
        PROVIDER_READ_TIMEOUT_SECONDS.read(os.environ),
        max_pool_connections=32,
    )
    return boto3.client(service, config=config)  # type: ignore[call-overload]


def client_on_first_use(service: str) -> Callable[[], Any]:
    """A function that makes ``client(service)`` on its first call and returns
    that one client ever after: for a caller that may never need it (the
    reaper's EventBridge client, made only when outcome events wait)."""
    return functools.cache(lambda: client(service))


def lambda_client() -> Any:
    """The dispatcher's client for the hand-off's (and its own wake-ups')
    asynchronous invokes. One attempt matters most here: a retry after a read
    timeout would queue a second event when the first was already accepted. A
    failed hand-off releases its claims, and the next pass claims them again."""
    import boto3

    config = _one_attempt(_CONNECT_TIMEOUT_SECONDS, 10, max_pool_connections=16)
    return boto3.client("lambda", config=config)


def nudge_client(region: str | None) -> Any:
    """A producer's client for the dispatcher's nudge (``outbox.wake``), made
    on the nudge thread. botocore rather than boto3: the client is the same,
    and boto3 would also load its S3 transfer manager for nothing. One
    attempt: the next commit, or the schedule, is the retry."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "lambda", region_name=region, config=_one_attempt(2, 5)
    )


def db_auth_token(host: str, port: int, user: str) -> str:
    """An IAM authentication token for a database login (signed locally: no
    call is made, so the client keeps boto3's defaults)."""
    import boto3

    token = boto3.client("rds").generate_db_auth_token(DBHostname=host, Port=port, DBUsername=user)
    return str(token)


def error_code(exc: BaseException) -> str | None:
    """The AWS error code of a botocore ClientError, else None."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code else None
    return None


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore ClientError's answer, else None."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
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


def is_invoke_throttled(exc: BaseException) -> bool:
    """Whether Lambda refused an invoke for now: its ``TooManyRequestsException``,
    or any answer with HTTP status 429."""
    return error_code(exc) == "TooManyRequestsException" or http_status(exc) == 429
