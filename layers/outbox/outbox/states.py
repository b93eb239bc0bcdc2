"""The names of the state machine: a message's status and an attempt's outcome.

Both are ``StrEnum``s, so a member is the very string stored in the
database (``Status.DELIVERED == "delivered"``) and travels as one in JSON,
SQL parameters and logs; the groups below are the sets the state machine
and the operator commands are defined over (docs/design.md, State machine),
as tuples in the order above, so whatever lists them lists them alike.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum


class Status(StrEnum):
    """``outbox_message.status``."""

    PENDING = "pending"
    CLAIMED = "claimed"
    DELIVERED = "delivered"
    FAILED = "failed"
    DEAD = "dead"
    SUPPRESSED = "suppressed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    BOUNCED = "bounced"
    COMPLAINED = "complained"

    @classmethod
    def parse(
        cls, value: str, allowed: Collection[Status] | None = None, verb: str = "use"
    ) -> Status:
        """``value`` as one of the ``allowed`` statuses (default: any), or
        ValueError naming the choices: the one check of a status given from
        outside (the CLI's options, the store's operator statements)."""
        choices = ", ".join(s for s in cls if allowed is None or s in allowed)
        try:
            status = cls(value)
        except ValueError:
            raise ValueError(f"unknown status {value!r}; choose from {choices}") from None
        if allowed is not None and status not in allowed:
            raise ValueError(f"cannot {verb} status {value!r}; choose from {choices}")
        return status


STATUSES = tuple(Status)
# Settled for good (settled_at set): nothing but an operator moves them again.
TERMINAL_STATUSES = tuple(s for s in Status if s not in (Status.PENDING, Status.CLAIMED))
# Did not succeed, and sending again may help: an operator's redrive takes them
# back to pending. They hold the later rows of their ordering key, and are kept
# past the routine retention (UNRESOLVED_RETENTION_DAYS).
UNRESOLVED_STATUSES = (Status.FAILED, Status.DEAD, Status.EXPIRED)
REDRIVABLE_STATUSES = UNRESOLVED_STATUSES
# Pending rows, and the rows that hold their ordering key: cancelling a held
# head is how an operator lets its successors go without sending it again.
CANCELLABLE_STATUSES = (Status.PENDING, *UNRESOLVED_STATUSES)


class AttemptOutcome(StrEnum):
    """``outbox_attempt.outcome``: how one attempt (or one provider event about
    it) ended."""

    # what a channel's send can come to (channels.Outcome.kind)
    DELIVERED = "delivered"
    RETRY = "retry"
    FAILED = "failed"
    SUPPRESSED = "suppressed"
    DEFERRED = "deferred"
    # what the state machine makes of it
    DEAD = "dead"
    EXPIRED = "expired"
    NOT_STARTED = "not_started"
    # provider feedback on a delivered message
    BOUNCED = "bounced"
    COMPLAINED = "complained"
    TRANSIENT_BOUNCE = "transient_bounce"
    DELIVERY_CONFIRMED = "delivery_confirmed"


SEND_OUTCOMES = (
    AttemptOutcome.DELIVERED,
    AttemptOutcome.RETRY,
    AttemptOutcome.FAILED,
    AttemptOutcome.SUPPRESSED,
    AttemptOutcome.DEFERRED,
)
# What a sender settles: a channel's outcomes, and not_started for a row whose
# call it never began (its deadline came first). That is capacity's fault, not
# the message's: no attempt and no deferral are counted for it.
SETTLE_OUTCOMES = (*SEND_OUTCOMES, AttemptOutcome.NOT_STARTED)
FEEDBACK_OUTCOMES = (
    AttemptOutcome.BOUNCED,
    AttemptOutcome.COMPLAINED,
    AttemptOutcome.TRANSIENT_BOUNCE,
    AttemptOutcome.DELIVERY_CONFIRMED,
)


class PredecessorFailure(StrEnum):
    """``outbox_message.on_predecessor_failure``: what a row does when an
    earlier row of its ordering key ends failed, dead or expired."""

    HOLD = "hold"
    CANCEL = "cancel"


class CooldownAction(StrEnum):
    """``outbox_message.on_cooldown``: what a row does when another message of
    its (channel, cooldown_key) was delivered within that one's window."""

    WAIT = "wait"
    SUPPRESS = "suppress"
