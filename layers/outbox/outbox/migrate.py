"""Apply the schema with Alembic, programmatically (no alembic.ini to ship).

The relay keeps its migration state in a version table of its own,
``outbox_alembic_version``, so it shares a database with an application that
uses Alembic itself: neither sees the other's revisions. Every object the
relay creates is named ``outbox_*``; an application's autogenerate leaves
the relay's tables (``RELAY_TABLES``, by exact name) alone with
:func:`include_object`.

The migrate function's protocol is here too (:func:`handle`): a
CloudFormation custom resource that applies the schema on Create and Update
and answers the stack's pre-signed response URL, or a plain invoke.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .errors import ValidationError
from .migrations.builtins import qualify_installed_functions

VERSION_TABLE = "outbox_alembic_version"
# Where releases before 0.1.0 kept the relay's revision: Alembic's default.
LEGACY_VERSION_TABLE = "alembic_version"
# The relay's own tables, by name: an application's autogenerate skips these
# and nothing else, so its own ``outbox_preferences`` stays its own. A test
# holds this set to the tables the migrations create.
RELAY_TABLES = frozenset(
    {
        "outbox_message",
        "outbox_message_live",
        "outbox_message_unresolved",
        "outbox_message_resolved",
        "outbox_message_resolved_default",
        "outbox_attempt",
        "outbox_dedupe",
        "outbox_fingerprint_key",
        "outbox_outcome_event",
        "outbox_channel_pause",
        "outbox_channel",
        "outbox_destination",
        "outbox_cooldown",
        "outbox_tenant",
        "outbox_tenant_role",
        "outbox_tenant_secret",
        "outbox_tenant_turn",
        "outbox_tenant_channel",
        VERSION_TABLE,
    }
)

_MIGRATIONS = Path(__file__).with_name("migrations")
# Serialises concurrent migrators (two deploys, a deploy and `outbox migrate`).
_MIGRATION_LOCK_ID = 0x6F7574626F78  # "outbox"


def _config(connection: sa.Connection | None = None) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    config.attributes["connection"] = connection
    config.attributes["version_table"] = VERSION_TABLE
    return config


def _current(connection: sa.Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def head() -> str:
    """The newest revision this release ships."""
    from alembic.script import ScriptDirectory

    revision = ScriptDirectory.from_config(_config()).get_current_head()
    assert revision is not None  # the package always ships its migrations
    return revision


def _adopt_legacy_version_row(connection: sa.Connection) -> None:
    """Move the relay's revision out of ``alembic_version`` (where releases
    before 0.1.0 kept it) into the relay's own table. The rows of an
    application that shares that table stay; the table is dropped only when
    the relay's row was all it held."""
    from alembic.script import ScriptDirectory

    inspector = sa.inspect(connection)
    if (
        inspector.has_table(VERSION_TABLE)
        or not inspector.has_table(LEGACY_VERSION_TABLE)
        or not inspector.has_table("outbox_message")
    ):
        return
    ours = {s.revision for s in ScriptDirectory.from_config(_config()).walk_revisions()}
    rows = connection.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
    legacy = [r for r in rows if r in ours]
    if not legacy:
        return
    connection.execute(
        sa.text(
            "CREATE TABLE outbox_alembic_version (version_num varchar(32) NOT NULL, "
            "CONSTRAINT outbox_alembic_version_pkc PRIMARY KEY (version_num))"
        )
    )
    for revision in legacy:
        connection.execute(
            sa.text("INSERT INTO outbox_alembic_version (version_num) VALUES (:r)"), {"r": revision}
        )
        connection.execute(
            sa.text("DELETE FROM alembic_version WHERE version_num = :r"), {"r": revision}
        )
    if len(legacy) == len(rows):
        connection.execute(sa.text("DROP TABLE alembic_version"))


class UnsafeSchema(Exception):
    """Roles other than the schema's owner and the migrator may create in the
    relay's schema (PUBLIC may, on ``public``, up to PostgreSQL 14)."""

    def __init__(self, schema: str, creators: list[str]) -> None:
        self.schema = schema
        self.creators = creators
        who = ", ".join(creators)
        super().__init__(
            f"schema {schema} lets {who} create objects in it: any of them could plant a "
            "function the relay's own would call. Revoke it (REVOKE CREATE ON SCHEMA "
            f"{schema} FROM {who}) or run `outbox migrate --fix`, which does"
        )


# Who may create in the current schema but its owner and the migrator: the
# grantees of CREATE in its ACL (grantee 0 is PUBLIC).
_OTHER_CREATORS = """
    SELECT n.nspname AS schema,
           CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                ELSE pg_catalog.quote_ident(r.rolname) END AS creator
    FROM pg_catalog.pg_namespace AS n
    CROSS JOIN LATERAL pg_catalog.aclexplode(n.nspacl) AS a
    LEFT JOIN pg_catalog.pg_roles AS r ON r.oid = a.grantee
    WHERE n.oid = pg_catalog.current_schema()::pg_catalog.regnamespace
      AND a.privilege_type = 'CREATE'
      AND a.grantee NOT IN (n.nspowner, (SELECT oid FROM pg_catalog.pg_roles
                                         WHERE rolname = current_user))
    ORDER BY a.grantee <> 0, r.rolname
"""


def check_schema_creators(connection: sa.Connection, *, fix: bool = False) -> list[str]:
    """Refuse (``UnsafeSchema``) a relay schema that a role other than its
    owner and the migrator may create in; with ``fix``, revoke that CREATE
    instead and return whom it was revoked from. The relay's functions name
    every built-in ``pg_catalog.*``, so a planted overload cannot stand in for
    one; this shuts the door on planting anything at all."""
    rows = connection.execute(sa.text(_OTHER_CREATORS)).all()
    if not rows:
        return []
    schema = pg_quote_ident(rows[0].schema)
    creators = [row.creator for row in rows]
    if not fix:
        raise UnsafeSchema(schema, creators)
    for creator in creators:
        connection.execute(sa.text(f"REVOKE CREATE ON SCHEMA {schema} FROM {creator}"))
    return creators


def pg_quote_ident(name: str) -> str:
    return name if re.fullmatch(r"[a-z_][a-z0-9_]*", name) else '"' + name.replace('"', '""') + '"'


def upgrade(
    engine: sa.Engine,
    revision: str = "head",
    *,
    delivered_events: bool | None = None,
    retrying_events: bool | None = None,
) -> str | None:
    """Bring the schema to ``revision``; returns the revision now applied
    (``upgrade_from`` says from which)."""
    return upgrade_from(
        engine, revision, delivered_events=delivered_events, retrying_events=retrying_events
    )[1]


def upgrade_from(
    engine: sa.Engine,
    revision: str = "head",
    *,
    delivered_events: bool | None = None,
    retrying_events: bool | None = None,
) -> tuple[str | None, str | None]:
    """Bring the schema to ``revision``; returns the revision it was at (None:
    no schema) and the one now applied, both read under the migration lock.

    First refuses a schema that roles other than its owner and the migrator
    may create in (``check_schema_creators``).
    Then turns the ``delivered`` outcome event on or off as
    ``delivered_events`` says (by default ``OUTCOME_EVENTS_DELIVERED``), and
    the ``retrying`` one as ``retrying_events`` says (``OUTCOME_EVENTS_RETRYING``):
    each is a trigger, and only the schema's owner, who migrates, may switch it."""
    from alembic import command

    from . import store
    from .relay_settings import OutcomeEventSettings

    if delivered_events is None or retrying_events is None:
        from_env = OutcomeEventSettings.from_env()
        delivered_events = (
            from_env.include_delivered if delivered_events is None else delivered_events
        )
        retrying_events = from_env.include_retrying if retrying_events is None else retrying_events
    # Each revision is a transaction of its own (migrations/env.py), so that
    # a revision's locks end with it, not with the last revision's (0018
    # holds outbox_message while it runs: only for its own work), and an
    # upgrade interrupted resumes after the last revision it committed. The
    # migration lock is the session's, held across them.
    with engine.connect() as connection:
        connection.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        try:
            check_schema_creators(connection)
            _adopt_legacy_version_row(connection)
            before = _current(connection)
            connection.commit()
            command.upgrade(_config(connection), revision)
            connection.commit()
            if revision == "head":
                # (a schema made by a printed script missed this step: see 0014)
                qualify_installed_functions(connection)
                store.make_history_partitions(connection)
            store.set_delivered_outcome_events(connection, delivered_events)
            store.set_retrying_outcome_events(connection, retrying_events)
            after = _current(connection)
            connection.commit()
            return before, after
        finally:
            _release_migration_lock(connection)


def _release_migration_lock(connection: sa.Connection) -> None:
    """End what a failed revision left open and release the session's
    migration lock; on a connection that is gone the session took the lock
    with it, and the error that ended the upgrade is the one to see."""
    try:
        connection.rollback()
        connection.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": _MIGRATION_LOCK_ID})
        connection.commit()
    except sa.exc.DBAPIError:
        connection.invalidate()


def downgrade(engine: sa.Engine, revision: str) -> None:
    from alembic import command

    with engine.begin() as connection:
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        command.downgrade(_config(connection), revision)


def current(engine: sa.Engine) -> str | None:
    with engine.connect() as connection:
        return _current(connection)


class UnknownRevision(Exception):
    """The database's revision is not one this release ships (a newer release
    migrated it, or the version table was edited)."""


def pending(revision: str | None) -> list[str]:
    """The revisions an upgrade from ``revision`` (None: an empty database)
    applies, oldest first; [] when it is the head."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_config())
    known = {s.revision for s in script.walk_revisions()}
    if revision is not None and revision not in known:
        raise UnknownRevision(revision)
    # walk_revisions goes from the head down; stop at the database's revision.
    ahead: list[str] = []
    for step in script.walk_revisions():
        if step.revision == revision:
            break
        ahead.append(step.revision)
    return ahead[::-1]


def upgrade_sql(revision: str | None) -> str:
    """The SQL an upgrade from ``revision`` (None: an empty database) to the
    head would run, as a script (Alembic's offline mode); runs nothing.

    Not in it: moving a revision out of a pre-0.1.0 ``alembic_version`` row,
    and switching the ``delivered`` outcome event trigger (read from the
    database at run time); ``outbox migrate`` does both."""
    import io

    from alembic import command

    buffer = io.StringIO()
    config = _config()
    config.output_buffer = buffer
    command.upgrade(config, f"{revision}:head" if revision else "head", sql=True)
    return buffer.getvalue()


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """For an application's Alembic ``env.py``: autogenerate ignores the relay's
    objects, so it neither drops them nor adds them to the application's
    migrations::

        from outbox.migrate import include_object
        context.configure(..., include_object=include_object)
    """
    table = obj if type_ == "table" else getattr(obj, "table", None)
    table_name = getattr(table, "name", None) or (name if type_ == "table" else None)
    return not is_relay_table(table_name)


# The history's day partitions (and the one an upgrade to 0018 kept): made and
# dropped by the relay as days pass, so known by their names' form.
HISTORY_PARTITION = re.compile(r"outbox_message_resolved_(p[0-9]{8}|before_0018)")


def is_relay_table(name: str | None) -> bool:
    """A table the relay made: one of ``RELAY_TABLES``, or a history partition."""
    return name is not None and (name in RELAY_TABLES or bool(HISTORY_PARTITION.fullmatch(name)))


# --- the migrate function: a CloudFormation custom resource, or a plain invoke --


def handle(event: Any, context: Any, engine_factory: Callable[[], sa.Engine]) -> dict[str, Any]:
    """The migrate function: apply the schema. As a custom resource it
    answers CloudFormation; a plain invoke (``aws lambda invoke
    --function-name <Migrate> out.json``) returns the revision applied."""
    from .observability import logger  # Powertools: the function's, not the CLI's

    is_custom_resource = isinstance(event, Mapping) and "ResponseURL" in event
    if not is_custom_resource:
        revision = upgrade(engine_factory())
        logger.info("schema migrated", extra={"revision": revision})
        return {"revision": revision}

    check_response_url(event["ResponseURL"])  # before anything: a forged event does nothing
    request_type = event.get("RequestType")
    physical_id = event.get("PhysicalResourceId") or "outbox-schema"
    data: dict[str, Any] = {}
    try:
        if request_type in ("Create", "Update"):
            data["Revision"] = upgrade(engine_factory())
            logger.info("schema migrated", extra={"revision": data["Revision"]})
        # Delete: never drop the data with the stack.
    except Exception as exc:
        logger.exception("schema migration failed")
        _answer_cloudformation(
            event, "FAILED", physical_id, {}, reason=f"migration failed: {type(exc).__name__}"
        )
        return {"status": "FAILED"}
    # The migration is done; a failure from here on is the answer's, not its.
    _answer_cloudformation(event, "SUCCESS", physical_id, data, reason="")
    return {"status": "SUCCESS", **data}


# Where CloudFormation's pre-signed response URLs point: its own S3 buckets,
# in every partition (amazonaws.com, amazonaws.com.cn), with the global,
# regional and dash-regional S3 endpoint spellings.
RESPONSE_URL_HOST = re.compile(
    r"^cloudformation-custom-resource-response-[a-z0-9-]+"
    r"\.s3(?:[.-][a-z0-9-]+)?(?:\.dualstack\.[a-z0-9-]+)?\.amazonaws\.com(?:\.cn)?$"
)


def check_response_url(value: Any) -> str:
    """The custom resource's ``ResponseURL``: https to CloudFormation's S3
    response bucket, or nothing is sent (a forged event cannot make the
    migrate function, which holds the migrator's credentials, PUT anywhere)."""
    if not isinstance(value, str) or len(value) > 8192:
        raise ValidationError("ResponseURL", "must be a URL")
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        raise ValidationError("ResponseURL", "must be a URL") from None
    if parts.scheme != "https" or parts.username is not None or parts.password is not None:
        raise ValidationError("ResponseURL", "must be an https URL without credentials")
    if not RESPONSE_URL_HOST.match(parts.hostname or ""):
        raise ValidationError("ResponseURL", "must point at CloudFormation's S3 response bucket")
    return value


class CustomResourceAnswerFailed(Exception):
    """CloudFormation was not told the outcome (the migration's own outcome is
    logged apart): the stack waits until its custom resource times out."""


def _answer_cloudformation(
    event: Mapping[str, Any], status: str, physical_id: str, data: dict[str, Any], reason: str
) -> None:
    body = json.dumps(
        {
            "Status": status,
            "Reason": reason or "see the function's CloudWatch logs",
            "PhysicalResourceId": physical_id,
            "StackId": event.get("StackId"),
            "RequestId": event.get("RequestId"),
            "LogicalResourceId": event.get("LogicalResourceId"),
            "Data": data,
        }
    ).encode()
    url = check_response_url(event["ResponseURL"])
    request = urllib.request.Request(  # noqa: S310 - scheme and host checked just above
        url, data=body, method="PUT", headers={"Content-Type": "", "Content-Length": str(len(body))}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            response.read()
    except OSError as exc:  # URLError, HTTPError, timeouts: one error, not a chain
        raise CustomResourceAnswerFailed(
            f"could not deliver the {status} answer to CloudFormation's ResponseURL: "
            f"{type(exc).__name__}"
        ) from None
