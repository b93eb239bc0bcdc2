"""Alembic environment: always runs on a connection handed in by outbox.migrate,
with the relay's own version table (never the application's alembic_version)."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    transactional_ddl=True,
    version_table=context.config.attributes["version_table"],
)
with context.begin_transaction():
    context.run_migrations()
