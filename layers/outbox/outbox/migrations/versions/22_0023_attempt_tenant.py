"""The send log per tenant (issue 33, item 3): ``outbox_attempt.tenant``.

"Did X get it?" (``outbox history --recipient X --tenant T``) must answer for
one tenant, and the send log outlives the messages (ATTEMPT_RETENTION_DAYS),
so an attempt row carries its message's tenant, written by the statement that
writes the row (no trigger: the settle is the hot path). A column with a
default: no rewrite. The attempts written since 0022 get their messages'
tenant here, from the messages still kept; older attempts are no tenant's,
as their messages were.

Revision ID: 0023
Revises: 0022
"""

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE outbox_attempt ADD COLUMN tenant text NOT NULL DEFAULT ''")
    # A plain statement: a printed script (`outbox migrate --sql`) runs it too.
    op.execute(
        """
        UPDATE outbox_attempt AS a SET tenant = m.tenant
        FROM outbox_message AS m
        WHERE m.id = a.message_id AND m.tenant <> ''
        """
    )


def downgrade() -> None:
    op.execute("ALTER TABLE outbox_attempt DROP COLUMN tenant")
