"""All SQL of the state machine, and nothing else: one module per audience.

    delivery        the hot path: the dispatcher's claim and release, the
                    sender's receipt and settle (and the worker's claim-and-receive)
    upkeep          the reaper: expired leases, deliver-by times, held rows,
                    retention, backlog figures
    enqueue         the producer: ``outbox.enqueue`` and ``enqueue_many``
    operator        the ``outbox`` command: reads, redrive, cancel, prune, pause
    feedback        provider feedback (SES bounces and complaints)
    outcome_events  the transitions published to EventBridge
    pacing          the dispatcher's next wake-up when it goes to sleep
    policy          the retry policy and the SQL fragments that apply it
    rates           destinations' pauses and learned rates (throttling, quotas)
    _sql            how statements are written and parameters encoded

The names below are the whole API; every module keeps its statements private.

The states and their transitions are drawn once, in docs/design.md (State
machine); ``outbox.states`` names them.

An ordering key runs one row at a time, in id order (= commit order: enqueue
takes a transaction-scoped advisory lock per key). A row that ends failed, dead
or expired holds its key's later rows (they stay pending, "held") until an
operator redrives or cancels it; rows enqueued with
``on_predecessor_failure='cancel'`` are cancelled instead, by the reaper.

Transitions to failed, dead, expired, bounced and complained (and delivered,
when turned on) also write an ``outbox_outcome_event`` row: a trigger of the
schema does it in the same statement, so no statement here has to remember.

Rules every statement here keeps (docs/design.md, invariants 1-7):
* the claim is one compare-and-set UPDATE over ``FOR UPDATE SKIP LOCKED`` rows;
* a claim is sent at most once: the sender's receipt is a compare-and-set too
  (``received_at`` stamped on a claimed, unreceived row of a live lease);
* every write after a claim is fenced on (id, status = 'claimed', claim_token);
* every time comes from the database clock, ``now()``; Python only supplies
  durations (lease, delays, backoff parameters);
* batches are written by one statement over arrays (``unnest``) or one JSON
  document, never a loop; every parameter follows the one convention of ``_sql``.
"""

from ..limits import check_destination, check_limit
from ._sql import array_literal
from .cooldown import prune_cooldowns
from .delivery import (
    ChannelLoad,
    Claim,
    ClaimedMessage,
    Held,
    Settled,
    Settlement,
    channel_load,
    claim,
    claim_and_receive,
    receive_claimed,
    release,
    settle,
    settle_with_outcomes,
    unowned_claims,
)
from .enqueue import (
    Enqueued,
    NewMessage,
    insert_messages,
    payload_json,
)
from .feedback import (
    Feedback,
    FeedbackResult,
    record_feedback,
)
from .operator import (
    ChannelStatusCount,
    PausedChannel,
    attempt_history,
    cancel,
    channel_has_rows,
    channel_status_counts,
    channels_with_rows,
    count_prunable,
    get_message,
    list_messages,
    matching_ids,
    pause_channel,
    paused_channels,
    prune_cutoff,
    prune_settled_before,
    recipient_history,
    redrive,
    resume_channel,
    statuses_of,
    uncancel,
)
from .outcome_events import (
    OutcomeEvent,
    drop_outcome_events,
    finish_outcome_events,
    outcome_event_backlog,
    set_delivered_outcome_events,
    take_outcome_events,
)
from .pacing import NextWake, next_wake
from .policy import (
    Backoff,
    bounded_delay,
)
from .rates import (
    AppliedLimits,
    DestinationFigures,
    Throttled,
    apply_configured_limits,
    channel_paused,
    clear_limit,
    destination_figures,
    next_resume,
    record_throttling,
    set_limit,
    set_provider_limit,
)
from .upkeep import (
    LEASE_EXPIRED_ERROR,
    NOT_STARTED_ERROR,
    Backlog,
    ChannelBacklog,
    Reaped,
    backlog,
    cancel_held,
    channel_backlog,
    expire_overdue,
    held_count,
    prune,
    prune_attempts,
    prune_dedupe_keys,
    reap_expired,
)

__all__ = [
    "LEASE_EXPIRED_ERROR",
    "NOT_STARTED_ERROR",
    "AppliedLimits",
    "Backlog",
    "Backoff",
    "ChannelBacklog",
    "ChannelLoad",
    "ChannelStatusCount",
    "Claim",
    "ClaimedMessage",
    "DestinationFigures",
    "Enqueued",
    "Feedback",
    "FeedbackResult",
    "Held",
    "NewMessage",
    "NextWake",
    "OutcomeEvent",
    "PausedChannel",
    "Reaped",
    "Settled",
    "Settlement",
    "Throttled",
    "apply_configured_limits",
    "array_literal",
    "attempt_history",
    "backlog",
    "bounded_delay",
    "cancel",
    "cancel_held",
    "channel_backlog",
    "channel_has_rows",
    "channel_load",
    "channel_paused",
    "channel_status_counts",
    "channels_with_rows",
    "check_destination",
    "check_limit",
    "claim",
    "claim_and_receive",
    "clear_limit",
    "count_prunable",
    "destination_figures",
    "drop_outcome_events",
    "expire_overdue",
    "finish_outcome_events",
    "get_message",
    "held_count",
    "insert_messages",
    "list_messages",
    "matching_ids",
    "next_resume",
    "next_wake",
    "outcome_event_backlog",
    "pause_channel",
    "paused_channels",
    "payload_json",
    "prune",
    "prune_attempts",
    "prune_cooldowns",
    "prune_cutoff",
    "prune_dedupe_keys",
    "prune_settled_before",
    "reap_expired",
    "receive_claimed",
    "recipient_history",
    "record_feedback",
    "record_throttling",
    "redrive",
    "release",
    "resume_channel",
    "set_delivered_outcome_events",
    "set_limit",
    "set_provider_limit",
    "settle",
    "settle_with_outcomes",
    "statuses_of",
    "take_outcome_events",
    "uncancel",
    "unowned_claims",
]
