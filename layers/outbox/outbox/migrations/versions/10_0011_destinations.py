"""Destinations: who a message is sent to, as the provider's rate sees it, and
what the relay knows about each one's rate.

* ``outbox_message.destination``: the key a provider's rate applies to, set
  on insert by a trigger from the channel and payload (``outbox_destination_of``,
  a pure function, so the Python producer, the SQL enqueue and raw SQL all get
  the same): a webhook's receiver ``host[:port]``, an SQS queue URL, an event
  bus ('' for the relay's default one); '' (the whole account) for email, SMS,
  push and custom channels. Rows settled before this revision keep NULL; the
  unfinished ones are backfilled here.
* ``outbox_destination``: one row per (channel, destination) that has told
  the relay to slow down, or that an operator limited (``limit_rate``
  messages a second, ``limit_burst`` at once: ``outbox limit set``).
  ``paused_until``: the claim skips its rows until then; ``rate`` (messages
  a second) and ``rate_at``: the rate learned when it last throttled, which
  grows again with time since (additive increase) and is cut on every
  throttling answer (multiplicative decrease); ``tokens`` and ``tokens_at``:
  the bucket the claim draws from, refilled at the limit or that rate.
  ``throttled_total``, ``throttled_minute``, ``minute_start``: how often.
* ``outbox_channel_pause.paused_until``: a pause that ends by itself (a
  provider's quota resets); NULL, as before, waits for an operator.

Every function here pins its search_path (the install schema, then pg_temp).

Revision ID: 0011
Revises: 0009
"""

from alembic import op

from outbox.migrations import revision_module

revision = "0011"
down_revision = "0009"
branch_labels = None
depends_on = None


def relay_role() -> str:
    return str(revision_module("0003").relay_role())


# A webhook's receiver: the URL's host (a bracketed IPv6 address included)
# and its port when one is written, lower-cased, user info dropped.
_WEBHOOK_HOST = (
    r"^[A-Za-z][A-Za-z0-9+.-]*://(?:[^@/?#]*@)?(\[[^]/?#]*\](?::[0-9]+)?|[^:/?#]*(?::[0-9]+)?)"
)


def _schema() -> str:
    # The same rule as 0009's (a printed script names OUTBOX_SCHEMA).
    return str(revision_module("0009").install_schema())


def upgrade() -> None:
    schema = _schema()
    op.execute("ALTER TABLE outbox_message ADD COLUMN destination text")
    op.execute(
        f"""
        CREATE FUNCTION outbox_destination_of(channel text, payload jsonb) RETURNS text
        LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = {schema}, pg_temp AS $$
            SELECT COALESCE(CASE channel
                WHEN 'webhook' THEN lower(substring(payload ->> 'url' FROM '{_WEBHOOK_HOST}'))
                WHEN 'sqs' THEN payload ->> 'queue_url'
                WHEN 'eventbridge' THEN payload ->> 'event_bus'
                END, '')
        $$
        """
    )
    op.execute(
        f"""
        CREATE FUNCTION outbox_message_set_destination() RETURNS trigger
        LANGUAGE plpgsql SET search_path = {schema}, pg_temp AS $$
        BEGIN
            NEW.destination := outbox_destination_of(NEW.channel, NEW.payload);
            RETURN NEW;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER outbox_message_destination BEFORE INSERT ON outbox_message "
        "FOR EACH ROW EXECUTE FUNCTION outbox_message_set_destination()"
    )
    # Only the unfinished rows: a settled row is never claimed again unless
    # redriven, and a redrive keeps its payload (so the backfill covers it too).
    op.execute(
        "UPDATE outbox_message SET destination = outbox_destination_of(channel, payload) "
        "WHERE status IN ('pending', 'claimed', 'failed', 'dead', 'expired')"
    )
    # The claim takes a throttled or limited destination's first rows by a
    # probe of this index (as many as its bucket holds), however far behind
    # other destinations' rows they sit in the claim-order index.
    op.execute(
        "CREATE INDEX outbox_message_due_by_destination ON outbox_message "
        "(channel, destination, priority DESC, available_at, id) WHERE status = 'pending'"
    )
    op.execute(
        """
        CREATE TABLE outbox_destination (
            channel          text        NOT NULL CHECK (channel ~ '^[a-z][a-z0-9_-]{0,63}$'),
            destination      text        NOT NULL,
            paused_until     timestamptz,
            rate             float8      CHECK (rate > 0),
            limit_rate       float8      CHECK (limit_rate > 0 AND limit_rate <= 100000),
            limit_burst      float8      CHECK (limit_burst >= 1 AND limit_burst <= 1000000),
            rate_at          timestamptz,
            tokens           float8,
            tokens_at        timestamptz,
            throttled_total  bigint      NOT NULL DEFAULT 0,
            throttled_minute int         NOT NULL DEFAULT 0,
            minute_start     timestamptz,
            PRIMARY KEY (channel, destination)
        )
        """
    )
    op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_destination TO {relay_role()}")
    # Statistics of the empty table: never analyzed, the planner would guess
    # some fifty destinations, cost the claim's per-destination probes fifty
    # times over and JIT-compile it (above jit_above_cost). It holds a few rows.
    op.execute("ANALYZE outbox_destination")
    op.execute("ALTER TABLE outbox_channel_pause ADD COLUMN paused_until timestamptz")


def downgrade() -> None:
    op.execute("ALTER TABLE outbox_channel_pause DROP COLUMN paused_until")
    op.execute("DROP TABLE outbox_destination")
    op.execute("DROP INDEX outbox_message_due_by_destination")
    op.execute("DROP TRIGGER outbox_message_destination ON outbox_message")
    op.execute("DROP FUNCTION outbox_message_set_destination()")
    op.execute("DROP FUNCTION outbox_destination_of(text, jsonb)")
    op.execute("ALTER TABLE outbox_message DROP COLUMN destination")
