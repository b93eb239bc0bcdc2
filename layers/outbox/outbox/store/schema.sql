-- The relay's schema at the head of its migration chain, as `outbox migrate`
-- creates it (tables, indexes, constraints, triggers, functions, grants).
-- Generated from the migrations, never edited by hand: after adding a
-- migration, run `make schema`. The reasons behind each object are in the
-- migrations (layers/outbox/outbox/migrations/versions/), in chain order.
-- For reading (it loads into an empty database, but deployments are
-- created and upgraded by `outbox migrate`).
-- Roles are shown with their default names (the settings OUTBOX_*_ROLE),
-- the objects in the schema public (the migrator's first on its search_path).
-- The history's day partitions (outbox_message_resolved_pYYYYMMDD, one a
-- UTC day) are left out: the relay makes them as days pass.
-- Rendered by pg_dump 15.

-- The functions come in name order, some before the ones they call: their
-- bodies are checked when first called rather than when created.
SET check_function_bodies = false;

-- Name: outbox_addresses(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_addresses(channel text, payload jsonb) RETURNS SETOF text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT DISTINCT public.outbox_normalize_address(channel, a)
        FROM pg_catalog.jsonb_array_elements_text(CASE channel
            WHEN 'email' THEN public.outbox_jsonb_list(payload -> 'to')
                              || public.outbox_jsonb_list(payload -> 'cc')
                              || public.outbox_jsonb_list(payload -> 'bcc')
            WHEN 'sms' THEN pg_catalog.jsonb_build_array(payload -> 'to')
            WHEN 'push' THEN pg_catalog.jsonb_build_array(payload -> 'endpoint_arn')
            WHEN 'webhook' THEN pg_catalog.jsonb_build_array(payload -> 'url')
            WHEN 'eventbridge' THEN pg_catalog.jsonb_build_array(COALESCE(payload -> 'event_bus', '""'))
            WHEN 'sqs' THEN pg_catalog.jsonb_build_array(payload -> 'queue_url')
            ELSE '[]' END) AS a
        WHERE a IS NOT NULL
    $$;

-- Name: outbox_cooldown_problem(interval, text, text); Type: FUNCTION

CREATE FUNCTION public.outbox_cooldown_problem(cooldown interval, cooldown_key text, on_cooldown text) RETURNS TABLE(field text, problem text)
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $$
    SELECT v.field, v.problem FROM (VALUES
        (1, 'cooldown', CASE WHEN cooldown IS NULL AND cooldown_key IS NOT NULL
            THEN 'is required with cooldown_key'
            WHEN cooldown <= interval '0' OR cooldown > interval '366 days'
                 OR NOT pg_catalog.isfinite(cooldown)
            THEN 'must be more than 0 seconds and at most 366 days' END),
        (2, 'cooldown_key', CASE WHEN cooldown_key IS NULL AND cooldown IS NOT NULL
            THEN 'is required with cooldown'
            WHEN NOT pg_catalog.char_length(cooldown_key) BETWEEN 1 AND 255
            THEN 'must be 1 to 255 characters'
            WHEN cooldown_key ~ '[\x01-\x1f\x7f-\x9f]'
            THEN 'must not contain control characters' END),
        (3, 'on_cooldown', CASE
            WHEN COALESCE(on_cooldown, 'wait') NOT IN ('wait', 'suppress')
            THEN pg_catalog.format('must be one of ''wait'', ''suppress'', got %s',
                        public.outbox_quote_text(on_cooldown))
            WHEN on_cooldown = 'suppress' AND cooldown IS NULL
            THEN 'only with cooldown and cooldown_key' END)
    ) AS v(n, field, problem)
    WHERE v.problem IS NOT NULL
    ORDER BY v.n
    LIMIT 1
$$;

-- Name: outbox_dedupe_identity(text, jsonb, text[]); Type: FUNCTION

CREATE FUNCTION public.outbox_dedupe_identity(channel text, payload jsonb, addresses text[]) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT CASE channel
            WHEN 'eventbridge' THEN pg_catalog.concat_ws(E'\n', COALESCE(payload ->> 'event_bus', ''),
                                              payload ->> 'source', payload ->> 'detail_type')
            ELSE pg_catalog.array_to_string(addresses, E'\n') END
    $$;

-- Name: outbox_destination_of(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_destination_of(channel text, payload jsonb) RETURNS text
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $_$
DECLARE
    parts text[];
    host text;
    port text;
BEGIN
    IF channel = 'webhook' THEN
        parts := pg_catalog.regexp_match(payload ->> 'url', '^([A-Za-z][A-Za-z0-9+.-]*)://(?:[^@/?#]*@)?(\[[^]/?#]*\]|[^:/?#]*)(?::([0-9]+))?');
        IF parts IS NULL THEN
            RETURN '';
        END IF;
        host := pg_catalog.rtrim(pg_catalog.lower(parts[2]), '.');
        IF pg_catalog.octet_length(host) <> pg_catalog.length(host) THEN
            host := outbox_idna_host(host);
        END IF;
        IF host IS NULL OR host !~ '^([a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*|\[[0-9a-f:.]+\])$' THEN
            RETURN '';  -- "*" above all: never the key of a channel-wide limit
        END IF;
        port := NULLIF(pg_catalog.ltrim(parts[3], '0'), '');
        IF port IS NULL OR (port = '443' AND pg_catalog.lower(parts[1]) = 'https')
                OR (port = '80' AND pg_catalog.lower(parts[1]) = 'http') THEN
            RETURN host;
        END IF;
        RETURN host || ':' || port;
    ELSIF channel = 'sqs' THEN
        RETURN COALESCE(payload ->> 'queue_url', '');
    ELSIF channel = 'eventbridge' THEN
        RETURN COALESCE(payload ->> 'event_bus', '');
    END IF;
    RETURN '';
END
$_$;

-- Name: outbox_drop_history_before(timestamp with time zone, boolean); Type: FUNCTION

CREATE FUNCTION public.outbox_drop_history_before(p_before timestamp with time zone, p_dry_run boolean DEFAULT false) RETURNS TABLE(partition_name text, rows bigint)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    SET lock_timeout TO '5s'
    AS $$
DECLARE
    leaf record;
BEGIN
    IF p_before IS NULL OR NOT pg_catalog.isfinite(p_before) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'the cutoff must be a finite time, not ' || COALESCE(p_before::text, 'null');
    END IF;
    FOR leaf IN
        SELECT b.name, b.upper_bound FROM outbox_history_partitions() AS b
        WHERE b.upper_bound <= p_before
        ORDER BY b.upper_bound
    LOOP
        BEGIN
            EXECUTE 'SELECT pg_catalog.count(*) FROM ' || pg_catalog.quote_ident(leaf.name)
                INTO rows;
            IF NOT p_dry_run THEN
                EXECUTE 'DROP TABLE ' || pg_catalog.quote_ident(leaf.name);
            END IF;
            partition_name := leaf.name;
            RETURN NEXT;
        EXCEPTION WHEN lock_not_available THEN
            RAISE WARNING USING MESSAGE = 'history partition ' || leaf.name
                || ' not dropped: its table is busy';
        END;
    END LOOP;
END
$$;

-- Name: outbox_enqueue(text, jsonb, text, text, integer, interval, integer, timestamp with time zone, interval, text, interval, text, text, text); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue(channel text, payload jsonb, dedupe_key text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, priority integer DEFAULT 0, delay interval DEFAULT NULL::interval, max_attempts integer DEFAULT NULL::integer, expires_at timestamp with time zone DEFAULT NULL::timestamp with time zone, ttl interval DEFAULT NULL::interval, on_predecessor_failure text DEFAULT 'hold'::text, cooldown interval DEFAULT NULL::interval, cooldown_key text DEFAULT NULL::text, on_cooldown text DEFAULT 'wait'::text, tenant text DEFAULT NULL::text) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    p_cooldown interval := outbox_enqueue.cooldown;
    p_key text := outbox_enqueue.cooldown_key;
    p_action text := COALESCE(outbox_enqueue.on_cooldown, 'wait');
    f record;
    new_id bigint;
    p_tenant text;
BEGIN
    SELECT * INTO f FROM outbox_cooldown_problem(p_cooldown, p_key, p_action);
    IF FOUND THEN
        PERFORM outbox_enqueue_refuse(f.field, f.problem);
    END IF;
    -- (0022) the tenant: the role's bound one, or the one given, checked
    SELECT * INTO f FROM outbox_enqueue_tenants(outbox_enqueue.tenant, NULL, 1);
    IF f.field IS NOT NULL THEN
        PERFORM outbox_enqueue_refuse(f.field, f.problem);
    END IF;
    p_tenant := (f.tenants)[1];
    IF outbox_secret_refused(p_tenant, outbox_enqueue.channel, outbox_enqueue.payload) THEN
        PERFORM outbox_enqueue_refuse('payload.secret_id', 'is not a signing secret of this message''s tenant (outbox tenant secret)');
    END IF;
    new_id := outbox_enqueue_core(outbox_enqueue.channel, outbox_enqueue.payload,
        outbox_enqueue.dedupe_key, outbox_enqueue.ordering_key, outbox_enqueue.priority,
        outbox_enqueue.delay, outbox_enqueue.max_attempts, outbox_enqueue.expires_at,
        outbox_enqueue.ttl, outbox_enqueue.on_predecessor_failure, p_tenant);
    -- The core draws a fresh id for every message it checked: the id it
    -- returns is that one when it wrote the message, an older one for a replay
    -- (which is left as it was).
    IF p_cooldown IS NOT NULL AND new_id = pg_catalog.currval('outbox_message_id_seq') THEN
        UPDATE outbox_message AS m
        SET cooldown_key = p_key, cooldown = pg_catalog.make_interval(secs => EXTRACT(EPOCH FROM p_cooldown)),
            on_cooldown = p_action
        WHERE m.id = new_id;
    END IF;
    RETURN new_id;
END
$$;

-- Name: outbox_enqueue_builtin_fields(text); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_builtin_fields(channel text) RETURNS TABLE(field text, kind text, required boolean)
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
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

-- Name: outbox_enqueue_core(text, jsonb, text, text, integer, interval, integer, timestamp with time zone, interval, text, text); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_core(channel text, payload jsonb, dedupe_key text DEFAULT NULL::text, ordering_key text DEFAULT NULL::text, priority integer DEFAULT 0, delay interval DEFAULT NULL::interval, max_attempts integer DEFAULT NULL::integer, expires_at timestamp with time zone DEFAULT NULL::timestamp with time zone, ttl interval DEFAULT NULL::interval, on_predecessor_failure text DEFAULT 'hold'::text, tenant text DEFAULT ''::text) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    p_channel text := outbox_enqueue_core.channel;
    p_payload jsonb := outbox_enqueue_core.payload;
    p_dedupe text := outbox_enqueue_core.dedupe_key;
    p_ordering text := outbox_enqueue_core.ordering_key;
    p_priority integer := COALESCE(outbox_enqueue_core.priority, 0);
    p_delay interval := COALESCE(outbox_enqueue_core.delay, interval '0');
    p_max integer := outbox_enqueue_core.max_attempts;
    p_expires timestamptz := outbox_enqueue_core.expires_at;
    p_ttl interval := outbox_enqueue_core.ttl;
    p_on_failure text := COALESCE(outbox_enqueue_core.on_predecessor_failure, 'hold');
    p_tenant text := COALESCE(outbox_enqueue_core.tenant, '');
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
            pg_catalog.jsonb_typeof(p_payload -> f.field) = f.kind
            OR (f.kind = 'integer' AND pg_catalog.jsonb_typeof(p_payload -> f.field) = 'number'
                AND pg_catalog.scale(CAST(p_payload -> f.field AS numeric)) = 0)
        ) THEN
            PERFORM outbox_enqueue_refuse('payload.' || f.field, 'must be ' ||
                CASE WHEN f.kind IN ('array', 'object', 'integer') THEN 'an ' ELSE 'a ' END
                || f.kind);
        END IF;
    END LOOP;
    IF builtin THEN
        SELECT k INTO f FROM pg_catalog.jsonb_object_keys(p_payload) AS k
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
        PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended('outbox-ordering-key:' || p_tenant || '/' || p_ordering, 0));
    END IF;
    -- the id first, so that a dedupe key's entry can name its message
    new_id := pg_catalog.nextval('outbox_message_id_seq');
    IF p_dedupe IS NOT NULL THEN
        held_id := outbox_take_dedupe_key(p_channel, p_dedupe, p_payload, new_id, p_tenant);
        IF held_id IS NOT NULL THEN
            RETURN held_id;  -- a replay: nothing written
        END IF;
    END IF;
    INSERT INTO outbox_message
        (id, channel, payload, dedupe_key, ordering_key, priority, available_at, max_attempts,
         expires_at, on_predecessor_failure, recipient_fingerprints, tenant)
    OVERRIDING SYSTEM VALUE
    VALUES (new_id, p_channel, p_payload, p_dedupe, p_ordering, p_priority, pg_catalog.now() + p_delay,
            p_max,
            -- a ttl counts from the time the message is first due
            COALESCE(p_expires, pg_catalog.now() + p_delay + p_ttl), p_on_failure,
            outbox_recipient_fingerprints(p_channel, p_payload), p_tenant);
    RETURN new_id;
END
$$;

-- Name: outbox_enqueue_many(text[], jsonb, text[], text[], integer[], double precision[], integer[], timestamp with time zone[], double precision[], text[], double precision[], text[], text[], text, text[]); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_many(p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[], p_priorities integer[], p_delays double precision[], p_max_attempts integer[], p_expires_at timestamp with time zone[], p_ttls double precision[], p_on_predecessor_failure text[], p_cooldowns double precision[] DEFAULT NULL::double precision[], p_cooldown_keys text[] DEFAULT NULL::text[], p_on_cooldown text[] DEFAULT NULL::text[], p_tenant text DEFAULT NULL::text, p_tenants text[] DEFAULT NULL::text[]) RETURNS TABLE(ord bigint, conflict boolean, id bigint, created boolean, first_ord bigint, held_id bigint, refused_field text, refused_problem text)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $$
#variable_conflict use_column
DECLARE
    bad record;
    result jsonb;
    tenants text[];
BEGIN
    -- (0022) each message's tenant: the role's bound one, or the ones given
    SELECT * INTO bad FROM outbox_enqueue_tenants(p_tenant, p_tenants,
        pg_catalog.cardinality(p_channels));
    IF bad.field IS NOT NULL THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
                            bad.field, bad.problem;
        RETURN;
    END IF;
    tenants := bad.tenants;
    SELECT i.ord INTO bad
    FROM ROWS FROM (pg_catalog.unnest(p_channels), pg_catalog.jsonb_array_elements(p_payloads),
                    pg_catalog.unnest(tenants)) WITH ORDINALITY AS i(channel, payload, tenant, ord)
    WHERE outbox_secret_refused(i.tenant, i.channel, i.payload)
    ORDER BY i.ord LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
            'payload.secret_id'::text, 'is not a signing secret of this message''s tenant (outbox tenant secret)'::text;
        RETURN;
    END IF;
    IF p_cooldowns IS NULL AND p_cooldown_keys IS NULL AND p_on_cooldown IS NULL THEN
        RETURN QUERY SELECT * FROM outbox_enqueue_many_core(p_channels, p_payloads,
            p_dedupe_keys, p_ordering_keys, p_priorities, p_delays, p_max_attempts,
            p_expires_at, p_ttls, p_on_predecessor_failure, tenants);
        RETURN;
    END IF;
    IF pg_catalog.cardinality(p_cooldowns) IS DISTINCT FROM pg_catalog.cardinality(p_channels)
       OR pg_catalog.cardinality(p_cooldown_keys) IS DISTINCT FROM pg_catalog.cardinality(p_channels)
       OR pg_catalog.cardinality(p_on_cooldown) IS DISTINCT FROM pg_catalog.cardinality(p_channels) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'cooldowns: give p_cooldowns, p_cooldown_keys and p_on_cooldown, '
                      'one per channel';
    END IF;
    SELECT c.ord, p.field, p.problem INTO bad
    FROM ROWS FROM (pg_catalog.unnest(p_cooldowns), pg_catalog.unnest(p_cooldown_keys), pg_catalog.unnest(p_on_cooldown))
        WITH ORDINALITY AS c(cooldown_s, cooldown_key, on_cooldown, ord)
    CROSS JOIN LATERAL outbox_cooldown_problem(CASE WHEN c.cooldown_s BETWEEN -1e9 AND 1e9 THEN pg_catalog.make_interval(secs => c.cooldown_s) WHEN c.cooldown_s IS NOT NULL THEN interval '367 days' END, c.cooldown_key, c.on_cooldown) AS p
    ORDER BY c.ord LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
                            bad.field, bad.problem;
        RETURN;
    END IF;
    SELECT pg_catalog.jsonb_agg(pg_catalog.to_jsonb(r) ORDER BY r.ord) INTO result
    FROM outbox_enqueue_many_core(p_channels, p_payloads, p_dedupe_keys, p_ordering_keys,
        p_priorities, p_delays, p_max_attempts, p_expires_at, p_ttls,
        p_on_predecessor_failure, tenants) AS r;
    -- A new statement, so it sees the rows the core wrote; a replay is left as it was.
    UPDATE outbox_message AS m
    SET cooldown_key = c.cooldown_key, cooldown = pg_catalog.make_interval(secs => c.cooldown_s),
        on_cooldown = COALESCE(c.on_cooldown, 'wait')
    FROM pg_catalog.jsonb_to_recordset(result) AS r(ord bigint, conflict boolean, id bigint, created boolean, first_ord bigint,
             held_id bigint, refused_field text, refused_problem text)
    JOIN ROWS FROM (pg_catalog.unnest(p_cooldowns), pg_catalog.unnest(p_cooldown_keys), pg_catalog.unnest(p_on_cooldown))
        WITH ORDINALITY AS c(cooldown_s, cooldown_key, on_cooldown, ord) ON c.ord = r.ord
    WHERE r.created AND m.id = r.id AND c.cooldown_key IS NOT NULL;
    RETURN QUERY SELECT r.* FROM pg_catalog.jsonb_to_recordset(result) AS r(ord bigint, conflict boolean, id bigint, created boolean, first_ord bigint,
             held_id bigint, refused_field text, refused_problem text) ORDER BY r.ord;
END
$$;

-- Name: outbox_enqueue_many_core(text[], jsonb, text[], text[], integer[], double precision[], integer[], timestamp with time zone[], double precision[], text[], text[]); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_many_core(p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[], p_priorities integer[], p_delays double precision[], p_max_attempts integer[], p_expires_at timestamp with time zone[], p_ttls double precision[], p_on_predecessor_failure text[], p_tenants text[] DEFAULT NULL::text[]) RETURNS TABLE(ord bigint, conflict boolean, id bigint, created boolean, first_ord bigint, held_id bigint, refused_field text, refused_problem text)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $_$
#variable_conflict use_column
DECLARE
    bad record;
    result jsonb;
    round integer;
BEGIN
    IF pg_catalog.jsonb_typeof(p_payloads) IS DISTINCT FROM 'array'
       OR pg_catalog.jsonb_array_length(p_payloads) <> pg_catalog.cardinality(p_channels) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'payloads: must be a JSON array, one per channel';
    END IF;
    -- Every row checked first, in one pass of plain comparisons (the rules of
    -- outbox_enqueue_problem, which then words the first refused row's).
    SELECT i.*, p.field, p.problem INTO bad
    FROM (SELECT i.* FROM 
    ROWS FROM (
        pg_catalog.unnest(p_channels), pg_catalog.jsonb_array_elements(p_payloads),
        pg_catalog.unnest(p_dedupe_keys), pg_catalog.unnest(p_ordering_keys), pg_catalog.unnest(p_priorities),
        pg_catalog.unnest(p_delays), pg_catalog.unnest(p_max_attempts), pg_catalog.unnest(p_expires_at), pg_catalog.unnest(p_ttls),
        pg_catalog.unnest(p_on_predecessor_failure), pg_catalog.unnest(p_tenants)
    ) WITH ORDINALITY AS i(channel, payload, dedupe_key, ordering_key, priority,
                           delay_s, max_attempts, expires_at, ttl_s, on_predecessor_failure, tenant, ord)

          WHERE (i.channel ~ '^[a-z][a-z0-9_-]{0,63}$'
                 AND pg_catalog.jsonb_typeof(i.payload) = 'object'
                 AND (i.dedupe_key IS NULL OR pg_catalog.char_length(i.dedupe_key) BETWEEN 1 AND 255)
                 AND (i.ordering_key IS NULL OR pg_catalog.char_length(i.ordering_key) BETWEEN 1 AND 255)
                 AND COALESCE(i.priority, 0) BETWEEN -32768 AND 32767
                 AND COALESCE(i.delay_s, 0) BETWEEN 0 AND 365 * 86400
                 AND (i.max_attempts IS NULL OR i.max_attempts BETWEEN 1 AND 1000)
                 AND (i.ttl_s IS NULL
                      OR (i.expires_at IS NULL AND i.ttl_s > 0 AND i.ttl_s <= 366 * 86400))
                 AND (i.expires_at IS NULL OR pg_catalog.isfinite(i.expires_at))
                 AND COALESCE(i.on_predecessor_failure, 'hold') IN ('hold', 'cancel')
                 AND pg_catalog.octet_length(CAST(i.payload AS text)) <= 262144) IS NOT TRUE
          ORDER BY i.ord LIMIT 1) AS i
    CROSS JOIN LATERAL outbox_enqueue_problem(i.channel, i.payload, i.dedupe_key,
        i.ordering_key, i.priority, pg_catalog.make_interval(secs => i.delay_s), i.max_attempts,
        i.expires_at, pg_catalog.make_interval(secs => i.ttl_s), i.on_predecessor_failure, true) AS p;
    IF FOUND THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
                            bad.field, bad.problem;
        RETURN;
    END IF;
    -- (0021) A call by hand runs no Python: the built-in channels' fields
    -- are checked here as outbox_enqueue checks them, in one pass over the
    -- six channels' field lists (no problem before this row's: the checks
    -- above passed every row).
    SELECT r.ord, r.field, r.problem INTO bad
    FROM (
        WITH fields AS MATERIALIZED (
            SELECT c AS channel, f.field, f.kind, f.required, f.n
            FROM pg_catalog.unnest(
                ARRAY['email', 'sms', 'push', 'webhook', 'eventbridge', 'sqs']) AS c
            CROSS JOIN LATERAL outbox_enqueue_builtin_fields(c)
                WITH ORDINALITY AS f(field, kind, required, n)
        ), given AS (
            SELECT i.ord, i.channel, i.payload
            FROM ROWS FROM (pg_catalog.unnest(p_channels),
                            pg_catalog.jsonb_array_elements(p_payloads))
                WITH ORDINALITY AS i(channel, payload, ord)
            WHERE i.channel IN ('email', 'sms', 'push', 'webhook', 'eventbridge', 'sqs')
        )
        SELECT g.ord, f.n AS rank, 'payload.' || f.field AS field,
               CASE WHEN NOT g.payload ? f.field THEN 'is required'
                    ELSE 'must be ' || CASE WHEN f.kind IN ('array', 'object', 'integer')
                                            THEN 'an ' ELSE 'a ' END || f.kind END AS problem
        FROM given AS g JOIN fields AS f ON f.channel = g.channel
        WHERE CASE WHEN NOT g.payload ? f.field THEN f.required
                   ELSE f.kind IS NOT NULL AND NOT (
                       pg_catalog.jsonb_typeof(g.payload -> f.field) = f.kind
                       OR (f.kind = 'integer'
                           AND pg_catalog.jsonb_typeof(g.payload -> f.field) = 'number'
                           AND pg_catalog.scale(CAST(g.payload -> f.field AS numeric)) = 0)) END
        UNION ALL
        -- the key is the producer's text: named only if it is a short identifier
        SELECT g.ord, 1000, outbox_payload_field(u.k), 'is not a field of this channel'
        FROM given AS g
        JOIN (SELECT f.channel, pg_catalog.array_agg(f.field) AS names
              FROM fields AS f GROUP BY f.channel) AS n ON n.channel = g.channel
        CROSS JOIN LATERAL (
            SELECT k
            FROM pg_catalog.jsonb_object_keys(g.payload OPERATOR(pg_catalog.-) n.names) AS k
            ORDER BY k LIMIT 1) AS u
        UNION ALL
        SELECT g.ord, 1001, 'payload.text', 'text or html is required'
        FROM given AS g
        WHERE g.channel = 'email' AND NOT (g.payload ? 'text' OR g.payload ? 'html')
    ) AS r
    ORDER BY r.ord, r.rank LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
                            bad.field, bad.problem;
        RETURN;
    END IF;
    -- (0021) A channel it does not know is registered only while the registry
    -- is small: a call by hand could otherwise fill it with invented ones.
    SELECT n.ord INTO bad
    FROM pg_catalog.unnest(p_channels) WITH ORDINALITY AS n(channel, ord)
    WHERE NOT EXISTS (SELECT 1 FROM outbox_channel AS r WHERE r.name = n.channel)
      AND (SELECT pg_catalog.count(*) FROM outbox_channel)
          + (SELECT pg_catalog.count(DISTINCT u.c) FROM pg_catalog.unnest(p_channels) AS u(c)
             WHERE NOT EXISTS (SELECT 1 FROM outbox_channel AS r WHERE r.name = u.c))
          > 256
    ORDER BY n.ord LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
            'channel', 'is not a registered channel (outbox_channel), and the bulk door '
                       'registers no more than 256: register it with '
                       'INSERT INTO outbox_channel';
        RETURN;
    END IF;
    -- Python checked these channels against its registry: SQL producers may use them too
    -- (0021: the registry not full)
    INSERT INTO outbox_channel (name)
    SELECT DISTINCT c FROM pg_catalog.unnest(p_channels) AS c
    WHERE NOT EXISTS (SELECT 1 FROM outbox_channel AS r WHERE r.name = c)
    ON CONFLICT DO NOTHING;
    -- producers of one ordering key take turns until their commit (in key
    -- order, so that two producers cannot deadlock on each other)
    PERFORM pg_catalog.count(pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended('outbox-ordering-key:' || k, 0)))
    FROM (SELECT DISTINCT COALESCE(u.t, '') || '/' || u.o AS k
          FROM ROWS FROM (pg_catalog.unnest(p_ordering_keys), pg_catalog.unnest(p_tenants)) AS u(o, t)
          WHERE u.o IS NOT NULL ORDER BY k) AS keys;

    IF NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(p_dedupe_keys) AS d WHERE d IS NOT NULL) THEN
        -- Identity values are drawn in the order the SELECT produces rows
        -- (ORDER BY ord), so the ids sorted ascending are the input order.
        RETURN QUERY
        WITH inserted AS (
            INSERT INTO outbox_message (channel, payload, ordering_key, priority, available_at,
                                        max_attempts, expires_at, on_predecessor_failure,
                                        recipient_fingerprints, tenant)
            SELECT i.channel, i.payload, i.ordering_key, COALESCE(i.priority, 0),
                   pg_catalog.now() + pg_catalog.make_interval(secs => COALESCE(i.delay_s, 0)), i.max_attempts,
                   COALESCE(i.expires_at, pg_catalog.now() + pg_catalog.make_interval(secs => COALESCE(i.delay_s, 0) + i.ttl_s)), COALESCE(i.on_predecessor_failure, 'hold'),
                   ARRAY(SELECT outbox_hmac(k.inner_pad, k.outer_pad, a) FROM outbox_addresses(i.channel, i.payload) AS a ORDER BY a), COALESCE(i.tenant, '')
            FROM 
    ROWS FROM (
        pg_catalog.unnest(p_channels), pg_catalog.jsonb_array_elements(p_payloads),
        pg_catalog.unnest(p_dedupe_keys), pg_catalog.unnest(p_ordering_keys), pg_catalog.unnest(p_priorities),
        pg_catalog.unnest(p_delays), pg_catalog.unnest(p_max_attempts), pg_catalog.unnest(p_expires_at), pg_catalog.unnest(p_ttls),
        pg_catalog.unnest(p_on_predecessor_failure), pg_catalog.unnest(p_tenants)
    ) WITH ORDINALITY AS i(channel, payload, dedupe_key, ordering_key, priority,
                           delay_s, max_attempts, expires_at, ttl_s, on_predecessor_failure, tenant, ord)
 CROSS JOIN outbox_fingerprint_key AS k
            ORDER BY i.ord
            RETURNING outbox_message.id
        )
        SELECT pg_catalog.row_number() OVER (ORDER BY n.id), false, n.id, true, NULL::bigint,
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
                   pg_catalog.nextval('outbox_message_id_seq') AS new_id,
                   ARRAY(SELECT outbox_hmac(k.inner_pad, k.outer_pad, a) FROM outbox_addresses(i.channel, i.payload) AS a ORDER BY a) AS recipient_fingerprints,
                   CASE WHEN i.dedupe_key IS NOT NULL THEN outbox_hmac(k.inner_pad, k.outer_pad,
                       outbox_dedupe_identity(i.channel, i.payload, ARRAY(SELECT a FROM outbox_addresses(i.channel, i.payload) AS a ORDER BY a))) END
                       AS fingerprint,
                   CASE WHEN i.dedupe_key IS NOT NULL
                        THEN outbox_payload_digest(i.payload) END AS digest
            FROM 
    ROWS FROM (
        pg_catalog.unnest(p_channels), pg_catalog.jsonb_array_elements(p_payloads),
        pg_catalog.unnest(p_dedupe_keys), pg_catalog.unnest(p_ordering_keys), pg_catalog.unnest(p_priorities),
        pg_catalog.unnest(p_delays), pg_catalog.unnest(p_max_attempts), pg_catalog.unnest(p_expires_at), pg_catalog.unnest(p_ttls),
        pg_catalog.unnest(p_on_predecessor_failure), pg_catalog.unnest(p_tenants)
    ) WITH ORDINALITY AS i(channel, payload, dedupe_key, ordering_key, priority,
                           delay_s, max_attempts, expires_at, ttl_s, on_predecessor_failure, tenant, ord)
 CROSS JOIN outbox_fingerprint_key AS k
            ORDER BY i.ord
        ),
        keyed AS (  -- the first of each (channel, key, recipient) in the list stands for it
            SELECT DISTINCT ON (tenant, channel, dedupe_key, fingerprint)
                   ord, new_id, COALESCE(tenant, '') AS tenant, channel, dedupe_key, fingerprint, digest
            FROM input WHERE dedupe_key IS NOT NULL
            ORDER BY tenant, channel, dedupe_key, fingerprint, ord
        ),
        held AS (  -- keys already taken when this statement began
            SELECT k.ord, d.message_id, d.payload_digest
            FROM keyed AS k JOIN outbox_dedupe AS d
              ON d.channel = k.channel AND d.dedupe_key = k.dedupe_key
             AND d.recipient_fingerprint = k.fingerprint AND d.tenant = k.tenant
        ),
        conflicts AS (  -- a payload other than the one its key was first given
            SELECT i.ord FROM input AS i
            JOIN keyed AS k ON k.channel = i.channel AND k.dedupe_key = i.dedupe_key
                           AND k.fingerprint = i.fingerprint AND k.tenant = COALESCE(i.tenant, '')
            LEFT JOIN held AS h ON h.ord = k.ord
            WHERE i.digest <> COALESCE(h.payload_digest, k.digest)
        ),
        taken AS (  -- nothing at all is written when any message conflicts
            INSERT INTO outbox_dedupe
                (channel, dedupe_key, recipient_fingerprint, payload_digest, message_id, tenant)
            SELECT k.channel, k.dedupe_key, k.fingerprint, k.digest, k.new_id, k.tenant FROM keyed AS k
            WHERE NOT EXISTS (SELECT 1 FROM conflicts)
              AND NOT EXISTS (SELECT 1 FROM held AS h WHERE h.ord = k.ord)
            ORDER BY k.ord
            ON CONFLICT DO NOTHING  -- taken meanwhile by a transaction that committed since
            RETURNING message_id
        ),
        inserted AS (
            INSERT INTO outbox_message (id, channel, payload, dedupe_key, ordering_key, priority,
                                        available_at, max_attempts, expires_at,
                                        on_predecessor_failure, recipient_fingerprints, tenant)
            OVERRIDING SYSTEM VALUE
            SELECT new_id, channel, payload, dedupe_key, ordering_key, COALESCE(priority, 0),
                   pg_catalog.now() + pg_catalog.make_interval(secs => COALESCE(delay_s, 0)), max_attempts,
                   COALESCE(i.expires_at, pg_catalog.now() + pg_catalog.make_interval(secs => COALESCE(i.delay_s, 0) + i.ttl_s)), COALESCE(on_predecessor_failure, 'hold'),
                   recipient_fingerprints, COALESCE(i.tenant, '')
            FROM input AS i
            WHERE NOT EXISTS (SELECT 1 FROM conflicts)
              AND (dedupe_key IS NULL OR new_id IN (SELECT message_id FROM taken))
            ORDER BY ord
        )
        SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
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
                            AND k.fingerprint = i.fingerprint AND k.tenant = COALESCE(i.tenant, '')
        LEFT JOIN held AS h ON h.ord = k.ord;

        IF NOT EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements(result) AS r
                       WHERE r -> 'id' = 'null' AND NOT (r ->> 'conflict')::boolean)
           OR EXISTS (SELECT 1 FROM pg_catalog.jsonb_array_elements(result) AS r
                      WHERE (r ->> 'conflict')::boolean) THEN
            EXIT;
        END IF;
        -- take back what this round wrote (the keys by their primary key)
        WITH gone AS (
            DELETE FROM outbox_message AS m
            WHERE m.id IN (SELECT (r ->> 'id')::bigint FROM pg_catalog.jsonb_array_elements(result) AS r
                           WHERE (r ->> 'created')::boolean)
            RETURNING m.id, m.channel, m.dedupe_key, m.payload, m.tenant
        )
        DELETE FROM outbox_dedupe AS d USING gone AS g
        WHERE d.channel = g.channel AND d.dedupe_key = g.dedupe_key AND d.tenant = g.tenant
          AND d.recipient_fingerprint = outbox_recipient_fingerprint(g.channel, g.payload)
          AND d.message_id = g.id;
    END LOOP;
    RETURN QUERY
    SELECT r.ord, r.conflict, r.id, r.created, r.first_ord, r.held_id, NULL::text, NULL::text
    FROM pg_catalog.jsonb_to_recordset(result) AS r(ord bigint, conflict boolean, id bigint,
                                         created boolean, first_ord bigint, held_id bigint)
    ORDER BY r.ord;
END
$_$;

-- Name: outbox_enqueue_problem(text, jsonb, text, text, integer, interval, integer, timestamp with time zone, interval, text, boolean); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_problem(channel text, payload jsonb, dedupe_key text, ordering_key text, priority integer, delay interval, max_attempts integer, expires_at timestamp with time zone, ttl interval, on_predecessor_failure text, registered boolean) RETURNS TABLE(field text, problem text)
    LANGUAGE sql STABLE
    SET search_path TO 'public', 'pg_temp'
    AS $_$
    SELECT v.field, v.problem FROM (VALUES
        (1, 'channel', CASE WHEN channel IS NULL THEN 'is required'
            WHEN channel !~ '^[a-z][a-z0-9_-]{0,63}$' THEN
                'must be 1 to 64 lower-case letters, digits, _ or -, starting with a letter'
            WHEN NOT registered THEN 'is not a registered channel (outbox_channel)' END),
        (2, 'dedupe_key', CASE WHEN NOT pg_catalog.char_length(dedupe_key) BETWEEN 1 AND 255
            THEN 'must be 1 to 255 characters' END),
        (3, 'ordering_key', CASE WHEN NOT pg_catalog.char_length(ordering_key) BETWEEN 1 AND 255
            THEN 'must be 1 to 255 characters' END),
        (4, 'priority', CASE WHEN NOT COALESCE(priority, 0) BETWEEN -32768 AND 32767
            THEN pg_catalog.format('must be between -32768 and 32767, got %s', priority) END),
        (5, 'delay', CASE WHEN delay < interval '0' OR delay > interval '365 days'
            OR NOT pg_catalog.isfinite(delay) THEN 'must be between 0 and 365 days' END),
        (6, 'max_attempts', CASE WHEN NOT max_attempts BETWEEN 1 AND 1000
            THEN pg_catalog.format('must be between 1 and 1000, got %s', max_attempts) END),
        (7, 'ttl', CASE WHEN expires_at IS NOT NULL AND ttl IS NOT NULL
            THEN 'give expires_at or ttl, not both'
            WHEN ttl <= interval '0' OR ttl > interval '366 days' OR NOT pg_catalog.isfinite(ttl)
            THEN 'must be more than 0 seconds and at most 366 days' END),
        (8, 'expires_at', CASE WHEN NOT pg_catalog.isfinite(expires_at) THEN 'must be a finite time' END),
        (9, 'on_predecessor_failure', CASE
            WHEN COALESCE(on_predecessor_failure, 'hold') NOT IN ('hold', 'cancel')
            THEN pg_catalog.format('must be one of ''hold'', ''cancel'', got %s',
                        public.outbox_quote_text(on_predecessor_failure)) END),
        (10, 'payload', CASE WHEN payload IS NULL OR pg_catalog.jsonb_typeof(payload) = 'null'
            THEN 'is required'
            WHEN pg_catalog.jsonb_typeof(payload) <> 'object' THEN 'must be an object'
            WHEN pg_catalog.octet_length(CAST(payload AS text)) > 262144
            THEN pg_catalog.format('is %s bytes; the limit is 262144',
                        pg_catalog.octet_length(CAST(payload AS text))) END)
    ) AS v(n, field, problem)
    WHERE v.problem IS NOT NULL
    ORDER BY v.n
    LIMIT 1
$_$;

-- Name: outbox_enqueue_refuse(text, text); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_refuse(field text, problem text) RETURNS void
    LANGUAGE plpgsql
    SET search_path TO 'public', 'pg_temp'
    AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
        MESSAGE = field || ': ' || problem, COLUMN = field;
END
$$;

-- Name: outbox_enqueue_tenants(text, text[], integer); Type: FUNCTION

CREATE FUNCTION public.outbox_enqueue_tenants(p_tenant text, p_tenants text[], p_count integer) RETURNS TABLE(tenants text[], ord bigint, field text, problem text)
    LANGUAGE plpgsql STABLE
    SET search_path TO 'public', 'pg_temp'
    AS $_$
DECLARE
    given text[];
    bound text;
    bad bigint;
BEGIN
    IF p_tenants IS NOT NULL AND pg_catalog.cardinality(p_tenants) <> p_count THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'tenants: give p_tenants, one per channel';
    END IF;
    given := COALESCE(p_tenants, pg_catalog.array_fill(p_tenant, ARRAY[p_count]));
    SELECT b.tenant INTO bound FROM outbox_tenant_role AS b
    WHERE b.role_name = CAST(SESSION_USER AS text);
    IF FOUND THEN
        SELECT g.ord INTO bad FROM pg_catalog.unnest(given) WITH ORDINALITY AS g(t, ord)
        WHERE g.t IS NOT NULL AND g.t <> bound ORDER BY g.ord LIMIT 1;
        IF FOUND THEN
            RETURN QUERY SELECT NULL::text[], bad, 'tenant'::text,
                'is not the tenant this database role is bound to'::text;
            RETURN;
        END IF;
        RETURN QUERY SELECT pg_catalog.array_fill(bound, ARRAY[p_count]), NULL::bigint,
                            NULL::text, NULL::text;
        RETURN;
    END IF;
    SELECT g.ord INTO bad FROM pg_catalog.unnest(given) WITH ORDINALITY AS g(t, ord)
    WHERE g.t IS NOT NULL AND g.t <> '' AND g.t !~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$'
    ORDER BY g.ord LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT NULL::text[], bad, 'tenant'::text, 'must be 1 to 64 letters, digits, dots, underscores, colons or hyphens, starting with a letter or digit'::text;
        RETURN;
    END IF;
    RETURN QUERY SELECT ARRAY(SELECT COALESCE(g.t, '')
                              FROM pg_catalog.unnest(given) WITH ORDINALITY AS g(t, ord)
                              ORDER BY g.ord),
                        NULL::bigint, NULL::text, NULL::text;
END
$_$;

-- Name: outbox_fingerprint(text); Type: FUNCTION

CREATE FUNCTION public.outbox_fingerprint(message text) RETURNS bytea
    LANGUAGE sql STABLE SECURITY DEFINER PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $$
        SELECT outbox_hmac(k.inner_pad, k.outer_pad, message) FROM outbox_fingerprint_key AS k
    $$;

-- Name: outbox_history_partitions(); Type: FUNCTION

CREATE FUNCTION public.outbox_history_partitions() RETURNS TABLE(name text, upper_bound timestamp with time zone)
    LANGUAGE sql STABLE
    SET search_path TO 'public', 'pg_temp'
    AS $$
    SELECT c.relname::text,
           CAST(pg_catalog.substring(pg_catalog.pg_get_expr(c.relpartbound, c.oid),
                                     'TO \(''([^'']*)''\)') AS timestamptz)
    FROM pg_catalog.pg_inherits AS i
    JOIN pg_catalog.pg_class AS c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'outbox_message_resolved'::pg_catalog.regclass
      AND pg_catalog.pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT'
$$;

-- Name: outbox_hmac(bytea, bytea, text); Type: FUNCTION

CREATE FUNCTION public.outbox_hmac(inner_pad bytea, outer_pad bytea, message text) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT pg_catalog.sha256(outer_pad || pg_catalog.sha256(inner_pad || pg_catalog.convert_to(message, 'UTF8')))
    $$;

-- Name: outbox_hmac_pad(bytea, integer); Type: FUNCTION

CREATE FUNCTION public.outbox_hmac_pad(key bytea, pad integer) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $$
        SELECT pg_catalog.string_agg(
                   pg_catalog.set_byte(pg_catalog.decode('00', 'hex'), 0,
                            (CASE WHEN i < pg_catalog.length(key) THEN pg_catalog.get_byte(key, i) ELSE 0 END) # pad),
                   ''::bytea ORDER BY i)
        FROM pg_catalog.generate_series(0, 63) AS i
    $$;

-- Name: outbox_idna_host(text); Type: FUNCTION

CREATE FUNCTION public.outbox_idna_host(host text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $$
DECLARE
    labels text[];
    label text;
    result text[] := '{}';
BEGIN
    host := pg_catalog.lower(pg_catalog.normalize(
        pg_catalog.translate(host, U&'\3002\FF0E\FF61', '...'), 'NFKC'));
    labels := pg_catalog.string_to_array(host, '.');
    FOREACH label IN ARRAY labels LOOP
        IF pg_catalog.octet_length(label) <> pg_catalog.length(label) THEN
            label := 'xn--' || outbox_punycode(label);
        END IF;
        result := result || label;
    END LOOP;
    RETURN pg_catalog.rtrim(pg_catalog.array_to_string(result, '.'), '.');
EXCEPTION WHEN OTHERS THEN
    RETURN NULL;
END
$$;

-- Name: outbox_jsonb_list(jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_jsonb_list(value jsonb) RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT CASE WHEN pg_catalog.jsonb_typeof(value) = 'array' THEN value ELSE '[]' END
    $$;

-- Name: outbox_make_history_partitions(integer); Type: FUNCTION

CREATE FUNCTION public.outbox_make_history_partitions(p_days_ahead integer) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    SET lock_timeout TO '5s'
    AS $$
DECLARE
    today date := (pg_catalog.now() AT TIME ZONE 'UTC')::date;
    day date;
    name text;
    lower_bound timestamptz;
    upper_bound timestamptz;
    made integer := 0;
BEGIN
    IF p_days_ahead IS NULL OR p_days_ahead < 0 OR p_days_ahead > 31 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'days ahead must be 0 to 31, not ' || COALESCE(p_days_ahead::text, 'null');
    END IF;
    FOR i IN 0 .. p_days_ahead LOOP
        day := today + i;
        name := 'outbox_message_resolved_p' || pg_catalog.to_char(day, 'YYYYMMDD');
        lower_bound := day::timestamp AT TIME ZONE 'UTC';
        upper_bound := (day + 1)::timestamp AT TIME ZONE 'UTC';
        CONTINUE WHEN pg_catalog.to_regclass(pg_catalog.quote_ident(name)) IS NOT NULL;
        BEGIN
            EXECUTE 'CREATE TABLE ' || pg_catalog.quote_ident(name)
                || ' (LIKE outbox_message_resolved INCLUDING DEFAULTS INCLUDING CONSTRAINTS)';
            EXECUTE 'WITH caught AS (DELETE FROM outbox_message_resolved_default '
                || 'WHERE settled_at >= ' || pg_catalog.quote_literal(lower_bound)
                || ' AND settled_at < ' || pg_catalog.quote_literal(upper_bound)
                || ' RETURNING *) INSERT INTO ' || pg_catalog.quote_ident(name)
                || ' SELECT * FROM caught';
            EXECUTE 'ALTER TABLE outbox_message_resolved ATTACH PARTITION '
                || pg_catalog.quote_ident(name) || ' FOR VALUES FROM ('
                || pg_catalog.quote_literal(lower_bound) || ') TO ('
                || pg_catalog.quote_literal(upper_bound) || ')';
            made := made + 1;
        EXCEPTION WHEN lock_not_available THEN
            -- busy now: the next run makes it (the default partition holds
            -- that day's settles meanwhile)
            RAISE WARNING USING MESSAGE = 'history partition ' || name
                || ' not made: its table is busy';
        END;
    END LOOP;
    RETURN made;
END
$$;

-- Name: outbox_message_set_destination(); Type: FUNCTION

CREATE FUNCTION public.outbox_message_set_destination() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path TO 'public', 'pg_temp'
    AS $$
        BEGIN
            NEW.destination := outbox_destination_of(NEW.channel, NEW.payload);
            RETURN NEW;
        END
        $$;

-- Name: outbox_normalize_address(text, text); Type: FUNCTION

CREATE FUNCTION public.outbox_normalize_address(channel text, address text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT CASE WHEN channel = 'email' THEN pg_catalog.lower(pg_catalog.btrim(address)) ELSE address END
    $$;

-- Name: outbox_payload_digest(jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_payload_digest(payload jsonb) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT pg_catalog.sha256(pg_catalog.convert_to(CAST(payload AS text), 'UTF8'))
    $$;

-- Name: outbox_payload_field(text); Type: FUNCTION

CREATE FUNCTION public.outbox_payload_field(key text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $_$
        SELECT CASE WHEN key ~ '^[A-Za-z_][A-Za-z0-9_-]{0,39}$' THEN 'payload.' || key
                    ELSE 'payload[…]' END
    $_$;

-- Name: outbox_punycode(text); Type: FUNCTION

CREATE FUNCTION public.outbox_punycode(label text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $$
DECLARE
    points integer[] := ARRAY(
        SELECT pg_catalog.ascii(c) FROM pg_catalog.regexp_split_to_table(label, '') AS c
    );
    total integer := pg_catalog.cardinality(points);
    output text := '';
    n integer := 128;
    delta integer := 0;
    bias integer := 72;
    handled integer := 0;
    basic integer;
    m integer;
    q integer;
    k integer;
    t integer;
    point integer;
BEGIN
    FOREACH point IN ARRAY points LOOP
        IF point < 128 THEN
            output := output || pg_catalog.chr(point);
        END IF;
    END LOOP;
    basic := pg_catalog.length(output);
    handled := basic;
    IF basic > 0 THEN
        output := output || '-';
    END IF;
    WHILE handled < total LOOP
        SELECT pg_catalog.min(p) INTO m FROM pg_catalog.unnest(points) AS p WHERE p >= n;
        delta := delta + (m - n) * (handled + 1);
        n := m;
        FOREACH point IN ARRAY points LOOP
            IF point < n THEN
                delta := delta + 1;
            ELSIF point = n THEN
                q := delta;
                k := 36;
                LOOP
                    t := CASE WHEN k <= bias THEN 1 WHEN k >= bias + 26 THEN 26 ELSE k - bias END;
                    EXIT WHEN q < t;
                    output := output || outbox_punycode_digit(t + pg_catalog.mod(q - t, 36 - t));
                    q := pg_catalog.div(q - t, 36 - t)::integer;
                    k := k + 36;
                END LOOP;
                output := output || outbox_punycode_digit(q);
                -- adapt the bias (RFC 3492 section 6.1)
                delta := CASE WHEN handled = basic THEN pg_catalog.div(delta, 700)::integer
                              ELSE pg_catalog.div(delta, 2)::integer END;
                delta := delta + pg_catalog.div(delta, handled + 1)::integer;
                k := 0;
                WHILE delta > 455 LOOP
                    delta := pg_catalog.div(delta, 35)::integer;
                    k := k + 36;
                END LOOP;
                bias := k + pg_catalog.div(36 * delta, delta + 38)::integer;
                delta := 0;
                handled := handled + 1;
            END IF;
        END LOOP;
        delta := delta + 1;
        n := n + 1;
    END LOOP;
    RETURN output;
END
$$;

-- Name: outbox_punycode_digit(integer); Type: FUNCTION

CREATE FUNCTION public.outbox_punycode_digit(d integer) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $$
    SELECT pg_catalog.chr(CASE WHEN d < 26 THEN 97 + d ELSE 22 + d END)
$$;

-- Name: outbox_quote_text(text); Type: FUNCTION

CREATE FUNCTION public.outbox_quote_text(value text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $_$
        SELECT CASE WHEN value ~ '^[ -~]{0,64}$' THEN pg_catalog.quote_literal(value)
                    WHEN value IS NULL THEN 'NULL'
                    ELSE 'a value that cannot be shown' END
    $_$;

-- Name: outbox_recipient_fingerprint(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_recipient_fingerprint(channel text, payload jsonb) RETURNS bytea
    LANGUAGE sql STABLE SECURITY DEFINER PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $$
        SELECT outbox_hmac(k.inner_pad, k.outer_pad, outbox_dedupe_identity(channel, payload,
                   ARRAY(SELECT a FROM outbox_addresses(channel, payload) AS a ORDER BY a)))
        FROM outbox_fingerprint_key AS k
    $$;

-- Name: outbox_recipient_fingerprints(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_recipient_fingerprints(channel text, payload jsonb) RETURNS bytea[]
    LANGUAGE sql STABLE SECURITY DEFINER PARALLEL SAFE
    SET search_path TO 'public', 'pg_temp'
    AS $$
        SELECT ARRAY(SELECT outbox_hmac(k.inner_pad, k.outer_pad, a)
                     FROM outbox_addresses(channel, payload) AS a ORDER BY a)
        FROM outbox_fingerprint_key AS k
    $$;

-- Name: outbox_recipients(text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_recipients(channel text, payload jsonb) RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
        SELECT ARRAY(SELECT a FROM public.outbox_addresses(channel, payload) AS a ORDER BY a)
    $$;

-- Name: outbox_record_outcome_event(); Type: FUNCTION

CREATE FUNCTION public.outbox_record_outcome_event() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $$
BEGIN
    INSERT INTO outbox_outcome_event (message_id, channel, status, attempts, last_error,
                                      provider_message_id, dedupe_key, ordering_key, tenant)
    VALUES (NEW.id, NEW.channel, NEW.status, NEW.attempts, NEW.last_error,
            NEW.provider_message_id, NEW.dedupe_key, NEW.ordering_key, NEW.tenant);
    RETURN NULL;
END
$$;

-- Name: outbox_record_retrying_event(); Type: FUNCTION

CREATE FUNCTION public.outbox_record_retrying_event() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'public', 'pg_temp'
    AS $$
BEGIN
    INSERT INTO outbox_outcome_event (message_id, channel, status, attempts, last_error,
                                      provider_message_id, dedupe_key, ordering_key, retry_at, tenant)
    VALUES (NEW.id, NEW.channel, 'retrying', NEW.attempts, NEW.last_error,
            NEW.provider_message_id, NEW.dedupe_key, NEW.ordering_key, NEW.available_at, NEW.tenant);
    RETURN NULL;
END
$$;

-- Name: outbox_secret_refused(text, text, jsonb); Type: FUNCTION

CREATE FUNCTION public.outbox_secret_refused(p_tenant text, p_channel text, p_payload jsonb) RETURNS boolean
    LANGUAGE sql STABLE
    SET search_path TO 'public', 'pg_temp'
    AS $$
    SELECT p_channel = 'webhook'
       AND pg_catalog.jsonb_typeof(p_payload -> 'secret_id') = 'string'
       AND (SELECT s.tenant FROM outbox_tenant_secret AS s
            WHERE s.secret_id = p_payload ->> 'secret_id')
           IS DISTINCT FROM NULLIF(p_tenant, '')
$$;

-- Name: outbox_take_dedupe_key(text, text, jsonb, bigint, text); Type: FUNCTION

CREATE FUNCTION public.outbox_take_dedupe_key(p_channel text, p_dedupe_key text, p_payload jsonb, p_new_id bigint, p_tenant text DEFAULT ''::text) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path TO 'public', 'pg_temp'
    AS $$
DECLARE
    v_fingerprint bytea := outbox_recipient_fingerprint(p_channel, p_payload);
    v_digest bytea := outbox_payload_digest(p_payload);
    v_held_id bigint;
    v_held_digest bytea;
BEGIN
    LOOP
        INSERT INTO outbox_dedupe
            (channel, dedupe_key, recipient_fingerprint, payload_digest, message_id, tenant)
        VALUES (p_channel, p_dedupe_key, v_fingerprint, v_digest, p_new_id, p_tenant)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NULL;
        END IF;
        -- a new statement: it sees a key committed while the INSERT waited
        SELECT d.message_id, d.payload_digest INTO v_held_id, v_held_digest
        FROM outbox_dedupe AS d
        WHERE d.channel = p_channel AND d.dedupe_key = p_dedupe_key
          AND d.recipient_fingerprint = v_fingerprint AND d.tenant = p_tenant;
        IF FOUND THEN
            IF v_held_digest <> v_digest THEN
                RAISE EXCEPTION USING ERRCODE = 'unique_violation',
                    MESSAGE = pg_catalog.format('dedupe_key: %L already names %s message %s for this '
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
    tenant text DEFAULT ''::text NOT NULL,
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

-- Name: outbox_channel; Type: TABLE

CREATE TABLE public.outbox_channel (
    name text NOT NULL,
    registered_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_channel_name_check CHECK ((name ~ '^[a-z][a-z0-9_-]{0,63}$'::text))
);

-- Name: outbox_channel_pause; Type: TABLE

CREATE TABLE public.outbox_channel_pause (
    channel text NOT NULL,
    reason text,
    paused_at timestamp with time zone DEFAULT now() NOT NULL,
    paused_until timestamp with time zone,
    CONSTRAINT outbox_channel_pause_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text))
);

-- Name: outbox_cooldown; Type: TABLE

CREATE TABLE public.outbox_cooldown (
    channel text NOT NULL,
    cooldown_key text NOT NULL,
    message_id bigint NOT NULL,
    until timestamp with time zone,
    taken_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    tenant text DEFAULT ''::text NOT NULL,
    CONSTRAINT outbox_cooldown_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text))
);

-- Name: outbox_dedupe; Type: TABLE

CREATE TABLE public.outbox_dedupe (
    channel text NOT NULL,
    dedupe_key text NOT NULL,
    recipient_fingerprint bytea NOT NULL,
    payload_digest bytea NOT NULL,
    message_id bigint NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    tenant text DEFAULT ''::text NOT NULL
);

-- Name: outbox_destination; Type: TABLE

CREATE TABLE public.outbox_destination (
    channel text NOT NULL,
    destination text NOT NULL,
    paused_until timestamp with time zone,
    rate double precision,
    limit_rate double precision,
    limit_burst double precision,
    rate_at timestamp with time zone,
    tokens double precision,
    tokens_at timestamp with time zone,
    throttled_total bigint DEFAULT 0 NOT NULL,
    throttled_minute integer DEFAULT 0 NOT NULL,
    minute_start timestamp with time zone,
    limit_source text,
    CONSTRAINT outbox_destination_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text)),
    CONSTRAINT outbox_destination_limit_burst_check CHECK (((limit_burst >= (1)::double precision) AND (limit_burst <= (1000000)::double precision))),
    CONSTRAINT outbox_destination_limit_has_source CHECK (((limit_rate IS NULL) = (limit_source IS NULL))),
    CONSTRAINT outbox_destination_limit_rate_check CHECK (((limit_rate > (0)::double precision) AND (limit_rate <= (100000)::double precision))),
    CONSTRAINT outbox_destination_limit_source_known CHECK ((limit_source = ANY (ARRAY['operator'::text, 'config'::text, 'provider'::text]))),
    CONSTRAINT outbox_destination_rate_check CHECK ((rate > (0)::double precision))
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
    destination text,
    cooldown_key text,
    cooldown interval,
    on_cooldown text,
    tenant text DEFAULT ''::text NOT NULL,
    CONSTRAINT outbox_message_attempts_at_redrive_check CHECK ((attempts_at_redrive >= 0)),
    CONSTRAINT outbox_message_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT outbox_message_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text)),
    CONSTRAINT outbox_message_claim_consistent CHECK (((status = 'claimed'::text) = ((claim_token IS NOT NULL) AND (lease_expires_at IS NOT NULL)))),
    CONSTRAINT outbox_message_cooldown_check CHECK ((((cooldown_key IS NULL) = (cooldown IS NULL)) AND ((cooldown_key IS NULL) = (on_cooldown IS NULL)) AND ((on_cooldown IS NULL) OR (on_cooldown = ANY (ARRAY['wait'::text, 'suppress'::text]))) AND ((cooldown IS NULL) OR (cooldown > '00:00:00'::interval)))),
    CONSTRAINT outbox_message_deferrals_check CHECK ((deferrals >= 0)),
    CONSTRAINT outbox_message_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT outbox_message_on_predecessor_failure_check CHECK ((on_predecessor_failure = ANY (ARRAY['hold'::text, 'cancel'::text]))),
    CONSTRAINT outbox_message_settled_consistent CHECK (((status = ANY (ARRAY['pending'::text, 'claimed'::text])) = (settled_at IS NULL))),
    CONSTRAINT outbox_message_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'claimed'::text, 'delivered'::text, 'failed'::text, 'dead'::text, 'suppressed'::text, 'cancelled'::text, 'expired'::text, 'bounced'::text, 'complained'::text])))
)
PARTITION BY LIST (status);

-- Name: outbox_message_id_seq; Type: SEQUENCE

ALTER TABLE public.outbox_message ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_message_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- Name: outbox_message_live; Type: TABLE

CREATE TABLE public.outbox_message_live (
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
    destination text,
    cooldown_key text,
    cooldown interval,
    on_cooldown text,
    tenant text DEFAULT ''::text NOT NULL,
    CONSTRAINT outbox_message_attempts_at_redrive_check CHECK ((attempts_at_redrive >= 0)),
    CONSTRAINT outbox_message_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT outbox_message_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text)),
    CONSTRAINT outbox_message_claim_consistent CHECK (((status = 'claimed'::text) = ((claim_token IS NOT NULL) AND (lease_expires_at IS NOT NULL)))),
    CONSTRAINT outbox_message_cooldown_check CHECK ((((cooldown_key IS NULL) = (cooldown IS NULL)) AND ((cooldown_key IS NULL) = (on_cooldown IS NULL)) AND ((on_cooldown IS NULL) OR (on_cooldown = ANY (ARRAY['wait'::text, 'suppress'::text]))) AND ((cooldown IS NULL) OR (cooldown > '00:00:00'::interval)))),
    CONSTRAINT outbox_message_deferrals_check CHECK ((deferrals >= 0)),
    CONSTRAINT outbox_message_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT outbox_message_on_predecessor_failure_check CHECK ((on_predecessor_failure = ANY (ARRAY['hold'::text, 'cancel'::text]))),
    CONSTRAINT outbox_message_settled_consistent CHECK (((status = ANY (ARRAY['pending'::text, 'claimed'::text])) = (settled_at IS NULL))),
    CONSTRAINT outbox_message_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'claimed'::text, 'delivered'::text, 'failed'::text, 'dead'::text, 'suppressed'::text, 'cancelled'::text, 'expired'::text, 'bounced'::text, 'complained'::text])))
)
WITH (autovacuum_vacuum_scale_factor='0.01', autovacuum_vacuum_threshold='1000', autovacuum_analyze_scale_factor='0.02', autovacuum_vacuum_cost_delay='0', fillfactor='70');

-- Name: outbox_message_resolved; Type: TABLE

CREATE TABLE public.outbox_message_resolved (
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
    destination text,
    cooldown_key text,
    cooldown interval,
    on_cooldown text,
    tenant text DEFAULT ''::text NOT NULL,
    CONSTRAINT outbox_message_attempts_at_redrive_check CHECK ((attempts_at_redrive >= 0)),
    CONSTRAINT outbox_message_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT outbox_message_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text)),
    CONSTRAINT outbox_message_claim_consistent CHECK (((status = 'claimed'::text) = ((claim_token IS NOT NULL) AND (lease_expires_at IS NOT NULL)))),
    CONSTRAINT outbox_message_cooldown_check CHECK ((((cooldown_key IS NULL) = (cooldown IS NULL)) AND ((cooldown_key IS NULL) = (on_cooldown IS NULL)) AND ((on_cooldown IS NULL) OR (on_cooldown = ANY (ARRAY['wait'::text, 'suppress'::text]))) AND ((cooldown IS NULL) OR (cooldown > '00:00:00'::interval)))),
    CONSTRAINT outbox_message_deferrals_check CHECK ((deferrals >= 0)),
    CONSTRAINT outbox_message_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT outbox_message_on_predecessor_failure_check CHECK ((on_predecessor_failure = ANY (ARRAY['hold'::text, 'cancel'::text]))),
    CONSTRAINT outbox_message_settled_consistent CHECK (((status = ANY (ARRAY['pending'::text, 'claimed'::text])) = (settled_at IS NULL))),
    CONSTRAINT outbox_message_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'claimed'::text, 'delivered'::text, 'failed'::text, 'dead'::text, 'suppressed'::text, 'cancelled'::text, 'expired'::text, 'bounced'::text, 'complained'::text])))
)
PARTITION BY RANGE (settled_at);

-- Name: outbox_message_resolved_default; Type: TABLE

CREATE TABLE public.outbox_message_resolved_default (
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
    destination text,
    cooldown_key text,
    cooldown interval,
    on_cooldown text,
    tenant text DEFAULT ''::text NOT NULL,
    CONSTRAINT outbox_message_attempts_at_redrive_check CHECK ((attempts_at_redrive >= 0)),
    CONSTRAINT outbox_message_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT outbox_message_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text)),
    CONSTRAINT outbox_message_claim_consistent CHECK (((status = 'claimed'::text) = ((claim_token IS NOT NULL) AND (lease_expires_at IS NOT NULL)))),
    CONSTRAINT outbox_message_cooldown_check CHECK ((((cooldown_key IS NULL) = (cooldown IS NULL)) AND ((cooldown_key IS NULL) = (on_cooldown IS NULL)) AND ((on_cooldown IS NULL) OR (on_cooldown = ANY (ARRAY['wait'::text, 'suppress'::text]))) AND ((cooldown IS NULL) OR (cooldown > '00:00:00'::interval)))),
    CONSTRAINT outbox_message_deferrals_check CHECK ((deferrals >= 0)),
    CONSTRAINT outbox_message_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT outbox_message_on_predecessor_failure_check CHECK ((on_predecessor_failure = ANY (ARRAY['hold'::text, 'cancel'::text]))),
    CONSTRAINT outbox_message_settled_consistent CHECK (((status = ANY (ARRAY['pending'::text, 'claimed'::text])) = (settled_at IS NULL))),
    CONSTRAINT outbox_message_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'claimed'::text, 'delivered'::text, 'failed'::text, 'dead'::text, 'suppressed'::text, 'cancelled'::text, 'expired'::text, 'bounced'::text, 'complained'::text])))
);

-- Name: outbox_message_unresolved; Type: TABLE

CREATE TABLE public.outbox_message_unresolved (
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
    destination text,
    cooldown_key text,
    cooldown interval,
    on_cooldown text,
    tenant text DEFAULT ''::text NOT NULL,
    CONSTRAINT outbox_message_attempts_at_redrive_check CHECK ((attempts_at_redrive >= 0)),
    CONSTRAINT outbox_message_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT outbox_message_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text)),
    CONSTRAINT outbox_message_claim_consistent CHECK (((status = 'claimed'::text) = ((claim_token IS NOT NULL) AND (lease_expires_at IS NOT NULL)))),
    CONSTRAINT outbox_message_cooldown_check CHECK ((((cooldown_key IS NULL) = (cooldown IS NULL)) AND ((cooldown_key IS NULL) = (on_cooldown IS NULL)) AND ((on_cooldown IS NULL) OR (on_cooldown = ANY (ARRAY['wait'::text, 'suppress'::text]))) AND ((cooldown IS NULL) OR (cooldown > '00:00:00'::interval)))),
    CONSTRAINT outbox_message_deferrals_check CHECK ((deferrals >= 0)),
    CONSTRAINT outbox_message_max_attempts_check CHECK ((max_attempts > 0)),
    CONSTRAINT outbox_message_on_predecessor_failure_check CHECK ((on_predecessor_failure = ANY (ARRAY['hold'::text, 'cancel'::text]))),
    CONSTRAINT outbox_message_settled_consistent CHECK (((status = ANY (ARRAY['pending'::text, 'claimed'::text])) = (settled_at IS NULL))),
    CONSTRAINT outbox_message_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'claimed'::text, 'delivered'::text, 'failed'::text, 'dead'::text, 'suppressed'::text, 'cancelled'::text, 'expired'::text, 'bounced'::text, 'complained'::text])))
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
    publish_error text,
    retry_at timestamp with time zone,
    tenant text
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

-- Name: outbox_tenant; Type: TABLE

CREATE TABLE public.outbox_tenant (
    tenant text NOT NULL,
    weight integer DEFAULT 1 NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_tenant_tenant_check CHECK (((tenant = ''::text) OR (tenant ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$'::text))),
    CONSTRAINT outbox_tenant_weight_check CHECK (((weight >= 1) AND (weight <= 1000)))
);

-- Name: outbox_tenant_channel; Type: TABLE

CREATE TABLE public.outbox_tenant_channel (
    tenant text NOT NULL,
    channel text NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    reason text,
    limit_rate double precision,
    limit_burst double precision,
    tokens double precision,
    tokens_at timestamp with time zone,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_tenant_channel_burst_has_rate CHECK (((limit_burst IS NULL) OR (limit_rate IS NOT NULL))),
    CONSTRAINT outbox_tenant_channel_channel_check CHECK ((channel ~ '^[a-z][a-z0-9_-]{0,63}$'::text)),
    CONSTRAINT outbox_tenant_channel_limit_burst_check CHECK (((limit_burst >= (1)::double precision) AND (limit_burst <= (1000000)::double precision))),
    CONSTRAINT outbox_tenant_channel_limit_rate_check CHECK (((limit_rate > (0)::double precision) AND (limit_rate <= (100000)::double precision))),
    CONSTRAINT outbox_tenant_channel_reason_check CHECK ((char_length(reason) <= 500)),
    CONSTRAINT outbox_tenant_channel_tenant_check CHECK ((tenant ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$'::text))
);

-- Name: outbox_tenant_role; Type: TABLE

CREATE TABLE public.outbox_tenant_role (
    role_name text NOT NULL,
    tenant text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_tenant_role_tenant_check CHECK ((tenant ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$'::text))
);

-- Name: outbox_tenant_secret; Type: TABLE

CREATE TABLE public.outbox_tenant_secret (
    secret_id text NOT NULL,
    tenant text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT outbox_tenant_secret_secret_id_check CHECK ((char_length(secret_id) <= 2048)),
    CONSTRAINT outbox_tenant_secret_tenant_check CHECK ((tenant ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$'::text))
);

-- Name: outbox_tenant_turn; Type: TABLE

CREATE TABLE public.outbox_tenant_turn (
    one boolean DEFAULT true NOT NULL,
    tenant text NOT NULL,
    CONSTRAINT outbox_tenant_turn_one_check CHECK (one)
);

-- Name: outbox_message_live; Type: TABLE ATTACH

ALTER TABLE ONLY public.outbox_message ATTACH PARTITION public.outbox_message_live FOR VALUES IN ('pending', 'claimed');

-- Name: outbox_message_resolved; Type: TABLE ATTACH

ALTER TABLE ONLY public.outbox_message ATTACH PARTITION public.outbox_message_resolved FOR VALUES IN ('delivered', 'suppressed', 'cancelled', 'bounced', 'complained');

-- Name: outbox_message_resolved_default; Type: TABLE ATTACH

ALTER TABLE ONLY public.outbox_message_resolved ATTACH PARTITION public.outbox_message_resolved_default DEFAULT;

-- Name: outbox_message_unresolved; Type: TABLE ATTACH

ALTER TABLE ONLY public.outbox_message ATTACH PARTITION public.outbox_message_unresolved FOR VALUES IN ('failed', 'dead', 'expired');

-- Name: outbox_attempt outbox_attempt_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_attempt
    ADD CONSTRAINT outbox_attempt_pkey PRIMARY KEY (id);

-- Name: outbox_channel_pause outbox_channel_pause_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_channel_pause
    ADD CONSTRAINT outbox_channel_pause_pkey PRIMARY KEY (channel);

-- Name: outbox_channel outbox_channel_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_channel
    ADD CONSTRAINT outbox_channel_pkey PRIMARY KEY (name);

-- Name: outbox_cooldown outbox_cooldown_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_cooldown
    ADD CONSTRAINT outbox_cooldown_pkey PRIMARY KEY (channel, cooldown_key, tenant);

-- Name: outbox_dedupe outbox_dedupe_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_dedupe
    ADD CONSTRAINT outbox_dedupe_pkey PRIMARY KEY (channel, dedupe_key, recipient_fingerprint, tenant);

-- Name: outbox_destination outbox_destination_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_destination
    ADD CONSTRAINT outbox_destination_pkey PRIMARY KEY (channel, destination);

-- Name: outbox_fingerprint_key outbox_fingerprint_key_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_fingerprint_key
    ADD CONSTRAINT outbox_fingerprint_key_pkey PRIMARY KEY (singleton);

-- Name: outbox_message_live outbox_message_live_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_message_live
    ADD CONSTRAINT outbox_message_live_pkey PRIMARY KEY (id);

-- Name: outbox_message_unresolved outbox_message_unresolved_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_message_unresolved
    ADD CONSTRAINT outbox_message_unresolved_pkey PRIMARY KEY (id);

-- Name: outbox_outcome_event outbox_outcome_event_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_outcome_event
    ADD CONSTRAINT outbox_outcome_event_pkey PRIMARY KEY (id);

-- Name: outbox_tenant_channel outbox_tenant_channel_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_tenant_channel
    ADD CONSTRAINT outbox_tenant_channel_pkey PRIMARY KEY (tenant, channel);

-- Name: outbox_tenant outbox_tenant_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_tenant
    ADD CONSTRAINT outbox_tenant_pkey PRIMARY KEY (tenant);

-- Name: outbox_tenant_role outbox_tenant_role_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_tenant_role
    ADD CONSTRAINT outbox_tenant_role_pkey PRIMARY KEY (role_name);

-- Name: outbox_tenant_secret outbox_tenant_secret_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_tenant_secret
    ADD CONSTRAINT outbox_tenant_secret_pkey PRIMARY KEY (secret_id);

-- Name: outbox_tenant_turn outbox_tenant_turn_pkey; Type: CONSTRAINT

ALTER TABLE ONLY public.outbox_tenant_turn
    ADD CONSTRAINT outbox_tenant_turn_pkey PRIMARY KEY (one);

-- Name: outbox_attempt_feedback; Type: INDEX

CREATE UNIQUE INDEX outbox_attempt_feedback ON public.outbox_attempt USING btree (message_id, feedback_id) WHERE (feedback_id IS NOT NULL);

-- Name: outbox_attempt_finished; Type: INDEX

CREATE INDEX outbox_attempt_finished ON public.outbox_attempt USING btree (finished_at);

-- Name: outbox_attempt_message; Type: INDEX

CREATE INDEX outbox_attempt_message ON public.outbox_attempt USING btree (message_id, id);

-- Name: outbox_attempt_recipient; Type: INDEX

CREATE INDEX outbox_attempt_recipient ON public.outbox_attempt USING gin (recipient_fingerprints);

-- Name: outbox_cooldown_until; Type: INDEX

CREATE INDEX outbox_cooldown_until ON public.outbox_cooldown USING btree (until);

-- Name: outbox_dedupe_created; Type: INDEX

CREATE INDEX outbox_dedupe_created ON public.outbox_dedupe USING btree (created_at);

-- Name: outbox_destination_channel_wide; Type: INDEX

CREATE INDEX outbox_destination_channel_wide ON public.outbox_destination USING btree (channel) WHERE (destination = '*'::text);

-- Name: outbox_destination_turn; Type: INDEX

CREATE INDEX outbox_destination_turn ON public.outbox_destination USING btree (tokens_at NULLS FIRST) WHERE (((rate IS NOT NULL) OR (limit_rate IS NOT NULL)) AND (destination <> '*'::text));

-- Name: outbox_message_due; Type: INDEX

CREATE INDEX outbox_message_due ON public.outbox_message_live USING btree (priority DESC, available_at, id) WHERE (status = 'pending'::text);

-- Name: outbox_message_due_by_channel; Type: INDEX

CREATE INDEX outbox_message_due_by_channel ON public.outbox_message_live USING btree (channel, priority DESC, available_at, id) WHERE (status = 'pending'::text);

-- Name: outbox_message_due_by_destination; Type: INDEX

CREATE INDEX outbox_message_due_by_destination ON public.outbox_message_live USING btree (channel, destination, priority DESC, available_at, id) WHERE (status = 'pending'::text);

-- Name: outbox_message_due_by_tenant; Type: INDEX

CREATE INDEX outbox_message_due_by_tenant ON public.outbox_message_live USING btree (tenant, priority DESC, available_at, id) WHERE (status = 'pending'::text);

-- Name: outbox_message_expiry; Type: INDEX

CREATE INDEX outbox_message_expiry ON public.outbox_message_live USING btree (expires_at) WHERE ((status = 'pending'::text) AND (expires_at IS NOT NULL));

-- Name: outbox_message_lease; Type: INDEX

CREATE INDEX outbox_message_lease ON public.outbox_message_live USING btree (lease_expires_at) WHERE (status = 'claimed'::text);

-- Name: outbox_message_live_email_provider_id; Type: INDEX

CREATE INDEX outbox_message_live_email_provider_id ON public.outbox_message_live USING btree (provider_message_id) WHERE ((channel = 'email'::text) AND (provider_message_id IS NOT NULL));

-- Name: outbox_message_live_ordering; Type: INDEX

CREATE INDEX outbox_message_live_ordering ON public.outbox_message_live USING btree (ordering_key, id) WHERE (ordering_key IS NOT NULL);

-- Name: outbox_message_resolved_id; Type: INDEX

CREATE INDEX outbox_message_resolved_id ON ONLY public.outbox_message_resolved USING btree (id);

-- Name: outbox_message_resolved_default_id_idx; Type: INDEX

CREATE INDEX outbox_message_resolved_default_id_idx ON public.outbox_message_resolved_default USING btree (id);

-- Name: outbox_message_resolved_email_provider_id; Type: INDEX

CREATE INDEX outbox_message_resolved_email_provider_id ON ONLY public.outbox_message_resolved USING btree (provider_message_id) WHERE ((channel = 'email'::text) AND (provider_message_id IS NOT NULL));

-- Name: outbox_message_resolved_default_provider_message_id_idx; Type: INDEX

CREATE INDEX outbox_message_resolved_default_provider_message_id_idx ON public.outbox_message_resolved_default USING btree (provider_message_id) WHERE ((channel = 'email'::text) AND (provider_message_id IS NOT NULL));

-- Name: outbox_message_resolved_settled; Type: INDEX

CREATE INDEX outbox_message_resolved_settled ON ONLY public.outbox_message_resolved USING btree (status, settled_at);

-- Name: outbox_message_resolved_default_status_settled_at_idx; Type: INDEX

CREATE INDEX outbox_message_resolved_default_status_settled_at_idx ON public.outbox_message_resolved_default USING btree (status, settled_at);

-- Name: outbox_message_unresolved_email_provider_id; Type: INDEX

CREATE INDEX outbox_message_unresolved_email_provider_id ON public.outbox_message_unresolved USING btree (provider_message_id) WHERE ((channel = 'email'::text) AND (provider_message_id IS NOT NULL));

-- Name: outbox_message_unresolved_ordering; Type: INDEX

CREATE INDEX outbox_message_unresolved_ordering ON public.outbox_message_unresolved USING btree (ordering_key, id) WHERE (ordering_key IS NOT NULL);

-- Name: outbox_message_unresolved_settled; Type: INDEX

CREATE INDEX outbox_message_unresolved_settled ON public.outbox_message_unresolved USING btree (status, settled_at);

-- Name: outbox_outcome_event_due; Type: INDEX

CREATE INDEX outbox_outcome_event_due ON public.outbox_outcome_event USING btree (publish_after, id);

-- Name: outbox_tenant_channel_turn; Type: INDEX

CREATE INDEX outbox_tenant_channel_turn ON public.outbox_tenant_channel USING btree (tokens_at NULLS FIRST) WHERE (limit_rate IS NOT NULL);

-- Name: outbox_tenant_secret_tenant; Type: INDEX

CREATE INDEX outbox_tenant_secret_tenant ON public.outbox_tenant_secret USING btree (tenant);

-- Name: outbox_message_resolved_default_id_idx; Type: INDEX ATTACH

ALTER INDEX public.outbox_message_resolved_id ATTACH PARTITION public.outbox_message_resolved_default_id_idx;

-- Name: outbox_message_resolved_default_provider_message_id_idx; Type: INDEX ATTACH

ALTER INDEX public.outbox_message_resolved_email_provider_id ATTACH PARTITION public.outbox_message_resolved_default_provider_message_id_idx;

-- Name: outbox_message_resolved_default_status_settled_at_idx; Type: INDEX ATTACH

ALTER INDEX public.outbox_message_resolved_settled ATTACH PARTITION public.outbox_message_resolved_default_status_settled_at_idx;

-- Name: outbox_message_resolved outbox_message_delivered_event; Type: TRIGGER

CREATE TRIGGER outbox_message_delivered_event AFTER INSERT ON public.outbox_message_resolved FOR EACH ROW WHEN ((new.status = 'delivered'::text)) EXECUTE FUNCTION public.outbox_record_outcome_event();

ALTER TABLE public.outbox_message_resolved DISABLE TRIGGER outbox_message_delivered_event;

-- Name: outbox_message_live outbox_message_destination; Type: TRIGGER

CREATE TRIGGER outbox_message_destination BEFORE INSERT ON public.outbox_message_live FOR EACH ROW EXECUTE FUNCTION public.outbox_message_set_destination();

-- Name: outbox_message outbox_message_outcome_event; Type: TRIGGER

CREATE TRIGGER outbox_message_outcome_event AFTER UPDATE OF status ON public.outbox_message FOR EACH ROW WHEN (((new.status IS DISTINCT FROM old.status) AND (new.status = ANY (ARRAY['failed'::text, 'dead'::text, 'expired'::text, 'bounced'::text, 'complained'::text, 'suppressed'::text])))) EXECUTE FUNCTION public.outbox_record_outcome_event();

-- Name: outbox_message_live outbox_message_retrying_event; Type: TRIGGER

CREATE TRIGGER outbox_message_retrying_event AFTER UPDATE OF status ON public.outbox_message_live FOR EACH ROW WHEN (((old.status = 'claimed'::text) AND (new.status = 'pending'::text) AND (new.attempts > old.attempts))) EXECUTE FUNCTION public.outbox_record_retrying_event();

ALTER TABLE public.outbox_message_live DISABLE TRIGGER outbox_message_retrying_event;

-- Name: outbox_message_resolved outbox_message_settled_event; Type: TRIGGER

CREATE TRIGGER outbox_message_settled_event AFTER INSERT ON public.outbox_message_resolved FOR EACH ROW WHEN ((new.status = ANY (ARRAY['bounced'::text, 'complained'::text, 'suppressed'::text]))) EXECUTE FUNCTION public.outbox_record_outcome_event();

-- Name: outbox_message_unresolved outbox_message_settled_event; Type: TRIGGER

CREATE TRIGGER outbox_message_settled_event AFTER INSERT ON public.outbox_message_unresolved FOR EACH ROW EXECUTE FUNCTION public.outbox_record_outcome_event();

-- Name: FUNCTION outbox_cooldown_problem(cooldown interval, cooldown_key text, on_cooldown text); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_cooldown_problem(cooldown interval, cooldown_key text, on_cooldown text) FROM PUBLIC;

-- Name: FUNCTION outbox_drop_history_before(p_before timestamp with time zone, p_dry_run boolean); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_drop_history_before(p_before timestamp with time zone, p_dry_run boolean) FROM PUBLIC;
GRANT ALL ON FUNCTION public.outbox_drop_history_before(p_before timestamp with time zone, p_dry_run boolean) TO outbox_relay;

-- Name: FUNCTION outbox_enqueue(channel text, payload jsonb, dedupe_key text, ordering_key text, priority integer, delay interval, max_attempts integer, expires_at timestamp with time zone, ttl interval, on_predecessor_failure text, cooldown interval, cooldown_key text, on_cooldown text, tenant text); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_enqueue(channel text, payload jsonb, dedupe_key text, ordering_key text, priority integer, delay interval, max_attempts integer, expires_at timestamp with time zone, ttl interval, on_predecessor_failure text, cooldown interval, cooldown_key text, on_cooldown text, tenant text) FROM PUBLIC;
GRANT ALL ON FUNCTION public.outbox_enqueue(channel text, payload jsonb, dedupe_key text, ordering_key text, priority integer, delay interval, max_attempts integer, expires_at timestamp with time zone, ttl interval, on_predecessor_failure text, cooldown interval, cooldown_key text, on_cooldown text, tenant text) TO outbox_producer;

-- Name: FUNCTION outbox_enqueue_core(channel text, payload jsonb, dedupe_key text, ordering_key text, priority integer, delay interval, max_attempts integer, expires_at timestamp with time zone, ttl interval, on_predecessor_failure text, tenant text); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_enqueue_core(channel text, payload jsonb, dedupe_key text, ordering_key text, priority integer, delay interval, max_attempts integer, expires_at timestamp with time zone, ttl interval, on_predecessor_failure text, tenant text) FROM PUBLIC;

-- Name: FUNCTION outbox_enqueue_many(p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[], p_priorities integer[], p_delays double precision[], p_max_attempts integer[], p_expires_at timestamp with time zone[], p_ttls double precision[], p_on_predecessor_failure text[], p_cooldowns double precision[], p_cooldown_keys text[], p_on_cooldown text[], p_tenant text, p_tenants text[]); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_enqueue_many(p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[], p_priorities integer[], p_delays double precision[], p_max_attempts integer[], p_expires_at timestamp with time zone[], p_ttls double precision[], p_on_predecessor_failure text[], p_cooldowns double precision[], p_cooldown_keys text[], p_on_cooldown text[], p_tenant text, p_tenants text[]) FROM PUBLIC;
GRANT ALL ON FUNCTION public.outbox_enqueue_many(p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[], p_priorities integer[], p_delays double precision[], p_max_attempts integer[], p_expires_at timestamp with time zone[], p_ttls double precision[], p_on_predecessor_failure text[], p_cooldowns double precision[], p_cooldown_keys text[], p_on_cooldown text[], p_tenant text, p_tenants text[]) TO outbox_producer;

-- Name: FUNCTION outbox_enqueue_many_core(p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[], p_priorities integer[], p_delays double precision[], p_max_attempts integer[], p_expires_at timestamp with time zone[], p_ttls double precision[], p_on_predecessor_failure text[], p_tenants text[]); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_enqueue_many_core(p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[], p_priorities integer[], p_delays double precision[], p_max_attempts integer[], p_expires_at timestamp with time zone[], p_ttls double precision[], p_on_predecessor_failure text[], p_tenants text[]) FROM PUBLIC;

-- Name: FUNCTION outbox_enqueue_tenants(p_tenant text, p_tenants text[], p_count integer); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_enqueue_tenants(p_tenant text, p_tenants text[], p_count integer) FROM PUBLIC;

-- Name: FUNCTION outbox_fingerprint(message text); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_fingerprint(message text) FROM PUBLIC;
GRANT ALL ON FUNCTION public.outbox_fingerprint(message text) TO outbox_relay;

-- Name: FUNCTION outbox_history_partitions(); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_history_partitions() FROM PUBLIC;
GRANT ALL ON FUNCTION public.outbox_history_partitions() TO outbox_relay;

-- Name: FUNCTION outbox_make_history_partitions(p_days_ahead integer); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_make_history_partitions(p_days_ahead integer) FROM PUBLIC;
GRANT ALL ON FUNCTION public.outbox_make_history_partitions(p_days_ahead integer) TO outbox_relay;

-- Name: FUNCTION outbox_recipient_fingerprint(channel text, payload jsonb); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_recipient_fingerprint(channel text, payload jsonb) FROM PUBLIC;

-- Name: FUNCTION outbox_recipient_fingerprints(channel text, payload jsonb); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_recipient_fingerprints(channel text, payload jsonb) FROM PUBLIC;

-- Name: FUNCTION outbox_record_outcome_event(); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_record_outcome_event() FROM PUBLIC;

-- Name: FUNCTION outbox_secret_refused(p_tenant text, p_channel text, p_payload jsonb); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_secret_refused(p_tenant text, p_channel text, p_payload jsonb) FROM PUBLIC;
GRANT ALL ON FUNCTION public.outbox_secret_refused(p_tenant text, p_channel text, p_payload jsonb) TO outbox_relay;

-- Name: FUNCTION outbox_take_dedupe_key(p_channel text, p_dedupe_key text, p_payload jsonb, p_new_id bigint, p_tenant text); Type: ACL

REVOKE ALL ON FUNCTION public.outbox_take_dedupe_key(p_channel text, p_dedupe_key text, p_payload jsonb, p_new_id bigint, p_tenant text) FROM PUBLIC;

-- Name: TABLE outbox_attempt; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_attempt TO outbox_relay;

-- Name: TABLE outbox_channel; Type: ACL

GRANT SELECT ON TABLE public.outbox_channel TO outbox_relay;

-- Name: TABLE outbox_channel_pause; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_channel_pause TO outbox_relay;

-- Name: TABLE outbox_cooldown; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_cooldown TO outbox_relay;

-- Name: TABLE outbox_dedupe; Type: ACL

GRANT SELECT,DELETE,UPDATE ON TABLE public.outbox_dedupe TO outbox_relay;

-- Name: TABLE outbox_destination; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_destination TO outbox_relay;

-- Name: TABLE outbox_message; Type: ACL

GRANT SELECT,DELETE,UPDATE ON TABLE public.outbox_message TO outbox_relay;

-- Name: TABLE outbox_message_resolved_default; Type: ACL

GRANT SELECT,DELETE,UPDATE ON TABLE public.outbox_message_resolved_default TO outbox_relay;

-- Name: TABLE outbox_outcome_event; Type: ACL

GRANT SELECT,DELETE,UPDATE ON TABLE public.outbox_outcome_event TO outbox_relay;

-- Name: TABLE outbox_tenant; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_tenant TO outbox_relay;

-- Name: TABLE outbox_tenant_channel; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_tenant_channel TO outbox_relay;

-- Name: TABLE outbox_tenant_role; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_tenant_role TO outbox_relay;

-- Name: TABLE outbox_tenant_secret; Type: ACL

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE public.outbox_tenant_secret TO outbox_relay;

-- Name: TABLE outbox_tenant_turn; Type: ACL

GRANT SELECT,UPDATE ON TABLE public.outbox_tenant_turn TO outbox_relay;
