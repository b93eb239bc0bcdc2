"""The relay in one long-running process: dispatcher, senders and reaper.

For local development and for running on a container service instead of
Lambda. The hand-off is in process (a CallableInvoker calling the sender
runtime), and every claim, fence and settle is the same SQL as in Lambda, so
several workers (and Lambda dispatchers) may run against one database at once.

Stopping (``stop`` set, e.g. by SIGTERM): the batch in hand finishes: its
provider calls already started are settled, hand-offs not yet started are
released at once (no attempt counted). No claim is left to expire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import channels as channel_registry
from . import dispatcher, reaper, sender, store
from .channels import aws
from .config import OutcomeEventSettings, RelaySettings
from .handoff import CallableInvoker, HandOff

log = logging.getLogger(__name__)

STOPPING = "worker stopping: not started"


@dataclass
class WorkerReport:
    claimed: int = 0
    released: int = 0
    reaped: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    batches: int = 0


class Worker:
    """Claim, send and settle in a loop until ``stop`` is set (or the backlog is empty)."""

    def __init__(
        self,
        engine: sa.Engine,
        settings: RelaySettings,
        *,
        channels: Sequence[str] | None = None,
        stop: threading.Event | None = None,
        reap_interval_seconds: float = 30.0,
        on_batch: Callable[[WorkerReport], None] | None = None,
        outcome_events: OutcomeEventSettings | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        # Off unless a bus is named: then the reaper step publishes them too.
        self.outcome_events = outcome_events or OutcomeEventSettings()
        self._events_client: Any = None
        self.channels = list(channels) if channels else None
        self.stop = stop or threading.Event()
        self.reap_interval_seconds = reap_interval_seconds
        self.on_batch = on_batch
        self.report = WorkerReport()
        self._lock = threading.Lock()
        names = self.channels or channel_registry.names()
        self.invoker = CallableInvoker({name: self._sender_for(name) for name in names})

    def _sender_for(self, channel: str) -> Callable[[dict[str, Any]], Any]:
        def send(event: dict[str, Any]) -> None:
            if self.stop.is_set():
                # Not started: give the rows back now rather than leave them claimed.
                handoff = HandOff.from_event(event)
                with self.engine.begin() as conn:
                    released = store.release(
                        conn, [(c.id, c.claim_token) for c in handoff.claims], reason=STOPPING
                    )
                with self._lock:
                    self.report.released += len(released)
                return
            # A sender here has the whole lease (less the margin) for its batch.
            result = sender.run(
                self.engine,
                event,
                self.settings,
                lambda: float(self.settings.sender_timeout_seconds),
                channel_name=channel,
            )
            with self._lock:
                for status, n in result.statuses.items():
                    self.report.statuses[status] = self.report.statuses.get(status, 0) + n

        return send

    def reap(self) -> reaper.ReapReport:
        deadline = time.monotonic() + 30.0
        result = reaper.run(
            self.engine,
            self.settings,
            lambda: deadline - time.monotonic(),
            self.outcome_events,
            self._events,
        )
        self.report.reaped += result.reclaimed + result.not_started + result.dead + result.expired
        return result

    def _events(self) -> Any:
        if self._events_client is None:
            self._events_client = aws.client("events")
        return self._events_client

    def run_once(self) -> dispatcher.DispatchReport:
        """One claim of up to a batch, sent and settled before it returns."""
        result = dispatcher.dispatch_once(self.engine, self.invoker, self.settings, self.channels)
        self.report.claimed += result.claimed
        self.report.released += result.released
        self.report.batches += 1
        if self.on_batch is not None:
            self.on_batch(self.report)
        return result

    def run(self, *, once: bool = False, until_empty: bool = False) -> WorkerReport:
        """The loop. ``once``: one batch; ``until_empty``: stop when nothing is due."""
        next_reap = time.monotonic()
        while not self.stop.is_set():
            if time.monotonic() >= next_reap:
                self.reap()
                next_reap = time.monotonic() + self.reap_interval_seconds
            result = self.run_once()
            if once or (until_empty and result.claimed == 0):
                break
            if result.claimed < self.settings.batch_size:
                self.stop.wait(self.settings.poll_interval_seconds)
        return self.report
