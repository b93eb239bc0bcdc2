"""Dedupe scoped to the recipient, and a send log that outlives its messages.

* ``outbox_fingerprint_key``: one row, the installation's random HMAC key,
  generated here. Recipient fingerprints are HMAC-SHA256 of a normalised
  address under it, so a fingerprint names nobody without the key, and every
  producer (Python, or SQL from another language) computes the same one
  because the functions below do it inside the database.
* ``outbox_recipients(channel, payload)``: each built-in channel's recipient
  addresses, normalised; ``outbox_recipient_fingerprint(channel, payload)``:
  the dedupe scope; ``outbox_recipient_fingerprints(channel, payload)``: one
  fingerprint per address, for the send log.
* ``outbox_dedupe``: the dedupe keys, unique per (channel, dedupe_key,
  recipient fingerprint), each with the digest of its payload (a repeat with
  another payload is a conflict) and the id of its message. Kept for the
  dedupe window, independently of the message rows (the reaper prunes both).
* ``outbox_attempt`` keeps its channel and the recipients' fingerprints and no
  longer cascades from its message: the attempt history has its own retention.

Revision ID: 0006
Revises: 0003
"""

import secrets

import sqlalchemy as sa
from alembic import context, op

from outbox.migrations import revision_module

revision = "0006"
down_revision = "0003"
branch_labels = None
depends_on = None

# The building blocks are plain SQL expressions the planner inlines, so the
# bulk INSERT of outbox.store.enqueue computes every fingerprint of a batch in one pass;
# the wrappers at the end serve single rows (another language's producer, the
# CLI). Nested calls of non-inlinable SQL functions are avoided: Postgres plans
# the inner one again on every call.
FUNCTIONS = [
    # HMAC's padded key (RFC 2104): the key zero-filled to SHA-256's 64-byte
    # block, each byte XOR pad. Only for the generated columns of the key table.
    """
    CREATE FUNCTION outbox_hmac_pad(key bytea, pad integer) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
        SELECT string_agg(
                   set_byte(decode('00', 'hex'), 0,
                            (CASE WHEN i < length(key) THEN get_byte(key, i) ELSE 0 END) # pad),
                   ''::bytea ORDER BY i)
        FROM generate_series(0, 63) AS i
    $$
    """,
    # HMAC-SHA256 from the padded keys: equal to
    # hmac.new(key, message.encode(), hashlib.sha256).digest() in Python.
    """
    CREATE FUNCTION outbox_hmac(inner_pad bytea, outer_pad bytea, message text) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT sha256(outer_pad || sha256(inner_pad || convert_to(message, 'UTF8')))
    $$
    """,
    # How a channel's address is compared: email addresses ignore case and
    # surrounding spaces; phone numbers (E.164, checked at enqueue), endpoint
    # ARNs, URLs, buses and queues are taken as written.
    """
    CREATE FUNCTION outbox_normalize_address(channel text, address text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT CASE WHEN channel = 'email' THEN lower(btrim(address)) ELSE address END
    $$
    """,
    """
    CREATE FUNCTION outbox_jsonb_list(value jsonb) RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT CASE WHEN jsonb_typeof(value) = 'array' THEN value ELSE '[]' END
    $$
    """,
    # The addresses a message goes to, normalised, without repeats. A channel
    # not named here has none: its dedupe scope is the channel as a whole.
    """
    CREATE FUNCTION outbox_addresses(channel text, payload jsonb) RETURNS SETOF text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT DISTINCT outbox_normalize_address(channel, a)
        FROM jsonb_array_elements_text(CASE channel
            WHEN 'email' THEN outbox_jsonb_list(payload -> 'to')
                              || outbox_jsonb_list(payload -> 'cc')
                              || outbox_jsonb_list(payload -> 'bcc')
            WHEN 'sms' THEN jsonb_build_array(payload -> 'to')
            WHEN 'push' THEN jsonb_build_array(payload -> 'endpoint_arn')
            WHEN 'webhook' THEN jsonb_build_array(payload -> 'url')
            -- '' is the relay's default bus (EVENT_BUS_NAME)
            WHEN 'eventbridge' THEN jsonb_build_array(COALESCE(payload -> 'event_bus', '""'))
            WHEN 'sqs' THEN jsonb_build_array(payload -> 'queue_url')
            ELSE '[]' END) AS a
        WHERE a IS NOT NULL
    $$
    """,
    # The dedupe scope, from the sorted addresses: who the message is for. An
    # event bus's target is the rule that matches, so source and detail-type
    # belong to it.
    """
    CREATE FUNCTION outbox_dedupe_identity(channel text, payload jsonb, addresses text[])
    RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT CASE channel
            WHEN 'eventbridge' THEN concat_ws(E'\\n', COALESCE(payload ->> 'event_bus', ''),
                                              payload ->> 'source', payload ->> 'detail_type')
            ELSE array_to_string(addresses, E'\\n') END
    $$
    """,
    # --- single-row wrappers ---------------------------------------------------
    """
    CREATE FUNCTION outbox_recipients(channel text, payload jsonb) RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT ARRAY(SELECT a FROM outbox_addresses(channel, payload) AS a ORDER BY a)
    $$
    """,
    # One text under the installation's key: what `outbox history` looks up.
    """
    CREATE FUNCTION outbox_fingerprint(message text) RETURNS bytea
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
        SELECT outbox_hmac(k.inner_pad, k.outer_pad, message) FROM outbox_fingerprint_key AS k
    $$
    """,
    # The dedupe scope of a message, as outbox_dedupe.recipient_fingerprint.
    """
    CREATE FUNCTION outbox_recipient_fingerprint(channel text, payload jsonb) RETURNS bytea
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
        SELECT outbox_hmac(k.inner_pad, k.outer_pad, outbox_dedupe_identity(channel, payload,
                   ARRAY(SELECT a FROM outbox_addresses(channel, payload) AS a ORDER BY a)))
        FROM outbox_fingerprint_key AS k
    $$
    """,
    # One fingerprint per address, as outbox_message/outbox_attempt.recipient_fingerprints.
    """
    CREATE FUNCTION outbox_recipient_fingerprints(channel text, payload jsonb) RETURNS bytea[]
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
        SELECT ARRAY(SELECT outbox_hmac(k.inner_pad, k.outer_pad, a)
                     FROM outbox_addresses(channel, payload) AS a ORDER BY a)
        FROM outbox_fingerprint_key AS k
    $$
    """,
    # What a replay must repeat exactly: jsonb's text is canonical (key order,
    # spacing), so equal payloads have equal digests.
    """
    CREATE FUNCTION outbox_payload_digest(payload jsonb) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT sha256(convert_to(CAST(payload AS text), 'UTF8'))
    $$
    """,
    # Dedupe for a single-row producer in SQL (another language): take the key
    # of (channel, dedupe_key, recipient) for message ``new_id`` (drawn with
    # nextval('outbox_message_id_seq') and then inserted with OVERRIDING
    # SYSTEM VALUE and recipient_fingerprints = outbox_recipient_fingerprints).
    # NULL: the key is now this message's, insert it. An id: a replay, insert
    # nothing and return that id. Another payload: raises SQLSTATE 23505
    # naming the key. The same rules as store.insert_messages.
    """
    CREATE FUNCTION outbox_take_dedupe_key(
        p_channel text, p_dedupe_key text, p_payload jsonb, p_new_id bigint)
    RETURNS bigint LANGUAGE plpgsql AS $$
    DECLARE
        v_fingerprint bytea := outbox_recipient_fingerprint(p_channel, p_payload);
        v_digest bytea := outbox_payload_digest(p_payload);
        v_held_id bigint;
        v_held_digest bytea;
    BEGIN
        LOOP
            INSERT INTO outbox_dedupe
                (channel, dedupe_key, recipient_fingerprint, payload_digest, message_id)
            VALUES (p_channel, p_dedupe_key, v_fingerprint, v_digest, p_new_id)
            ON CONFLICT DO NOTHING;
            IF FOUND THEN
                RETURN NULL;
            END IF;
            -- a new statement: it sees a key committed while the INSERT waited
            SELECT d.message_id, d.payload_digest INTO v_held_id, v_held_digest
            FROM outbox_dedupe AS d
            WHERE d.channel = p_channel AND d.dedupe_key = p_dedupe_key
              AND d.recipient_fingerprint = v_fingerprint;
            IF FOUND THEN
                IF v_held_digest <> v_digest THEN
                    RAISE EXCEPTION USING ERRCODE = 'unique_violation',
                        MESSAGE = format('dedupe_key: %L already names %s message %s for this '
                                         'recipient, with a different payload',
                                         p_dedupe_key, p_channel, v_held_id);
                END IF;
                RETURN v_held_id;
            END IF;
            -- released by the reaper in between: take it
        END LOOP;
    END
    $$
    """,
]


def _relay_role() -> str:
    """The relay's group role of revision 0003 (OUTBOX_RELAY_ROLE)."""
    module = revision_module("0003")
    return str(module.relay_role())


def upgrade() -> None:
    hmac_pad, *functions = FUNCTIONS
    op.execute(hmac_pad)
    op.execute(
        """
        CREATE TABLE outbox_fingerprint_key (
            singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
            key       bytea   NOT NULL CHECK (length(key) = 32),
            inner_pad bytea   GENERATED ALWAYS AS (outbox_hmac_pad(key, 54)) STORED,  -- 0x36
            outer_pad bytea   GENERATED ALWAYS AS (outbox_hmac_pad(key, 92)) STORED   -- 0x5c
        )
        """
    )
    # The key is made here, once per installation, and never leaves the database.
    if context.is_offline_mode():
        # A printed script (`outbox migrate --sql`) must not carry the key:
        # the database draws it (two random UUIDs, pg_strong_random's bytes).
        op.execute(
            "INSERT INTO outbox_fingerprint_key (key) VALUES (decode(replace("
            "gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'))"
        )
    else:
        op.execute(
            sa.text("INSERT INTO outbox_fingerprint_key (key) VALUES (:key)").bindparams(
                key=secrets.token_bytes(32)
            )
        )
    op.execute("ANALYZE outbox_fingerprint_key")  # one row: plans must know it
    for function in functions:
        op.execute(function)

    op.execute("ALTER TABLE outbox_message ADD COLUMN recipient_fingerprints bytea[]")
    # Set-based, as at enqueue (the single-row wrapper would run per row).
    op.execute(
        """
        UPDATE outbox_message AS m
        SET recipient_fingerprints = ARRAY(
            SELECT outbox_hmac(k.inner_pad, k.outer_pad, a)
            FROM outbox_addresses(m.channel, m.payload) AS a ORDER BY a)
        FROM outbox_fingerprint_key AS k
        """
    )
    # The default only serves rows written by hand (tests, repairs): every
    # enqueue path computes the fingerprints.
    op.execute(
        "ALTER TABLE outbox_message ALTER COLUMN recipient_fingerprints SET DEFAULT '{}', "
        "ALTER COLUMN recipient_fingerprints SET NOT NULL"
    )

    op.execute(
        """
        CREATE TABLE outbox_dedupe (
            channel               text        NOT NULL,
            dedupe_key            text        NOT NULL,
            recipient_fingerprint bytea       NOT NULL,
            payload_digest        bytea       NOT NULL,
            -- no foreign key: the key outlives a pruned message when the
            -- dedupe window is longer than the retention
            message_id            bigint      NOT NULL,
            created_at            timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (channel, dedupe_key, recipient_fingerprint)
        )
        """
    )
    op.execute("CREATE INDEX outbox_dedupe_created ON outbox_dedupe (created_at)")
    # Existing keys keep holding: the oldest row of each (old scope: one per
    # channel and key) becomes the entry.
    op.execute(
        """
        INSERT INTO outbox_dedupe
            (channel, dedupe_key, recipient_fingerprint, payload_digest, message_id, created_at)
        SELECT channel, dedupe_key, outbox_recipient_fingerprint(channel, payload),
               outbox_payload_digest(payload), id, created_at
        FROM outbox_message WHERE dedupe_key IS NOT NULL
        ON CONFLICT DO NOTHING
        """
    )
    op.execute("DROP INDEX outbox_message_dedupe")

    op.execute("ALTER TABLE outbox_attempt DROP CONSTRAINT outbox_attempt_message_id_fkey")
    op.execute(
        "ALTER TABLE outbox_attempt ADD COLUMN channel text, "
        "ADD COLUMN recipient_fingerprints bytea[]"
    )
    op.execute(
        "UPDATE outbox_attempt AS a SET channel = m.channel, "
        "recipient_fingerprints = m.recipient_fingerprints "
        "FROM outbox_message AS m WHERE m.id = a.message_id"
    )
    op.execute(
        "ALTER TABLE outbox_attempt ALTER COLUMN channel SET NOT NULL, "
        "ALTER COLUMN recipient_fingerprints SET DEFAULT '{}', "
        "ALTER COLUMN recipient_fingerprints SET NOT NULL"
    )
    # "Did they get it?": attempts by any of their recipients' fingerprints.
    op.execute(
        "CREATE INDEX outbox_attempt_recipient ON outbox_attempt USING gin (recipient_fingerprints)"
    )
    # The attempt history's own retention, pruned oldest first.
    op.execute("CREATE INDEX outbox_attempt_finished ON outbox_attempt (finished_at)")

    # The relay (and a producer using its grants) enqueues with dedupe keys,
    # draws message ids ahead of the insert, fingerprints with the key, and
    # the reaper releases keys past the window.
    role = _relay_role()
    op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_dedupe TO {role}")
    op.execute(f"GRANT SELECT ON outbox_fingerprint_key TO {role}")
    op.execute(f"GRANT USAGE ON SEQUENCE outbox_message_id_seq TO {role}")


def downgrade() -> None:
    role = _relay_role()
    op.execute(f"REVOKE ALL ON SEQUENCE outbox_message_id_seq FROM {role}")
    op.execute("DROP INDEX outbox_attempt_finished")
    op.execute("DROP INDEX outbox_attempt_recipient")
    op.execute(
        "DELETE FROM outbox_attempt AS a "
        "WHERE NOT EXISTS (SELECT 1 FROM outbox_message AS m WHERE m.id = a.message_id)"
    )
    op.execute(
        "ALTER TABLE outbox_attempt DROP COLUMN channel, DROP COLUMN recipient_fingerprints, "
        "ADD CONSTRAINT outbox_attempt_message_id_fkey FOREIGN KEY (message_id) "
        "REFERENCES outbox_message (id) ON DELETE CASCADE"
    )
    # The old scope is one message per (channel, dedupe_key): later repeats lose their key.
    op.execute(
        """
        UPDATE outbox_message AS m SET dedupe_key = NULL
        WHERE dedupe_key IS NOT NULL AND EXISTS (
            SELECT 1 FROM outbox_message AS p
            WHERE p.channel = m.channel AND p.dedupe_key = m.dedupe_key AND p.id < m.id)
        """
    )
    op.execute(
        "CREATE UNIQUE INDEX outbox_message_dedupe ON outbox_message (channel, dedupe_key) "
        "WHERE dedupe_key IS NOT NULL"
    )
    op.execute("DROP TABLE outbox_dedupe")
    op.execute("ALTER TABLE outbox_message DROP COLUMN recipient_fingerprints")
    op.execute("DROP TABLE outbox_fingerprint_key")
    for name in (
        "outbox_take_dedupe_key(text, text, jsonb, bigint)",
        "outbox_payload_digest(jsonb)",
        "outbox_recipient_fingerprints(text, jsonb)",
        "outbox_recipient_fingerprint(text, jsonb)",
        "outbox_fingerprint(text)",
        "outbox_recipients(text, jsonb)",
        "outbox_dedupe_identity(text, jsonb, text[])",
        "outbox_addresses(text, jsonb)",
        "outbox_jsonb_list(jsonb)",
        "outbox_normalize_address(text, text)",
        "outbox_hmac(bytea, bytea, text)",
        "outbox_hmac_pad(bytea, integer)",
    ):
        op.execute(f"DROP FUNCTION {name}")
