"""Due pending rows by channel: the dispatcher's per-channel claims.

When a channel is at its in-flight budget, the dispatcher claims for the
other channels only (``channel = ANY(...)``) and lists the channels that have
pending rows (a skip scan, one index probe per channel). The claim-order index
cannot serve either without walking the full channel's whole backlog; this
one finds another channel's rows, and the next channel name, in a probe.

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Pending rows only (a small part of a pruned table), so the build is short.
    op.execute(
        "CREATE INDEX outbox_message_due_by_channel "
        "ON outbox_message (channel, priority DESC, available_at, id) WHERE status = 'pending'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX outbox_message_due_by_channel")
