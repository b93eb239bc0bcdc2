"""What the Lambda handlers share: settings and the engine, made once per
execution environment and reused by every invocation after it.

Settings are read at import (cold start), every one declared in
``outbox.settings``, so a bad setting fails the init with a message naming
it. The engine connects on first use.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import sqlalchemy as sa

from . import aws, coldstart_limits, dispatcher, pacing, reaper, sender, store
from . import settings as declared
from .errors import ConfigError, ValidationError
from .handoff import Invoker, LambdaInvoker
from .observability import count, logger
from .relay_settings import DatabaseSettings, OutcomeEventSettings, RelaySettings
from .settings import read_all

# Leave the Lambda this long after the work to flush logs and metrics.
_EXIT_MARGIN_SECONDS = 2.0


class Runtime:
    def __init__(self, env: Mapping[str, str] | None = None, *, autocommit: bool = True) -> None:
        """``autocommit=False`` for the migrate function, whose Alembic run is one
        transaction; the relay's own operations are single statements."""
        env = os.environ if env is None else env
        self._autocommit = autocommit
        self.settings = RelaySettings.from_env(env)
        self.database = DatabaseSettings.from_env(env)
        self.outcome_events = OutcomeEventSettings.from_env(env)
        # And every other declared setting (the channels', the migration's):
        # a malformed one fails the cold start, not the first message it shapes.
        read_all(env)
        self._engine: sa.Engine | None = None
        self._invoker: Invoker | None = None
        # The reaper's EventBridge client, made when outcome events first wait.
        self.events_client = aws.client_on_first_use("events")
        self._lambda_client: Any = None
        self.sleeps = self.settings.pacing_mode == "sleep"
        wake_name = declared.WAKE_SCHEDULE_NAME.read(env)
        self.wake_schedule = pacing.WakeSchedule(wake_name) if wake_name else None
        self.reaper_function = declared.REAPER_FUNCTION.read(env)
        # Written to the database once per environment, on its first use
        # (docs/how-to/rate-limits.md): the configured limits by the
        # dispatcher, a provider's own rate by the channel that sends to it.
        self._limits_applied = False
        self._provider_limits_asked: set[str] = set()

    @classmethod
    def for_dispatcher(cls, env: Mapping[str, str] | None = None) -> Runtime:
        """The dispatcher's runtime. With no channel function map every row it
        claims would fail as unroutable: it refuses to start instead, naming the
        setting (the template always sets it; locally, `outbox worker` hands off
        in process)."""
        runtime = cls(env)
        if not runtime.settings.channel_functions:
            raise ConfigError(
                "CHANNEL_FUNCTIONS",
                "is empty, so the dispatcher has no function to hand any message to "
                "(it maps each channel to its function; run `outbox worker` to send locally)",
            )
        runtime.settings.check_rate_limit_channels(runtime.settings.channel_functions)
        return runtime

    def apply_configured_limits(self) -> None:
        """The dispatcher's first run in this environment writes RATE_LIMITS
        to the database, for the channels it hands off (a failure leaves it
        to the next run, as the claim's own failure would)."""
        if not self._limits_applied:
            coldstart_limits.apply_configured_limits(
                self.engine, self.settings, sorted(self.settings.channel_functions)
            )
            self._limits_applied = True

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            from .db import create_engine

            self._engine = create_engine(self.database, autocommit=self._autocommit)
        return self._engine

    @property
    def invoker(self) -> Invoker:
        if self._invoker is None:
            self._invoker = LambdaInvoker(self.settings.channel_functions)
        return self._invoker

    @property
    def lambda_client(self) -> Any:
        """The client of the dispatcher's own invokes (its successor, the reaper)."""
        if self._lambda_client is None:
            self._lambda_client = getattr(self.invoker, "client", None)
        return self._lambda_client

    def dispatch(self, event: Any, context: Any) -> dict[str, Any]:
        """One dispatcher run, for any of its wake-ups (the safety-net
        schedule, the wake schedule, a producer's nudge, its predecessor)."""
        event = scheduler_event(event)
        source = wake_source(event)
        remaining = _remaining(context)
        started, budget = time.monotonic(), self.settings.dispatch_budget_seconds

        def time_left() -> float:
            spent = time.monotonic() - started
            return min(budget - spent, remaining() - _EXIT_MARGIN_SECONDS)

        if not self.sleeps:
            self.apply_configured_limits()
            report = dispatcher.run(self.engine, self.invoker, self.settings, time_left)
            logger.info("dispatcher run", extra={**asdict(report), "woken_by": source})
            return asdict(report)
        try:
            # The reaping steps first: a wake-up at a lease's end or at a
            # deliver-by time is for them. They take the invocation's time, not
            # the claiming budget (which may be 0: one pass).
            def reap_time_left() -> float:
                return remaining() - _EXIT_MARGIN_SECONDS

            released, reaping_failed = reaper.ReapReport(), False
            try:
                reaper.release_expired_leases(self.engine, self.settings, reap_time_left, released)
                reaper.expire_overdue_rows(self.engine, self.settings, reap_time_left, released)
            except Exception:
                # A fault here (a statement or lock timeout, a lost connection)
                # must not cost the claim: the scheduled reaper and the next
                # wake-up do these steps again, and each batch is its own
                # transaction, so what was done stays done.
                reaping_failed = True
                logger.exception("dispatcher: the reaping steps failed; claiming anyway")
                count("ReapingFailed")
            reaper.count_released(released)
            self.apply_configured_limits()
            report = dispatcher.run(
                self.engine,
                self.invoker,
                self.settings,
                time_left,
                linger=self.settings.idle_linger_seconds,
            )
            consumed = pacing.scheduled_time(event) if source == "outbox.wake" else None
            arranged = self._before_sleep(
                report, getattr(context, "invoked_function_arn", None), consumed
            )
        finally:
            self.release_connections()
        result = {
            **asdict(report),
            "released_leases": released.reclaimed + released.not_started,
            "expired": released.expired,
            "reaping_failed": reaping_failed,
        }
        logger.info("dispatcher run", extra={**result, **arranged, "woken_by": source})
        return {**result, **arranged}

    def _before_sleep(
        self,
        report: dispatcher.DispatchReport,
        own_arn: str | None,
        consumed: Any = None,
    ) -> dict[str, Any]:
        """Arrange what wakes the relay next (outbox.pacing): the successor at
        once when work is left, else the wake schedule at the next event; the
        reaper when outcome events wait."""
        arranged: dict[str, Any] = {"successor": False, "wake_at": None, "reaper_woken": False}
        with self.engine.begin() as conn:
            wake = store.next_wake(conn)
        if report.work_left and own_arn:
            arranged["successor"] = pacing.invoke_async(
                self.lambda_client, own_arn, pacing.SUCCESSOR_EVENT
            )
        if not arranged["successor"] and wake.earliest is not None and self.wake_schedule:
            self.wake_schedule.arrange(wake.earliest, wake.now, consumed)
            arranged["wake_at"] = pacing.at_expression(wake.earliest)
        if wake.outcome_events_due and self.outcome_events.bus and self.reaper_function:
            arranged["reaper_woken"] = pacing.invoke_async(
                self.lambda_client, self.reaper_function, pacing.REAPER_WAKE_EVENT
            )
        return arranged

    def release_connections(self) -> None:
        """Sleep mode: close the pool's connections before the environment is
        frozen, so that between invocations no connection holds the database
        awake (Aurora Serverless v2 pauses only with none open). The next
        invocation connects again. (Run in process by several threads at
        once, as `make run` and the tests do, the last one out closes them.)"""
        if self.sleeps and self._engine is not None:
            checked_out = getattr(self._engine.pool, "checkedout", lambda: 0)()
            if not checked_out:
                self._engine.dispose()

    def send(self, channel: str, event: Any, context: Any) -> dict[str, Any]:
        try:
            if channel not in self._provider_limits_asked:
                self._provider_limits_asked.add(channel)  # once, whatever it answers
                coldstart_limits.refresh_provider_limit(self.engine, channel)
            report = sender.run(
                self.engine, event, self.settings, _remaining(context), channel_name=channel
            )
        finally:
            self.release_connections()
        return {
            "received": report.received,
            "owned": report.owned,
            "lease_lost": report.lease_lost,
            "duplicates": report.duplicates,
            "unknown": report.unknown,
            "statuses": dict(report.statuses),
        }

    def reap(self, event: Any, context: Any) -> dict[str, Any]:
        scheduler_event(event)
        remaining = _remaining(context)
        try:
            report = reaper.run(
                self.engine,
                self.settings,
                lambda: remaining() - _EXIT_MARGIN_SECONDS,
                self.outcome_events,
                self.events_client,
                quiet_when_idle=self.sleeps,
            )
        finally:
            self.release_connections()
        return {
            "reclaimed": report.reclaimed,
            "not_started": report.not_started,
            "dead": report.dead,
            "expired": report.expired,
            "cancelled": report.cancelled,
            "pruned": report.pruned,
            "outcome_events": {
                "published": report.events_published,
                "refused": report.events_refused,
                "dropped": report.events_dropped,
                "waiting": report.events_waiting,
            },
            "backlog": asdict(report.backlog) if report.backlog else None,
            "paused_channels": [c.channel for c in report.channels if c.paused],
        }

    def feedback(self, event: Any) -> dict[str, Any]:
        from . import feedback

        try:
            return feedback.handle(self.engine, event).as_dict()
        finally:
            self.release_connections()


# How many more container objects may be made than freed before the garbage
# collector walks the youngest generation (CPython's default: 700). A batch of
# 1,000 messages holds some tens of thousands alive while it is sent and
# settled, so at 700 each batch set off dozens of collections, each of which
# moved the batch's live rows one generation older, where larger collections
# walked them again: 3 µs a message at batch 1,000, a tenth of the relay's own
# time (bench/README.md). Almost everything a batch makes is freed by its
# reference count when the batch ends; what the collector is for (cycles) is
# rare here and is still collected, a few batches later.
YOUNG_GENERATION_THRESHOLD = 50_000


def cold_start_done() -> None:
    """Move what the cold start made (the imported modules, the settings) out of
    the garbage collector's reach. It lives as long as the environment, and
    every full collection walked all of it: 10 to 30 ms each, some thousands of
    messages apart, about 4% of a sender's time at batch 100 (bench/README.md).
    What invocations make is collected as before, a batch's worth at a time
    (``YOUNG_GENERATION_THRESHOLD``)."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)


def channel_handler(channel: str) -> Callable[[dict[str, Any], Any], dict[str, Any]]:
    """The whole Lambda handler of a channel function: settings checked now (at
    cold start), then each invocation sends the hand-off it was given."""
    from .observability import log_metrics

    runtime = Runtime()
    cold_start_done()

    @logger.inject_lambda_context
    @log_metrics
    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        return runtime.send(channel, event, context)

    handler.runtime = runtime  # type: ignore[attr-defined]
    return handler


def _remaining(context: Any) -> Callable[[], float]:
    """Seconds left in this invocation, from the Lambda context."""
    return lambda: context.get_remaining_time_in_millis() / 1000.0


def scheduler_event(event: Any) -> dict[str, Any]:
    """Check an EventBridge Scheduler event (the Input the template configures)
    and put its execution id on every log line of this invocation."""
    if not isinstance(event, Mapping):
        raise ValidationError("event", f"must be an object, got {type(event).__name__}")
    execution_id = event.get("execution_id")
    if execution_id is not None and not isinstance(execution_id, str):
        raise ValidationError("event.execution_id", "must be a string")
    logger.append_keys(schedule_execution_id=execution_id)
    return dict(event)


# The wake-ups of the dispatcher that say who sent them (events/dispatcher-*.json);
# any other object is a schedule's event (the safety net's has no "source").
WAKE_SOURCES = ("outbox.nudge", "outbox.wake", "outbox.successor", "outbox.dispatcher")


def wake_source(event: Mapping[str, Any]) -> str:
    """Who woke this run, for the logs. Unknown keys are ignored, and an
    unknown source is only a run like any other (it carries no data)."""
    source = event.get("source")
    return source if source in WAKE_SOURCES else "schedule"
