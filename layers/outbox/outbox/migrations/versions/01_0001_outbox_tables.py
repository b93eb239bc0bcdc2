"""The outbox tables: messages and their attempt history.

Revision ID: 0001
Revises:
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE outbox_message (
            id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            channel             text        NOT NULL CHECK (channel ~ '^[a-z][a-z0-9_-]{0,63}$'),
            payload             jsonb       NOT NULL,
            status              text        NOT NULL DEFAULT 'pending' CHECK (status IN
                ('pending', 'claimed', 'delivered', 'failed', 'dead', 'suppressed', 'cancelled')),
            priority            smallint    NOT NULL DEFAULT 0,
            available_at        timestamptz NOT NULL DEFAULT now(),
            attempts            integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
            -- NULL: the relay's configured default (template parameter MaxAttempts).
            max_attempts        integer     CHECK (max_attempts > 0),
            claim_token         uuid,
            claimed_at          timestamptz,
            lease_expires_at    timestamptz,
            dedupe_key          text,
            ordering_key        text,
            provider_message_id text,
            last_error          text,
            created_at          timestamptz NOT NULL DEFAULT now(),
            settled_at          timestamptz,
            -- A claim and its token/lease exist together or not at all.
            CONSTRAINT outbox_message_claim_consistent CHECK (
                (status = 'claimed') = (claim_token IS NOT NULL AND lease_expires_at IS NOT NULL)),
            -- Terminal rows carry the time they settled (retention counts from it).
            CONSTRAINT outbox_message_settled_consistent CHECK (
                (status IN ('pending', 'claimed')) = (settled_at IS NULL))
        )
        """
    )
    # Due pending rows in exactly the claim order, so the claim is an index scan.
    op.execute(
        "CREATE INDEX outbox_message_due ON outbox_message (priority DESC, available_at, id) "
        "WHERE status = 'pending'"
    )
    op.execute(
        "CREATE INDEX outbox_message_lease ON outbox_message (lease_expires_at) "
        "WHERE status = 'claimed'"
    )
    op.execute(
        "CREATE UNIQUE INDEX outbox_message_dedupe ON outbox_message (channel, dedupe_key) "
        "WHERE dedupe_key IS NOT NULL"
    )
    # Finds the unfinished predecessor of a row in its ordering key.
    op.execute(
        "CREATE INDEX outbox_message_ordering ON outbox_message (ordering_key, id) "
        "WHERE ordering_key IS NOT NULL AND status IN ('pending', 'claimed')"
    )
    # Terminal rows by status and age: prune, dead counts, operator listings.
    op.execute(
        "CREATE INDEX outbox_message_settled ON outbox_message (status, settled_at) "
        "WHERE settled_at IS NOT NULL"
    )
    # A queue table churns: vacuum it early so claim scans do not wade through
    # dead index entries of rows that already left the pending state.
    op.execute(
        "ALTER TABLE outbox_message SET (autovacuum_vacuum_scale_factor = 0.01, "
        "autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0.02, "
        "autovacuum_vacuum_cost_delay = 0, fillfactor = 90)"
    )
    op.execute(
        """
        CREATE TABLE outbox_attempt (
            id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            message_id          bigint      NOT NULL
                                REFERENCES outbox_message (id) ON DELETE CASCADE,
            attempt             integer     NOT NULL,
            outcome             text        NOT NULL CHECK (outcome IN
                ('delivered', 'retry', 'failed', 'dead', 'suppressed', 'deferred', 'expired')),
            error               text,
            provider_message_id text,
            claimed_at          timestamptz,
            finished_at         timestamptz NOT NULL DEFAULT now(),
            duration_ms         integer
        )
        """
    )
    op.execute("CREATE INDEX outbox_attempt_message ON outbox_attempt (message_id, id)")


def downgrade() -> None:
    op.execute("DROP TABLE outbox_attempt")
    op.execute("DROP TABLE outbox_message")
