-- Wake on enqueue for producers that write with SQL (outbox_enqueue() or a
-- plain INSERT): when a transaction that inserted outbox messages commits,
-- the database invokes the dispatcher function asynchronously, so the message
-- goes out at once instead of on the dispatcher's next scheduled run.
--
-- OPT-IN, outside the migrations, for RDS for PostgreSQL and Aurora
-- PostgreSQL only (it needs their aws_lambda extension). Before running it:
--   * CREATE EXTENSION IF NOT EXISTS aws_lambda CASCADE;   (brings aws_commons)
--   * an IAM role associated with the DB instance or cluster for the feature
--     "Lambda", allowed lambda:InvokeFunction on the dispatcher function;
--   * a network path from the database to the Lambda endpoint (a NAT gateway,
--     or a Lambda interface VPC endpoint in the database's subnets).
-- Then, as the user that owns the outbox tables (the migrator), with the
-- outbox's schema first on the search_path:
--   psql "$MIGRATOR_URL" -f wake_on_enqueue.sql
--   psql "$MIGRATOR_URL" -c "SELECT outbox_wake_configure('arn:aws:lambda:REGION:ACCOUNT:function:NAME')"
-- Running it again is harmless. docs/how-to/wake-on-enqueue.md says more, and
-- how to remove it.
--
-- What it promises:
--   * after the inserts, at COMMIT: a DEFERRABLE INITIALLY DEFERRED trigger,
--     so a transaction that rolls back never nudges. (Postgres has no hook
--     after a commit: the Invoke is sent while the COMMIT completes, and the
--     dispatcher lingers a few seconds for rows not yet visible.)
--   * coalesced: at most one transaction per min_interval (all producers
--     together) pays for an Invoke; the others skip without waiting. The last
--     nudge's time is kept in a sequence (not transactional, so no
--     SERIALIZABLE producer can fail because another one nudged) and the check
--     is guarded by a try-lock of outbox_wake's one row (FOR UPDATE SKIP
--     LOCKED): only a role that may update that table (the relay's owner) can
--     hold it, so no other role can stop every producer's nudges by holding
--     it, as a session-wide advisory lock could be held by anyone.
--   * bounded: the Invoke's connect and request timeouts are set for the call
--     (aws_lambda.connect_timeout_ms, aws_lambda.request_timeout_ms), so a hung
--     Lambda endpoint holds the producer's COMMIT for about 3 seconds at most.
--   * every built-in named pg_catalog.*: the function runs with its owner's
--     rights, and a better-matching overload planted in the outbox's schema
--     must not stand in for a built-in.
--   * never fails the producer's transaction: any error (no extension, no
--     role, no network, throttled, no such function) becomes a WARNING.
--     A lost nudge costs latency only: the dispatcher's schedule is the
--     safety net.

DO $check$
BEGIN
    IF to_regclass('outbox_message') IS NULL THEN
        RAISE EXCEPTION 'wake_on_enqueue.sql: no outbox_message on the search_path (%): '
            'run it in the outbox''s schema, after the migrations', current_setting('search_path');
    END IF;
    IF to_regnamespace('aws_lambda') IS NULL THEN
        RAISE EXCEPTION 'wake_on_enqueue.sql needs the aws_lambda extension '
            '(RDS or Aurora PostgreSQL): CREATE EXTENSION aws_lambda CASCADE';
    END IF;
END
$check$;

-- Where to send the nudge, and how often at most. One row.
CREATE TABLE IF NOT EXISTS outbox_wake (
    one_row boolean PRIMARY KEY DEFAULT true CHECK (one_row),
    function_arn text NOT NULL,
    region text,
    min_interval interval NOT NULL DEFAULT interval '1 second'
        CHECK (min_interval >= interval '0')
);

-- When the last nudge was sent, in milliseconds since the epoch.
CREATE SEQUENCE IF NOT EXISTS outbox_wake_last_nudge_ms MINVALUE 0 START 0;

CREATE OR REPLACE FUNCTION outbox_wake_configure(
    function_arn text,
    min_interval interval DEFAULT interval '1 second'
) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF function_arn !~ '^(arn:aws[a-z-]*:lambda:[a-z0-9-]+:[0-9]{12}:function:)?[A-Za-z0-9_-]{1,64}(:[A-Za-z0-9_$-]{1,128})?$' THEN
        RAISE EXCEPTION 'outbox_wake_configure: % is not a Lambda function name or ARN', function_arn
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO outbox_wake AS w (function_arn, region, min_interval)
    VALUES (
        function_arn,
        -- the ARN's region; a bare name is the database's own region
        NULLIF(pg_catalog.split_part(function_arn, ':', 4), ''),
        min_interval
    )
    ON CONFLICT (one_row) DO UPDATE
        SET function_arn = EXCLUDED.function_arn,
            region = EXCLUDED.region,
            min_interval = EXCLUDED.min_interval;
END
$$;

CREATE OR REPLACE FUNCTION outbox_wake_nudge() RETURNS trigger
LANGUAGE plpgsql
-- The owner's rights: producers need no grant on aws_lambda or on the sequence.
SECURITY DEFINER
AS $$
DECLARE
    target record;
    now_ms bigint;
BEGIN
    -- The trigger fires once per inserted row; the first one per transaction decides.
    IF pg_catalog.current_setting('outbox.wake_decided', true) = 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM pg_catalog.set_config('outbox.wake_decided', 'on', true);
    BEGIN
        -- Another producer deciding right now nudges for both: skip, never wait.
        -- (No row: installed, not configured yet.)
        SELECT w.function_arn, w.region, w.min_interval INTO target
        FROM outbox_wake AS w FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            now_ms := (extract(epoch FROM pg_catalog.clock_timestamp()) * 1000)::bigint;
            -- nudged within the interval: that run will find this row
            IF now_ms - pg_catalog.pg_sequence_last_value(
                            'outbox_wake_last_nudge_ms'::pg_catalog.regclass)
                    >= extract(epoch FROM target.min_interval) * 1000 THEN
                PERFORM pg_catalog.setval('outbox_wake_last_nudge_ms'::pg_catalog.regclass,
                                          now_ms);
                BEGIN  -- an extension too old for them still nudges, unbounded
                    PERFORM pg_catalog.set_config('aws_lambda.connect_timeout_ms', '1000', true);
                    PERFORM pg_catalog.set_config('aws_lambda.request_timeout_ms', '2000', true);
                EXCEPTION WHEN OTHERS THEN
                    NULL;
                END;
                PERFORM aws_lambda.invoke(
                    aws_commons.create_lambda_function_arn(target.function_arn, target.region),
                    '{"version": 1, "source": "outbox.nudge"}'::json,
                    'Event'
                );
            END IF;
        END IF;
        -- Give the row lock back now, not at the producer's commit: a row lock
        -- taken in a block goes when the block rolls back (the sequence and the
        -- Invoke are not transactional, so they stay). Else a transaction that
        -- fires this early (SET CONSTRAINTS ALL IMMEDIATE) and stays open would
        -- make every other producer skip its nudge until it ends.
        RAISE EXCEPTION USING ERRCODE = 'OW000', MESSAGE = 'outbox wake: decided';
    EXCEPTION
        WHEN SQLSTATE 'OW000' THEN
            NULL;
        WHEN OTHERS THEN
            RAISE WARNING 'outbox wake: the dispatcher was not nudged (%: %); the message '
                'goes out on its schedule', SQLSTATE, SQLERRM;
    END;
    RETURN NULL;
END
$$;

REVOKE ALL ON FUNCTION outbox_wake_configure(text, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION outbox_wake_nudge() FROM PUBLIC;

-- Both functions see the outbox's schema, whatever the caller's path.
DO $pin$
DECLARE
    schema_name text := (
        SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE c.oid = 'outbox_message'::regclass
    );
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_wake_configure(text, interval) SET search_path = %I, pg_temp',
                   schema_name);
    EXECUTE format('ALTER FUNCTION outbox_wake_nudge() SET search_path = %I, pg_temp', schema_name);
END
$pin$;

DROP TRIGGER IF EXISTS outbox_wake_on_enqueue ON outbox_message;
CREATE CONSTRAINT TRIGGER outbox_wake_on_enqueue
    AFTER INSERT ON outbox_message
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION outbox_wake_nudge();
