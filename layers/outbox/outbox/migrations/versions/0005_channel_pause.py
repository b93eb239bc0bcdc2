"""Paused channels: one row per channel the dispatcher must not claim.

Revision ID: 0005
Revises: 0001
"""

from alembic import op

revision = "0005"
down_revision = "0001"
branch_labels = None
depends_on = None


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


def downgrade() -> None:
    op.execute("DROP TABLE outbox_channel_pause")
