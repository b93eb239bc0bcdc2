"""All SQL of the state machine, and nothing else: one module per audience.

    delivery        the hot path: the dispatcher's claim and release, the
                    sender's receipt and settle (and the worker's claim-and-receive)
    upkeep          the reaper: expired leases, deliver-by times, held rows,
                    retention, backlog figures
    enqueue         the producer: ``outbox.enqueue`` and ``enqueue_many``
    operator        the ``outbox`` command: reads, redrive, cancel, prune, pause
    history         the settled rows' day partitions: made ahead, dropped whole
    feedback        provider feedback (SES bounces and complaints)
    outcome_events  the transitions published to EventBridge
    pacing          the dispatcher's next wake-up when it goes to sleep
    policy          the retry policy and the SQL fragments that apply it
    rates           destinations' pauses and learned rates (throttling, quotas)
    cooldown        the cooldown per key the claim and settle include
    tenants         what an operator sets per tenant (weight, pause, roles, secrets)
    _sql            how statements are written and parameters encoded

Each module's ``__all__`` is its part of the API, all of it imported here;
every module keeps its statements private.

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

from ..limits import check_destination as check_destination
from ..limits import check_limit as check_limit
from ._sql import array_literal as array_literal
from .cooldown import *
from .delivery import *
from .enqueue import *
from .feedback import *
from .history import *
from .operator import *
from .outcome_events import *
from .pacing import *
from .policy import *
from .rates import *
from .tenants import *
from .upkeep import *
