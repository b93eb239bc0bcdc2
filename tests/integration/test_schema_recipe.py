"""The own-schema recipe of docs/how-to/database.md, run as written (only the cluster-wide role
names get a suffix of this test's): the migrator owns the schema and every
object in it; the relay's login user runs the relay there through its own
connection setting (OUTBOX_SCHEMA) and can drop nothing; a producer enqueues
through the door by the schema's name and reads nothing."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

import outbox
from outbox import migrate, store
from outbox.db import create_engine
from outbox.relay_settings import DatabaseSettings
from outbox_cli import devdb
from support import EMAIL, doc_sql, settings

# The recipe's cluster-wide names (schemas are per database: kept as written).
ROLES = ("outbox_migrator", "outbox_relay_app", "outbox_relay", "outbox_producer", "app")


@dataclass
class Recipe:
    url: str
    names: dict[str, str]

    def engine(self, documented_role: str, **options: object) -> sa.Engine:
        url = make_url(self.url).set(username=self.names[documented_role], password="change-me")
        return create_engine(
            DatabaseSettings(
                url=url.render_as_string(hide_password=False), sslmode="disable", schema="outbox"
            ),
            **options,  # type: ignore[arg-type]
        )


@pytest.fixture
def recipe(server_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Recipe]:
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"{role}_{suffix}" for role in ROLES}
    database = f"outbox_recipe_{suffix}"
    url = devdb.recreate_database(server_url, database)
    admin = sa.create_engine(url)
    sql = doc_sql("own-schema")
    for role in ROLES:  # longest names first in ROLES: outbox_relay_app before outbox_relay
        sql = re.sub(rf"\b{role}\b", names[role], sql)
    try:
        with admin.begin() as conn:
            # The application's own user exists before the relay is installed.
            conn.execute(sa.text(f"CREATE ROLE {names['app']} LOGIN PASSWORD 'change-me'"))
            for statement in filter(str.strip, sql.split(";")):
                conn.execute(sa.text(statement))
        monkeypatch.setenv("OUTBOX_SCHEMA", "outbox")
        monkeypatch.setenv("OUTBOX_RELAY_ROLE", names["outbox_relay"])
        monkeypatch.setenv("OUTBOX_PRODUCER_ROLE", names["outbox_producer"])
        yield Recipe(url, names)
    finally:
        admin.dispose()
        devdb.drop_database(server_url, database)
        cleanup = sa.create_engine(server_url)
        with cleanup.begin() as conn:
            for role in ROLES:
                conn.execute(sa.text(f"DROP ROLE IF EXISTS {names[role]}"))
        cleanup.dispose()


def test_the_own_schema_recipe_as_written(recipe: Recipe) -> None:
    migrator = recipe.engine("outbox_migrator")
    relay = recipe.engine("outbox_relay_app", autocommit=True)
    producer = sa.create_engine(  # the application's own engine: its default search_path
        make_url(recipe.url).set(username=recipe.names["app"], password="change-me")
    )
    try:
        assert migrate.upgrade(migrator) is not None
        with migrator.connect() as conn:
            owners = set(
                conn.execute(
                    sa.text(
                        "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class "
                        "WHERE relnamespace = 'outbox'::regnamespace"
                    )
                ).scalars()
            )
        assert owners == {recipe.names["outbox_migrator"]}

        # A producer enqueues through the door (outbox.enqueue reads OUTBOX_SCHEMA)...
        with producer.begin() as conn:
            message_id = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-1")
            by_sql = conn.execute(
                sa.text(
                    "SELECT outbox.outbox_enqueue('email', CAST(:p AS jsonb), dedupe_key => 'order-1')"
                ),
                {
                    "p": '{"from": "a@example.com", "to": ["b@example.net"], "subject": "s", '
                    '"text": "t"}'
                },
            ).scalar_one()
        assert by_sql != message_id  # another recipient: another message
        # ... and reads nothing.
        denied = pytest.raises(sa.exc.ProgrammingError, match="permission denied")
        with denied, producer.connect() as conn:
            conn.execute(sa.text("SELECT payload FROM outbox.outbox_message"))

        # The relay's login user runs the relay in the schema, by its own setting.
        with relay.connect() as conn:
            assert conn.execute(sa.text("SHOW search_path")).scalar_one() == '"outbox", pg_temp'
            claims = store.claim(conn, 10, 60)
            assert sorted(c.id for c in claims) == sorted([message_id, by_sql])
            settled = store.settle(
                conn,
                [store.Settlement(c.id, c.claim_token, "delivered") for c in claims],
                settings().backoff(),
            )
            assert set(settled.values()) == {"delivered"}
        for statement in (
            "DROP TABLE outbox.outbox_message",
            "DROP SCHEMA outbox CASCADE",
            "ALTER TABLE outbox.outbox_attempt DISABLE TRIGGER ALL",
            "CREATE TABLE outbox.intruder (id int)",
        ):
            refused = pytest.raises(
                sa.exc.ProgrammingError, match=r"must be owner|permission denied"
            )
            with refused, relay.connect() as conn:
                conn.execute(sa.text(statement))
    finally:
        for engine in (migrator, relay, producer):
            engine.dispose()


def test_a_group_roles_search_path_does_not_reach_its_members(recipe: Recipe) -> None:
    """What the README warns about: ALTER ROLE ... SET on the group role."""
    admin = sa.create_engine(recipe.url)
    member = sa.create_engine(
        make_url(recipe.url).set(username=recipe.names["outbox_relay_app"], password="change-me")
    )
    try:
        with admin.begin() as conn:
            conn.execute(
                sa.text(f"ALTER ROLE {recipe.names['outbox_relay']} SET search_path = outbox")
            )
        with member.connect() as conn:
            assert conn.execute(sa.text("SHOW search_path")).scalar_one() == '"$user", public'
    finally:
        admin.dispose()
        member.dispose()
