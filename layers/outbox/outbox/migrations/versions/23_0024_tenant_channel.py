"""A tenant's channel (issue 33, item 5): a pause and a rate limit per tenant
and channel, ``outbox_tenant_channel``.

* ``paused``: the tenant's rows of that channel wait, pending (nobody else's,
  and none of its other channels'), as ``outbox pause CHANNEL --tenant T``
  sets it; ``reason`` is what ``outbox status`` shows.
* ``limit_rate`` / ``limit_burst``: a token bucket like a destination's
  (``outbox_destination``), shared by every claimer: the tenant's rows of
  that channel, whatever their destinations, take at most ``limit_rate`` a
  second (``outbox limit set CHANNEL --tenant T --rate R``). ``tokens`` and
  ``tokens_at`` are the bucket, which the claim draws from in the statement
  that claims the rows.

A new table, no rewrite; a tenant without a row is neither paused nor
limited on any channel.

Revision ID: 0024
Revises: 0023
"""

from __future__ import annotations

from alembic import op

from outbox.migrations import revision_module

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    relay = revision_module("0009").relay_role()
    pattern = revision_module("0022").TENANT_PATTERN
    op.execute(
        f"""
        CREATE TABLE outbox_tenant_channel (
            tenant      text        NOT NULL CHECK (tenant ~ '{pattern}'),
            channel     text        NOT NULL CHECK (channel ~ '^[a-z][a-z0-9_-]{{0,63}}$'),
            paused      boolean     NOT NULL DEFAULT false,
            reason      text        CHECK (pg_catalog.char_length(reason) <= 500),
            limit_rate  float8      CHECK (limit_rate > 0 AND limit_rate <= 100000),
            limit_burst float8      CHECK (limit_burst >= 1 AND limit_burst <= 1000000),
            tokens      float8,
            tokens_at   timestamptz,
            updated_at  timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (tenant, channel),
            CONSTRAINT outbox_tenant_channel_burst_has_rate
                CHECK (limit_burst IS NULL OR limit_rate IS NOT NULL)
        )
        """
    )
    # The claim's turn among the limited ones, least recently drawn first.
    op.execute(
        "CREATE INDEX outbox_tenant_channel_turn ON outbox_tenant_channel "
        "(tokens_at NULLS FIRST) WHERE limit_rate IS NOT NULL"
    )
    op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_tenant_channel TO {relay}")


def downgrade() -> None:
    op.execute("DROP TABLE outbox_tenant_channel")
