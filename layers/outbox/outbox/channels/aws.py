"""What the channels that call AWS share: the base class over one client and
the common table from an AWS error to an ``Outcome``.

The clients and the reading of AWS errors are ``outbox.aws``'s; its readers
are importable from here too (``from outbox.channels import aws``, then
``aws.describe(exc)``), for channels written against that path.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .. import aws
from ..aws import client as client
from ..aws import describe as describe
from ..aws import error_code as error_code
from ..aws import error_codes as error_codes
from ..aws import error_message as error_message
from ..aws import is_throttling as is_throttling
from . import Outcome, SchemaChannel

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
            self._client = aws.client(self.service)
        return self._client
