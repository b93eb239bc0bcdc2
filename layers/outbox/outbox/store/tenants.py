"""What an operator sets per tenant (``outbox tenant ...``; migration 0022):
the weight and pause the claim reads, a producer role bound to one tenant,
and the webhook signing secrets mapped to a tenant."""

from __future__ import annotations

from typing import NamedTuple

import sqlalchemy as sa

from ._sql import statement

__all__ = [
    "TenantSettings",
    "bind_role",
    "map_secret",
    "set_tenant",
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
