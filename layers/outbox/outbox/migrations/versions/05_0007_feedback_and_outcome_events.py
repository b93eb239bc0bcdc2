"""Provider feedback (``delivered -> bounced | complained``) and outcome events.

* ``outbox_message.status`` and ``outbox_attempt.outcome`` accept every status
  and outcome of the final design.
* ``outbox_attempt.feedback_id`` names the provider event an attempt row was
  recorded from; unique per message, so the same event applied twice writes
  nothing the second time.
* SES feedback finds its message by ``provider_message_id`` through a partial
  index of the email rows.
* ``outbox_outcome_event``: one row per transition an application may need to
  react to, written by a trigger in the same statement as the transition (so
  no transition is missed, whichever statement makes it, and no cursor can
  skip a row committed late). The reaper publishes them to EventBridge and
  deletes them.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

from outbox.migrations import revision_module

# The relay role of revision 0003: its users settle, reap and publish, so they
# write (through the trigger) and delete outcome events.
_relay_role = revision_module("0003").relay_role

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Every status and attempt outcome of the final design (other revisions add
# the transitions that use them).
_STATUSES = (
    "'pending', 'claimed', 'delivered', 'failed', 'dead', 'suppressed', 'cancelled', "
    "'expired', 'bounced', 'complained'"
)
_OUTCOMES = (
    "'delivered', 'retry', 'failed', 'dead', 'suppressed', 'deferred', 'expired', "
    "'not_started', 'bounced', 'complained', 'transient_bounce', 'delivery_confirmed'"
)
# What revision 0002 left (every status already; the outcomes before feedback).
_OLD_OUTCOMES = (
    "'delivered', 'retry', 'failed', 'dead', 'suppressed', 'deferred', 'expired', 'not_started'"
)

# The transitions that always produce an outcome event; ``delivered`` has its
# own trigger, disabled unless OUTCOME_EVENTS_DELIVERED is on (outbox.store.outcome_events).
_EVENT_STATUSES = "'failed', 'dead', 'expired', 'bounced', 'complained'"


def upgrade() -> None:
    _replace_checks(_STATUSES, _OUTCOMES)
    op.execute("ALTER TABLE outbox_attempt ADD COLUMN feedback_id text")
    op.execute(
        "CREATE UNIQUE INDEX outbox_attempt_feedback ON outbox_attempt (message_id, feedback_id) "
        "WHERE feedback_id IS NOT NULL"
    )
    op.execute(
        "CREATE INDEX outbox_message_email_provider_id ON outbox_message (provider_message_id) "
        "WHERE channel = 'email' AND provider_message_id IS NOT NULL"
    )
    op.execute(
        """
        CREATE TABLE outbox_outcome_event (
            id                  bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            -- A snapshot of the message at its transition (never the payload);
            -- no foreign key: the message may be pruned before this is published.
            message_id          bigint      NOT NULL,
            channel             text        NOT NULL,
            status              text        NOT NULL,
            attempts            integer     NOT NULL,
            last_error          text,
            provider_message_id text,
            dedupe_key          text,
            ordering_key        text,
            occurred_at         timestamptz NOT NULL DEFAULT now(),
            -- The publisher's lease: a row is due when this has passed; taking
            -- it pushes this past the publisher's run, so a publisher that dies
            -- leaves it to the next run once the lease ends.
            publish_after       timestamptz NOT NULL DEFAULT now(),
            publish_attempts    integer     NOT NULL DEFAULT 0,
            publish_error       text
        )
        """
    )
    op.execute("CREATE INDEX outbox_outcome_event_due ON outbox_outcome_event (publish_after, id)")
    op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_outcome_event TO {_relay_role()}")
    op.execute(
        """
        CREATE FUNCTION outbox_record_outcome_event() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO outbox_outcome_event (message_id, channel, status, attempts, last_error,
                                              provider_message_id, dedupe_key, ordering_key)
            VALUES (NEW.id, NEW.channel, NEW.status, NEW.attempts, NEW.last_error,
                    NEW.provider_message_id, NEW.dedupe_key, NEW.ordering_key);
            RETURN NULL;
        END
        $$
        """
    )
    # Row triggers with a WHEN clause: the condition is checked without calling
    # the function, so the hot path (claims, deliveries) pays next to nothing.
    op.execute(
        f"""
        CREATE TRIGGER outbox_message_outcome_event AFTER UPDATE OF status ON outbox_message
        FOR EACH ROW WHEN (NEW.status IS DISTINCT FROM OLD.status
                           AND NEW.status IN ({_EVENT_STATUSES}))
        EXECUTE FUNCTION outbox_record_outcome_event()
        """
    )
    op.execute(
        """
        CREATE TRIGGER outbox_message_delivered_event AFTER UPDATE OF status ON outbox_message
        FOR EACH ROW WHEN (NEW.status = 'delivered' AND OLD.status IS DISTINCT FROM 'delivered')
        EXECUTE FUNCTION outbox_record_outcome_event()
        """
    )
    op.execute("ALTER TABLE outbox_message DISABLE TRIGGER outbox_message_delivered_event")


def _replace_checks(statuses: str, outcomes: str) -> None:
    op.execute(
        "ALTER TABLE outbox_message DROP CONSTRAINT outbox_message_status_check, "
        f"ADD CONSTRAINT outbox_message_status_check CHECK (status IN ({statuses}))"
    )
    op.execute(
        "ALTER TABLE outbox_attempt DROP CONSTRAINT outbox_attempt_outcome_check, "
        f"ADD CONSTRAINT outbox_attempt_outcome_check CHECK (outcome IN ({outcomes}))"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER outbox_message_delivered_event ON outbox_message")
    op.execute("DROP TRIGGER outbox_message_outcome_event ON outbox_message")
    op.execute("DROP FUNCTION outbox_record_outcome_event()")
    op.execute("DROP TABLE outbox_outcome_event")
    op.execute("DROP INDEX outbox_message_email_provider_id")
    op.execute("DROP INDEX outbox_attempt_feedback")
    op.execute("ALTER TABLE outbox_attempt DROP COLUMN feedback_id")
    _replace_checks(_STATUSES, _OLD_OUTCOMES)
