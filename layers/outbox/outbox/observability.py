"""Logs and metrics, wired once per process.

Library modules log through ``logging.getLogger("outbox.<module>")``; the
Powertools Logger the handlers create is the ``outbox`` logger, so those
records come out as structured JSON with the handler's correlation keys.
Logged fields are ids, channels, counts and outcomes: never payloads,
addresses, tokens or secrets (docs/design.md, invariant 8).

Metrics are CloudWatch EMF in the namespace ``POWERTOOLS_METRICS_NAMESPACE``
with the dimension ``service`` = ``POWERTOOLS_SERVICE_NAME``; the template sets
the service to the stack's name, so two stacks never share a metric or an
alarm. A figure about one channel also carries the dimension ``channel``.
Every name goes through a function here whose first parameter is ``name``
(:func:`count`, :func:`gauge`, :func:`timing`, :func:`timings`), as a literal or a module-level
constant, so a template test can check that the dashboard and the alarms watch
only names the code emits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.logging.utils import copy_config_to_registered_loggers
from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit
from aws_lambda_powertools.metrics.functions import is_metrics_disabled
from aws_lambda_powertools.metrics.provider.cloudwatch_emf.constants import MAX_METRICS

from .settings import POWERTOOLS_METRICS_NAMESPACE, POWERTOOLS_SERVICE_NAME

# Powertools reads these two itself; the relay passes them explicitly so that
# its metrics have the same namespace and service wherever they are made.
NAMESPACE = POWERTOOLS_METRICS_NAMESPACE.read(os.environ)
SERVICE = POWERTOOLS_SERVICE_NAME.read(os.environ)

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
# The Powertools logger is named after the service, which the template sets
# to the stack's name: the modules' ``outbox.*`` records would then bypass it
# (plain text through the root logger, without their fields or the
# correlation keys). Powertools' own way for other loggers gives the
# ``outbox`` logger the same handler and level.
if logger.name.split(".")[0] != "outbox":
    logging.getLogger("outbox")
    copy_config_to_registered_loggers(source_logger=logger, include={"outbox"})
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)

# One metric set per channel (dimensions service + channel), and per tenant
# (service + tenant, the reaper's backlog of the busiest tenants): an EMF
# record has one set of dimension values, and one dispatcher or reaper run
# reports on several. Published with the relay-wide set by log_metrics.
_dimension_sets: dict[tuple[str, str], EphemeralMetrics] = {}
_dimension_sets_lock = threading.Lock()

_suspended = False

F = TypeVar("F", bound=Callable[..., Any])


class _Discard:
    def add_metric(self, **_: Any) -> None:
        pass


def _target(channel: str | None, tenant: str | None = None) -> Any:
    # Powertools prints a metric set to stdout whenever one metric reaches 100
    # values, disabled or not: when nothing will publish, record nothing.
    if _suspended or is_metrics_disabled():
        return _Discard()
    if channel is None and tenant is None:
        return metrics
    key = ("channel", channel) if channel is not None else ("tenant", str(tenant))
    with _dimension_sets_lock:
        dimension_set = _dimension_sets.get(key)
        if dimension_set is None:
            dimension_set = EphemeralMetrics(namespace=NAMESPACE, service=SERVICE)
            dimension_set.set_default_dimensions(**{key[0]: key[1]})
            _dimension_sets[key] = dimension_set
        return dimension_set


def count(name: str, value: float = 1, *, channel: str | None = None) -> None:
    """An event count; zero is not published."""
    if value:
        _target(channel).add_metric(name=name, unit=MetricUnit.Count, value=value)


def gauge(
    name: str,
    value: float,
    *,
    seconds: bool = False,
    channel: str | None = None,
    tenant: str | None = None,
) -> None:
    """A level rather than an event count: published even when it is zero.
    With ``tenant``, under the dimension tenant (at most one of the two)."""
    _target(channel, tenant).add_metric(
        name=name, unit=MetricUnit.Seconds if seconds else MetricUnit.Count, value=value
    )


def timing(name: str, milliseconds: float, *, channel: str | None = None) -> None:
    """One duration sample; CloudWatch derives percentiles from the samples."""
    _target(channel).add_metric(name=name, unit=MetricUnit.Milliseconds, value=milliseconds)


def timings(name: str, milliseconds: Iterable[float], *, channel: str | None = None) -> None:
    """One duration sample each, as :func:`timing` records them, for a batch.

    Powertools' ``add_metric`` formats the metric's whole value list into a
    debug message on every call (logged or not), so a batch of n samples cost
    O(n²): a tenth of the relay's time at batch 100. Here ``add_metric`` takes
    the first sample (it checks the name and unit and makes the entry) and the
    one that fills the metric to Powertools' limit of 100 values (it then
    publishes the set, as it would have); the samples between are appended to
    the entry's value list directly, as ``add_metric`` appends them."""
    target = _target(channel)
    values = [float(v) for v in milliseconds]
    if isinstance(target, _Discard):
        return
    i = 0
    while i < len(values):
        target.add_metric(name=name, unit=MetricUnit.Milliseconds, value=values[i])
        i += 1
        entry = target.metric_set.get(name)  # None: that value filled it and it was published
        series = entry.get("Value") if isinstance(entry, dict) else None
        if not isinstance(series, list):
            continue
        # Leave the value that reaches the limit to add_metric, which publishes.
        room = max(0, MAX_METRICS - 1 - len(series))
        series.extend(values[i : i + room])
        i += room


def flush_metrics() -> None:
    """Publish what was recorded (one EMF record per metric set that has data)."""
    with _dimension_sets_lock:
        metric_sets: list[Any] = [metrics, *_dimension_sets.values()]
    for metric_set in metric_sets:
        if metric_set.metric_set:  # an empty set is skipped, not warned about
            metric_set.flush_metrics()


def log_metrics(handler: F) -> F:
    """Publish the invocation's metrics when the handler returns or raises
    (``metrics.log_metrics``, covering the per-channel sets too)."""

    @functools.wraps(handler)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        finally:
            flush_metrics()

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Record no metrics meanwhile: for a long-running process with no Lambda
    log pipeline to carry EMF (``outbox worker``), whose stdout is its own."""
    global _suspended
    previous, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = previous
