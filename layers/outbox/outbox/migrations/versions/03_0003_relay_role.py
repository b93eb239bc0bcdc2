"""Least privilege: a relay role with DML on the outbox tables and nothing else.

Two kinds of database user run the relay:

* the **migrator** (the migrate function, ``outbox migrate``): owns the outbox
  tables and runs this DDL. Whoever runs the migrations is it.
* the **relay** (dispatcher, reaper, every channel function, the internet-facing
  webhook function included): a login user that is a member of the NOLOGIN
  group role created here (``OUTBOX_RELAY_ROLE``, default ``outbox_relay``),
  which may SELECT, INSERT, UPDATE and DELETE rows of ``outbox_message`` and
  ``outbox_attempt``, and nothing else: no DDL, no other table.

The group role is cluster-wide, so its creation is idempotent and safe when
several migrators (deploys, test runs) race for it. A migrator without
CREATEROLE fails with a message saying what to create. The login user is the
operator's to create (docs/how-to/deploy.md, "Database users"), for example::

    CREATE ROLE outbox_relay_app LOGIN PASSWORD '...' IN ROLE outbox_relay;

Revision ID: 0003
Revises: 0002
"""

import os

from alembic import op

from outbox.settings import OUTBOX_RELAY_ROLE

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TABLES = ("outbox_message", "outbox_attempt")


def relay_role() -> str:
    """The role's name: checked to be a plain lower-case identifier, because
    the statements below interpolate it (a role name cannot be a bound parameter)."""
    return OUTBOX_RELAY_ROLE.read(os.environ)


def upgrade() -> None:
    role = relay_role()
    # Created unless it exists; a concurrent creator wins the race harmlessly.
    op.execute(
        f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                BEGIN
                    CREATE ROLE {role} NOLOGIN;
                EXCEPTION
                    WHEN duplicate_object OR unique_violation THEN NULL;
                    WHEN insufficient_privilege THEN
                        RAISE EXCEPTION 'role {role} does not exist and this user cannot create it'
                            USING HINT = 'As a user with CREATEROLE: CREATE ROLE {role} NOLOGIN';
                END;
            END IF;
        END
        $$
        """
    )
    for table in TABLES:
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}")


def downgrade() -> None:
    role = relay_role()
    for table in TABLES:
        op.execute(f"REVOKE ALL ON {table} FROM {role}")
