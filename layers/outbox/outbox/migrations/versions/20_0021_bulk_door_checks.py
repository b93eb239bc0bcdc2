"""The bulk door checks what the single one does (issue 31, item 6).

``outbox_enqueue_many`` trusted its caller to have run the Python checks:
called by hand it stored a built-in channel's payload without its required
fields (an email without ``from``) and registered every channel it was given
(2,000 invented ones in one call). It now checks the built-in channels'
fields as ``outbox_enqueue`` does (required, kind, no unknown key, email's
text or html), and registers a channel it does not know only while the
registry holds fewer than 256 (a deployment has a handful; past that,
register one by hand with ``INSERT INTO outbox_channel``). A refusal is the
door's usual answer: the first refused row's ordinal, field and problem,
and nothing written.

Like 0017, this edits the installed definition (read with
``pg_get_functiondef``); offline (``outbox migrate --sql``) it cannot, and
says so.

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import context, op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

_ANCHOR = (
    "    -- Python checked these channels against its registry: SQL producers may use them too\n"
)
# The most channels the bulk door registers on its own (built-ins included).
REGISTRY_LIMIT = 256
_CHECKS = f"""    -- (0021) A call by hand runs no Python: the built-in channels' fields
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
          > {REGISTRY_LIMIT}
    ORDER BY n.ord LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint, NULL::bigint,
            'channel', 'is not a registered channel (outbox_channel), and the bulk door '
                       'registers no more than {REGISTRY_LIMIT}: register it with '
                       'INSERT INTO outbox_channel';
        RETURN;
    END IF;
    -- Python checked these channels against its registry: SQL producers may use them too
    -- (0021: the registry not full)
"""

_DEFINITION = """
    SELECT pg_catalog.pg_get_functiondef(p.oid)
    FROM pg_catalog.pg_proc AS p
    WHERE p.pronamespace = pg_catalog.current_schema()::pg_catalog.regnamespace
      AND p.proname = 'outbox_enqueue_many_core'
"""


def upgrade() -> None:
    if context.is_offline_mode():
        op.execute(
            "-- 0021: edits outbox_enqueue_many_core's installed definition (the bulk "
            "door's checks); it reads the database, so this script cannot: apply "
            "revision 0021 with `outbox migrate` (online) rather than from this script"
        )
        return
    connection = op.get_bind()
    definition = connection.execute(sa.text(_DEFINITION)).scalar_one()
    if _ANCHOR not in definition:
        raise RuntimeError(
            "outbox_enqueue_many_core is not the definition migration 0017 left: "
            "it was changed by hand; restore it (downgrade and upgrade) and migrate again"
        )
    connection.exec_driver_sql(definition.replace(_ANCHOR, _CHECKS))


def downgrade() -> None:
    if context.is_offline_mode():
        return
    connection = op.get_bind()
    definition = connection.execute(sa.text(_DEFINITION)).scalar_one()
    connection.exec_driver_sql(definition.replace(_CHECKS, _ANCHOR))
