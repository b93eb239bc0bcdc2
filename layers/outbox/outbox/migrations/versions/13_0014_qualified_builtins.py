"""Every built-in the relay's SQL functions call is named ``pg_catalog.*``.

The SECURITY DEFINER producer door and the triggers pinned their search_path
to the relay's schema, but called built-ins whose arguments need a cast
(``nextval('outbox_message_id_seq')``, ``hashtextextended(text, int)``): a
better-matching overload planted in that schema by any role with CREATE on it
ran as the functions' owner and could read the fingerprint key (the
CVE-2018-1058 pattern; ``outbox.migrations.builtins`` says more).

This re-creates every function of the relay's schema named ``outbox_*`` from
its installed definition with each built-in call qualified, so whatever
earlier migrations (and the opt-in ``wake_on_enqueue.sql``) installed is
covered, and nothing else about a function changes. A test lists the calls of
every installed function and finds none unqualified that ``pg_catalog``
defines. Migrations after this one write their built-ins qualified.

Offline (``outbox migrate --sql``) there are no installed definitions to
read: the script says so, and ``outbox migrate`` does this step after every
upgrade (it changes nothing when every call is qualified already), so a
database migrated from a printed script is mended by the next run.

Downgrade keeps the functions qualified: the same functions, safer.

Revision ID: 0014
Revises: 0013
"""

from alembic import context, op

from outbox.migrations.builtins import qualify_installed_functions

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if context.is_offline_mode():
        op.execute(
            "-- 0014: re-creates the relay's functions from their installed definitions "
            "with every built-in call named pg_catalog.*; it reads the database, so "
            "this script cannot: run `outbox migrate` after it (it does this step on every run)"
        )
        return
    qualify_installed_functions(op.get_bind())


def downgrade() -> None:
    pass
