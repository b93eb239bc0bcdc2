"""Settled rows apart from the hot path (issue 30): ``outbox_message`` becomes
a table partitioned by status.

* ``outbox_message_live``: ``pending`` and ``claimed``, the only rows the
  claim, the receipt, the settle and the reaper's lease steps read; it keeps
  the due, lease and expiry indexes and the churn settings.
* ``outbox_message_unresolved``: ``failed``, ``dead`` and ``expired``, the
  rows that wait for an operator (few; pruned row by row after
  UNRESOLVED_RETENTION_DAYS, never by default). Their ordering keys still
  hold successors, so it keeps the ordering index.
* ``outbox_message_resolved``: every other final state, partitioned by
  ``settled_at``, one partition a UTC day (``outbox_message_resolved_pYYYYMMDD``),
  with a default partition for a settle no day partition covers. Retention
  drops whole days (``outbox_drop_history_before``), a few kilobytes of WAL,
  and gives the disk back; ``outbox_make_history_partitions`` keeps days ahead
  (the reaper calls it each run, migrate at the head).

A settle is an UPDATE that Postgres turns into a move between partitions,
in the same statement: a row is never in two places or in none. The name
``outbox_message`` stays the one to read, hot or settled.

An existing table is not copied: its settled rows stay where they are and the
table becomes the partition of every resolved row settled before the upgrade
(``outbox_message_resolved_before_0018``, pruned row by row until its whole
range is past the retention, then dropped), after its live and unresolved rows
(a backlog, the dead: few) moved out. The upgrade holds the table for that
move, one CHECK scan and one index build of the settled rows (docs/how-to/database.md
gives the time for 1M rows).

Revision ID: 0018
Revises: 0017
"""

from alembic import op

from outbox.migrations import revision_module

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

LIVE = ("pending", "claimed")
UNRESOLVED = ("failed", "dead", "expired")
RESOLVED = ("delivered", "suppressed", "cancelled", "bounced", "complained")
# The outcome events as the 0016 trigger wrote them, by the partition a row
# arrives in (a move between partitions fires INSERT triggers, not UPDATE).
RESOLVED_EVENTS = ("bounced", "complained", "suppressed")
EVENTS = (*UNRESOLVED, *RESOLVED_EVENTS)

LEGACY = "outbox_message_resolved_before_0018"
# How many UTC days ahead of today the relay keeps partitions made.
DAYS_AHEAD = 2


def _list(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


# The hot path's indexes, as 0001-0013 made them, now of the live rows only.
LIVE_INDEXES = (
    "CREATE INDEX outbox_message_due ON outbox_message_live (priority DESC, available_at, id) "
    "WHERE status = 'pending'",
    "CREATE INDEX outbox_message_due_by_channel ON outbox_message_live "
    "(channel, priority DESC, available_at, id) WHERE status = 'pending'",
    "CREATE INDEX outbox_message_due_by_destination ON outbox_message_live "
    "(channel, destination, priority DESC, available_at, id) WHERE status = 'pending'",
    "CREATE INDEX outbox_message_expiry ON outbox_message_live (expires_at) "
    "WHERE status = 'pending' AND expires_at IS NOT NULL",
    "CREATE INDEX outbox_message_lease ON outbox_message_live (lease_expires_at) "
    "WHERE status = 'claimed'",
    "CREATE INDEX outbox_message_live_ordering ON outbox_message_live (ordering_key, id) "
    "WHERE ordering_key IS NOT NULL",
    "CREATE INDEX outbox_message_live_email_provider_id ON outbox_message_live "
    "(provider_message_id) WHERE channel = 'email' AND provider_message_id IS NOT NULL",
)
UNRESOLVED_INDEXES = (
    "CREATE INDEX outbox_message_unresolved_ordering ON outbox_message_unresolved "
    "(ordering_key, id) WHERE ordering_key IS NOT NULL",
    "CREATE INDEX outbox_message_unresolved_email_provider_id ON outbox_message_unresolved "
    "(provider_message_id) WHERE channel = 'email' AND provider_message_id IS NOT NULL",
    "CREATE INDEX outbox_message_unresolved_settled ON outbox_message_unresolved "
    "(status, settled_at)",
)
# Of the partitioned history, so every day partition gets them: a message by
# id (show, redrive, uncancel), SES feedback by provider id (a bounce days
# later: one index probe a day kept), the listing by status and time.
RESOLVED_INDEXES = (
    "CREATE INDEX outbox_message_resolved_id ON outbox_message_resolved (id)",
    "CREATE INDEX outbox_message_resolved_email_provider_id ON outbox_message_resolved "
    "(provider_message_id) WHERE channel = 'email' AND provider_message_id IS NOT NULL",
    "CREATE INDEX outbox_message_resolved_settled ON outbox_message_resolved (status, settled_at)",
)

# Kept ahead by the reaper (it runs as the relay's role, which may not create
# tables: hence SECURITY DEFINER, pinned path, built-ins named pg_catalog.*).
# A day partition is made detached and then attached: ATTACH takes a lock the
# relay's reads and writes do not wait for, where CREATE ... PARTITION OF
# would take the whole table; rows the default partition caught for that day
# move in first.
MAKE_PARTITIONS = """
CREATE FUNCTION outbox_make_history_partitions(p_days_ahead integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = {schema}, pg_temp
SET lock_timeout = '5s'
AS $fn$
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
$fn$
"""

# Retention: every history partition whose whole range ends by p_before goes,
# by DROP (no row by row DELETE: a few kilobytes of WAL, the disk given back).
# The default partition is never dropped (store.prune deletes its old rows).
# Returns each partition dropped and the rows it held (``p_dry_run``: each
# one it would drop, dropping none).
DROP_PARTITIONS = """
CREATE FUNCTION outbox_drop_history_before(p_before timestamptz, p_dry_run boolean DEFAULT false)
RETURNS TABLE(partition_name text, rows bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = {schema}, pg_temp
SET lock_timeout = '5s'
AS $fn$
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
$fn$
"""

# The history's partitions and the end of each one's range (the default has
# none: it is left out).
HISTORY_PARTITIONS = """
CREATE FUNCTION outbox_history_partitions()
RETURNS TABLE(name text, upper_bound timestamptz)
LANGUAGE sql STABLE
SET search_path = {schema}, pg_temp
AS $fn$
    SELECT c.relname::text,
           CAST(pg_catalog.substring(pg_catalog.pg_get_expr(c.relpartbound, c.oid),
                                     'TO \\(''([^'']*)''\\)') AS timestamptz)
    FROM pg_catalog.pg_inherits AS i
    JOIN pg_catalog.pg_class AS c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'outbox_message_resolved'::pg_catalog.regclass
      AND pg_catalog.pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT'
$fn$
"""

# The outcome events, now by where a row arrives: a status change inside a
# partition fires the UPDATE trigger (as before); a settle, which moves the
# row into the history, fires the history's INSERT triggers.
TRIGGERS = (
    "CREATE TRIGGER outbox_message_destination BEFORE INSERT ON outbox_message_live "
    "FOR EACH ROW EXECUTE FUNCTION outbox_message_set_destination()",
    "CREATE TRIGGER outbox_message_outcome_event AFTER UPDATE OF status ON outbox_message "
    "FOR EACH ROW WHEN (NEW.status IS DISTINCT FROM OLD.status "
    f"AND NEW.status IN ({_list(EVENTS)})) EXECUTE FUNCTION outbox_record_outcome_event()",
    "CREATE TRIGGER outbox_message_settled_event AFTER INSERT ON outbox_message_unresolved "
    "FOR EACH ROW EXECUTE FUNCTION outbox_record_outcome_event()",
    "CREATE TRIGGER outbox_message_settled_event AFTER INSERT ON outbox_message_resolved "
    f"FOR EACH ROW WHEN (NEW.status IN ({_list(RESOLVED_EVENTS)})) "
    "EXECUTE FUNCTION outbox_record_outcome_event()",
    # switched on and off by `outbox migrate` (OUTCOME_EVENTS_DELIVERED)
    "CREATE TRIGGER outbox_message_delivered_event AFTER INSERT ON outbox_message_resolved "
    "FOR EACH ROW WHEN (NEW.status = 'delivered') EXECUTE FUNCTION outbox_record_outcome_event()",
)


def relay_role() -> str:
    return str(revision_module("0003").relay_role())


def install_schema() -> str:
    return str(revision_module("0009").install_schema())


def upgrade() -> None:
    schema = install_schema()
    op.execute("LOCK TABLE outbox_message IN ACCESS EXCLUSIVE MODE")
    op.execute(f"ALTER TABLE outbox_message RENAME TO {LEGACY}")
    for trigger in (
        "outbox_message_destination",
        "outbox_message_outcome_event",
        "outbox_message_delivered_event",
    ):
        op.execute(f"DROP TRIGGER {trigger} ON {LEGACY}")
    # Its live indexes hold nothing once the live rows have moved out.
    for index in (
        "outbox_message_due",
        "outbox_message_due_by_channel",
        "outbox_message_due_by_destination",
        "outbox_message_expiry",
        "outbox_message_lease",
        "outbox_message_ordering",
    ):
        op.execute(f"DROP INDEX {index}")
    op.execute(f"ALTER TABLE {LEGACY} RENAME CONSTRAINT outbox_message_pkey TO {LEGACY}_pkey")
    op.execute(f"ALTER INDEX outbox_message_email_provider_id RENAME TO {LEGACY}_email_provider_id")
    op.execute(f"ALTER INDEX outbox_message_settled RENAME TO {LEGACY}_settled")

    op.execute(
        f"CREATE TABLE outbox_message (LIKE {LEGACY} INCLUDING DEFAULTS INCLUDING CONSTRAINTS) "
        "PARTITION BY LIST (status)"
    )
    # Whoever could read or write the table can, by its name, still.
    op.execute(
        f"""
        DO $$
        DECLARE g record;
        BEGIN
            FOR g IN
                SELECT grantee, pg_catalog.string_agg(privilege_type, ', ') AS privileges
                FROM information_schema.role_table_grants
                WHERE table_schema = pg_catalog.current_schema()
                  AND table_name = '{LEGACY}'
                  AND grantee <> current_user
                GROUP BY grantee
            LOOP
                EXECUTE 'GRANT ' || g.privileges || ' ON outbox_message TO '
                    || pg_catalog.quote_ident(g.grantee);
            END LOOP;
        END
        $$
        """
    )
    op.execute(
        "CREATE TABLE outbox_message_live PARTITION OF outbox_message "
        f"(PRIMARY KEY (id)) FOR VALUES IN ({_list(LIVE)}) "
        "WITH (fillfactor = 90, autovacuum_vacuum_scale_factor = 0.01, "
        "autovacuum_vacuum_threshold = 1000, autovacuum_analyze_scale_factor = 0.02, "
        "autovacuum_vacuum_cost_delay = 0)"
    )
    op.execute(
        "CREATE TABLE outbox_message_unresolved PARTITION OF outbox_message "
        f"(PRIMARY KEY (id)) FOR VALUES IN ({_list(UNRESOLVED)})"
    )
    op.execute(
        "CREATE TABLE outbox_message_resolved PARTITION OF outbox_message "
        f"FOR VALUES IN ({_list(RESOLVED)}) PARTITION BY RANGE (settled_at)"
    )
    op.execute(
        "CREATE TABLE outbox_message_resolved_default PARTITION OF outbox_message_resolved DEFAULT"
    )
    for index in (*LIVE_INDEXES, *UNRESOLVED_INDEXES, *RESOLVED_INDEXES):
        op.execute(index)

    # The live and unresolved rows move; the settled rest stays in place.
    for target, statuses in (
        ("outbox_message_live", LIVE),
        ("outbox_message_unresolved", UNRESOLVED),
    ):
        op.execute(
            f"WITH moved AS (DELETE FROM {LEGACY} WHERE status IN ({_list(statuses)}) "
            f"RETURNING *) INSERT INTO {target} SELECT * FROM moved"
        )
    # The rows settled before now are the partition [-infinity, now) of the
    # history; a CHECK that says so spares ATTACH its own scan. None (a new
    # install): the table goes.
    op.execute(
        f"""
        DO $$
        DECLARE
            upgraded_at timestamptz := pg_catalog.now();
            last_id bigint;
            called boolean;
        BEGIN
            SELECT last_value, is_called INTO last_id, called FROM outbox_message_id_seq;
            ALTER TABLE {LEGACY} ALTER COLUMN id DROP IDENTITY;
            ALTER TABLE outbox_message ALTER COLUMN id
                ADD GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME outbox_message_id_seq);
            PERFORM pg_catalog.setval('outbox_message_id_seq'::pg_catalog.regclass,
                                      last_id, called);
            IF NOT EXISTS (SELECT 1 FROM {LEGACY}) THEN
                DROP TABLE {LEGACY};
                RETURN;
            END IF;
            EXECUTE 'ALTER TABLE {LEGACY} ADD CONSTRAINT {LEGACY}_range '
                || 'CHECK (status IN ({_list(RESOLVED).replace("'", "''")}) '
                || 'AND settled_at IS NOT NULL AND settled_at < '
                || pg_catalog.quote_literal(upgraded_at) || ')';
            EXECUTE 'ALTER TABLE outbox_message_resolved ATTACH PARTITION {LEGACY} '
                || 'FOR VALUES FROM (MINVALUE) TO ('
                || pg_catalog.quote_literal(upgraded_at) || ')';
        END
        $$
        """
    )
    for trigger in TRIGGERS:
        op.execute(trigger)

    op.execute(HISTORY_PARTITIONS.format(schema=schema))
    op.execute(MAKE_PARTITIONS.format(schema=schema))
    op.execute(DROP_PARTITIONS.format(schema=schema))
    for function in (
        "outbox_history_partitions()",
        "outbox_make_history_partitions(integer)",
        "outbox_drop_history_before(timestamptz, boolean)",
    ):
        op.execute(f"REVOKE ALL ON FUNCTION {schema}.{function} FROM PUBLIC")
        op.execute(f"GRANT EXECUTE ON FUNCTION {schema}.{function} TO {relay_role()}")
    # The rows a day partition did not catch are pruned row by row, by the relay.
    op.execute(f"GRANT SELECT, UPDATE, DELETE ON outbox_message_resolved_default TO {relay_role()}")
    # Today's partition starts where the rows kept in place end.
    op.execute(_TODAY_FROM_UPGRADE)
    op.execute(f"SELECT outbox_make_history_partitions({DAYS_AHEAD})")


# When the rows kept in place end today (an upgrade), today's partition takes
# the rest of the day; on a new install it is the whole day, made by the
# function like any other.
_TODAY_FROM_UPGRADE = f"""
DO $$
DECLARE
    kept_until timestamptz := (SELECT b.upper_bound FROM outbox_history_partitions() AS b
                               WHERE b.name = '{LEGACY}');
    tomorrow timestamptz := ((pg_catalog.now() AT TIME ZONE 'UTC')::date + 1)::timestamp
                            AT TIME ZONE 'UTC';
    name text := 'outbox_message_resolved_p'
                 || pg_catalog.to_char((pg_catalog.now() AT TIME ZONE 'UTC')::date, 'YYYYMMDD');
BEGIN
    IF kept_until IS NOT NULL THEN
        EXECUTE 'CREATE TABLE ' || pg_catalog.quote_ident(name)
            || ' PARTITION OF outbox_message_resolved FOR VALUES FROM ('
            || pg_catalog.quote_literal(kept_until) || ') TO ('
            || pg_catalog.quote_literal(tomorrow) || ')';
    END IF;
END
$$
"""


def downgrade() -> None:
    """Back to one table: every row, hot and settled, in ``outbox_message``
    again (a copy: as long as the upgrade of a full table would take)."""
    schema = install_schema()
    for function in (
        "outbox_drop_history_before(timestamptz, boolean)",
        "outbox_make_history_partitions(integer)",
        "outbox_history_partitions()",
    ):
        op.execute(f"DROP FUNCTION {schema}.{function}")
    op.execute("LOCK TABLE outbox_message IN ACCESS EXCLUSIVE MODE")
    op.execute("ALTER TABLE outbox_message RENAME TO outbox_message_partitioned")
    op.execute(
        "CREATE TABLE outbox_message (LIKE outbox_message_partitioned "
        "INCLUDING DEFAULTS INCLUDING CONSTRAINTS) "
        "WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, "
        "autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0, "
        "fillfactor = 90)"
    )
    op.execute("INSERT INTO outbox_message SELECT * FROM outbox_message_partitioned ORDER BY id")
    op.execute(
        """
        DO $$
        DECLARE
            last_id bigint;
            called boolean;
            g record;
        BEGIN
            SELECT last_value, is_called INTO last_id, called FROM outbox_message_id_seq;
            FOR g IN
                SELECT grantee, pg_catalog.string_agg(privilege_type, ', ') AS privileges
                FROM information_schema.role_table_grants
                WHERE table_schema = pg_catalog.current_schema()
                  AND table_name = 'outbox_message_partitioned' AND grantee <> current_user
                GROUP BY grantee
            LOOP
                EXECUTE 'GRANT ' || g.privileges || ' ON outbox_message TO '
                    || pg_catalog.quote_ident(g.grantee);
            END LOOP;
            DROP TABLE outbox_message_partitioned;
            ALTER TABLE outbox_message ALTER COLUMN id
                ADD GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME outbox_message_id_seq);
            PERFORM pg_catalog.setval('outbox_message_id_seq'::pg_catalog.regclass,
                                      last_id, called);
        END
        $$
        """
    )
    op.execute("ALTER TABLE outbox_message ADD PRIMARY KEY (id)")
    for index in (
        "CREATE INDEX outbox_message_due ON outbox_message (priority DESC, available_at, id) "
        "WHERE status = 'pending'",
        "CREATE INDEX outbox_message_due_by_channel ON outbox_message "
        "(channel, priority DESC, available_at, id) WHERE status = 'pending'",
        "CREATE INDEX outbox_message_due_by_destination ON outbox_message "
        "(channel, destination, priority DESC, available_at, id) WHERE status = 'pending'",
        "CREATE INDEX outbox_message_email_provider_id ON outbox_message (provider_message_id) "
        "WHERE channel = 'email' AND provider_message_id IS NOT NULL",
        "CREATE INDEX outbox_message_expiry ON outbox_message (expires_at) "
        "WHERE status = 'pending' AND expires_at IS NOT NULL",
        "CREATE INDEX outbox_message_lease ON outbox_message (lease_expires_at) "
        "WHERE status = 'claimed'",
        "CREATE INDEX outbox_message_ordering ON outbox_message (ordering_key, id) "
        "WHERE ordering_key IS NOT NULL AND status IN "
        "('pending', 'claimed', 'failed', 'dead', 'expired')",
        "CREATE INDEX outbox_message_settled ON outbox_message (status, settled_at) "
        "WHERE settled_at IS NOT NULL",
    ):
        op.execute(index)
    op.execute(
        "CREATE TRIGGER outbox_message_destination BEFORE INSERT ON outbox_message "
        "FOR EACH ROW EXECUTE FUNCTION outbox_message_set_destination()"
    )
    op.execute(
        "CREATE TRIGGER outbox_message_outcome_event AFTER UPDATE OF status ON outbox_message "
        "FOR EACH ROW WHEN (NEW.status IS DISTINCT FROM OLD.status "
        f"AND NEW.status IN ({_list(EVENTS)})) EXECUTE FUNCTION outbox_record_outcome_event()"
    )
    op.execute(
        "CREATE TRIGGER outbox_message_delivered_event AFTER UPDATE OF status ON outbox_message "
        "FOR EACH ROW WHEN (NEW.status = 'delivered' AND OLD.status IS DISTINCT FROM 'delivered') "
        "EXECUTE FUNCTION outbox_record_outcome_event()"
    )
