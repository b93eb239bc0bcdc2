"""What an operator sets per tenant (``outbox tenant ...``; migration 0022):
the weight and pause the claim reads, a producer role bound to one tenant,
and the webhook signing secrets mapped to a tenant; and per tenant and
channel (migration 0024: ``outbox pause CHANNEL --tenant T``, ``outbox limit
set CHANNEL --tenant T``) a pause and a rate limit, which the claim reads."""

from __future__ import annotations

from typing import NamedTuple

import sqlalchemy as sa

from ..errors import ValidationError
from ..limits import check_limit
from ..tenants import check_tenant
from ._sql import check_channels, statement

__all__ = [
    "TenantChannel",
    "TenantSettings",
    "bind_role",
    "clear_tenant_limit",
    "map_secret",
    "pause_tenant_channel",
    "resume_tenant_channel",
    "set_tenant",
    "set_tenant_limit",
    "tenant_channels",
    "tenant_settings",
    "unbind_role",
    "unmap_secret",
]


class TenantSettings(NamedTuple):
    """One tenant as an operator set it, and what is bound and mapped to it."""

    tenant: str
    weight: int
    paused: bool
    roles: list[str]
    secrets: list[str]


_SET_TENANT = statement(
    """
    INSERT INTO outbox_tenant AS t (tenant, weight, paused)
    VALUES (:tenant, COALESCE(CAST(:weight AS int), 1), COALESCE(CAST(:paused AS boolean), false))
    ON CONFLICT (tenant) DO UPDATE SET
        weight = COALESCE(CAST(:weight AS int), t.weight),
        paused = COALESCE(CAST(:paused AS boolean), t.paused),
        updated_at = now()
    """
)
_SETTINGS = statement(
    """
    SELECT n.tenant, COALESCE(t.weight, 1) AS weight, COALESCE(t.paused, false) AS paused,
           ARRAY(SELECT r.role_name FROM outbox_tenant_role AS r
                 WHERE r.tenant = n.tenant ORDER BY 1) AS roles,
           ARRAY(SELECT s.secret_id FROM outbox_tenant_secret AS s
                 WHERE s.tenant = n.tenant ORDER BY 1) AS secrets
    FROM (SELECT tenant FROM outbox_tenant
          UNION SELECT tenant FROM outbox_tenant_role
          UNION SELECT tenant FROM outbox_tenant_secret) AS n
    LEFT JOIN outbox_tenant AS t ON t.tenant = n.tenant
    WHERE CAST(:tenant AS text) IS NULL OR n.tenant = CAST(:tenant AS text)
    ORDER BY n.tenant
    """
)
_BIND = statement(
    """
    INSERT INTO outbox_tenant_role (role_name, tenant) VALUES (:role, :tenant)
    ON CONFLICT (role_name) DO UPDATE SET tenant = EXCLUDED.tenant, created_at = now()
    """
)
_ROLE_EXISTS = statement("SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = :role")
_UNBIND = statement("DELETE FROM outbox_tenant_role WHERE role_name = :role")
_MAP = statement(
    """
    INSERT INTO outbox_tenant_secret (secret_id, tenant) VALUES (:secret_id, :tenant)
    ON CONFLICT (secret_id) DO UPDATE SET tenant = EXCLUDED.tenant, created_at = now()
    """
)
_UNMAP = statement("DELETE FROM outbox_tenant_secret WHERE secret_id = :secret_id")


def set_tenant(
    conn: sa.Connection, tenant: str, *, weight: int | None = None, paused: bool | None = None
) -> None:
    """Set a tenant's weight in the claim's fair share (1 to 1000; 1 by
    default) or pause it (its rows wait; nobody else's do); None: unchanged."""
    conn.execute(_SET_TENANT, {"tenant": tenant, "weight": weight, "paused": paused})


def tenant_settings(conn: sa.Connection, tenant: str | None = None) -> list[TenantSettings]:
    """Every tenant an operator set something for (or only ``tenant``)."""
    return [TenantSettings(*r) for r in conn.execute(_SETTINGS, {"tenant": tenant})]


def bind_role(conn: sa.Connection, role: str, tenant: str) -> None:
    """Bind a producer's database role (the one its connections log in as) to
    one tenant: the doors write that tenant for it and refuse any other.
    ValueError for a role the database does not have (a typo would bind
    nobody)."""
    if conn.execute(_ROLE_EXISTS, {"role": role}).scalar_one_or_none() is None:
        raise ValueError(f"role: no database role is named {role!r}")
    conn.execute(_BIND, {"role": role, "tenant": tenant})


def unbind_role(conn: sa.Connection, role: str) -> bool:
    """Whether the role was bound (and now is not)."""
    return bool(conn.execute(_UNBIND, {"role": role}).rowcount)


def map_secret(conn: sa.Connection, secret_id: str, tenant: str) -> None:
    """Make a webhook signing secret one tenant's: only that tenant's messages
    may name it (and those of a tenant may name no secret but its own)."""
    conn.execute(_MAP, {"secret_id": secret_id, "tenant": tenant})


def unmap_secret(conn: sa.Connection, secret_id: str) -> bool:
    """Whether the secret was mapped (and now is no tenant's)."""
    return bool(conn.execute(_UNMAP, {"secret_id": secret_id}).rowcount)


# --- a tenant's channel: a pause and a rate limit (migration 0024) -----------

# The most a pause's reason may hold (the table's check).
MAX_REASON_CHARS = 500
# The tokens a tenant's channel bucket holds now: refilled at its limit since
# ``tokens_at``, holding at most its burst (the claim's bucket, store/delivery.py).
TENANT_TOKENS_NOW_SQL = (
    "LEAST(tc.limit_burst, COALESCE(tc.tokens, 0) "
    "+ tc.limit_rate * GREATEST(0, EXTRACT(EPOCH FROM now() - tc.tokens_at)))"
)


class TenantChannel(NamedTuple):
    """What is set for one tenant's channel: a pause, a limit, its bucket."""

    tenant: str
    channel: str
    paused: bool
    reason: str | None
    limit_rate: float | None
    limit_burst: float | None
    tokens: float | None  # the bucket now (None: no limit)


_SET_TENANT_LIMIT = statement(
    """
    INSERT INTO outbox_tenant_channel AS tc
        (tenant, channel, limit_rate, limit_burst, tokens, tokens_at)
    VALUES (:tenant, :channel, :rate, :burst, :burst, now())
    ON CONFLICT (tenant, channel) DO UPDATE SET
        limit_rate = EXCLUDED.limit_rate, limit_burst = EXCLUDED.limit_burst,
        tokens = LEAST(COALESCE(tc.tokens, EXCLUDED.limit_burst), EXCLUDED.limit_burst),
        tokens_at = COALESCE(tc.tokens_at, now()), updated_at = now()
    """
)
_CLEAR_TENANT_LIMIT = statement(
    """
    UPDATE outbox_tenant_channel
    SET limit_rate = NULL, limit_burst = NULL, tokens = NULL, tokens_at = NULL,
        updated_at = now()
    WHERE tenant = :tenant AND channel = :channel AND limit_rate IS NOT NULL
    RETURNING tenant
    """
)
_PAUSE_TENANT_CHANNEL = statement(
    """
    WITH before AS (
        SELECT paused FROM outbox_tenant_channel
        WHERE tenant = :tenant AND channel = :channel FOR UPDATE
    ),
    paused AS (
        INSERT INTO outbox_tenant_channel AS tc (tenant, channel, paused, reason)
        VALUES (:tenant, :channel, true, :reason)
        ON CONFLICT (tenant, channel) DO UPDATE SET
            paused = true, reason = EXCLUDED.reason, updated_at = now()
        WHERE (SELECT count(*) FROM before) >= 0
    )
    SELECT NOT COALESCE((SELECT paused FROM before), false)
    """
)
_RESUME_TENANT_CHANNEL = statement(
    """
    UPDATE outbox_tenant_channel SET paused = false, reason = NULL, updated_at = now()
    WHERE tenant = :tenant AND channel = :channel AND paused
    RETURNING tenant
    """
)
# A row that holds nothing any more goes.
_DROP_EMPTY_TENANT_CHANNEL = statement(
    """
    DELETE FROM outbox_tenant_channel
    WHERE tenant = :tenant AND channel = :channel AND NOT paused AND limit_rate IS NULL
    """
)
_TENANT_CHANNELS = statement(
    f"""
    SELECT tc.tenant, tc.channel, tc.paused, tc.reason, tc.limit_rate, tc.limit_burst,
           CASE WHEN tc.limit_rate IS NOT NULL THEN {TENANT_TOKENS_NOW_SQL} END AS tokens
    FROM outbox_tenant_channel AS tc
    WHERE CAST(:tenant AS text) IS NULL OR tc.tenant = CAST(:tenant AS text)
    ORDER BY tc.tenant, tc.channel
    """
)


def _changed() -> None:
    """This process's claims read the tenants' channels again (delivery.py)."""
    from .delivery import tenant_channels_changed

    tenant_channels_changed()


def _key(tenant: str, channel: str) -> dict[str, str]:
    """The (tenant, channel) key, checked: ValueError before anything is written."""
    if not tenant:
        raise ValueError("tenant: give the tenant's name")
    try:
        check_tenant(tenant)
    except ValidationError as error:
        raise ValueError(str(error)) from None
    check_channels([channel])
    return {"tenant": tenant, "channel": channel}


def set_tenant_limit(
    conn: sa.Connection, tenant: str, channel: str, rate: float, burst: float | None = None
) -> tuple[float, float]:
    """Hold ``tenant``'s messages of ``channel``, whatever their destinations,
    to ``rate`` a second, ``burst`` at once, for every dispatcher and worker
    (a bucket in the database, as a destination's limit is). Returns (rate,
    burst) as stored; ValueError (nothing changed) for a bad one."""
    key = _key(tenant, channel)
    rate, burst = check_limit(rate, burst)
    conn.execute(_SET_TENANT_LIMIT, {**key, "rate": rate, "burst": burst})
    _changed()
    return rate, burst


def clear_tenant_limit(conn: sa.Connection, tenant: str, channel: str) -> bool:
    """Remove the limit; True if there was one."""
    return _unset(conn, _CLEAR_TENANT_LIMIT, tenant, channel)


def _unset(conn: sa.Connection, unset: sa.TextClause, tenant: str, channel: str) -> bool:
    """Run ``unset`` (a limit's or a pause's), then drop the row if it holds
    nothing now; True if there was something to unset."""
    key = _key(tenant, channel)
    was_set = conn.execute(unset, key).first() is not None
    conn.execute(_DROP_EMPTY_TENANT_CHANNEL, key)
    _changed()
    return was_set


def pause_tenant_channel(
    conn: sa.Connection, tenant: str, channel: str, reason: str | None = None
) -> bool:
    """Hold ``tenant``'s messages of ``channel``: they wait, pending, no attempt
    counted (nobody else's do, nor the tenant's other channels'). True if
    they were not paused before."""
    key = _key(tenant, channel)
    if reason is not None and len(reason) > MAX_REASON_CHARS:
        raise ValueError(f"reason: at most {MAX_REASON_CHARS} characters")
    newly = bool(conn.execute(_PAUSE_TENANT_CHANNEL, {**key, "reason": reason}).scalar_one())
    _changed()
    return newly


def resume_tenant_channel(conn: sa.Connection, tenant: str, channel: str) -> bool:
    """Let them go again; True if they were paused."""
    return _unset(conn, _RESUME_TENANT_CHANNEL, tenant, channel)


def tenant_channels(conn: sa.Connection, tenant: str | None = None) -> list[TenantChannel]:
    """Every tenant's channel with a pause or a limit (or only ``tenant``'s)."""
    return [TenantChannel(*r) for r in conn.execute(_TENANT_CHANNELS, {"tenant": tenant})]
