"""Logs and metrics, wired once per process.

Library modules log through ``logging.getLogger("outbox.<module>")``; the
Powertools Logger the handlers create is the ``outbox`` logger, so those
records come out as structured JSON with the handler's correlation keys.
Logged fields are ids, channels, counts and outcomes: never payloads,
addresses, tokens or secrets (docs/design.md, invariant 8).
"""

from __future__ import annotations

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit

NAMESPACE = "OutboxRelay"
SERVICE = "outbox"

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
