"""Trust boundaries in the database: a pinned search_path, one narrow door for
producers, the HMAC key behind functions, and the SQL enqueue's checks.

* **Pinned names.** Every relay function resolves names in the schema this
  migration runs in (the *install schema*, fixed here), never in the caller's:
  the functions that read a table are ``SET search_path = <schema>, pg_temp``,
  and the small helpers that only compute (inlined by the planner into the
  enqueue statement, which a ``SET`` clause would prevent) name the relay's
  other helpers schema-qualified. A schema named after a caller (``"$user"``)
  or a ``pg_temp`` object therefore shadows nothing.
* **The producer door.** ``outbox_enqueue`` (SQL, one message) and
  ``outbox_enqueue_many`` (the Python producer's batch) are ``SECURITY
  DEFINER``: they run as the migrator that owns them, with the pinned path,
  and EXECUTE on them is granted to the producer group role created here
  (``OUTBOX_PRODUCER_ROLE``, default ``outbox_producer``) and to nobody else.
  Producers get no privilege on the relay's tables: they cannot read another
  service's payloads, take a dedupe key without its message, or choose an id.
  The relay role is a member of the producer role (``outbox enqueue`` and the
  relay's tests enqueue with its users).
* **The HMAC key** (``outbox_fingerprint_key``) is readable only by its owner:
  the fingerprint functions that need it are ``SECURITY DEFINER``; the relay
  may call ``outbox_fingerprint`` (``outbox history --recipient`` asks "was
  this address sent to?"), producers reach the others only through the door.
* **Outcome events** are written by the trigger function as the owner: the
  relay role no longer inserts them (it still reads, leases and deletes them
  to publish).
* **The relay's DML** shrinks to what it runs: no INSERT on messages (it
  enqueues through the door), no INSERT on dedupe keys (the reaper locks and
  deletes expired ones), no sequence.
* **Channels** SQL knows: ``outbox_channel``, seeded with the built-in
  channels and every channel that already has messages. ``outbox_enqueue``
  refuses a channel not in it; the Python producer's door registers the
  custom channels it is given (Python checked them against its registry and
  their schema); an operator registers one for other languages as the
  migrator: ``INSERT INTO outbox_channel (name) VALUES ('fax')``.
* **The enqueue checks**, in both doors alike: a payload must be an object;
  ``expires_at`` must be finite; the 256 KiB limit is the byte length of the
  jsonb's text (what is stored, and what ``outbox.producer`` measures); a
  payload key named in an error is escaped and cut short.

Revision ID: 0009
Revises: 0005
"""

import os

import sqlalchemy as sa
from alembic import context, op

from outbox.migrations import revision_module
from outbox.settings import OUTBOX_PRODUCER_ROLE, OUTBOX_SCHEMA

revision = "0009"
down_revision = "0005"
branch_labels = None
depends_on = None


def relay_role() -> str:
    return str(revision_module("0003").relay_role())


def producer_role() -> str:
    """Checked to be a plain lower-case identifier (it is interpolated)."""
    return OUTBOX_PRODUCER_ROLE.read(os.environ)


def install_schema() -> str:
    """The schema this migration runs in, quoted: where the tables are. A
    script printed for later (``outbox migrate --sql``) names OUTBOX_SCHEMA,
    the schema the relay's connections resolve names in."""
    if context.is_offline_mode():
        return f'"{OUTBOX_SCHEMA.read(os.environ)}"'
    return str(op.get_bind().execute(sa.text("SELECT quote_ident(current_schema())")).scalar_one())


BUILTIN_CHANNELS = ("email", "sms", "push", "webhook", "eventbridge", "sqs")

MAX_PAYLOAD_BYTES = 262144  # = outbox.payloads.MAX_PAYLOAD_BYTES (a test holds them equal)

# Helpers that only compute: no SET clause (it would stop the planner from
# inlining them into the enqueue statement), the relay's names qualified.
# Built-ins resolve in pg_catalog, which Postgres searches first.
HELPERS = [
    """
    CREATE OR REPLACE FUNCTION @.outbox_addresses(channel text, payload jsonb) RETURNS SETOF text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT DISTINCT @.outbox_normalize_address(channel, a)
        FROM jsonb_array_elements_text(CASE channel
            WHEN 'email' THEN @.outbox_jsonb_list(payload -> 'to')
                              || @.outbox_jsonb_list(payload -> 'cc')
                              || @.outbox_jsonb_list(payload -> 'bcc')
            WHEN 'sms' THEN jsonb_build_array(payload -> 'to')
            WHEN 'push' THEN jsonb_build_array(payload -> 'endpoint_arn')
            WHEN 'webhook' THEN jsonb_build_array(payload -> 'url')
            WHEN 'eventbridge' THEN jsonb_build_array(COALESCE(payload -> 'event_bus', '""'))
            WHEN 'sqs' THEN jsonb_build_array(payload -> 'queue_url')
            ELSE '[]' END) AS a
        WHERE a IS NOT NULL
    $$
    """,
    """
    CREATE OR REPLACE FUNCTION @.outbox_recipients(channel text, payload jsonb) RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
        SELECT ARRAY(SELECT a FROM @.outbox_addresses(channel, payload) AS a ORDER BY a)
    $$
    """,
]

# Built-ins only in their bodies: pinned in place.
PINNED_AS_THEY_ARE = [
    "outbox_hmac_pad(bytea, integer)",
    "outbox_enqueue_refuse(text, text)",
    "outbox_enqueue_builtin_fields(text)",
]
# Built-ins only, and inlined into the enqueue statement: left unpinned.
INLINED = [
    "outbox_hmac(bytea, bytea, text)",
    "outbox_normalize_address(text, text)",
    "outbox_jsonb_list(jsonb)",
    "outbox_dedupe_identity(text, jsonb, text[])",
    "outbox_payload_digest(jsonb)",
]

_PIN = "SET search_path = @, pg_temp"

# The key's readers run as its owner.
KEY_READERS = [
    f"""
    CREATE OR REPLACE FUNCTION @.outbox_fingerprint(message text) RETURNS bytea
    LANGUAGE sql STABLE PARALLEL SAFE SECURITY DEFINER {_PIN} AS $$
        SELECT outbox_hmac(k.inner_pad, k.outer_pad, message) FROM outbox_fingerprint_key AS k
    $$
    """,
    f"""
    CREATE OR REPLACE FUNCTION @.outbox_recipient_fingerprint(channel text, payload jsonb)
    RETURNS bytea LANGUAGE sql STABLE PARALLEL SAFE SECURITY DEFINER {_PIN} AS $$
        SELECT outbox_hmac(k.inner_pad, k.outer_pad, outbox_dedupe_identity(channel, payload,
                   ARRAY(SELECT a FROM outbox_addresses(channel, payload) AS a ORDER BY a)))
        FROM outbox_fingerprint_key AS k
    $$
    """,
    f"""
    CREATE OR REPLACE FUNCTION @.outbox_recipient_fingerprints(channel text, payload jsonb)
    RETURNS bytea[] LANGUAGE sql STABLE PARALLEL SAFE SECURITY DEFINER {_PIN} AS $$
        SELECT ARRAY(SELECT outbox_hmac(k.inner_pad, k.outer_pad, a)
                     FROM outbox_addresses(channel, payload) AS a ORDER BY a)
        FROM outbox_fingerprint_key AS k
    $$
    """,
]

TAKE_DEDUPE_KEY = f"""
CREATE OR REPLACE FUNCTION @.outbox_take_dedupe_key(
    p_channel text, p_dedupe_key text, p_payload jsonb, p_new_id bigint)
RETURNS bigint LANGUAGE plpgsql {_PIN} AS $$
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
"""

# What an error may say of the producer's text. A payload key is named as
# outbox.payloads names it: ``payload.<key>`` for a short identifier, else
# ``payload[…]``. Another value is quoted only when it is short printable
# ASCII; else it is left out. No newline, escape sequence or 100,000
# characters of a producer's text reach an error message (and a log).
QUOTE = [
    f"""
    CREATE FUNCTION @.outbox_payload_field(key text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE {_PIN} AS $$
        SELECT CASE WHEN key ~ '^[A-Za-z_][A-Za-z0-9_-]{{0,39}}$' THEN 'payload.' || key
                    ELSE 'payload[…]' END
    $$
    """,
    f"""
    CREATE FUNCTION @.outbox_quote_text(value text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE {_PIN} AS $$
        SELECT CASE WHEN value ~ '^[\x20-\x7e]{{0,64}}$' THEN quote_literal(value)
                    WHEN value IS NULL THEN 'NULL'
                    ELSE 'a value that cannot be shown' END
    $$
    """,
]

# The checks both doors make, one row of options at a time: the first broken
# rule as (field, problem), or no row. outbox_enqueue asks it for its one
# message; outbox_enqueue_many makes the same comparisons in one pass over its
# rows and asks it to word the first refused one. The built-in channels'
# payload fields are checked by outbox_enqueue (SQL producers); the Python
# producer checked them against the same schemas before calling the door, and
# the sender checks every payload again either way.
ROW_PROBLEM = f"""
CREATE FUNCTION @.outbox_enqueue_problem(
    channel text, payload jsonb, dedupe_key text, ordering_key text, priority integer,
    delay interval, max_attempts integer, expires_at timestamptz, ttl interval,
    on_predecessor_failure text, registered boolean)
RETURNS TABLE (field text, problem text)
LANGUAGE sql STABLE {_PIN} AS $$
    SELECT v.field, v.problem FROM (VALUES
        (1, 'channel', CASE WHEN channel IS NULL THEN 'is required'
            WHEN channel !~ '^[a-z][a-z0-9_-]{{0,63}}$' THEN
                'must be 1 to 64 lower-case letters, digits, _ or -, starting with a letter'
            WHEN NOT registered THEN 'is not a registered channel (outbox_channel)' END),
        (2, 'dedupe_key', CASE WHEN NOT char_length(dedupe_key) BETWEEN 1 AND 255
            THEN 'must be 1 to 255 characters' END),
        (3, 'ordering_key', CASE WHEN NOT char_length(ordering_key) BETWEEN 1 AND 255
            THEN 'must be 1 to 255 characters' END),
        (4, 'priority', CASE WHEN NOT COALESCE(priority, 0) BETWEEN -32768 AND 32767
            THEN format('must be between -32768 and 32767, got %s', priority) END),
        (5, 'delay', CASE WHEN delay < interval '0' OR delay > interval '365 days'
            OR NOT isfinite(delay) THEN 'must be between 0 and 365 days' END),
        (6, 'max_attempts', CASE WHEN NOT max_attempts BETWEEN 1 AND 1000
            THEN format('must be between 1 and 1000, got %s', max_attempts) END),
        (7, 'ttl', CASE WHEN expires_at IS NOT NULL AND ttl IS NOT NULL
            THEN 'give expires_at or ttl, not both'
            WHEN ttl <= interval '0' OR ttl > interval '366 days' OR NOT isfinite(ttl)
            THEN 'must be more than 0 seconds and at most 366 days' END),
        (8, 'expires_at', CASE WHEN NOT isfinite(expires_at) THEN 'must be a finite time' END),
        (9, 'on_predecessor_failure', CASE
            WHEN COALESCE(on_predecessor_failure, 'hold') NOT IN ('hold', 'cancel')
            THEN format('must be one of ''hold'', ''cancel'', got %s',
                        @.outbox_quote_text(on_predecessor_failure)) END),
        (10, 'payload', CASE WHEN payload IS NULL OR jsonb_typeof(payload) = 'null'
            THEN 'is required'
            WHEN jsonb_typeof(payload) <> 'object' THEN 'must be an object'
            WHEN octet_length(CAST(payload AS text)) > {MAX_PAYLOAD_BYTES}
            THEN format('is %s bytes; the limit is {MAX_PAYLOAD_BYTES}',
                        octet_length(CAST(payload AS text))) END)
    ) AS v(n, field, problem)
    WHERE v.problem IS NOT NULL
    ORDER BY v.n
    LIMIT 1
$$
"""

ENQUEUE = f"""
CREATE OR REPLACE FUNCTION @.outbox_enqueue(
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
LANGUAGE plpgsql VOLATILE SECURITY DEFINER {_PIN}
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
    builtin boolean := false;
    new_id bigint;
    held_id bigint;
BEGIN
    SELECT * INTO f FROM outbox_enqueue_problem(p_channel, p_payload, p_dedupe, p_ordering,
        p_priority, p_delay, p_max, p_expires, p_ttl, p_on_failure,
        EXISTS (SELECT 1 FROM outbox_channel AS c WHERE c.name = p_channel));
    IF FOUND THEN
        PERFORM outbox_enqueue_refuse(f.field, f.problem);
    END IF;

    -- a built-in channel's payload fields
    FOR f IN SELECT * FROM outbox_enqueue_builtin_fields(p_channel) LOOP
        builtin := true;
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
            -- the key is the producer's text: named only if it is a short identifier
            PERFORM outbox_enqueue_refuse(outbox_payload_field(f.k),
                'is not a field of this channel');
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

# The Python producer's batch: the rows as parallel arrays (the payloads as
# one JSON array), checked, then written by one statement. Returns one row per
# message in order; nothing is written when a row is refused (refused_field
# names it) or a dedupe key conflicts (conflict), so the caller's transaction
# goes on untouched either way.
_INPUT_ROWS = """
    ROWS FROM (
        unnest(p_channels), jsonb_array_elements(p_payloads),
        unnest(p_dedupe_keys), unnest(p_ordering_keys), unnest(p_priorities),
        unnest(p_delays), unnest(p_max_attempts), unnest(p_expires_at), unnest(p_ttls),
        unnest(p_on_predecessor_failure)
    ) WITH ORDINALITY AS i(channel, payload, dedupe_key, ordering_key, priority,
                           delay_s, max_attempts, expires_at, ttl_s, on_predecessor_failure, ord)
"""
_EXPIRES_AT = "COALESCE(i.expires_at, now() + make_interval(secs => i.delay_s + i.ttl_s))"
_ADDRESSES = "ARRAY(SELECT a FROM outbox_addresses(i.channel, i.payload) AS a ORDER BY a)"
_RECIPIENT_FINGERPRINTS = (
    "ARRAY(SELECT outbox_hmac(k.inner_pad, k.outer_pad, a) "
    "FROM outbox_addresses(i.channel, i.payload) AS a ORDER BY a)"
)

ENQUEUE_MANY = f"""
CREATE FUNCTION @.outbox_enqueue_many(
    p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[],
    p_priorities integer[], p_delays float8[], p_max_attempts integer[],
    p_expires_at timestamptz[], p_ttls float8[], p_on_predecessor_failure text[])
RETURNS TABLE (ord bigint, conflict boolean, id bigint, created boolean, first_ord bigint,
               held_id bigint, refused_field text, refused_problem text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER {_PIN}
AS $$
#variable_conflict use_column
DECLARE
    bad record;
    result jsonb;
    round integer;
BEGIN
    IF jsonb_typeof(p_payloads) IS DISTINCT FROM 'array'
       OR jsonb_array_length(p_payloads) <> cardinality(p_channels) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'payloads: must be a JSON array, one per channel';
    END IF;
    -- Every row checked first, in one pass of plain comparisons (the rules of
    -- outbox_enqueue_problem, which then words the first refused row's).
    SELECT i.*, p.field, p.problem INTO bad
    FROM (SELECT i.* FROM {_INPUT_ROWS}
          WHERE (i.channel ~ '^[a-z][a-z0-9_-]{{0,63}}$'
                 AND jsonb_typeof(i.payload) = 'object'
                 AND (i.dedupe_key IS NULL OR char_length(i.dedupe_key) BETWEEN 1 AND 255)
                 AND (i.ordering_key IS NULL OR char_length(i.ordering_key) BETWEEN 1 AND 255)
                 AND COALESCE(i.priority, 0) BETWEEN -32768 AND 32767
                 AND COALESCE(i.delay_s, 0) BETWEEN 0 AND 365 * 86400
                 AND (i.max_attempts IS NULL OR i.max_attempts BETWEEN 1 AND 1000)
                 AND (i.ttl_s IS NULL
                      OR (i.expires_at IS NULL AND i.ttl_s > 0 AND i.ttl_s <= 366 * 86400))
                 AND (i.expires_at IS NULL OR isfinite(i.expires_at))
                 AND COALESCE(i.on_predecessor_failure, 'hold') IN ('hold', 'cancel')
                 AND octet_length(CAST(i.payload AS text)) <= {MAX_PAYLOAD_BYTES}) IS NOT TRUE
          ORDER BY i.ord LIMIT 1) AS i
    CROSS JOIN LATERAL outbox_enqueue_problem(i.channel, i.payload, i.dedupe_key,
        i.ordering_key, i.priority, make_interval(secs => i.delay_s), i.max_attempts,
        i.expires_at, make_interval(secs => i.ttl_s), i.on_predecessor_failure, true) AS p;
    IF FOUND THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
                            bad.field, bad.problem;
        RETURN;
    END IF;
    -- Python checked these channels against its registry: SQL producers may use them too
    INSERT INTO outbox_channel (name)
    SELECT DISTINCT c FROM unnest(p_channels) AS c
    WHERE NOT EXISTS (SELECT 1 FROM outbox_channel AS r WHERE r.name = c)
    ON CONFLICT DO NOTHING;
    -- producers of one ordering key take turns until their commit (in key
    -- order, so that two producers cannot deadlock on each other)
    PERFORM count(pg_advisory_xact_lock(hashtextextended('outbox-ordering-key:' || k, 0)))
    FROM (SELECT DISTINCT k FROM unnest(p_ordering_keys) AS u(k)
          WHERE k IS NOT NULL ORDER BY k) AS keys;

    IF NOT EXISTS (SELECT 1 FROM unnest(p_dedupe_keys) AS d WHERE d IS NOT NULL) THEN
        -- Identity values are drawn in the order the SELECT produces rows
        -- (ORDER BY ord), so the ids sorted ascending are the input order.
        RETURN QUERY
        WITH inserted AS (
            INSERT INTO outbox_message (channel, payload, ordering_key, priority, available_at,
                                        max_attempts, expires_at, on_predecessor_failure,
                                        recipient_fingerprints)
            SELECT i.channel, i.payload, i.ordering_key, COALESCE(i.priority, 0),
                   now() + make_interval(secs => COALESCE(i.delay_s, 0)), i.max_attempts,
                   {_EXPIRES_AT}, COALESCE(i.on_predecessor_failure, 'hold'),
                   {_RECIPIENT_FINGERPRINTS}
            FROM {_INPUT_ROWS} CROSS JOIN outbox_fingerprint_key AS k
            ORDER BY i.ord
            RETURNING outbox_message.id
        )
        SELECT row_number() OVER (ORDER BY n.id), false, n.id, true, NULL::bigint,
               NULL::bigint, NULL::text, NULL::text
        FROM inserted AS n ORDER BY n.id;
        RETURN;
    END IF;

    -- A key taken by a transaction that committed after a round's snapshot
    -- leaves its message without an id: the round is taken back and run
    -- again (each statement here sees a fresh snapshot). Only a key pruned in
    -- between needs another round.
    FOR round IN 1..3 LOOP
        WITH input AS (
            SELECT i.*,
                   -- ids are drawn first so that a key's entry can name its message
                   nextval('outbox_message_id_seq') AS new_id,
                   {_RECIPIENT_FINGERPRINTS} AS recipient_fingerprints,
                   CASE WHEN i.dedupe_key IS NOT NULL THEN outbox_hmac(k.inner_pad, k.outer_pad,
                       outbox_dedupe_identity(i.channel, i.payload, {_ADDRESSES})) END
                       AS fingerprint,
                   CASE WHEN i.dedupe_key IS NOT NULL
                        THEN outbox_payload_digest(i.payload) END AS digest
            FROM {_INPUT_ROWS} CROSS JOIN outbox_fingerprint_key AS k
            ORDER BY i.ord
        ),
        keyed AS (  -- the first of each (channel, key, recipient) in the list stands for it
            SELECT DISTINCT ON (channel, dedupe_key, fingerprint)
                   ord, new_id, channel, dedupe_key, fingerprint, digest
            FROM input WHERE dedupe_key IS NOT NULL
            ORDER BY channel, dedupe_key, fingerprint, ord
        ),
        held AS (  -- keys already taken when this statement began
            SELECT k.ord, d.message_id, d.payload_digest
            FROM keyed AS k JOIN outbox_dedupe AS d
              ON d.channel = k.channel AND d.dedupe_key = k.dedupe_key
             AND d.recipient_fingerprint = k.fingerprint
        ),
        conflicts AS (  -- a payload other than the one its key was first given
            SELECT i.ord FROM input AS i
            JOIN keyed AS k ON k.channel = i.channel AND k.dedupe_key = i.dedupe_key
                           AND k.fingerprint = i.fingerprint
            LEFT JOIN held AS h ON h.ord = k.ord
            WHERE i.digest <> COALESCE(h.payload_digest, k.digest)
        ),
        taken AS (  -- nothing at all is written when any message conflicts
            INSERT INTO outbox_dedupe
                (channel, dedupe_key, recipient_fingerprint, payload_digest, message_id)
            SELECT k.channel, k.dedupe_key, k.fingerprint, k.digest, k.new_id FROM keyed AS k
            WHERE NOT EXISTS (SELECT 1 FROM conflicts)
              AND NOT EXISTS (SELECT 1 FROM held AS h WHERE h.ord = k.ord)
            ORDER BY k.ord
            ON CONFLICT DO NOTHING  -- taken meanwhile by a transaction that committed since
            RETURNING message_id
        ),
        inserted AS (
            INSERT INTO outbox_message (id, channel, payload, dedupe_key, ordering_key, priority,
                                        available_at, max_attempts, expires_at,
                                        on_predecessor_failure, recipient_fingerprints)
            OVERRIDING SYSTEM VALUE
            SELECT new_id, channel, payload, dedupe_key, ordering_key, COALESCE(priority, 0),
                   now() + make_interval(secs => COALESCE(delay_s, 0)), max_attempts,
                   {_EXPIRES_AT}, COALESCE(on_predecessor_failure, 'hold'),
                   recipient_fingerprints
            FROM input AS i
            WHERE NOT EXISTS (SELECT 1 FROM conflicts)
              AND (dedupe_key IS NULL OR new_id IN (SELECT message_id FROM taken))
            ORDER BY ord
        )
        SELECT jsonb_agg(jsonb_build_object(
                   'ord', i.ord,
                   'conflict', i.ord IN (SELECT ord FROM conflicts),
                   'id', CASE WHEN i.dedupe_key IS NULL THEN i.new_id
                              WHEN k.new_id IN (SELECT message_id FROM taken) THEN k.new_id
                              ELSE h.message_id END,  -- NULL: taken since the snapshot
                   'created', i.dedupe_key IS NULL
                              OR i.new_id IN (SELECT message_id FROM taken),
                   'first_ord', k.ord, 'held_id', h.message_id) ORDER BY i.ord)
        INTO result
        FROM input AS i
        LEFT JOIN keyed AS k ON k.channel = i.channel AND k.dedupe_key = i.dedupe_key
                            AND k.fingerprint = i.fingerprint
        LEFT JOIN held AS h ON h.ord = k.ord;

        IF NOT EXISTS (SELECT 1 FROM jsonb_array_elements(result) AS r
                       WHERE r -> 'id' = 'null' AND NOT (r ->> 'conflict')::boolean)
           OR EXISTS (SELECT 1 FROM jsonb_array_elements(result) AS r
                      WHERE (r ->> 'conflict')::boolean) THEN
            EXIT;
        END IF;
        -- take back what this round wrote (the keys by their primary key)
        WITH gone AS (
            DELETE FROM outbox_message AS m
            WHERE m.id IN (SELECT (r ->> 'id')::bigint FROM jsonb_array_elements(result) AS r
                           WHERE (r ->> 'created')::boolean)
            RETURNING m.id, m.channel, m.dedupe_key, m.payload
        )
        DELETE FROM outbox_dedupe AS d USING gone AS g
        WHERE d.channel = g.channel AND d.dedupe_key = g.dedupe_key
          AND d.recipient_fingerprint = outbox_recipient_fingerprint(g.channel, g.payload)
          AND d.message_id = g.id;
    END LOOP;
    RETURN QUERY
    SELECT r.ord, r.conflict, r.id, r.created, r.first_ord, r.held_id, NULL::text, NULL::text
    FROM jsonb_to_recordset(result) AS r(ord bigint, conflict boolean, id bigint,
                                         created boolean, first_ord bigint, held_id bigint)
    ORDER BY r.ord;
END
$$
"""

OUTCOME_EVENT_TRIGGER = f"""
CREATE OR REPLACE FUNCTION @.outbox_record_outcome_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER {_PIN} AS $$
BEGIN
    INSERT INTO outbox_outcome_event (message_id, channel, status, attempts, last_error,
                                      provider_message_id, dedupe_key, ordering_key)
    VALUES (NEW.id, NEW.channel, NEW.status, NEW.attempts, NEW.last_error,
            NEW.provider_message_id, NEW.dedupe_key, NEW.ordering_key);
    RETURN NULL;
END
$$
"""

ENQUEUE_SIGNATURE = (
    "outbox_enqueue(text, jsonb, text, text, integer, interval, integer, timestamptz, "
    "interval, text)"
)
ENQUEUE_MANY_SIGNATURE = (
    "outbox_enqueue_many(text[], jsonb, text[], text[], integer[], float8[], integer[], "
    "timestamptz[], float8[], text[])"
)
# Callable by nobody but the owner, except through the doors (and the
# relay's fingerprint lookup, granted below).
PRIVATE = [
    "outbox_fingerprint(text)",
    "outbox_recipient_fingerprint(text, jsonb)",
    "outbox_recipient_fingerprints(text, jsonb)",
    "outbox_take_dedupe_key(text, text, jsonb, bigint)",
    "outbox_record_outcome_event()",
    ENQUEUE_SIGNATURE,
    ENQUEUE_MANY_SIGNATURE,
]

# The relay role's grants before and after this revision (revisions 0003,
# 0005, 0006, 0007), table by table.
RELAY_BEFORE = {
    "outbox_message": "SELECT, INSERT, UPDATE, DELETE",
    "outbox_dedupe": "SELECT, INSERT, UPDATE, DELETE",
    "outbox_outcome_event": "SELECT, INSERT, UPDATE, DELETE",
    "outbox_fingerprint_key": "SELECT",
}
RELAY_AFTER = {
    "outbox_message": "SELECT, UPDATE, DELETE",
    "outbox_dedupe": "SELECT, UPDATE, DELETE",  # UPDATE: the prune locks rows (FOR UPDATE)
    "outbox_outcome_event": "SELECT, UPDATE, DELETE",
    "outbox_channel": "SELECT",
}


def _ensure_role(role: str) -> None:
    """Created unless it exists; a concurrent creator wins the race harmlessly."""
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                BEGIN
                    CREATE ROLE {role} NOLOGIN;
                EXCEPTION
                    WHEN duplicate_object OR unique_violation THEN NULL;
                    WHEN insufficient_privilege THEN
                        RAISE EXCEPTION 'role {role} does not exist and this user cannot create it'
                            USING HINT = 'As a user with CREATEROLE: CREATE ROLE {role} NOLOGIN';
                END;
            END IF;
        END
        $$
        """
    )


def _in(schema: str, sql: str) -> str:
    return sql.replace("@.", f"{schema}.").replace("@,", f"{schema},")


def upgrade() -> None:
    schema = install_schema()
    relay, producer = relay_role(), producer_role()

    op.execute(
        """
        CREATE TABLE outbox_channel (
            name          text        PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_-]{0,63}$'),
            registered_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    # The built-in channels, and every channel that has messages already.
    op.execute(
        sa.text(
            "INSERT INTO outbox_channel (name) SELECT unnest(CAST(:names AS text[])) "
            "UNION SELECT DISTINCT channel FROM outbox_message"
        ).bindparams(names="{" + ",".join(BUILTIN_CHANNELS) + "}")
    )

    for helper in HELPERS:
        op.execute(_in(schema, helper))
    for function in PINNED_AS_THEY_ARE:
        op.execute(f"ALTER FUNCTION {schema}.{function} SET search_path = {schema}, pg_temp")
    for function in KEY_READERS:
        op.execute(_in(schema, function))
    op.execute(_in(schema, TAKE_DEDUPE_KEY))
    for function in QUOTE:
        op.execute(_in(schema, function))
    op.execute(_in(schema, ROW_PROBLEM))
    op.execute(_in(schema, ENQUEUE))
    op.execute(_in(schema, ENQUEUE_MANY))
    op.execute(_in(schema, OUTCOME_EVENT_TRIGGER))

    _ensure_role(producer)
    for function in PRIVATE:
        op.execute(f"REVOKE ALL ON FUNCTION {schema}.{function} FROM PUBLIC")
    for door in (ENQUEUE_SIGNATURE, ENQUEUE_MANY_SIGNATURE):
        op.execute(f"GRANT EXECUTE ON FUNCTION {schema}.{door} TO {producer}")
    op.execute(f"GRANT EXECUTE ON FUNCTION {schema}.outbox_fingerprint(text) TO {relay}")
    # The membership may be the administrator's to give (the own-schema recipe
    # does): granted here only when it is missing.
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT pg_has_role('{relay}', '{producer}', 'MEMBER') THEN
                GRANT {producer} TO {relay};
            END IF;
        END
        $$
        """
    )
    _grant_schema_usage(schema, (relay, producer))

    for table, privileges in RELAY_BEFORE.items():
        op.execute(f"REVOKE {privileges} ON {table} FROM {relay}")
    for table, privileges in RELAY_AFTER.items():
        op.execute(f"GRANT {privileges} ON {table} TO {relay}")
    op.execute(f"REVOKE ALL ON SEQUENCE outbox_message_id_seq FROM {relay}")


def _grant_schema_usage(schema: str, roles: tuple[str, ...]) -> None:
    """USAGE on the install schema, when the migrator owns it (an own schema,
    as the README's recipe makes it). ``public`` gives USAGE to everyone
    already, and its owner may not be the migrator."""
    op.execute(
        f"""
        DO $$
        BEGIN
            IF (SELECT nspowner FROM pg_namespace WHERE oid = '{schema}'::regnamespace)
               = (SELECT oid FROM pg_roles WHERE rolname = current_user) THEN
                GRANT USAGE ON SCHEMA {schema} TO {", ".join(roles)};
            END IF;
        END
        $$
        """.replace("'{schema}'", "'" + schema.replace("'", "''") + "'")
    )


def downgrade() -> None:
    schema = install_schema()
    relay, _producer = relay_role(), producer_role()
    for table, privileges in RELAY_AFTER.items():
        if table != "outbox_channel":
            op.execute(f"REVOKE {privileges} ON {table} FROM {relay}")
    for table, privileges in RELAY_BEFORE.items():
        op.execute(f"GRANT {privileges} ON {table} TO {relay}")
    op.execute(f"GRANT USAGE ON SEQUENCE outbox_message_id_seq TO {relay}")

    op.execute(f"DROP FUNCTION {schema}.{ENQUEUE_MANY_SIGNATURE}")
    op.execute(f"DROP FUNCTION {schema}.{ENQUEUE_SIGNATURE}")
    op.execute(
        f"DROP FUNCTION {schema}.outbox_enqueue_problem(text, jsonb, text, text, integer, "
        "interval, integer, timestamptz, interval, text, boolean)"
    )
    op.execute(f"DROP FUNCTION {schema}.outbox_payload_field(text)")
    op.execute(f"DROP FUNCTION {schema}.outbox_quote_text(text)")
    # The earlier revisions' bodies, as they wrote them (CREATE OR REPLACE
    # resets the SET clause and SECURITY DEFINER; the grants stay).
    op.execute(revision_module("0004").ENQUEUE)
    old_functions = revision_module("0006").FUNCTIONS
    for function in old_functions:
        op.execute(function.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    for function in PINNED_AS_THEY_ARE:
        op.execute(f"ALTER FUNCTION {schema}.{function} RESET search_path")
    op.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_record_outcome_event() RETURNS trigger
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
    for function in PRIVATE:
        if function not in (ENQUEUE_MANY_SIGNATURE,):
            op.execute(f"GRANT EXECUTE ON FUNCTION {schema}.{function} TO PUBLIC")
    op.execute("DROP TABLE outbox_channel")
