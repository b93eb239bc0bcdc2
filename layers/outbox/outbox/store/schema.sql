-- The relay's schema at the head of its migration chain, as `outbox migrate`
-- creates it (tables, indexes, constraints, triggers, functions, grants).
-- Generated from the migrations, never edited by hand: after adding a
-- migration, run `make schema`. The reasons behind each object are in the
-- migrations (layers/outbox/outbox/migrations/versions/), in chain order.
-- For reading (it loads into an empty database, but deployments are
-- created and upgraded by `outbox migrate`).
-- Roles are shown with their default names (the settings OUTBOX_*_ROLE),
-- the objects in the schema public (the migrator's first on its search_path).
-- Rendered by pg_dump 15.

-- The functions come in name order, some before the ones they call: their
-- bodies are checked when first called rather than when created.
SET check_function_bodies = false;

-- Name: outbox_addresses(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_addresses(channel text, payload jsonb) RETURNS SETOF text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
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
    $$;

-- Name: outbox_dedupe_identity(text, jsonb, text[]); Type: FUNCTION

CREATE FUNCTION public.outbox_dedupe_identity(channel text, payload jsonb, addresses text[]) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT CASE channel
            WHEN 'eventbridge' THEN concat_ws(E'\n', COALESCE(payload ->> 'event_bus', ''),
                                              payload ->> 'source', payload ->> 'detail_type')
            ELSE array_to_string(addresses, E'\n') END
    $$;

-- Name: outbox_enqueue(text, jsonb, text, text, integer, interval, integer, timestamp with time zone, interval, text); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue(channel text, payload jsonb, dedupe_key text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, priority integer DEFAULT 0, delay interval DEFAULT NULL::interval, max_attempts integer DEFAULT NULL::integer, expires_at timestamp with time zone DEFAULT NULL::timestamp with time zone, ttl interval DEFAULT NULL::interval, on_predecessor_failure text DEFAULT 'hold'::text) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path TO '$user', 'public'
    AS $_$
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
$_$;

-- Name: outbox_enqueue_builtin_fields(text); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_builtin_fields(channel text) RETURNS TABLE(field text, kind text, required boolean)
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT f.field, f.kind, f.required
    FROM (VALUES
                ('email', 'from', 'string', true),
                ('email', 'to', 'array', true),
                ('email', 'cc', 'array', false),
                ('email', 'bcc', 'array', false),
                ('email', 'reply_to', 'array', false),
                ('email', 'subject', 'string', true),
                ('email', 'text', 'string', false),
                ('email', 'html', 'string', false),
                ('sms', 'to', 'string', true),
                ('sms', 'message', 'string', true),
                ('sms', 'sender_id', 'string', false),
                ('sms', 'sms_type', NULL, false),
                ('push', 'endpoint_arn', 'string', true),
                ('push', 'title', 'string', false),
                ('push', 'body', 'string', true),
                ('push', 'data', 'object', false),
                ('webhook', 'url', 'string', true),
                ('webhook', 'event_type', 'string', true),
                ('webhook', 'body', 'object', true),
                ('webhook', 'secret_id', 'string', false),
                ('eventbridge', 'source', 'string', true),
                ('eventbridge', 'detail_type', 'string', true),
                ('eventbridge', 'detail', 'object', true),
                ('eventbridge', 'event_bus', 'string', false),
                ('eventbridge', 'resources', 'array', false),
                ('sqs', 'queue_url', 'string', true),
                ('sqs', 'body', 'string', true),
                ('sqs', 'delay_seconds', 'integer', false),
                ('sqs', 'attributes', 'object', false)
         ) AS f(channel, field, kind, required)
    WHERE f.channel = outbox_enqueue_builtin_fields.channel
$$;

-- Name: outbox_enqueue_refuse(text, text); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_refuse(field text, problem text) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
        MESSAGE = field || ': ' || problem, COLUMN = field;
END
$$;

-- Name: outbox_fingerprint(text); Type: FUNCTION

CREATE FUNCTION public.outbox_fingerprint(message text) RETURNS bytea
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
        SELECT outbox_hmac(k.inner_pad, k.outer_pad, message) FROM outbox_fingerprint_key AS k
    $$;

-- Name: outbox_hmac(bytea, bytea, text); Type: FUNCTION

CREATE FUNCTION public.outbox_hmac(inner_pad bytea, outer_pad bytea, message text) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT sha256(outer_pad || sha256(inner_pad || convert_to(message, 'UTF8')))
    $$;

-- Name: outbox_hmac_pad(bytea, integer); Type: FUNCTION

CREATE FUNCTION public.outbox_hmac_pad(key bytea, pad integer) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$
        SELECT string_agg(
                   set_byte(decode('00', 'hex'), 0,
                            (CASE WHEN i < length(key) THEN get_byte(key, i) ELSE 0 END) # pad),
                   ''::bytea ORDER BY i)
        FROM generate_series(0, 63) AS i
    $$;

-- Name: outbox_jsonb_list(jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_jsonb_list(value jsonb) RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT CASE WHEN jsonb_typeof(value) = 'array' THEN value ELSE '[]' END
    $$;

-- Name: outbox_normalize_address(text, text); Type: FUNCTION

CREATE FUNCTION public.outbox_normalize_address(channel text, address text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT CASE WHEN channel = 'email' THEN lower(btrim(address)) ELSE address END
    $$;

-- Name: outbox_payload_digest(jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_payload_digest(payload jsonb) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT sha256(convert_to(CAST(payload AS text), 'UTF8'))
    $$;

-- Name: outbox_recipient_fingerprint(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_recipient_fingerprint(channel text, payload jsonb) RETURNS bytea
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
        SELECT outbox_hmac(k.inner_pad, k.outer_pad, outbox_dedupe_identity(channel, payload,
                   ARRAY(SELECT a FROM outbox_addresses(channel, payload) AS a ORDER BY a)))
        FROM outbox_fingerprint_key AS k
    $$;

-- Name: outbox_recipient_fingerprints(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_recipient_fingerprints(channel text, payload jsonb) RETURNS bytea[]
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
        SELECT ARRAY(SELECT outbox_hmac(k.inner_pad, k.outer_pad, a)
                     FROM outbox_addresses(channel, payload) AS a ORDER BY a)
        FROM outbox_fingerprint_key AS k
    $$;

-- Name: outbox_recipients(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_recipients(channel text, payload jsonb) RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT ARRAY(SELECT a FROM outbox_addresses(channel, payload) AS a ORDER BY a)
    $$;

-- Name: outbox_record_outcome_event(); Type: FUNCTION

CREATE FUNCTION public.outbox_record_outcome_event() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
        BEGIN
            INSERT INTO outbox_outcome_event (message_id, channel, status, attempts, last_error,
                                              provider_message_id, dedupe_key, ordering_key)
            VALUES (NEW.id, NEW.channel, NEW.status, NEW.attempts, NEW.last_error,
                    NEW.provider_message_id, NEW.dedupe_key, NEW.ordering_key);
            RETURN NULL;
        END
        $$;

-- Name: outbox_take_dedupe_key(text, text, jsonb, bigint); Type: FUNCTION

CREATE FUNCTION public.outbox_take_dedupe_key(p_channel text, p_dedupe_key text, p_payload jsonb, p_new_id bigint) RETURNS bigint
    LANGUAGE plpgsql
    AS $$
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
    $$;

-- Name: outbox_attempt; Type: TABLE

CREATE TABLE public.outbox_attempt (
    id bigint NOT NULL,
    message_id bigint NOT NULL,
    attempt integer NOT NULL,
    outcome text NOT NULL,
    error text,
    provider_message_id text,
    claimed_at timestamp with time zone,
    finished_at timestamp with time zone DEFAULT now() NOT NULL,
    duration_ms integer,
    channel text NOT NULL,
    recipient_fingerprints bytea[] DEFAULT '{}'::bytea[] NOT NULL,
    feedback_id text,
    CONSTRAINT outbox_attempt_outcome_check CHECK ((outcome = ANY (ARRAY['delivered'::text, 'retry'::text, 'failed'::text, 'dead'::text, 'suppressed'::text, 'deferred'::text, 'expired'::text, 'not_started'::text, 'bounced'::text, 'complained'::text, 'transient_bounce'::text, 'delivery_confirmed'::text])))
);

-- Name: outbox_attempt_id_seq; Type: SEQUENCE

ALTER TABLE public.outbox_attempt ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_attempt_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: outbox_channel_pause; Type: TABLE

CREATE TABLE public.outbox_channel_pause (
    channel text NOT NULL,
    reason text,
    paused_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_channel_pause_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text))
);

-- Name: outbox_dedupe; Type: TABLE

CREATE TABLE public.outbox_dedupe (
    channel text NOT NULL,
    dedupe_key text NOT NULL,
    recipient_fingerprint bytea NOT NULL,
    payload_digest bytea NOT NULL,
    message_id bigint NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);

-- Name: outbox_fingerprint_key; Type: TABLE

CREATE TABLE public.outbox_fingerprint_key (
    singleton boolean DEFAULT true NOT NULL,
    key bytea NOT NULL,
    inner_pad bytea GENERATED ALWAYS AS (public.outbox_hmac_pad(key, 54)) STORED,
    outer_pad bytea GENERATED ALWAYS AS (public.outbox_hmac_pad(key, 92)) STORED,
    CONSTRAINT outbox_fingerprint_key_key_check CHECK ((length(key) = 32)),
    CONSTRAINT outbox_fingerprint_key_singleton_check CHECK (singleton)
);

-- Name: outbox_message; Type: TABLE

CREATE TABLE public.outbox_message (
    id bigint NOT NULL,
    channel text NOT NULL,
    payload jsonb NOT NULL,
    status text DEFAULT 'pending'::text NOT NULL,
    priority smallint DEFAULT 0 NOT NULL,
    available_at timestamp with time zone DEFAULT now() NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    max_attempts integer,
    claim_token uuid,
    claimed_at timestamp with time zone,
    lease_expires_at timestamp with time zone,
    dedupe_key text,
    ordering_key text,
    provider_message_id text,
    last_error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    settled_at timestamp with time zone,
    received_at timestamp with time zone,
    deferrals integer DEFAULT 0 NOT NULL,
    expires_at timestamp with time zone,
    on_predecessor_failure text DEFAULT 'hold'::text NOT NULL,
    recipient_fingerprints bytea[] DEFAULT '{}'::bytea[] NOT NULL,
    attempts_at_redrive integer DEFAULT 0 NOT NULL,
    CONSTRAINT outbox_message_attempts_at_redrive_check CHECK ((attempts_at_redrive >= 0)),
    CONSTRAINT outbox_message_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT outbox_message_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text)),
    CONSTRAINT outbox_message_claim_consistent CHECK (((status = 'claimed'::text) = ((claim_token IS NOT NULL) AND (lease_expires_at IS NOT NULL)))),
    CONSTRAINT outbox_message_deferrals_check CHECK ((deferrals >= 0)),
    CONSTRAINT outbox_message_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT outbox_message_on_predecessor_failure_check CHECK ((on_predecessor_failure = ANY (ARRAY['hold'::text, 'cancel'::text]))),
    CONSTRAINT outbox_message_settled_consistent CHECK (((status = ANY (ARRAY['pending'::text, 'claimed'::text])) = (settled_at IS NULL))),
    CONSTRAINT outbox_message_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'claimed'::text, 'delivered'::text, 'failed'::text, 'dead'::text, 'suppressed'::text, 'cancelled'::text, 'expired'::text, 'bounced'::text, 'complained'::text])))
)
WITH (autovacuum_vacuum_scale_factor='0.01', autovacuum_vacuum_threshold='1000', autovacuum_analyze_scale_factor='0.02', autovacuum_vacuum_cost_delay='0', fillfactor='90');

-- Name: outbox_message_id_seq; Type: SEQUENCE

ALTER TABLE public.outbox_message ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_message_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: outbox_outcome_event; Type: TABLE

CREATE TABLE public.outbox_outcome_event (
    id bigint NOT NULL,
    message_id bigint NOT NULL,
    channel text NOT NULL,
    status text NOT NULL,
    attempts integer NOT NULL,
    last_error text,
    provider_message_id text,
    dedupe_key text,
    ordering_key text,
    occurred_at timestamp with time zone DEFAULT now() NOT NULL,
    publish_after timestamp with time zone DEFAULT now() NOT NULL,
    publish_attempts integer DEFAULT 0 NOT NULL,
    publish_error text
);

-- Name: outbox_outcome_event_id_seq; Type: SEQUENCE

ALTER TABLE public.outbox_outcome_event ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_outcome_event_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: outbox_attempt outbox_attempt_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_attempt
    ADD CONSTRAINT outbox_attempt_pkey PRIMARY KEY (id);

-- Name: outbox_channel_pause outbox_channel_pause_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_channel_pause
    ADD CONSTRAINT outbox_channel_pause_pkey PRIMARY KEY (channel);

-- Name: outbox_dedupe outbox_dedupe_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_dedupe
    ADD CONSTRAINT outbox_dedupe_pkey PRIMARY KEY (channel, dedupe_key, recipient_fingerprint);

-- Name: outbox_fingerprint_key outbox_fingerprint_key_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_fingerprint_key
    ADD CONSTRAINT outbox_fingerprint_key_pkey PRIMARY KEY (singleton);

-- Name: outbox_message outbox_message_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_message
    ADD CONSTRAINT outbox_message_pkey PRIMARY KEY (id);

-- Name: outbox_outcome_event outbox_outcome_event_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_outcome_event
    ADD CONSTRAINT outbox_outcome_event_pkey PRIMARY KEY (id);

-- Name: outbox_attempt_feedback; Type: INDEX

CREATE UNIQUE INDEX outbox_attempt_feedback ON public.outbox_attempt USING btree (message_id, feedback_id) WHERE (feedback_id IS NOT NULL);

-- Name: outbox_attempt_finished; Type: INDEX

CREATE INDEX outbox_attempt_finished ON public.outbox_attempt USING btree (finished_at);

-- Name: outbox_attempt_message; Type: INDEX

CREATE INDEX outbox_attempt_message ON public.outbox_attempt USING btree (message_id, id);

-- Name: outbox_attempt_recipient; Type: INDEX

CREATE INDEX outbox_attempt_recipient ON public.outbox_attempt USING gin (recipient_fingerprints);

-- Name: outbox_dedupe_created; Type: INDEX

CREATE INDEX outbox_dedupe_created ON public.outbox_dedupe USING btree (created_at);

-- Name: outbox_message_due; Type: INDEX

CREATE INDEX outbox_message_due ON public.outbox_message USING btree (priority DESC, available_at, id) WHERE (status = 'pending'::text);

-- Name: outbox_message_due_by_channel; Type: INDEX

CREATE INDEX outbox_message_due_by_channel ON public.outbox_message USING btree (channel, priority DESC, available_at, id) WHERE (status = 'pending'::text);

-- Name: outbox_message_email_provider_id; Type: INDEX

CREATE INDEX outbox_message_email_provider_id ON public.outbox_message USING btree (provider_message_id) WHERE ((channel = 'email'::text) AND (provider_message_id IS NOT NULL));

-- Name: outbox_message_expiry; Type: INDEX

CREATE INDEX outbox_message_expiry ON public.outbox_message USING btree (expires_at) WHERE ((status = 'pending'::text) AND (expires_at IS NOT NULL));

-- Name: outbox_message_lease; Type: INDEX

CREATE INDEX outbox_message_lease ON public.outbox_message USING btree (lease_expires_at) WHERE (status = 'claimed'::text);

-- Name: outbox_message_ordering; Type: INDEX

CREATE INDEX outbox_message_ordering ON public.outbox_message USING btree (ordering_key, id) WHERE ((ordering_key IS NOT NULL) AND (status = ANY (ARRAY['pending'::text, 'claimed'::text, 'failed'::text, 'dead'::text, 'expired'::text])));

-- Name: outbox_message_settled; Type: INDEX

CREATE INDEX outbox_message_settled ON public.outbox_message USING btree (status, settled_at) WHERE (settled_at IS NOT NULL);

-- Name: outbox_outcome_event_due; Type: INDEX

CREATE INDEX outbox_outcome_event_due ON public.outbox_outcome_event USING btree (publish_after, id);

-- Name: outbox_message outbox_message_delivered_event; Type: TRIGGER

CREATE TRIGGER outbox_message_delivered_event AFTER UPDATE OF status ON public.outbox_message FOR EACH ROW WHEN (((new.status = 'delivered'::text) AND (old.status IS DISTINCT FROM 'delivered'::text))) EXECUTE FUNCTION public.outbox_record_outcome_event();

ALTER TABLE public.outbox_message DISABLE TRIGGER outbox_message_delivered_event;

-- Name: outbox_message outbox_message_outcome_event; Type: TRIGGER

CREATE TRIGGER outbox_message_outcome_event AFTER UPDATE OF status ON public.outbox_message FOR EACH ROW WHEN (((new.status IS DISTINCT FROM old.status) AND (new.status = ANY (ARRAY['failed'::text, 'dead'::text, 'expired'::text, 'bounced'::text, 'complained'::text])))) EXECUTE FUNCTION public.outbox_record_outcome_event();

-- Name: TABLE outbox_attempt; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_attempt TO outbox_relay;

-- Name: TABLE outbox_channel_pause; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_channel_pause TO outbox_relay;

-- Name: TABLE outbox_dedupe; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_dedupe TO outbox_relay;

-- Name: TABLE outbox_fingerprint_key; Type: ACL

GRANT SELECT ON TABLE public.outbox_fingerprint_key TO outbox_relay;

-- Name: TABLE outbox_message; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_message TO outbox_relay;

-- Name: SEQUENCE outbox_message_id_seq; Type: ACL

GRANT USAGE ON SEQUENCE public.outbox_message_id_seq TO outbox_relay;

-- Name: TABLE outbox_outcome_event; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_outcome_event TO outbox_relay;
