"""Apply the schema with Alembic, programmatically (no alembic.ini to ship)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

_MIGRATIONS = Path(__file__).with_name("migrations")
# Serialises concurrent migrators (two deploys, a deploy and `outbox migrate`).
_MIGRATION_LOCK_ID = 0x6F7574626F78  # "outbox"


def _config(connection: sa.Connection) -> object:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def upgrade(
    engine: sa.Engine, revision: str = "head", *, delivered_events: bool | None = None
) -> str | None:
    """Bring the schema to ``revision``; returns the revision now applied.

    Then turns the ``delivered`` outcome event on or off as
    ``delivered_events`` says (by default ``OUTCOME_EVENTS_DELIVERED``): it is
    a trigger, and only the schema's owner, who migrates, may switch it."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    from . import store
    from .config import OutcomeEventSettings

    if delivered_events is None:
        delivered_events = OutcomeEventSettings.from_env().include_delivered
    with engine.begin() as connection:
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        command.upgrade(_config(connection), revision)  # type: ignore[arg-type]
        store.set_delivered_outcome_events(connection, delivered_events)
        return MigrationContext.configure(connection).get_current_revision()


def downgrade(engine: sa.Engine, revision: str) -> None:
    from alembic import command

    with engine.begin() as connection:
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        command.downgrade(_config(connection), revision)  # type: ignore[arg-type]


def current(engine: sa.Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
