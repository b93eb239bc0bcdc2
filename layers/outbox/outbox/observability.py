"""Logs and metrics, wired once per process.

Library modules log through ``logging.getLogger("outbox.<module>")``; the
Powertools Logger the handlers create is the ``outbox`` logger, so those
records come out as structured JSON with the handler's correlation keys.
Logged fields are ids, channels, counts and outcomes: never payloads,
addresses, tokens or secrets (docs/design.md, invariant 8).
"""

from __future__ import annotations

import logging

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit

NAMESPACE = "OutboxRelay"
SERVICE = "outbox"

# Libraries whose DEBUG and INFO records carry what invariant 8 keeps out of
# logs: botocore logs request and response bodies (a secret's value, a phone
# number and its SMS text), urllib3 request lines (tokens in query strings),
# SQLAlchemy and pg8000 statements and their parameters. Lambda's
# ApplicationLogLevel (the template's LogLevel) sets the root logger; these
# stay at WARNING (urllib3 at ERROR) whatever it says.
QUIET_LIBRARIES = (
    "botocore",
    "boto3",
    "s3transfer",
    "urllib3",
    "sqlalchemy",
    "pg8000",
    "aws_lambda_powertools",
)


# urllib3's own warnings quote the request URL (query strings carry tokens).
QUIET_AT_ERROR = ("urllib3",)


def quiet_libraries() -> None:
    for name in QUIET_LIBRARIES:
        level = logging.ERROR if name in QUIET_AT_ERROR else logging.WARNING
        logging.getLogger(name).setLevel(level)


quiet_libraries()

logger = Logger(service=SERVICE)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)


def count(name: str, value: float = 1) -> None:
    if value:
        metrics.add_metric(name=name, unit=MetricUnit.Count, value=value)


def gauge(name: str, value: float, *, seconds: bool = False) -> None:
    """A level rather than an event count: published even when it is zero."""
    metrics.add_metric(
        name=name, unit=MetricUnit.Seconds if seconds else MetricUnit.Count, value=value
    )
