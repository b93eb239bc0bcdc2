"""Paused channels: one row per channel the dispatcher must not claim.

Every claim reads this table, so the relay role (revision 0003) gets SELECT
on it; and INSERT, UPDATE, DELETE, so that an operator running `outbox pause`
with the relay's user can pause and resume (as it can cancel and redrive).

Revision ID: 0005
Revises: 0004
"""

from alembic import op

from outbox.migrations import revision_module

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The relay role's name (OUTBOX_RELAY_ROLE, checked) as revision 0003 grants it.
relay_role = revision_module("0003").relay_role


def upgrade() -> None:
    # A control table, not a column on outbox_message: a pause names a channel
    # whether or not it has rows, changes no message row, and the claim checks
    # it with an anti-join against a table of a few rows.
    op.execute(
        """
        CREATE TABLE outbox_channel_pause (
            channel    text        PRIMARY KEY CHECK (channel ~ '^[a-z][a-z0-9_-]{0,63}$'),
            reason     text,
            paused_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_channel_pause TO {relay_role()}")


def downgrade() -> None:
    op.execute("DROP TABLE outbox_channel_pause")
