"""outbox_enqueue(): enqueue from SQL, for producers in any language; and
``attempts_at_redrive``, so a redriven message's attempts number on.

    SELECT outbox_enqueue('email', '{"from": ..., "to": [...], ...}',
                          dedupe_key => 'order-42', delay => interval '10 minutes');

The options are ``outbox.enqueue``'s: dedupe_key, ordering_key (with the same
per-key advisory lock, held to the caller's commit), priority, delay,
max_attempts, expires_at or ttl, on_predecessor_failure ('hold' or 'cancel').

Runs in the caller's transaction (a rollback takes the message with it) and
returns the message's id. Dedupe is outbox.enqueue's, by the same rules and
keys (``outbox_take_dedupe_key`` of revision 0006): a replay (same channel,
key, recipient and payload) returns the existing id and writes nothing; the
same key and recipient with another payload raises SQLSTATE 23505 naming it.
(Numbered 0004, applied after 0008: it builds on 0006's dedupe.)

It refuses, with SQLSTATE 22023 (invalid_parameter_value) and
the message ``<field>: <problem>`` (the field also in the error's column
name), what the database can check: the channel's name, the options' ranges,
a payload that is not an object or over 256 KiB, and for the built-in
channels the payload's fields (required ones present, each of its JSON type,
no unknown ones). A custom channel's payload, and the shape limits of
``outbox.payloads`` (nesting, keys, elements), are checked by the sender,
which validates every payload again either way and fails a bad one alone.

``outbox_message.attempts_at_redrive``: the attempts counted before the last
redrive. A message's ``max_attempts`` (and its backoff) count from there, so a
redrive gives a fresh set of attempts without numbering a second "attempt 1".

Revision ID: 0004
Revises: 0008
"""

from alembic import op

revision = "0004"
down_revision = "0008"
branch_labels = None
depends_on = None

# The built-in channels' payload fields at this revision: name -> (JSON
# type, required). A test keeps these equal to the channels' own schemas.
BUILTIN_FIELDS: dict[str, dict[str, tuple[str | None, bool]]] = {
    "email": {
        "from": ("string", True),
        "to": ("array", True),
        "cc": ("array", False),
        "bcc": ("array", False),
        "reply_to": ("array", False),
        "subject": ("string", True),
        "text": ("string", False),
        "html": ("string", False),
    },
    "sms": {
        "to": ("string", True),
        "message": ("string", True),
        "sender_id": ("string", False),
        "sms_type": (None, False),
    },
    "push": {
        "endpoint_arn": ("string", True),
        "title": ("string", False),
        "body": ("string", True),
        "data": ("object", False),
    },
    "webhook": {
        "url": ("string", True),
        "event_type": ("string", True),
        "body": ("object", True),
        "secret_id": ("string", False),
    },
    "eventbridge": {
        "source": ("string", True),
        "detail_type": ("string", True),
        "detail": ("object", True),
        "event_bus": ("string", False),
        "resources": ("array", False),
    },
    "sqs": {
        "queue_url": ("string", True),
        "body": ("string", True),
        "delay_seconds": ("integer", False),
        "attributes": ("object", False),
    },
}


def _fields_sql() -> str:
    def literal(value: str | None) -> str:
        return "NULL" if value is None else "'" + value.replace("'", "''") + "'"

    rows = [
        f"({literal(channel)}, {literal(field)}, {literal(kind)}, {str(required).lower()})"
        for channel, fields in BUILTIN_FIELDS.items()
        for field, (kind, required) in fields.items()
    ]
    return ",\n                ".join(rows)


REFUSE = """
CREATE FUNCTION outbox_enqueue_refuse(field text, problem text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
        MESSAGE = field || ': ' || problem, COLUMN = field;
END
$$
"""

# The channel's fields as a set: (field, type, required). No row: a custom
# channel, whose payload only its sender can check.
FIELDS = f"""
CREATE FUNCTION outbox_enqueue_builtin_fields(channel text)
RETURNS TABLE (field text, kind text, required boolean)
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT f.field, f.kind, f.required
    FROM (VALUES
                {_fields_sql()}
         ) AS f(channel, field, kind, required)
    WHERE f.channel = outbox_enqueue_builtin_fields.channel
$$
"""

ENQUEUE = """
CREATE FUNCTION outbox_enqueue(
    channel text,
    payload jsonb,
    dedupe_key text DEFAULT NULL,
    ordering_key text DEFAULT NULL,
    priority integer DEFAULT 0,
    delay interval DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    expires_at timestamptz DEFAULT NULL,
    ttl interval DEFAULT NULL,
    on_predecessor_failure text DEFAULT 'hold'
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
-- The tables of the schema the function lives in, whatever the caller's path.
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    p_channel text := outbox_enqueue.channel;
    p_payload jsonb := outbox_enqueue.payload;
    p_dedupe text := outbox_enqueue.dedupe_key;
    p_ordering text := outbox_enqueue.ordering_key;
    p_priority integer := COALESCE(outbox_enqueue.priority, 0);
    p_delay interval := COALESCE(outbox_enqueue.delay, interval '0');
    p_max integer := outbox_enqueue.max_attempts;
    p_expires timestamptz := outbox_enqueue.expires_at;
    p_ttl interval := outbox_enqueue.ttl;
    p_on_failure text := COALESCE(outbox_enqueue.on_predecessor_failure, 'hold');
    f record;
    size integer;
    builtin boolean := false;
    new_id bigint;
    held_id bigint;
BEGIN
    -- the channel: the table's rule for a name
    IF p_channel IS NULL THEN
        PERFORM outbox_enqueue_refuse('channel', 'is required');
    ELSIF p_channel !~ '^[a-z][a-z0-9_-]{0,63}$' THEN
        PERFORM outbox_enqueue_refuse('channel',
            'must be 1 to 64 lower-case letters, digits, _ or -, starting with a letter');
    END IF;

    -- the options, in the producer API's ranges
    IF p_dedupe IS NOT NULL AND NOT char_length(p_dedupe) BETWEEN 1 AND 255 THEN
        PERFORM outbox_enqueue_refuse('dedupe_key', 'must be 1 to 255 characters');
    END IF;
    IF p_ordering IS NOT NULL AND NOT char_length(p_ordering) BETWEEN 1 AND 255 THEN
        PERFORM outbox_enqueue_refuse('ordering_key', 'must be 1 to 255 characters');
    END IF;
    IF NOT p_priority BETWEEN -32768 AND 32767 THEN
        PERFORM outbox_enqueue_refuse('priority',
            format('must be between -32768 and 32767, got %s', p_priority));
    END IF;
    IF p_delay < interval '0' OR p_delay > interval '365 days' THEN
        PERFORM outbox_enqueue_refuse('delay', 'must be between 0 and 365 days');
    END IF;
    IF p_max IS NOT NULL AND NOT p_max BETWEEN 1 AND 1000 THEN
        PERFORM outbox_enqueue_refuse('max_attempts',
            format('must be between 1 and 1000, got %s', p_max));
    END IF;

    IF p_expires IS NOT NULL AND p_ttl IS NOT NULL THEN
        PERFORM outbox_enqueue_refuse('ttl', 'give expires_at or ttl, not both');
    END IF;
    IF p_ttl <= interval '0' OR p_ttl > interval '366 days' THEN
        PERFORM outbox_enqueue_refuse('ttl', 'must be more than 0 seconds and at most 366 days');
    END IF;
    IF p_on_failure NOT IN ('hold', 'cancel') THEN
        PERFORM outbox_enqueue_refuse('on_predecessor_failure',
            format('must be one of ''hold'', ''cancel'', got %L', p_on_failure));
    END IF;

    -- the payload
    IF p_payload IS NULL OR jsonb_typeof(p_payload) = 'null' THEN
        PERFORM outbox_enqueue_refuse('payload', 'is required');
    END IF;
    size := octet_length(CAST(p_payload AS text));
    IF size > 262144 THEN
        PERFORM outbox_enqueue_refuse('payload',
            format('is %s bytes; the limit is 262144', size));
    END IF;
    FOR f IN SELECT * FROM outbox_enqueue_builtin_fields(p_channel) LOOP
        IF NOT builtin THEN
            builtin := true;
            IF jsonb_typeof(p_payload) <> 'object' THEN
                PERFORM outbox_enqueue_refuse('payload', 'must be an object');
            END IF;
        END IF;
        IF NOT p_payload ? f.field THEN
            IF f.required THEN
                PERFORM outbox_enqueue_refuse('payload.' || f.field, 'is required');
            END IF;
        ELSIF f.kind IS NOT NULL AND NOT (
            jsonb_typeof(p_payload -> f.field) = f.kind
            OR (f.kind = 'integer' AND jsonb_typeof(p_payload -> f.field) = 'number'
                AND scale(CAST(p_payload -> f.field AS numeric)) = 0)
        ) THEN
            PERFORM outbox_enqueue_refuse('payload.' || f.field, 'must be ' ||
                CASE WHEN f.kind IN ('array', 'object', 'integer') THEN 'an ' ELSE 'a ' END
                || f.kind);
        END IF;
    END LOOP;
    IF builtin THEN
        SELECT k INTO f FROM jsonb_object_keys(p_payload) AS k
        WHERE k NOT IN (SELECT b.field FROM outbox_enqueue_builtin_fields(p_channel) AS b)
        ORDER BY k LIMIT 1;
        IF FOUND THEN
            PERFORM outbox_enqueue_refuse('payload.' || f.k, 'is not a field of this channel');
        END IF;
        IF p_channel = 'email' AND NOT (p_payload ? 'text' OR p_payload ? 'html') THEN
            PERFORM outbox_enqueue_refuse('payload.text', 'text or html is required');
        END IF;
    END IF;

    IF p_ordering IS NOT NULL THEN
        -- As outbox.enqueue: producers of one ordering key take turns until
        -- their commit, so the key's ids follow commit order.
        PERFORM pg_advisory_xact_lock(hashtextextended('outbox-ordering-key:' || p_ordering, 0));
    END IF;
    -- the id first, so that a dedupe key's entry can name its message
    new_id := nextval('outbox_message_id_seq');
    IF p_dedupe IS NOT NULL THEN
        held_id := outbox_take_dedupe_key(p_channel, p_dedupe, p_payload, new_id);
        IF held_id IS NOT NULL THEN
            RETURN held_id;  -- a replay: nothing written
        END IF;
    END IF;
    INSERT INTO outbox_message
        (id, channel, payload, dedupe_key, ordering_key, priority, available_at, max_attempts,
         expires_at, on_predecessor_failure, recipient_fingerprints)
    OVERRIDING SYSTEM VALUE
    VALUES (new_id, p_channel, p_payload, p_dedupe, p_ordering, p_priority, now() + p_delay,
            p_max,
            -- a ttl counts from the time the message is first due
            COALESCE(p_expires, now() + p_delay + p_ttl), p_on_failure,
            outbox_recipient_fingerprints(p_channel, p_payload));
    RETURN new_id;
END
$$
"""


def upgrade() -> None:
    op.execute(
        "ALTER TABLE outbox_message ADD COLUMN attempts_at_redrive integer NOT NULL DEFAULT 0 "
        "CHECK (attempts_at_redrive >= 0)"
    )
    op.execute(REFUSE)
    op.execute(FIELDS)
    op.execute(ENQUEUE)


def downgrade() -> None:
    op.execute(
        "DROP FUNCTION outbox_enqueue(text, jsonb, text, text, integer, interval, integer, "
        "timestamptz, interval, text)"
    )
    op.execute("DROP FUNCTION outbox_enqueue_builtin_fields(text)")
    op.execute("DROP FUNCTION outbox_enqueue_refuse(text, text)")
    op.execute("ALTER TABLE outbox_message DROP COLUMN attempts_at_redrive")
