"""Alembic environment: always runs on a connection handed in by outbox.migrate,
with the relay's own version table (never the application's alembic_version).
Offline (``outbox migrate --sql``) it writes the statements instead of running them."""

from alembic import context

if context.is_offline_mode():
    context.configure(
        dialect_name="postgresql",
        literal_binds=True,
        transactional_ddl=True,
        transaction_per_migration=True,
        version_table=context.config.attributes["version_table"],
    )
else:
    context.configure(
        connection=context.config.attributes["connection"],
        transactional_ddl=True,
        # a transaction a revision (outbox.migrate.upgrade_from says why)
        transaction_per_migration=True,
        version_table=context.config.attributes["version_table"],
    )
with context.begin_transaction():
    context.run_migrations()
