"""The producer's statement: enqueue through the producer door, with dedupe
per recipient and the per-ordering-key lock (what ``outbox.enqueue`` and
``enqueue_many`` run)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa

from ..errors import DedupeConflict, OutboxError, ValidationError
from ..settings import OUTBOX_SCHEMA
from ..states import CooldownAction, PredecessorFailure
from ._sql import array_literal, statement

__all__ = [
    "Enqueued",
    "NewMessage",
    "insert_messages",
    "payload_json",
]


@dataclass(frozen=True)
class NewMessage:
    channel: str
    payload_json: str
    dedupe_key: str | None = None
    ordering_key: str | None = None
    priority: int = 0
    delay_seconds: float = 0.0
    max_attempts: int | None = None
    # ISO 8601 with a zone, or None: the relay's default deliver-by.
    expires_at: str | None = None
    ttl_seconds: float | None = None
    on_predecessor_failure: str = PredecessorFailure.HOLD
    # At most one message per (channel, cooldown_key) delivered within a window
    # (docs/design.md, invariant 11): the window in seconds, or None for none.
    cooldown_seconds: float | None = None
    cooldown_key: str | None = None
    on_cooldown: str = CooldownAction.WAIT
    # The message's tenant (None: none, or the producer role's bound one).
    tenant: str | None = None


def payload_json(payload: Any) -> str:
    """A payload's JSON text, laid out as Postgres's jsonb writes it back
    (``", "`` and ``": "``), so that its length is the stored size the limit
    is measured on (``outbox.payloads.stored_size``)."""
    return json.dumps(payload, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)


# Producers have no privilege on the relay's tables: they write through the
# enqueue functions of migration 0009, which run as the migrator with the
# relay's schema pinned (the "producer door"). outbox_enqueue_many is the
# batch one: the rows travel as parallel arrays (the payloads as one JSON
# array), are checked, and are written by one statement inside it, dedupe per
# (channel, dedupe_key, recipient) and the ordering-key locks included. It is
# called by its schema's name (OUTBOX_SCHEMA), never through the caller's
# search_path, where a schema named after the caller could shadow it.
_ENQUEUE_MANY = """
    SELECT * FROM "{schema}".outbox_enqueue_many(
        CAST(:channels AS text[]), CAST(:payloads AS jsonb), CAST(:dedupe_keys AS text[]),
        CAST(:ordering_keys AS text[]), CAST(:priorities AS int[]), CAST(:delays AS float8[]),
        CAST(:max_attempts AS int[]), CAST(:expires_at AS timestamptz[]),
        CAST(:ttls AS float8[]), CAST(:on_predecessor_failure AS text[]){cooldown}{tenant})
"""
# The cooldown options go by name, and only when a message has one: a batch
# without them is the call every release since 0009 understands, so a producer
# upgraded before `outbox migrate` ran keeps working for it.
_COOLDOWN_ARGUMENTS = """,
        p_cooldowns => CAST(:cooldowns AS float8[]),
        p_cooldown_keys => CAST(:cooldown_keys AS text[]),
        p_on_cooldown => CAST(:on_cooldown AS text[])"""
# The tenants likewise (migration 0022), only when a message names one: a
# producer whose role is bound to a tenant names none and gets that one.
_TENANT_ARGUMENTS = """,
        p_tenants => CAST(:tenants AS text[])"""


@functools.lru_cache(maxsize=16)
def _enqueue_many(schema: str, cooldown: bool, tenant: bool) -> sa.TextClause:
    return statement(
        _ENQUEUE_MANY.format(
            schema=schema,
            cooldown=_COOLDOWN_ARGUMENTS if cooldown else "",
            tenant=_TENANT_ARGUMENTS if tenant else "",
        )
    )


def outbox_schema() -> str:
    """The schema of the outbox (OUTBOX_SCHEMA, checked to be a plain identifier)."""
    return OUTBOX_SCHEMA.read(os.environ)


class Enqueued(NamedTuple):
    """The id of an enqueued message, and whether this call created it (False:
    a replay of its (channel, dedupe_key, recipient) returned the existing one)."""

    id: int
    created: bool


def insert_messages(conn: sa.Connection, messages: Sequence[NewMessage]) -> list[Enqueued]:
    """Insert validated messages in one statement; returns their ids in order.

    A (channel, dedupe_key, recipient) that already exists, or repeats within
    the list, with the same payload yields the existing id; with another
    payload, DedupeConflict is raised and nothing is written. A message the
    database refuses (the size limit, measured on what it stores) raises
    ValidationError with ``index`` set, and nothing is written.
    """
    if not messages:
        return []
    params = {
        "channels": array_literal([m.channel for m in messages]),
        # the payloads travel as one JSON array (canonical JSON text already)
        "payloads": "[" + ",".join(m.payload_json for m in messages) + "]",
        "dedupe_keys": array_literal([m.dedupe_key for m in messages]),
        "ordering_keys": array_literal([m.ordering_key for m in messages]),
        "priorities": array_literal(m.priority for m in messages),
        "delays": array_literal(float(m.delay_seconds) for m in messages),
        "max_attempts": array_literal(m.max_attempts for m in messages),
        "expires_at": array_literal([m.expires_at for m in messages]),
        "ttls": array_literal(m.ttl_seconds for m in messages),
        "on_predecessor_failure": array_literal([m.on_predecessor_failure for m in messages]),
    }
    cooldown = any(m.cooldown_key is not None for m in messages)
    if cooldown:
        params["cooldowns"] = array_literal(m.cooldown_seconds for m in messages)
        params["cooldown_keys"] = array_literal([m.cooldown_key for m in messages])
        params["on_cooldown"] = array_literal(
            [None if m.cooldown_key is None else m.on_cooldown for m in messages]
        )
    tenant = any(m.tenant is not None for m in messages)
    if tenant:
        params["tenants"] = array_literal([m.tenant for m in messages])
    rows = conn.execute(_enqueue_many(outbox_schema(), cooldown, tenant), params).all()
    first = rows[0]
    if first.refused_field is not None:
        refused = ValidationError(first.refused_field, first.refused_problem)
        refused.index = first.ord - 1  # type: ignore[attr-defined]
        raise refused
    conflict = next((r for r in rows if r.conflict), None)
    if conflict is not None:
        index = conflict.ord - 1
        message = messages[index]
        raise DedupeConflict(
            message.channel,
            str(message.dedupe_key),
            index=index,
            existing_id=conflict.held_id,
            first_index=None if conflict.held_id is not None else conflict.first_ord - 1,
        )
    if any(r.id is None for r in rows):
        raise OutboxError("dedupe keys kept changing under a concurrent enqueue; try again")
    return [Enqueued(r.id, r.created) for r in rows]
