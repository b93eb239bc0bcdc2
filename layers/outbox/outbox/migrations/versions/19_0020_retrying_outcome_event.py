"""A ``retrying`` outcome event, opt-in (issue 31, item 10): when a send fails
and the message will be tried again, an event says so, with the attempt it
was and when the next one is due (``retry_at``), as the push-delivery worker
the relay learned from publishes one. Off by default (a retry storm would be
as many events); ``outbox migrate`` switches its trigger as
OUTCOME_EVENTS_RETRYING says, as it does ``delivered``'s.

A retry is the claimed row back to ``pending`` with one more attempt counted:
an update inside the live partition, so the trigger is that partition's. A
throttled send, a released lease (a sender that stopped early) and a deferral
count no attempt and write no event.

Revision ID: 0020
Revises: 0019
"""

from alembic import op

from outbox.migrations import revision_module

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

TRIGGER = "outbox_message_retrying_event"

RECORD_RETRYING = """
CREATE FUNCTION outbox_record_retrying_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = {schema}, pg_temp
AS $fn$
BEGIN
    INSERT INTO outbox_outcome_event (message_id, channel, status, attempts, last_error,
                                      provider_message_id, dedupe_key, ordering_key, retry_at)
    VALUES (NEW.id, NEW.channel, 'retrying', NEW.attempts, NEW.last_error,
            NEW.provider_message_id, NEW.dedupe_key, NEW.ordering_key, NEW.available_at);
    RETURN NULL;
END
$fn$
"""


def upgrade() -> None:
    schema = str(revision_module("0009").install_schema())
    op.execute("ALTER TABLE outbox_outcome_event ADD COLUMN retry_at timestamptz")
    op.execute(RECORD_RETRYING.format(schema=schema))
    op.execute(
        f"CREATE TRIGGER {TRIGGER} AFTER UPDATE OF status ON outbox_message_live "
        "FOR EACH ROW WHEN (OLD.status = 'claimed' AND NEW.status = 'pending' "
        "AND NEW.attempts > OLD.attempts) EXECUTE FUNCTION outbox_record_retrying_event()"
    )
    op.execute(f"ALTER TABLE outbox_message_live DISABLE TRIGGER {TRIGGER}")


def downgrade() -> None:
    op.execute(f"DROP TRIGGER {TRIGGER} ON outbox_message_live")
    op.execute("DROP FUNCTION outbox_record_retrying_event()")
    op.execute("DELETE FROM outbox_outcome_event WHERE status = 'retrying'")
    op.execute("ALTER TABLE outbox_outcome_event DROP COLUMN retry_at")
