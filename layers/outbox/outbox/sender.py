"""The sender runtime shared by every channel function: its send policy.

A batch goes through three steps. The receipt is a compare-and-set, so each
claim is taken, and so sent, only once. Then the provider calls run side by
side, each within its deadline. Last, one fenced settle statement records the
outcomes and writes the attempt rows (an event of several tenants settles its
first wave's final outcomes early, in a statement of its own:
``send_then_settle``'s ``settle_first_wave``).

The deadline of a row is the sooner of its lease end (from the database
clock) and the Lambda's end, less a margin for the settle. A row whose
deadline is near is not started. It goes back to pending, due at once, with
no attempt and no deferral counted, rather than being left to expire: a slow
provider ahead of it, or a short invocation, is not the message's fault
(docs/design.md, invariant 4).

This module decides what to send, when a call may start, and what each row's
outcome is. The threads that make the calls are ``outbox.sendpool``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from . import channels, payloads, sendpool, store
from .channels import CHANNEL, DESTINATION, Channel, Deadline, Message, Outcome
from .errors import ValidationError
from .handoff import HandOff
from .observability import count, timings
from .redact import scrub_optional
from .relay_settings import RelaySettings
from .states import SEND_OUTCOMES, AttemptOutcome

# Outcomes that leave a row pending without counting an attempt.
_NOT_COUNTED = (AttemptOutcome.DEFERRED, AttemptOutcome.NOT_STARTED)
# Outcomes a row keeps whatever else its batch hears: it is not given back,
# so no pause need be written before it (``settle_first_wave``).
_FINAL = (AttemptOutcome.DELIVERED, AttemptOutcome.FAILED, AttemptOutcome.SUPPRESSED)

log = logging.getLogger(__name__)

NOT_STARTED = "deadline near: not started"
DEADLINE_EXCEEDED = "provider call exceeded its deadline"
STOPPING = "stopping: not started"
STOP_GRACE_EXCEEDED = "stopping: provider call cut at the stop grace"
# A channel's send must return an Outcome. Anything else is a bug in the
# channel, and the call may well have reached the provider (a channel that
# sent, then forgot to return): sending again could send again, so the row
# fails at once, as the workers this design came from refuse it ("delivery
# refused"), logged as a programming error and counted (ChannelContractError).
REFUSED = "delivery refused"
_NOT_STARTED = Outcome(AttemptOutcome.NOT_STARTED, error=NOT_STARTED)
_STOPPED = Outcome(AttemptOutcome.NOT_STARTED, error=STOPPING)
DESTINATION_THROTTLED = "destination throttled: not started"
CHANNEL_QUOTA = "channel quota spent: not started"
CHANNEL_PAUSED = "channel paused: not started"
DESTINATION_PAUSED = "destination paused: not started"
_DESTINATION_THROTTLED = Outcome(AttemptOutcome.NOT_STARTED, error=DESTINATION_THROTTLED)
_CHANNEL_QUOTA = Outcome(AttemptOutcome.NOT_STARTED, error=CHANNEL_QUOTA)
_CHANNEL_PAUSED = Outcome(AttemptOutcome.NOT_STARTED, error=CHANNEL_PAUSED)
_DESTINATION_PAUSED = Outcome(AttemptOutcome.NOT_STARTED, error=DESTINATION_PAUSED)
# A row whose payload names a signing secret that is not its tenant's.
_SECRET_REFUSED = Outcome.failed("secret_id: not a signing secret of this message's tenant")
# The minimum call time: a call starts only if its deadline leaves at least
# this long for the answer. A call started with less time would probably be
# given up after the receiver got the request, and then be sent again. Once a
# call of the batch has been answered, the slowest answered call replaces this
# figure. A function whose timeout is short (a test deployment) uses a
# twentieth of that timeout when it is less.
MIN_CALL_SECONDS = 0.5
# A channel most of whose calls of its last batch came back within this time
# sends its next batch on one thread, because waking every send thread for
# calls that short costs more than the calls (bench/README.md, "The relay's own
# overhead, second round", change 3). The other threads join as soon as one
# call has run this long, so a provider that turns slow delays the batch by no
# more than this. Most, not all: on several threads, a call the interpreter
# lock held up mid-way measures the wait as well, so a few slow calls are what
# every thread at once costs a fast provider, not the provider's own time.
FAST_CALL_SECONDS = 0.001
_calls_were_fast: dict[str, bool] = {}  # by channel name
_FOREVER = float("inf")
# A row's outcome, and how long its provider call took in milliseconds (None
# when no call was made).
_Result = tuple[Outcome, int | None]
# How often the sender checks for a stop while calls are running.
STOP_POLL_SECONDS = 0.05
# Metric name per settled status or outcome.
_METRIC = {
    "delivered": "Delivered",
    "pending": "Retried",
    "failed": "Failed",
    "dead": "Dead",
    "suppressed": "Suppressed",
    "deferred": "Deferred",
    "not_started": "NotStarted",
    "expired": "Expired",
}


class Limits:
    """What one batch has learned of its provider's limits while sending.
    After a destination's throttling answer, no further call to that
    destination starts; after a quota answer, no further call starts at all
    (docs/design.md, invariant 10). The rows not started go back to pending
    with no attempt and no deferral counted.

    ``heeding``: the limits of the batch sent before this one, when its last
    calls still run beside this batch's first (``outbox worker``). What that
    batch hears blocks this batch's calls too, and it alone writes it."""

    def __init__(self, heeding: Limits | None = None) -> None:
        self._lock = threading.Lock()
        self.heeding = heeding
        self.began = time.monotonic()
        self.throttled: dict[str, list[float | None]] = {}  # destination -> pauses asked
        self.quota: Outcome | None = None
        self.calls: Counter[str] = Counter()  # answered, by destination
        self.delivered: Counter[str] = Counter()  # by destination
        # By destination, the rate at which it was called until its first
        # throttling answer. The first estimate of what a destination admits
        # is the rate the batch delivered to it, because an estimate that is
        # too low costs less than one that is too high (each cut from too high
        # a rate costs a refused call and the provider's pause). This rate is
        # the estimate only when nothing was delivered (another sender had
        # used up what the destination admits), since zero is no estimate.
        self.called_rate: dict[str, float] = {}
        self.last_throttled_at: dict[str, float] = {}  # monotonic, by destination

    def _heard(self, row: store.ClaimedMessage) -> Outcome | None:
        if self.quota is not None:
            return _CHANNEL_QUOTA
        if row.destination in self.throttled:
            return _DESTINATION_THROTTLED
        return None

    def blocked(self, row: store.ClaimedMessage) -> Outcome | None:
        """The outcome of a row that must not be started, else None."""
        blocked = self._heard(row)
        heeding = self.heeding
        if blocked is None and heeding is not None:
            blocked = heeding._heard(row)  # one batch back only: older ones are settled
        return blocked

    def note(self, row: store.ClaimedMessage, outcome: Outcome) -> None:
        with self._lock:
            self.calls[row.destination] += 1
            if outcome.kind == AttemptOutcome.DELIVERED:
                self.delivered[row.destination] += 1
            if outcome.pause == CHANNEL:
                if self.quota is None:
                    self.quota = outcome
            elif outcome.pause == DESTINATION:
                if row.destination not in self.called_rate:
                    seconds = max(time.monotonic() - self.began, 0.001)
                    self.called_rate[row.destination] = self.calls[row.destination] / seconds
                self.throttled.setdefault(row.destination, []).append(outcome.delay_seconds)
                self.last_throttled_at[row.destination] = time.monotonic()

    def records(self) -> tuple[dict[str, store.Throttled], tuple[str, float | None] | None]:
        """What to write: each throttled destination, and the channel's quota
        pause; less what the heeded batch heard as well, which that batch
        writes (its settle comes first). Ends the heeding: the heeded batch
        is not kept alive by this one."""
        heeding, self.heeding = self.heeding, None
        now = time.monotonic()
        seconds = max(now - self.began, 0.001)
        throttled = {
            destination: store.Throttled(
                # The longest pause asked for; None means the relay's own pause.
                max((p for p in pauses if p is not None), default=None),
                len(pauses),
                self.delivered[destination] / seconds or self.called_rate[destination],
                now - self.last_throttled_at[destination],
                self.delivered[destination],
            )
            for destination, pauses in self.throttled.items()
            if heeding is None or destination not in heeding.throttled
        }
        quota = None
        if self.quota is not None and (heeding is None or heeding.quota is None):
            quota = (f"quota: {self.quota.error}", self.quota.delay_seconds)
        return throttled, quota


@dataclass
class SendReport:
    received: int = 0
    owned: int = 0
    lease_lost: list[int] = field(default_factory=list)
    # Claims another sender took under the same claim, from a duplicated event.
    duplicates: list[int] = field(default_factory=list)
    # Claims that name no message of the channel: they were never live, as in
    # a sample event.
    unknown: list[int] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    # When (time.monotonic()) the first destination this batch paused may be
    # called again: a caller that polls can claim again then, not a poll later.
    resumes_at: float | None = None


def _refused(row: store.ClaimedMessage, answer: Any) -> Outcome:
    """The final outcome of a send that returned what the relay does not know."""
    if isinstance(answer, Outcome):
        said = f"returned unknown outcome {answer.kind!r}"[:200]
    else:
        said = f"returned {'None' if answer is None else type(answer).__name__}, not an Outcome"
    error = f"channel {row.channel!r} {said}: {REFUSED}"
    log.error(
        "programming error in a channel: send must return an Outcome",
        extra={"message_id": row.id, "channel": row.channel, "error": error},
    )
    count("ChannelContractError", channel=row.channel)
    return Outcome.failed(error)


def _send_one(
    channel: Channel,
    row: store.ClaimedMessage,
    deadline: Deadline,
    stop: threading.Event | None = None,
    min_call_seconds: float = MIN_CALL_SECONDS,
    limits: Limits | None = None,
) -> _Result:
    """One row's call, and how long it took in milliseconds (None when no
    provider call was made). The call starts only if the deadline leaves
    ``min_call_seconds``; ``limits`` is what the batch has learned so far of
    the provider's limits."""
    started = time.monotonic()
    if stop is not None and stop.is_set():
        return _STOPPED, None
    if limits is not None:
        blocked = limits.blocked(row)
        if blocked is not None:
            return blocked, None
    if row.secret_refused:
        return _SECRET_REFUSED, None
    if deadline.remaining() < min_call_seconds:
        return _NOT_STARTED, None
    try:
        payload = payloads.decode(row.payload)
        channel.validate(payload)
    except ValidationError as exc:
        return Outcome.failed(f"invalid payload: {exc}"), None
    except NotImplementedError:
        return Outcome.failed(f"channel {row.channel!r} does not implement validate"), None
    except Exception as exc:  # a bug in a custom channel's validate method
        return Outcome.retry(f"unexpected {type(exc).__name__} in validate"), None
    message = Message(row.id, row.channel, payload, row.attempt, row.dedupe_key, row.ordering_key)
    try:
        outcome = channel.send(message, deadline)
    except NotImplementedError:
        return Outcome.failed(f"channel {row.channel!r} does not implement send"), None
    except Exception as exc:  # a channel bug or an unclassified provider error
        outcome = Outcome.retry(f"unexpected {type(exc).__name__}")
    if not isinstance(outcome, Outcome) or outcome.kind not in SEND_OUTCOMES:
        return _refused(row, outcome), int((time.monotonic() - started) * 1000)
    if limits is not None:
        limits.note(row, outcome)
    return outcome, int((time.monotonic() - started) * 1000)


def run(
    engine: sa.Engine,
    event: Any,
    settings: RelaySettings,
    remaining_seconds: Callable[[], float],
    *,
    channel_name: str | None = None,
    channel: Channel | None = None,
) -> SendReport:
    """Handle one hand-off event for ``channel_name`` (the function's own channel)."""
    handoff = HandOff.from_event(event)
    if channel_name is not None and handoff.channel != channel_name:
        raise ValidationError(
            "event.channel", f"this function sends {channel_name!r}, not {handoff.channel!r}"
        )
    report = SendReport(received=len(handoff.claims))
    with engine.begin() as conn:
        rows = store.receive_claimed(
            conn,
            handoff.channel,
            handoff.claims,
            settings.max_attempts,
        )
    # A channel paused since the claim (a quota another sender heard, an
    # operator's pause) sends nothing: its rows go back as not started. The
    # receipt read the pause in its own statement.
    paused = bool(rows) and rows[0].channel_paused
    report.owned = len(rows)
    owned = {r.id for r in rows}
    not_owned = [c for c in handoff.claims if c.id not in owned]
    if not_owned:
        # These rows are not ours to send, so nothing touches them. There are
        # three reasons, and the log says which one applies. Another sender
        # took them under this very claim, because the event came twice
        # (which happens now and then). Or no message has the id, because the
        # claim was never live (a sample event). Or the claim is over: the row
        # was settled, reaped or claimed again.
        with engine.begin() as conn:
            why = store.unowned_claims(conn, handoff.channel, not_owned)
        report.duplicates.extend(c.id for c in not_owned if c.id in why.duplicates)
        report.unknown.extend(c.id for c in not_owned if c.id in why.unknown)
        report.lease_lost.extend(
            c.id for c in not_owned if c.id not in why.duplicates and c.id not in why.unknown
        )
        if report.unknown:
            log.info(
                "no such claim: this event's claims were never live here (events/ samples "
                "carry placeholder claim tokens; get a live event with `outbox invoke "
                "<Function> --claim N`); skipped",
                extra={"message_ids": report.unknown},
            )
        if report.duplicates:
            count("DuplicateHandOff", len(report.duplicates), channel=handoff.channel)
            log.info(
                "claims already taken by another delivery of this hand-off; skipped",
                extra={"message_ids": report.duplicates},
            )
        if report.lease_lost:
            count("LeaseLost", len(report.lease_lost), channel=handoff.channel)
            log.warning(
                "claims no longer held (settled, reaped or claimed again); skipped",
                extra={"message_ids": report.lease_lost},
            )
    if not rows:
        return report
    return send_then_settle(
        engine,
        handoff.channel,
        rows,
        settings,
        remaining_seconds,
        channel=channel,
        report=report,
        channel_paused=paused,
        settle_first_wave=True,
    )()


def send_then_settle(
    engine: sa.Engine,
    channel_name: str,
    rows: list[store.ClaimedMessage],
    settings: RelaySettings,
    remaining_seconds: Callable[[], float],
    *,
    channel: Channel | None = None,
    report: SendReport | None = None,
    stop: threading.Event | None = None,
    stop_grace: float | None = None,
    channel_paused: bool = False,
    limits: Limits | None = None,
    last_round: threading.Event | None = None,
    settle_after: Callable[[], object] | None = None,
    settle_first_wave: bool = False,
) -> Callable[[], SendReport]:
    """Send now the rows whose receipt this process holds, and return their
    settle (one fenced statement, the log line and the metrics) for the caller
    to run when it chooses. ``run`` settles at once; so does ``outbox worker``,
    on the thread that sent the batch, while its next batch is sending.

    Once ``stop`` is set (the worker's SIGTERM), no further call starts, and
    the rows not begun go back to pending with no attempt counted. With
    ``stop_grace``, calls still running that long after the stop are given up
    as retries, because their outcome is unknown. The process can then settle
    and exit within a container's stop grace instead of waiting for the
    calls' deadlines.

    ``channel_paused``: the channel was paused after these rows were claimed,
    so none is sent; each goes back to pending with no attempt counted.

    A batch that heard a throttling or quota answer is settled before this
    returns, so that its pauses are written before the caller claims again.

    For ``outbox worker``, which claims its next batch while the last calls
    of a batch run: ``limits`` (what this batch learns, heeding
    the batch before it), ``last_round`` (set once no more rows of this batch
    wait than it has send threads) and ``settle_after`` (waits for the
    settle of the batch before, which must be written first: its pauses
    before this batch's rows go back).

    ``settle_first_wave`` (the Lambda sender): when the rows are several
    tenants', the rows of the first round of calls that came to a final
    outcome (delivered, failed, suppressed) are settled as soon as that
    round is answered, by the send thread that recorded its last answer,
    while the other threads send on. A tenant's few rows go first in the
    batch's order (the fair share), so their outcomes are written a wave
    after the call rather than after the event's last wave (docs/design.md,
    Tenants). One tenant's event settles once, as before."""
    if report is None:
        report = SendReport(received=len(rows), owned=len(rows))
    if channel is None:
        channel, missing = channels.load(channel_name)
    else:
        missing = channels.missing_piece(channel)
    backoff = settings.backoff()
    owned = {r.id for r in rows}
    throttled: dict[str, store.Throttled] = {}
    quota: tuple[str, float | None] | None = None
    settled_early: set[int] = set()  # rows the first wave's settle wrote
    if limits is None:
        limits = Limits()
    if channel_paused:
        results: dict[int, _Result] = {r.id: (_CHANNEL_PAUSED, None) for r in rows}
    elif missing is not None or channel is None:
        # Nothing here can send this channel. Fail the rows at once with the
        # reason, rather than let them come back again and again until dead.
        reason = missing or f"channel {channel_name!r} is unavailable"
        log.error("channel cannot send; rows failed", extra={"channel": channel_name})
        results = {r.id: (Outcome.failed(reason), None) for r in rows}
    else:
        margin = settings.settle_margin_seconds
        lambda_left = remaining_seconds()
        # One Deadline per distinct lease end, so the rows of one claim share one.
        shared: dict[float, Deadline] = {}
        deadlines = {}
        for r in rows:
            seconds = min(r.lease_left_seconds, lambda_left) - margin
            deadline = shared.get(seconds)
            if deadline is None:
                deadline = shared[seconds] = Deadline(seconds)
            deadlines[r.id] = deadline
        min_call_seconds = min(MIN_CALL_SECONDS, settings.sender_timeout_seconds / 20)
        # Rows whose destination another sender paused since the claim (a
        # throttle it heard) go back unsent, as the receipt found them.
        sending = [r for r in rows if not r.destination_paused]
        settle_early = None
        if settle_first_wave and len({r.tenant for r in sending}) > 1:

            def settle_early(answered: dict[int, _Result]) -> None:
                final = [r for r in sending if _is_final(answered.get(r.id))]
                if not final:
                    return
                ids = {r.id for r in final}
                try:
                    _settle(
                        engine, channel_name, _settlements(final, answered), backoff, ids, report
                    )
                except Exception:
                    # Not lost: these rows settle with the rest of the event.
                    log.warning("early settle failed; settled with the event", exc_info=True)
                    return
                settled_early.update(ids)

        results = {}
        if sending:
            results = _send_all(
                channel,
                sending,
                deadlines,
                settings.send_concurrency,
                stop,
                min_call_seconds,
                stop_grace,
                limits,
                last_round,
                settle_early,
            )
        results.update((r.id, (_DESTINATION_PAUSED, None)) for r in rows if r.destination_paused)
        throttled, quota = limits.records()
        if throttled:
            report.resumes_at = time.monotonic() + min(t.pause_left() for t in throttled.values())

    if settled_early:
        rows = [r for r in rows if r.id not in settled_early]
        owned -= settled_early
    settlements = _settlements(rows, results)
    # The rows whose own call a destination refused (a throttling answer),
    # by destination: such a call counts an attempt once the destination has
    # refused every call for long (store.REFUSING_AFTER_SECONDS).
    refused_calls = {
        row.id: row.destination
        for row in rows
        if results[row.id][0].pause == DESTINATION and results[row.id][1] is not None
    }
    limits.heeding = None  # (the rows of a channel that sent none kept it)
    if last_round is not None:
        last_round.set()  # (a batch that sent nothing, or ended early)

    def settle() -> SendReport:
        if settle_after is not None:
            settle_after()
        return _settle(
            engine,
            channel_name,
            settlements,
            backoff,
            owned,
            report,
            throttled,
            quota,
            refused_calls,
        )

    if throttled or quota:
        settled = settle()
        return lambda: settled
    return settle


def _is_final(result: _Result | None) -> bool:
    """Whether an answered call came to an outcome that no pause or retry
    order depends on, so it may be settled before the rest of its batch."""
    return result is not None and result[0].pause is None and result[0].kind in _FINAL


def _settlements(
    rows: list[store.ClaimedMessage], results: dict[int, _Result]
) -> list[store.Settlement]:
    """The settlement of each row, from its result."""
    return [
        # Settlement's fields in order: id, claim_token, outcome, error,
        # provider_message_id, delay_seconds, duration_ms. They are given by
        # position because building a NamedTuple by keyword costs more, and
        # this runs for every row (bench/README.md, "The relay's own overhead,
        # second round", change 5). The error is a channel's text, perhaps a remote server's,
        # so it is scrubbed and bounded before it is stored, logged or
        # published.
        store.Settlement(
            row.id,
            row.claim_token,
            outcome.kind,
            scrub_optional(outcome.error),
            outcome.provider_message_id,
            outcome.delay_seconds,
            duration_ms,
        )
        if outcome.pause is None
        # Throttled, or a quota used up. The pause, written with the settle,
        # holds the destination or channel back, and the row counts nothing.
        else store.Settlement(
            row.id,
            row.claim_token,
            AttemptOutcome.NOT_STARTED,
            outcome.error,
            None,
            None,
            duration_ms,
        )
        for row in rows
        for outcome, duration_ms in [results[row.id]]
    ]


def _count_refused_calls(
    settlements: list[store.Settlement], refused_calls: dict[int, str], refusing: set[str]
) -> list[store.Settlement]:
    """The settlements with each call that a destination refusing every call
    for long refused (``refused_calls``: row id -> destination) counted as an
    attempt (a retry: backed off, dead after max_attempts), the reason said."""
    minutes = int(store.REFUSING_AFTER_SECONDS // 60)
    return [
        s._replace(
            outcome=AttemptOutcome.RETRY,
            error=f"{s.error}; the destination refused every call for {minutes}+ min: "
            "counted as an attempt",
        )
        if refused_calls.get(s.id) in refusing
        else s
        for s in settlements
    ]


def _settle(
    engine: sa.Engine,
    channel_name: str,
    settlements: list[store.Settlement],
    backoff: store.Backoff,
    owned: set[int],
    report: SendReport,
    throttled: dict[str, store.Throttled] | None = None,
    quota: tuple[str, float | None] | None = None,
    refused_calls: dict[int, str] | None = None,
) -> SendReport:
    with engine.begin() as conn:
        if throttled or quota:
            # This comes first, in the same transaction, so that no claim can
            # take the rows the settle gives back before their destination or
            # channel is paused.
            refusing = store.record_throttling(conn, channel_name, throttled or {}, quota)
            if refusing:
                settlements = _count_refused_calls(settlements, refused_calls or {}, refusing)
        settled = store.settle_with_outcomes(conn, settlements, backoff)
    if throttled:
        count("Throttled", sum(t.answers for t in throttled.values()), channel=channel_name)
        log.warning(
            "destination asked to slow down; paused",
            extra={"channel": channel_name, "destinations": len(throttled)},
        )
    if quota:
        count("QuotaPaused", 1, channel=channel_name)
        log.error(
            "quota spent; channel paused", extra={"channel": channel_name, "reason": quota[0]}
        )

    lost = sorted(owned - set(settled))
    if lost:
        report.lease_lost.extend(lost)
        count("LeaseLost", len(lost), channel=channel_name)
        log.warning("lease lost before settle; outcome abandoned", extra={"message_ids": lost})
    # One log line per batch, not per message, with the ids by status and the
    # errors by id.
    ids_by_status: dict[str, list[int]] = {}
    errors: dict[int, str] = {}
    for s in settlements:
        row = settled.get(s.id)
        if row is None:
            continue
        # A pending row says whether it was deferred or not started. A deferral
        # past the limit was counted as a retry, so it is reported as pending.
        key = row.outcome if row.status == "pending" and row.outcome in _NOT_COUNTED else row.status
        ids_by_status.setdefault(key, []).append(s.id)
        if s.error:
            errors[s.id] = s.error
    for key, ids in ids_by_status.items():
        report.statuses[key] += len(ids)
        count(_METRIC[key], len(ids), channel=channel_name)
    if ids_by_status:
        log.info(
            "settled",
            extra={
                "channel": channel_name,
                "message_ids": ids_by_status,
                "errors": errors,
                "max_duration_ms": max((s.duration_ms or 0) for s in settlements),
            },
        )
    timings(  # only the provider calls made: a row not started or refused made none
        "SendMilliseconds",
        [s.duration_ms for s in settlements if s.duration_ms is not None and s.id in settled],
        channel=channel_name,
    )
    return report


class _Batch:
    """The rows of one batch while the send threads work through them.

    Every thread runs ``drain``: it takes a row, sends it, records the
    result and takes the next row, until none is left or the batch is
    closed. One task per thread, rather than one future per row, saves a
    lock, a condition and a queue hand-over per message. ``waiting``,
    ``running``, ``results``, ``slowest``, the call counts and ``closed`` change only under
    ``lock``; the other fields never change."""

    def __init__(
        self,
        channel: Channel,
        rows: list[store.ClaimedMessage],
        deadlines: dict[int, Deadline],
        stop: threading.Event | None,
        min_call_seconds: float,
        limits: Limits | None,
        last_round: threading.Event | None = None,
        last_round_rows: int = 0,
        settle_early: Callable[[dict[int, _Result]], None] | None = None,
        first_wave: int = 0,
    ) -> None:
        self.channel = channel
        self.rows = rows
        self.deadlines = deadlines
        self.stop = stop
        self.limits = limits
        # Until a call of this batch is answered; then ``slowest`` replaces it.
        self.min_call_seconds = min_call_seconds
        self.lock = threading.Lock()
        self.waiting = deque(rows)  # not yet taken by a thread
        self.running: dict[int, float] = {}  # row id -> when its call began
        self.results: dict[int, _Result] = {}
        self.slowest: float | None = None  # of the calls answered so far, in seconds
        self.calls = 0  # provider calls answered
        self.slow_calls = 0  # of them, those that took FAST_CALL_SECONDS or more
        self.closed = False  # once set, no thread takes a further row
        # Set once no more rows wait than there are send threads: one round of
        # calls is left to start, so the next batch's claim (about a call's
        # time) ends as these threads come free.
        self.last_round = last_round
        self.last_round_rows = last_round_rows
        # Called once, with the results so far, when ``first_wave`` calls are
        # answered and rows still wait (send_then_settle's settle_first_wave);
        # ``settled_early`` is set once it has returned.
        self.settle_early = settle_early
        self.first_wave = first_wave
        self.settled_early = threading.Event()
        if settle_early is None:
            self.settled_early.set()

    def _take(self) -> store.ClaimedMessage | None:
        """The next row, marked as running, or None when the batch is done.
        The caller holds the lock."""
        if self.closed or not self.waiting:
            return None
        row = self.waiting.popleft()
        self.running[row.id] = time.monotonic()
        if self.last_round is not None and len(self.waiting) <= self.last_round_rows:
            self.last_round.set()
        return row

    def drain(self) -> None:
        """Send rows one after another until none is left: each send thread's task."""
        with self.lock:
            row = self._take()
        while row is not None:
            # Read without the lock: an answer that lands meanwhile counts
            # from the next row on.
            min_call_seconds = self.min_call_seconds if self.slowest is None else self.slowest
            result = _send_one(
                self.channel,
                row,
                self.deadlines[row.id],
                self.stop,
                min_call_seconds,
                self.limits,
            )
            with self.lock:  # the row's result and the next row in one hold of the lock
                del self.running[row.id]
                # A row given up at its deadline keeps that outcome.
                answered = self.results.setdefault(row.id, result) is result
                if answered and result[1] is not None:  # a provider call was made
                    seconds = result[1] / 1000
                    if self.slowest is None or seconds > self.slowest:
                        self.slowest = seconds
                    self.calls += 1
                    if seconds >= FAST_CALL_SECONDS:
                        self.slow_calls += 1
                settle_early = self.settle_early
                if (
                    settle_early is None
                    or len(self.results) < self.first_wave
                    or not self.waiting
                    or self.closed
                ):
                    row = self._take()
                    continue
                self.settle_early = None  # once
                results_so_far = dict(self.results)
            # This thread settles the first wave, then takes its next row.
            try:
                settle_early(results_so_far)
            finally:
                self.settled_early.set()
            with self.lock:
                row = self._take()

    def slow_call_running(self, now: float) -> bool:
        """Whether rows are waiting while a call has run ``FAST_CALL_SECONDS``."""
        with self.lock:
            return bool(self.waiting) and any(
                now - began >= FAST_CALL_SECONDS for began in self.running.values()
            )

    def close(self, cut_by_stop: bool) -> tuple[dict[int, _Result], bool]:
        """End the batch: no thread takes a further row. Returns the outcome of
        every row, and whether a call is still running. A row that no thread
        took was not started. A call still running is given up, and counts
        as a retry because its outcome is unknown. Once closed, no later
        answer changes a result or ``slowest``."""
        with self.lock:
            self.closed = True
            stuck = bool(self.running)
            now = time.monotonic()
            for row in self.rows:
                if row.id not in self.results:
                    began = self.running.get(row.id)
                    self.results[row.id] = (
                        (_STOPPED if cut_by_stop else _NOT_STARTED, None)
                        if began is None
                        else (
                            Outcome.retry(
                                STOP_GRACE_EXCEEDED if cut_by_stop else DEADLINE_EXCEEDED
                            ),
                            int((now - began) * 1000),
                        )
                    )
            return dict(self.results), stuck


def _send_all(
    channel: Channel,
    rows: list[store.ClaimedMessage],
    deadlines: dict[int, Deadline],
    concurrency: int,
    stop: threading.Event | None = None,
    min_call_seconds: float = MIN_CALL_SECONDS,
    stop_grace: float | None = None,
    limits: Limits | None = None,
    last_round: threading.Event | None = None,
    settle_early: Callable[[dict[int, _Result]], None] | None = None,
) -> dict[int, _Result]:
    """Send every row, up to ``concurrency`` at once. A call still running at
    its deadline is given up (its outcome is unknown, so it counts as a
    retry), and a row that no thread reached by then is not started. Once
    ``stop`` is set, that deadline is at most ``stop_grace`` seconds away.

    A channel whose calls all came back within ``FAST_CALL_SECONDS`` last
    time starts on one thread, and the other threads join as soon as a call
    runs that long.

    ``settle_early``: called once, on a send thread, with the results of the
    first round of calls while rows still wait; returned from only after it
    has returned."""
    # Even a single row goes through the send threads, because only a caller
    # that waits apart from the call can give up on a call that hangs past
    # its deadline.
    threads = sendpool.pools.get(concurrency)
    wanted = min(concurrency, len(rows))
    batch = _Batch(
        channel,
        rows,
        deadlines,
        stop,
        min_call_seconds,
        limits,
        last_round,
        concurrency,
        settle_early,
        wanted,
    )
    narrow = wanted > 1 and _calls_were_fast.get(channel.name, False)
    countdown = threads.start(batch.drain, 1 if narrow else wanted)
    ends = time.monotonic() + max(d.remaining() for d in set(deadlines.values()))
    grace = _FOREVER if stop is None or stop_grace is None else stop_grace
    unseen_stop = stop if grace < _FOREVER else None  # checked until it is seen set
    cut_by_stop = False
    while not countdown.wait(
        min(
            ends - time.monotonic(),
            FAST_CALL_SECONDS if narrow else _FOREVER,
            _FOREVER if unseen_stop is None else STOP_POLL_SECONDS,
        )
    ):
        now = time.monotonic()
        if unseen_stop is not None and unseen_stop.is_set():
            unseen_stop = None  # the grace runs from the first check that sees the stop
            if now + grace < ends:
                ends, cut_by_stop = now + grace, True
        if now >= ends:
            break
        if not narrow:
            continue  # woken only to check for the stop; every thread is sending already
        if batch.slow_call_running(now):
            threads.add(countdown, batch.drain, wanted - 1)
            narrow = False
    results, stuck = batch.close(cut_by_stop)
    # Its rows must not be settled twice: the caller leaves out what it wrote.
    batch.settled_early.wait()
    _calls_were_fast[channel.name] = batch.calls > 0 and 2 * batch.slow_calls < batch.calls
    if stuck:
        # Do not wait for calls stuck past their deadline (they hold no claim
        # now), and do not let them occupy the threads of the next batch.
        sendpool.pools.retire(threads)
    return results
