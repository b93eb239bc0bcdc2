"""Sleep when idle (docs/how-to/pacing.md): what a dispatcher run arranges
before it ends, so that nothing runs, and nothing touches the database, until
there is something to do.

* Work still due when the run's budget ran out: its successor starts at once
  (an asynchronous invoke of the dispatcher itself).
* Otherwise the one-time wake schedule of the stack (EventBridge Scheduler,
  ``at(...)``) is moved to the earliest future event the database knows of:
  a delayed or retried row coming due, a lease expiring, a deliver-by time.
  It is only ever moved earlier: a schedule that still holds an earlier
  future time stays, because some run wanted that wake-up. The time it holds
  is remembered in the process, so a warm dispatcher asks Scheduler again only
  when it wants an earlier time.
* Outcome events waiting to be published: the reaper is woken.

Every call here is best effort: a failure is logged and the safety-net
schedule covers it, at the cost of latency only.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
from typing import Any

from . import aws

log = logging.getLogger(__name__)

# The event of each wake-up the relay sends itself (events/dispatcher-*.json).
SUCCESSOR_EVENT = {"version": 1, "source": "outbox.successor"}
REAPER_WAKE_EVENT = {"version": 1, "source": "outbox.dispatcher"}
_AT = re.compile(r"^at\((\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})\)$")


def at_expression(when: dt.datetime) -> str:
    """Scheduler's one-time expression for ``when`` (UTC), rounded up to the
    whole minute. Scheduler invokes with 60-second precision (a schedule for
    1:00 runs between 1:00:00 and 1:00:59), so a time within a minute could
    fire before it, and a wake-up early finds nothing due; rounded up, it
    fires at most a minute and a few seconds late."""
    utc = when.astimezone(dt.UTC)
    whole = utc.replace(second=0, microsecond=0)
    if whole < utc:
        whole += dt.timedelta(minutes=1)
    return f"at({whole.strftime('%Y-%m-%dT%H:%M:%S')})"


def scheduled_time(event: dict[str, Any]) -> dt.datetime | None:
    """The time a wake schedule's event says it was scheduled for (its
    ``scheduled_time``, Scheduler's ``<aws.scheduler.scheduled-time>``)."""
    text = event.get("scheduled_time")
    if not isinstance(text, str):
        return None
    try:
        value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def held_time(expression: str | None) -> dt.datetime | None:
    """The time an ``at(...)`` expression holds (we always write it in UTC)."""
    match = _AT.match(expression or "")
    if not match:
        return None
    return dt.datetime.fromisoformat(match.group(1)).replace(tzinfo=dt.UTC)


class WakeSchedule:
    """The stack's one one-time schedule that wakes the dispatcher.

    The template creates it (with its target, role, dead-letter queue and
    input); the dispatcher only reads it and moves its time, with Scheduler's
    GetSchedule and UpdateSchedule on that one schedule."""

    def __init__(self, name: str, client: Any = None, group: str = "default") -> None:
        self.name = name
        self.group = group
        self._client = client
        # The time the schedule holds, as far as this process knows.
        self.known: dt.datetime | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = aws.client("scheduler")
        return self._client

    def arrange(
        self, when: dt.datetime, now: dt.datetime, consumed: dt.datetime | None = None
    ) -> bool:
        """Make the schedule fire at ``when`` unless it already fires earlier
        and in the future; True when it was moved. ``now`` is the database's.
        ``consumed``: the time of the wake-up that started this run. That time
        has fired even when the database's clock, a little behind Scheduler's,
        says it is still to come."""
        wanted = held_time(at_expression(when))
        assert wanted is not None
        if self.known is not None and self.known != consumed and now < self.known <= wanted:
            return False
        try:
            current = self.client.get_schedule(Name=self.name, GroupName=self.group)
            held = held_time(current.get("ScheduleExpression"))
            if (
                held is not None
                and held != consumed
                and now < held <= wanted
                and current.get("State") == "ENABLED"
            ):
                self.known = held
                return False
            update = {
                key: current[key]
                for key in ("Description", "KmsKeyArn", "Target", "FlexibleTimeWindow")
                if current.get(key) is not None
            }
            self.client.update_schedule(
                Name=self.name,
                GroupName=self.group,
                ScheduleExpression=at_expression(when),
                ScheduleExpressionTimezone="UTC",
                State="ENABLED",
                **update,
            )
        except Exception as exc:
            log.warning(
                "could not move the wake schedule; the safety net will wake the dispatcher",
                extra={"schedule": self.name, "error": aws.describe(exc)},
            )
            self.known = None
            return False
        self.known = wanted
        log.info(
            "wake schedule moved", extra={"schedule": self.name, "wake_at": wanted.isoformat()}
        )
        return True


def invoke_async(client: Any, function: str, event: dict[str, Any]) -> bool:
    """An asynchronous invoke; False (logged) when Lambda refused it."""
    try:
        client.invoke(
            FunctionName=function,
            InvocationType="Event",
            Payload=json.dumps(event, separators=(",", ":")).encode(),
        )
    except Exception as exc:
        log.warning(
            "wake-up invoke failed; the schedules cover it",
            extra={"source": event.get("source"), "error": aws.describe(exc)},
        )
        return False
    return True


def seconds_until(when: dt.datetime, now: dt.datetime) -> float:
    return max(0.0, (when - now).total_seconds())


__all__ = [
    "REAPER_WAKE_EVENT",
    "SUCCESSOR_EVENT",
    "WakeSchedule",
    "at_expression",
    "held_time",
    "invoke_async",
    "scheduled_time",
    "seconds_until",
]
