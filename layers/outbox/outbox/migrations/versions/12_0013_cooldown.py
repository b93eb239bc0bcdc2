"""Cooldown per key: at most one message per (channel, cooldown_key) delivered
within a window (docs/design.md, invariant 11).

* ``outbox_message.cooldown_key``, ``cooldown`` (the window, an interval of
  seconds) and ``on_cooldown`` (``wait`` or ``suppress``): all three or none
  (a CHECK constraint). NULL on every row enqueued without a cooldown.
* ``outbox_cooldown``: one row per (channel, cooldown_key) whose cooldown was
  taken: ``message_id``, the message holding it; ``until``, the end of its
  window (NULL while the holder is not delivered yet: it may still fail, and
  then holds nothing); and ``taken_at``, when the holder took it (the clock at
  the upsert, not the transaction's start: a claim whose statement began
  before it treats the key as held, since it may not see that holder yet).
  The claim takes it in the claim statement (an upsert,
  so concurrent claimers serialise on the row); the settle of a delivered
  holder opens its window (``until = now() + cooldown``); the reaper removes
  rows whose window ended or whose holder ended undelivered.
* The producer door takes the same options: ``outbox_enqueue(...,
  cooldown, cooldown_key, on_cooldown)`` and ``outbox_enqueue_many(...,
  p_cooldowns, p_cooldown_keys, p_on_cooldown)``, all with defaults, so every
  existing call keeps working. The doors of 0009 are kept, renamed
  ``outbox_enqueue_core`` and ``outbox_enqueue_many_core`` and callable by
  their owner only: the new doors check the cooldown options (SQLSTATE 22023,
  or a refused row, as before), call them, and write the cooldown onto the
  messages they created (never onto a replay's).

Every function here pins its search_path (the install schema, then pg_temp).

Revision ID: 0013
Revises: 0012
"""

from types import ModuleType

from alembic import op

from outbox.migrations import revision_module

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# The longest window (as the ttl's bound).
MAX_COOLDOWN_DAYS = 366


def _m9() -> ModuleType:
    return revision_module("0009")


_PIN = "SET search_path = @, pg_temp"

# The cooldown options' checks, one message at a time: the first broken rule
# as (field, problem), or no row. Both doors ask it.
COOLDOWN_PROBLEM = f"""
CREATE FUNCTION @.outbox_cooldown_problem(cooldown interval, cooldown_key text, on_cooldown text)
RETURNS TABLE (field text, problem text)
LANGUAGE sql IMMUTABLE PARALLEL SAFE {_PIN} AS $$
    SELECT v.field, v.problem FROM (VALUES
        (1, 'cooldown', CASE WHEN cooldown IS NULL AND cooldown_key IS NOT NULL
            THEN 'is required with cooldown_key'
            WHEN cooldown <= interval '0' OR cooldown > interval '{MAX_COOLDOWN_DAYS} days'
                 OR NOT isfinite(cooldown)
            THEN 'must be more than 0 seconds and at most {MAX_COOLDOWN_DAYS} days' END),
        (2, 'cooldown_key', CASE WHEN cooldown_key IS NULL AND cooldown IS NOT NULL
            THEN 'is required with cooldown'
            WHEN NOT char_length(cooldown_key) BETWEEN 1 AND 255
            THEN 'must be 1 to 255 characters'
            WHEN cooldown_key ~ '[\\x01-\\x1f\\x7f-\\x9f]'
            THEN 'must not contain control characters' END),
        (3, 'on_cooldown', CASE
            WHEN COALESCE(on_cooldown, 'wait') NOT IN ('wait', 'suppress')
            THEN format('must be one of ''wait'', ''suppress'', got %s',
                        @.outbox_quote_text(on_cooldown))
            WHEN on_cooldown = 'suppress' AND cooldown IS NULL
            THEN 'only with cooldown and cooldown_key' END)
    ) AS v(n, field, problem)
    WHERE v.problem IS NOT NULL
    ORDER BY v.n
    LIMIT 1
$$
"""

# A window as seconds only: '1 day' is 86,400 s whatever the session's time
# zone does that day.
_SECONDS = "make_interval(secs => EXTRACT(EPOCH FROM {0}))"

ENQUEUE = f"""
CREATE FUNCTION @.outbox_enqueue(
    channel text,
    payload jsonb,
    dedupe_key text DEFAULT NULL,
    ordering_key text DEFAULT NULL,
    priority integer DEFAULT 0,
    delay interval DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    expires_at timestamptz DEFAULT NULL,
    ttl interval DEFAULT NULL,
    on_predecessor_failure text DEFAULT 'hold',
    cooldown interval DEFAULT NULL,
    cooldown_key text DEFAULT NULL,
    on_cooldown text DEFAULT 'wait'
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER {_PIN}
AS $$
#variable_conflict use_column
DECLARE
    p_cooldown interval := outbox_enqueue.cooldown;
    p_key text := outbox_enqueue.cooldown_key;
    p_action text := COALESCE(outbox_enqueue.on_cooldown, 'wait');
    f record;
    new_id bigint;
BEGIN
    SELECT * INTO f FROM outbox_cooldown_problem(p_cooldown, p_key, p_action);
    IF FOUND THEN
        PERFORM outbox_enqueue_refuse(f.field, f.problem);
    END IF;
    new_id := outbox_enqueue_core(outbox_enqueue.channel, outbox_enqueue.payload,
        outbox_enqueue.dedupe_key, outbox_enqueue.ordering_key, outbox_enqueue.priority,
        outbox_enqueue.delay, outbox_enqueue.max_attempts, outbox_enqueue.expires_at,
        outbox_enqueue.ttl, outbox_enqueue.on_predecessor_failure);
    -- The core draws a fresh id for every message it checked: the id it
    -- returns is that one when it wrote the message, an older one for a replay
    -- (which is left as it was).
    IF p_cooldown IS NOT NULL AND new_id = currval('outbox_message_id_seq') THEN
        UPDATE outbox_message AS m
        SET cooldown_key = p_key, cooldown = {_SECONDS.format("p_cooldown")},
            on_cooldown = p_action
        WHERE m.id = new_id;
    END IF;
    RETURN new_id;
END
$$
"""

_ROWS = """ROWS FROM (unnest(p_cooldowns), unnest(p_cooldown_keys), unnest(p_on_cooldown))
        WITH ORDINALITY AS c(cooldown_s, cooldown_key, on_cooldown, ord)"""
# NaN or an infinity (or a number no interval holds) reads as a window too long.
_WINDOW = (
    "CASE WHEN c.cooldown_s BETWEEN -1e9 AND 1e9 THEN make_interval(secs => c.cooldown_s) "
    f"WHEN c.cooldown_s IS NOT NULL THEN interval '{MAX_COOLDOWN_DAYS + 1} days' END"
)
_RESULT = """r(ord bigint, conflict boolean, id bigint, created boolean, first_ord bigint,
             held_id bigint, refused_field text, refused_problem text)"""

ENQUEUE_MANY = f"""
CREATE FUNCTION @.outbox_enqueue_many(
    p_channels text[], p_payloads jsonb, p_dedupe_keys text[], p_ordering_keys text[],
    p_priorities integer[], p_delays float8[], p_max_attempts integer[],
    p_expires_at timestamptz[], p_ttls float8[], p_on_predecessor_failure text[],
    p_cooldowns float8[] DEFAULT NULL, p_cooldown_keys text[] DEFAULT NULL,
    p_on_cooldown text[] DEFAULT NULL)
RETURNS TABLE (ord bigint, conflict boolean, id bigint, created boolean, first_ord bigint,
               held_id bigint, refused_field text, refused_problem text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER {_PIN}
AS $$
#variable_conflict use_column
DECLARE
    bad record;
    result jsonb;
BEGIN
    IF p_cooldowns IS NULL AND p_cooldown_keys IS NULL AND p_on_cooldown IS NULL THEN
        RETURN QUERY SELECT * FROM outbox_enqueue_many_core(p_channels, p_payloads,
            p_dedupe_keys, p_ordering_keys, p_priorities, p_delays, p_max_attempts,
            p_expires_at, p_ttls, p_on_predecessor_failure);
        RETURN;
    END IF;
    IF cardinality(p_cooldowns) IS DISTINCT FROM cardinality(p_channels)
       OR cardinality(p_cooldown_keys) IS DISTINCT FROM cardinality(p_channels)
       OR cardinality(p_on_cooldown) IS DISTINCT FROM cardinality(p_channels) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'cooldowns: give p_cooldowns, p_cooldown_keys and p_on_cooldown, '
                      'one per channel';
    END IF;
    SELECT c.ord, p.field, p.problem INTO bad
    FROM {_ROWS}
    CROSS JOIN LATERAL outbox_cooldown_problem({_WINDOW}, c.cooldown_key, c.on_cooldown) AS p
    ORDER BY c.ord LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
                            bad.field, bad.problem;
        RETURN;
    END IF;
    SELECT jsonb_agg(to_jsonb(r) ORDER BY r.ord) INTO result
    FROM outbox_enqueue_many_core(p_channels, p_payloads, p_dedupe_keys, p_ordering_keys,
        p_priorities, p_delays, p_max_attempts, p_expires_at, p_ttls,
        p_on_predecessor_failure) AS r;
    -- A new statement, so it sees the rows the core wrote; a replay is left as it was.
    UPDATE outbox_message AS m
    SET cooldown_key = c.cooldown_key, cooldown = make_interval(secs => c.cooldown_s),
        on_cooldown = COALESCE(c.on_cooldown, 'wait')
    FROM jsonb_to_recordset(result) AS {_RESULT}
    JOIN {_ROWS} ON c.ord = r.ord
    WHERE r.created AND m.id = r.id AND c.cooldown_key IS NOT NULL;
    RETURN QUERY SELECT r.* FROM jsonb_to_recordset(result) AS {_RESULT} ORDER BY r.ord;
END
$$
"""

ENQUEUE_SIGNATURE = (
    "outbox_enqueue(text, jsonb, text, text, integer, interval, integer, timestamptz, "
    "interval, text, interval, text, text)"
)
ENQUEUE_MANY_SIGNATURE = (
    "outbox_enqueue_many(text[], jsonb, text[], text[], integer[], float8[], integer[], "
    "timestamptz[], float8[], text[], float8[], text[], text[])"
)
_ENQUEUE_ARGUMENTS = (
    "(text, jsonb, text, text, integer, interval, integer, timestamptz, interval, text)"
)
_ENQUEUE_MANY_ARGUMENTS = (
    "(text[], jsonb, text[], text[], integer[], float8[], integer[], timestamptz[], float8[], "
    "text[])"
)


def _enqueue_core() -> str:
    """0009's outbox_enqueue under its new name. Created anew rather than
    renamed: its body names its parameters by the function's name."""
    return (
        _m9()
        .ENQUEUE.replace(
            "CREATE OR REPLACE FUNCTION @.outbox_enqueue(", "CREATE FUNCTION @.outbox_enqueue_core("
        )
        .replace("outbox_enqueue.", "outbox_enqueue_core.")
    )


def upgrade() -> None:
    m9 = _m9()
    schema, producer = m9.install_schema(), m9.producer_role()
    relay = str(revision_module("0003").relay_role())

    op.execute(
        "ALTER TABLE outbox_message ADD COLUMN cooldown_key text, ADD COLUMN cooldown interval, "
        "ADD COLUMN on_cooldown text"
    )
    # Checked without rewriting or long-locking the table: the columns are new,
    # so every existing row passes.
    op.execute(
        """
        ALTER TABLE outbox_message ADD CONSTRAINT outbox_message_cooldown_check CHECK (
            (cooldown_key IS NULL) = (cooldown IS NULL)
            AND (cooldown_key IS NULL) = (on_cooldown IS NULL)
            AND (on_cooldown IS NULL OR on_cooldown IN ('wait', 'suppress'))
            AND (cooldown IS NULL OR cooldown > interval '0')) NOT VALID
        """
    )
    op.execute("ALTER TABLE outbox_message VALIDATE CONSTRAINT outbox_message_cooldown_check")
    op.execute(
        """
        CREATE TABLE outbox_cooldown (
            channel      text        NOT NULL CHECK (channel ~ '^[a-z][a-z0-9_-]{0,63}$'),
            cooldown_key text        NOT NULL,
            message_id   bigint      NOT NULL,
            until        timestamptz,
            taken_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (channel, cooldown_key)
        )
        """
    )
    # The reaper removes the rows whose window ended (oldest first).
    op.execute("CREATE INDEX outbox_cooldown_until ON outbox_cooldown (until)")
    op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_cooldown TO {relay}")
    op.execute("ANALYZE outbox_cooldown")

    op.execute(f"DROP FUNCTION {schema}.outbox_enqueue{_ENQUEUE_ARGUMENTS}")
    op.execute(m9._in(schema, _enqueue_core()))
    op.execute(
        f"ALTER FUNCTION {schema}.outbox_enqueue_many{_ENQUEUE_MANY_ARGUMENTS} "
        "RENAME TO outbox_enqueue_many_core"
    )
    op.execute(m9._in(schema, COOLDOWN_PROBLEM))
    op.execute(m9._in(schema, ENQUEUE))
    op.execute(m9._in(schema, ENQUEUE_MANY))
    # Only the doors are the producers': the cores and the check are the owner's.
    for function in (
        f"outbox_enqueue_core{_ENQUEUE_ARGUMENTS}",
        f"outbox_enqueue_many_core{_ENQUEUE_MANY_ARGUMENTS}",
        "outbox_cooldown_problem(interval, text, text)",
    ):
        op.execute(f"REVOKE ALL ON FUNCTION {schema}.{function} FROM PUBLIC, {producer}")
    for door in (ENQUEUE_SIGNATURE, ENQUEUE_MANY_SIGNATURE):
        op.execute(f"REVOKE ALL ON FUNCTION {schema}.{door} FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {schema}.{door} TO {producer}")


def downgrade() -> None:
    m9 = _m9()
    schema, producer = m9.install_schema(), m9.producer_role()
    op.execute(f"DROP FUNCTION {schema}.{ENQUEUE_MANY_SIGNATURE}")
    op.execute(f"DROP FUNCTION {schema}.{ENQUEUE_SIGNATURE}")
    op.execute(f"DROP FUNCTION {schema}.outbox_cooldown_problem(interval, text, text)")
    op.execute(f"DROP FUNCTION {schema}.outbox_enqueue_core{_ENQUEUE_ARGUMENTS}")
    op.execute(m9._in(schema, m9.ENQUEUE))
    op.execute(
        f"ALTER FUNCTION {schema}.outbox_enqueue_many_core{_ENQUEUE_MANY_ARGUMENTS} "
        "RENAME TO outbox_enqueue_many"
    )
    for door in (_ENQUEUE_ARGUMENTS, _ENQUEUE_MANY_ARGUMENTS):
        name = "outbox_enqueue_many" if door is _ENQUEUE_MANY_ARGUMENTS else "outbox_enqueue"
        op.execute(f"REVOKE ALL ON FUNCTION {schema}.{name}{door} FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {schema}.{name}{door} TO {producer}")
    op.execute("DROP TABLE outbox_cooldown")
    op.execute("ALTER TABLE outbox_message DROP CONSTRAINT outbox_message_cooldown_check")
    op.execute(
        "ALTER TABLE outbox_message DROP COLUMN cooldown_key, DROP COLUMN cooldown, "
        "DROP COLUMN on_cooldown"
    )
