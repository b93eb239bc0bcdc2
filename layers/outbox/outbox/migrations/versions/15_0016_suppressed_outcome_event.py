"""A suppressed message gets an outcome event, as every other final state
but delivered does: a message the cooldown dropped (``on_cooldown =
'suppress'``) was the one final outcome nothing on the bus ever said.

The trigger keeps its WHEN clause (the hot path pays next to nothing); only
its list of statuses grows.

Revision ID: 0016
Revises: 0015
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def _trigger(statuses: str) -> None:
    op.execute("DROP TRIGGER outbox_message_outcome_event ON outbox_message")
    op.execute(
        f"""
        CREATE TRIGGER outbox_message_outcome_event AFTER UPDATE OF status ON outbox_message
        FOR EACH ROW WHEN (NEW.status IS DISTINCT FROM OLD.status
                           AND NEW.status IN ({statuses}))
        EXECUTE FUNCTION outbox_record_outcome_event()
        """
    )


def upgrade() -> None:
    _trigger("'failed', 'dead', 'expired', 'bounced', 'complained', 'suppressed'")


def downgrade() -> None:
    _trigger("'failed', 'dead', 'expired', 'bounced', 'complained'")
