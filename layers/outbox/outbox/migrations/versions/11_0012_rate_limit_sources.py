"""Where each destination's limit came from: ``outbox_destination.limit_source``.

* ``operator``: ``outbox limit set``; it holds until ``outbox limit clear``,
  whatever the configuration says.
* ``config``: the ``RATE_LIMITS`` setting, written by a dispatcher's or
  worker's cold start, and removed by the next one when the setting no
  longer names it.
* ``provider``: the provider's own figure (SES's ``MaxSendRate`` for email),
  written by a cold start of a function that can ask, only where neither an
  operator nor the configuration set one.

NULL exactly when there is no limit. Limits set before this revision were
all an operator's.

Revision ID: 0012
Revises: 0011
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE outbox_destination ADD COLUMN limit_source text "
        "CONSTRAINT outbox_destination_limit_source_known "
        "CHECK (limit_source IN ('operator', 'config', 'provider'))"
    )
    op.execute(
        "UPDATE outbox_destination SET limit_source = 'operator' WHERE limit_rate IS NOT NULL"
    )
    op.execute(
        "ALTER TABLE outbox_destination ADD CONSTRAINT outbox_destination_limit_has_source "
        "CHECK ((limit_rate IS NULL) = (limit_source IS NULL))"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE outbox_destination DROP CONSTRAINT outbox_destination_limit_has_source")
    op.execute("ALTER TABLE outbox_destination DROP COLUMN limit_source")
