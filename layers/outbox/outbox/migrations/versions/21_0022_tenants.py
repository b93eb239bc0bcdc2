"""Tenants (issue 33): a tenant on every message, keys that are a tenant's own,
credentials per tenant, a producer role bound to one tenant, and what the
claim's fair share and an operator's pause read.

* ``outbox_message.tenant``: a short text, ``''`` for none (the single-tenant
  relay of before, whose producers change nothing). The doors check its
  form (1 to 64 letters, digits, ``.``, ``_``, ``:``, ``-``, starting with a
  letter or digit); a fast default, so adding it rewrites nothing.
* ``outbox_message_due_by_tenant``: the due rows of the live partition in
  claim order per tenant, which the claim's fair share reads one tenant at a
  time (store/delivery.py).
* Dedupe keys, cooldown keys and ordering keys are scoped by tenant: the
  tenant joins ``outbox_dedupe``'s and ``outbox_cooldown``'s primary keys
  (last, so every lookup by the old prefix keeps its index), and the
  ordering-key lock of the doors names the tenant.
* ``outbox_tenant``: what an operator set for a tenant (its weight in the
  claim's fair share, a pause). A tenant without a row has weight 1.
* ``outbox_tenant_role``: a producer's database role bound to one tenant (by
  the role the connection logged in as, ``SESSION_USER``): the doors write
  that tenant for it, and refuse a message that names another.
* ``outbox_tenant_secret``: the webhook signing secrets mapped to a tenant.
  A message of a tenant may name only its tenant's secrets; a message without
  a tenant only secrets mapped to none. The doors refuse any other, and the
  sender fails a row that no longer passes (a mapping changed after it was
  written) rather than sign it with another tenant's key.
* Outcome events carry the message's tenant (``outbox_outcome_event.tenant``).
* ``outbox_tenant_turn``: one row, the tenant the last fair share ended at,
  so that with more tenants than one claim serves, the next claim starts
  after it.

The doors ``outbox_enqueue(..., tenant)`` and ``outbox_enqueue_many(...,
p_tenant, p_tenants)`` take the tenant with defaults (NULL: the bound one, or
none), so every existing call keeps working. Like 0021 this edits the
installed definitions (read with ``pg_get_functiondef``); offline
(``outbox migrate --sql``) the script makes the tables, columns and keys but
cannot edit the doors, and says so (the doors then take no tenant argument
and write none; apply 0022 with ``outbox migrate`` to have them).

Revision ID: 0022
Revises: 0021
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

from outbox.migrations import revision_module

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# What a tenant's name may be (the doors and the CLI check it).
TENANT_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
TENANT_RULE = (
    "must be 1 to 64 letters, digits, dots, underscores, colons or hyphens, "
    "starting with a letter or digit"
)

_PIN = "SET search_path = @, pg_temp"

# The tenant of each message of a call: the role's bound tenant, or the ones
# given (NULL: none, ''), checked. A refusal is the door's usual answer: the
# first refused message's ordinal, field and problem.
ENQUEUE_TENANTS = f"""
CREATE FUNCTION @.outbox_enqueue_tenants(p_tenant text, p_tenants text[], p_count integer)
RETURNS TABLE (tenants text[], ord bigint, field text, problem text)
LANGUAGE plpgsql STABLE {_PIN} AS $$
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
    WHERE g.t IS NOT NULL AND g.t <> '' AND g.t !~ '{TENANT_PATTERN}'
    ORDER BY g.ord LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT NULL::text[], bad, 'tenant'::text, '{TENANT_RULE}'::text;
        RETURN;
    END IF;
    RETURN QUERY SELECT ARRAY(SELECT COALESCE(g.t, '')
                              FROM pg_catalog.unnest(given) WITH ORDINALITY AS g(t, ord)
                              ORDER BY g.ord),
                        NULL::bigint, NULL::text, NULL::text;
END
$$"""

# Whether a message may not be signed with the secret its payload names: a
# tenant's message only with its tenant's secrets, a message without a
# tenant only with secrets mapped to none. The doors and the sender's
# receipt ask it.
SECRET_REFUSED = """
CREATE FUNCTION @.outbox_secret_refused(p_tenant text, p_channel text, p_payload jsonb)
RETURNS boolean
LANGUAGE sql STABLE {pin} AS $$
    SELECT p_channel = 'webhook'
       AND pg_catalog.jsonb_typeof(p_payload -> 'secret_id') = 'string'
       AND (SELECT s.tenant FROM outbox_tenant_secret AS s
            WHERE s.secret_id = p_payload ->> 'secret_id')
           IS DISTINCT FROM NULLIF(p_tenant, '')
$$""".replace("{pin}", _PIN)

_ON_FAILURE = (
    "    p_on_failure text := COALESCE(outbox_enqueue_core.on_predecessor_failure, 'hold');\n"
)
_SECRET_PROBLEM = "is not a signing secret of this message''s tenant (outbox tenant secret)"  # noqa: S105 (a message)

# (function, the edits of its installed definition: (old, new, how many times))
_TAKE_DEDUPE_KEY = (
    "outbox_take_dedupe_key",
    "(text, text, jsonb, bigint)",
    [
        ("p_new_id bigint)", "p_new_id bigint, p_tenant text DEFAULT ''::text)", 1),
        (
            "recipient_fingerprint, payload_digest, message_id)",
            "recipient_fingerprint, payload_digest, message_id, tenant)",
            1,
        ),
        ("v_digest, p_new_id)", "v_digest, p_new_id, p_tenant)", 1),
        (
            "AND d.recipient_fingerprint = v_fingerprint;",
            "AND d.recipient_fingerprint = v_fingerprint AND d.tenant = p_tenant;",
            1,
        ),
    ],
)
_ENQUEUE_CORE = (
    "outbox_enqueue_core",
    "(text, jsonb, text, text, integer, interval, integer, timestamptz, interval, text)",
    [
        (
            "on_predecessor_failure text DEFAULT 'hold'::text)",
            "on_predecessor_failure text DEFAULT 'hold'::text, tenant text DEFAULT ''::text)",
            1,
        ),
        (
            _ON_FAILURE,
            _ON_FAILURE + "    p_tenant text := COALESCE(outbox_enqueue_core.tenant, '');\n",
            1,
        ),
        (
            "'outbox-ordering-key:' || p_ordering",
            "'outbox-ordering-key:' || p_tenant || '/' || p_ordering",
            1,
        ),
        (
            "outbox_take_dedupe_key(p_channel, p_dedupe, p_payload, new_id)",
            "outbox_take_dedupe_key(p_channel, p_dedupe, p_payload, new_id, p_tenant)",
            1,
        ),
        (
            "expires_at, on_predecessor_failure, recipient_fingerprints)",
            "expires_at, on_predecessor_failure, recipient_fingerprints, tenant)",
            1,
        ),
        (
            "outbox_recipient_fingerprints(p_channel, p_payload));",
            "outbox_recipient_fingerprints(p_channel, p_payload), p_tenant);",
            1,
        ),
    ],
)
_ENQUEUE_MANY_CORE = (
    "outbox_enqueue_many_core",
    "(text[], jsonb, text[], text[], integer[], double precision[], integer[], timestamptz[],"
    " double precision[], text[])",
    [
        (
            "p_on_predecessor_failure text[])\n",
            "p_on_predecessor_failure text[], p_tenants text[] DEFAULT NULL::text[])\n",
            1,
        ),
        (
            "        pg_catalog.unnest(p_on_predecessor_failure)\n"
            "    ) WITH ORDINALITY AS i(channel, payload, dedupe_key, ordering_key, priority,\n"
            "                           delay_s, max_attempts, expires_at, ttl_s,"
            " on_predecessor_failure, ord)",
            "        pg_catalog.unnest(p_on_predecessor_failure), pg_catalog.unnest(p_tenants)\n"
            "    ) WITH ORDINALITY AS i(channel, payload, dedupe_key, ordering_key, priority,\n"
            "                           delay_s, max_attempts, expires_at, ttl_s,"
            " on_predecessor_failure, tenant, ord)",
            3,
        ),
        (
            "(SELECT DISTINCT k FROM pg_catalog.unnest(p_ordering_keys) AS u(k)\n"
            "          WHERE k IS NOT NULL ORDER BY k)",
            "(SELECT DISTINCT COALESCE(u.t, '') || '/' || u.o AS k\n"
            "          FROM ROWS FROM (pg_catalog.unnest(p_ordering_keys),"
            " pg_catalog.unnest(p_tenants)) AS u(o, t)\n"
            "          WHERE u.o IS NOT NULL ORDER BY k)",
            1,
        ),
        (
            "                                        recipient_fingerprints)\n"
            "            SELECT i.channel,",
            "                                        recipient_fingerprints, tenant)\n"
            "            SELECT i.channel,",
            1,
        ),
        (
            "ORDER BY a)\n            FROM ",
            "ORDER BY a), COALESCE(i.tenant, '')\n            FROM ",
            1,
        ),
        (
            "            SELECT DISTINCT ON (channel, dedupe_key, fingerprint)\n"
            "                   ord, new_id, channel, dedupe_key, fingerprint, digest\n"
            "            FROM input WHERE dedupe_key IS NOT NULL\n"
            "            ORDER BY channel, dedupe_key, fingerprint, ord",
            "            SELECT DISTINCT ON (tenant, channel, dedupe_key, fingerprint)\n"
            "                   ord, new_id, COALESCE(tenant, '') AS tenant, channel, dedupe_key,"
            " fingerprint, digest\n"
            "            FROM input WHERE dedupe_key IS NOT NULL\n"
            "            ORDER BY tenant, channel, dedupe_key, fingerprint, ord",
            1,
        ),
        (
            "AND d.recipient_fingerprint = k.fingerprint",
            "AND d.recipient_fingerprint = k.fingerprint AND d.tenant = k.tenant",
            1,
        ),
        (
            "AND k.fingerprint = i.fingerprint",
            "AND k.fingerprint = i.fingerprint AND k.tenant = COALESCE(i.tenant, '')",
            2,
        ),
        (
            "recipient_fingerprint, payload_digest, message_id)",
            "recipient_fingerprint, payload_digest, message_id, tenant)",
            1,
        ),
        (
            "k.digest, k.new_id FROM keyed AS k",
            "k.digest, k.new_id, k.tenant FROM keyed AS k",
            1,
        ),
        (
            "on_predecessor_failure, recipient_fingerprints)\n            OVERRIDING SYSTEM VALUE",
            "on_predecessor_failure, recipient_fingerprints, tenant)\n"
            "            OVERRIDING SYSTEM VALUE",
            1,
        ),
        (
            "                   recipient_fingerprints\n            FROM input AS i",
            "                   recipient_fingerprints, COALESCE(i.tenant, '')\n"
            "            FROM input AS i",
            1,
        ),
        (
            "RETURNING m.id, m.channel, m.dedupe_key, m.payload\n",
            "RETURNING m.id, m.channel, m.dedupe_key, m.payload, m.tenant\n",
            1,
        ),
        (
            "WHERE d.channel = g.channel AND d.dedupe_key = g.dedupe_key",
            "WHERE d.channel = g.channel AND d.dedupe_key = g.dedupe_key AND d.tenant = g.tenant",
            1,
        ),
    ],
)
_ENQUEUE = (
    "outbox_enqueue",
    "(text, jsonb, text, text, integer, interval, integer, timestamptz, interval, text,"
    " interval, text, text)",
    [
        (
            "on_cooldown text DEFAULT 'wait'::text)",
            "on_cooldown text DEFAULT 'wait'::text, tenant text DEFAULT NULL::text)",
            1,
        ),
        ("    new_id bigint;\n", "    new_id bigint;\n    p_tenant text;\n", 1),
        (
            "        PERFORM outbox_enqueue_refuse(f.field, f.problem);\n    END IF;\n",
            "        PERFORM outbox_enqueue_refuse(f.field, f.problem);\n    END IF;\n"
            "    -- (0022) the tenant: the role's bound one, or the one given, checked\n"
            "    SELECT * INTO f FROM outbox_enqueue_tenants(outbox_enqueue.tenant, NULL, 1);\n"
            "    IF f.field IS NOT NULL THEN\n"
            "        PERFORM outbox_enqueue_refuse(f.field, f.problem);\n"
            "    END IF;\n"
            "    p_tenant := (f.tenants)[1];\n"
            "    IF outbox_secret_refused(p_tenant, outbox_enqueue.channel,"
            " outbox_enqueue.payload) THEN\n"
            f"        PERFORM outbox_enqueue_refuse('payload.secret_id', '{_SECRET_PROBLEM}');\n"
            "    END IF;\n",
            1,
        ),
        (
            "outbox_enqueue.ttl, outbox_enqueue.on_predecessor_failure);",
            "outbox_enqueue.ttl, outbox_enqueue.on_predecessor_failure, p_tenant);",
            1,
        ),
    ],
)
_ENQUEUE_MANY = (
    "outbox_enqueue_many",
    "(text[], jsonb, text[], text[], integer[], double precision[], integer[], timestamptz[],"
    " double precision[], text[], double precision[], text[], text[])",
    [
        (
            "p_on_cooldown text[] DEFAULT NULL::text[])\n",
            "p_on_cooldown text[] DEFAULT NULL::text[], p_tenant text DEFAULT NULL::text,"
            " p_tenants text[] DEFAULT NULL::text[])\n",
            1,
        ),
        ("    result jsonb;\n", "    result jsonb;\n    tenants text[];\n", 1),
        (
            "BEGIN\n    IF p_cooldowns IS NULL",
            "BEGIN\n"
            "    -- (0022) each message's tenant: the role's bound one, or the ones given\n"
            "    SELECT * INTO bad FROM outbox_enqueue_tenants(p_tenant, p_tenants,\n"
            "        pg_catalog.cardinality(p_channels));\n"
            "    IF bad.field IS NOT NULL THEN\n"
            "        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint,"
            " NULL::bigint,\n"
            "                            bad.field, bad.problem;\n"
            "        RETURN;\n"
            "    END IF;\n"
            "    tenants := bad.tenants;\n"
            "    SELECT i.ord INTO bad\n"
            "    FROM ROWS FROM (pg_catalog.unnest(p_channels),"
            " pg_catalog.jsonb_array_elements(p_payloads),\n"
            "                    pg_catalog.unnest(tenants)) WITH ORDINALITY AS i(channel,"
            " payload, tenant, ord)\n"
            "    WHERE outbox_secret_refused(i.tenant, i.channel, i.payload)\n"
            "    ORDER BY i.ord LIMIT 1;\n"
            "    IF FOUND THEN\n"
            "        RETURN QUERY SELECT bad.ord, false, NULL::bigint, false, NULL::bigint,"
            " NULL::bigint,\n"
            f"            'payload.secret_id'::text, '{_SECRET_PROBLEM}'::text;\n"
            "        RETURN;\n"
            "    END IF;\n"
            "    IF p_cooldowns IS NULL",
            1,
        ),
        (
            "p_expires_at, p_ttls, p_on_predecessor_failure);",
            "p_expires_at, p_ttls, p_on_predecessor_failure, tenants);",
            1,
        ),
        ("p_on_predecessor_failure) AS r;", "p_on_predecessor_failure, tenants) AS r;", 1),
    ],
)
# The outcome events' triggers write the tenant too (their arguments stay: edited in place).
_RECORD_OUTCOME_EVENT = (
    "outbox_record_outcome_event",
    [
        (
            "provider_message_id, dedupe_key, ordering_key)",
            "provider_message_id, dedupe_key, ordering_key, tenant)",
            1,
        ),
        ("NEW.dedupe_key, NEW.ordering_key);", "NEW.dedupe_key, NEW.ordering_key, NEW.tenant);", 1),
    ],
)
_RECORD_RETRYING_EVENT = (
    "outbox_record_retrying_event",
    [
        ("dedupe_key, ordering_key, retry_at)", "dedupe_key, ordering_key, retry_at, tenant)", 1),
        (
            "NEW.ordering_key, NEW.available_at);",
            "NEW.ordering_key, NEW.available_at, NEW.tenant);",
            1,
        ),
    ],
)
_EDITED_IN_PLACE = (_RECORD_OUTCOME_EVENT, _RECORD_RETRYING_EVENT)
_EDITED = (_TAKE_DEDUPE_KEY, _ENQUEUE_CORE, _ENQUEUE_MANY_CORE, _ENQUEUE, _ENQUEUE_MANY)
_DOORS = {"outbox_enqueue", "outbox_enqueue_many"}

# A function's definition, and who besides its owner may run it (PUBLIC when
# no grant was ever changed, as a new function has).
_DEFINITION = """
    SELECT pg_catalog.pg_get_functiondef(p.oid),
           CASE WHEN p.proacl IS NULL THEN ARRAY['PUBLIC'] ELSE ARRAY(
               SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                           ELSE pg_catalog.quote_ident(CAST(CAST(a.grantee AS regrole) AS text)) END
               FROM pg_catalog.aclexplode(p.proacl) AS a
               WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner) END
    FROM pg_catalog.pg_proc AS p
    WHERE p.pronamespace = pg_catalog.current_schema()::pg_catalog.regnamespace
      AND p.proname = :name
"""


def _edit(definition: str, name: str, edits: list[tuple[str, str, int]]) -> str:
    for old, new, times in edits:
        found = definition.count(old)
        if found != times:
            raise RuntimeError(
                f"{name} is not the definition migration 0021 left ({old[:40]!r} found "
                f"{found} times, not {times}): it was changed by hand; restore it "
                "(downgrade and upgrade) and migrate again"
            )
        definition = definition.replace(old, new)
    return definition


def _replace_functions(edits_of: list[tuple[str, str, list[tuple[str, str, int]]]]) -> None:
    """Each function's installed definition, edited, in place of the old one
    (its arguments change, so a new function, and the old one dropped), with
    the old one's grants (the doors the producers', the rest the owner's)."""
    schema = revision_module("0009").install_schema()
    connection = op.get_bind()
    for name, arguments, edits in edits_of:
        definition, grantees = connection.execute(sa.text(_DEFINITION), {"name": name}).one()
        connection.exec_driver_sql(f"DROP FUNCTION {schema}.{name}{arguments}")
        connection.exec_driver_sql(_edit(definition, name, edits))
        new = f"{schema}.{name}{_arguments(name)}"
        connection.exec_driver_sql(f"REVOKE ALL ON FUNCTION {new} FROM PUBLIC")
        for grantee in grantees:
            connection.exec_driver_sql(f"GRANT EXECUTE ON FUNCTION {new} TO {grantee}")


def _edit_in_place(edits_of: list[tuple[str, list[tuple[str, str, int]]]]) -> None:
    connection = op.get_bind()
    for name, edits in edits_of:
        definition = connection.execute(sa.text(_DEFINITION), {"name": name}).one()[0]
        connection.exec_driver_sql(_edit(definition, name, edits))


def _reversed(edits: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    return [(new, old, times) for old, new, times in reversed(edits)]


def _arguments(name: str) -> str:
    """The argument types of the relay's one function of this name."""
    return (
        "("
        + str(
            op.get_bind()
            .execute(
                sa.text(
                    "SELECT pg_catalog.pg_get_function_identity_arguments(p.oid) "
                    "FROM pg_catalog.pg_proc AS p "
                    "WHERE p.pronamespace = pg_catalog.current_schema()::pg_catalog.regnamespace "
                    "AND p.proname = :name"
                ),
                {"name": name},
            )
            .scalar_one()
        )
        + ")"
    )


def upgrade() -> None:
    m9 = revision_module("0009")
    schema, relay = m9.install_schema(), m9.relay_role()
    op.execute("ALTER TABLE outbox_message ADD COLUMN tenant text NOT NULL DEFAULT ''")
    op.execute(
        "CREATE INDEX outbox_message_due_by_tenant ON outbox_message_live "
        "(tenant, priority DESC, available_at, id) WHERE status = 'pending'"
    )
    for table, key in (
        ("outbox_dedupe", "channel, dedupe_key, recipient_fingerprint"),
        ("outbox_cooldown", "channel, cooldown_key"),
    ):
        op.execute(f"ALTER TABLE {table} ADD COLUMN tenant text NOT NULL DEFAULT ''")
        op.execute(
            f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey, "
            f"ADD CONSTRAINT {table}_pkey PRIMARY KEY ({key}, tenant)"
        )
    op.execute(
        f"""
        CREATE TABLE outbox_tenant (
            tenant     text        PRIMARY KEY CHECK (tenant = '' OR tenant ~ '{TENANT_PATTERN}'),
            weight     integer     NOT NULL DEFAULT 1 CHECK (weight BETWEEN 1 AND 1000),
            paused     boolean     NOT NULL DEFAULT false,
            updated_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE outbox_tenant_role (
            role_name  text        PRIMARY KEY,
            tenant     text        NOT NULL CHECK (tenant ~ '{TENANT_PATTERN}'),
            created_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE outbox_tenant_secret (
            secret_id  text        PRIMARY KEY CHECK (pg_catalog.char_length(secret_id) <= 2048),
            tenant     text        NOT NULL CHECK (tenant ~ '{TENANT_PATTERN}'),
            created_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute("CREATE INDEX outbox_tenant_secret_tenant ON outbox_tenant_secret (tenant)")
    op.execute(
        """
        CREATE TABLE outbox_tenant_turn (
            one    boolean PRIMARY KEY DEFAULT true CHECK (one),
            tenant text    NOT NULL
        )
        """
    )
    op.execute("INSERT INTO outbox_tenant_turn (tenant) VALUES ('')")
    for table in ("outbox_tenant", "outbox_tenant_role", "outbox_tenant_secret"):
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {relay}")
    op.execute(f"GRANT SELECT, UPDATE ON outbox_tenant_turn TO {relay}")
    op.execute(m9._in(schema, ENQUEUE_TENANTS))
    op.execute(m9._in(schema, SECRET_REFUSED))
    op.execute(
        f"REVOKE ALL ON FUNCTION {schema}.outbox_enqueue_tenants(text, text[], integer) FROM PUBLIC"
    )
    # The receipt asks it too, as the relay.
    op.execute(
        f"REVOKE ALL ON FUNCTION {schema}.outbox_secret_refused(text, text, jsonb) FROM PUBLIC"
    )
    op.execute(
        f"GRANT EXECUTE ON FUNCTION {schema}.outbox_secret_refused(text, text, jsonb) TO {relay}"
    )
    op.execute("ALTER TABLE outbox_outcome_event ADD COLUMN tenant text")
    if context.is_offline_mode():
        # The tables, columns and keys above are in the script; the edits of
        # the installed doors and triggers read the database. Without them the
        # doors write no tenant (every message: none) and take no tenant
        # argument; everything else works.
        op.execute(
            "-- 0022: edits the doors' and triggers' installed definitions (a tenant "
            "argument); it reads the database, so this script cannot: apply revision "
            "0022 with `outbox migrate` (online) rather than from this script to have them"
        )
        return
    _replace_functions(list(_EDITED))
    _edit_in_place(list(_EDITED_IN_PLACE))
    for table in ("outbox_tenant", "outbox_tenant_role", "outbox_tenant_secret", "outbox_dedupe"):
        op.execute(f"ANALYZE {table}")


def downgrade() -> None:
    schema = revision_module("0009").install_schema()
    if not context.is_offline_mode():  # (offline, upgrade made no edits either)
        _edit_in_place([(name, _reversed(edits)) for name, edits in _EDITED_IN_PLACE])
        _replace_functions(
            [(name, _arguments(name), _reversed(edits)) for name, _, edits in reversed(_EDITED)]
        )
    op.execute("ALTER TABLE outbox_outcome_event DROP COLUMN tenant")
    op.execute(f"DROP FUNCTION {schema}.outbox_secret_refused(text, text, jsonb)")
    op.execute(f"DROP FUNCTION {schema}.outbox_enqueue_tenants(text, text[], integer)")
    for table in ("outbox_tenant_turn", "outbox_tenant_secret", "outbox_tenant_role"):
        op.execute(f"DROP TABLE {table}")
    op.execute("DROP TABLE outbox_tenant")
    for table, key in (
        ("outbox_dedupe", "channel, dedupe_key, recipient_fingerprint"),
        ("outbox_cooldown", "channel, cooldown_key"),
    ):
        # keys two tenants shared cannot both stay: the later ones go
        op.execute(
            f"DELETE FROM {table} AS a USING {table} AS b WHERE "
            + " AND ".join(f"a.{c.strip()} = b.{c.strip()}" for c in key.split(","))
            + " AND a.tenant > b.tenant"
        )
        op.execute(
            f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey, "
            f"ADD CONSTRAINT {table}_pkey PRIMARY KEY ({key})"
        )
        op.execute(f"ALTER TABLE {table} DROP COLUMN tenant")
    op.execute("DROP INDEX outbox_message_due_by_tenant")
    op.execute("ALTER TABLE outbox_message DROP COLUMN tenant")
