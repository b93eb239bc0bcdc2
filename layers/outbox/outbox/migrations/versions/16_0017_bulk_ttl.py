"""The bulk door keeps a ``ttl`` given without a delay (issue 31, item 6).

``outbox_enqueue_many`` with a NULL delay computed the deliver-by time as
``now() + NULL + ttl``, which is NULL: the ttl was dropped and the message
had none. It now counts from now, as ``outbox_enqueue``'s does.

Like 0014, this edits the installed definition (read with
``pg_get_functiondef``), so the rest of the function stays as earlier
migrations left it; offline (``outbox migrate --sql``) it cannot, and says so.

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import context, op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_TTL_WITHOUT_DELAY = "make_interval(secs => i.delay_s + i.ttl_s)"
_TTL_FROM_NOW = "make_interval(secs => COALESCE(i.delay_s, 0) + i.ttl_s)"

_DEFINITION = """
    SELECT pg_catalog.pg_get_functiondef(p.oid)
    FROM pg_catalog.pg_proc AS p
    WHERE p.pronamespace = pg_catalog.current_schema()::pg_catalog.regnamespace
      AND p.proname = 'outbox_enqueue_many_core'
"""


def upgrade() -> None:
    if context.is_offline_mode():
        op.execute(
            "-- 0017: edits outbox_enqueue_many_core's installed definition (a ttl "
            "without a delay); it reads the database, so this script cannot: apply "
            "revision 0017 with `outbox migrate` (online) rather than from this script"
        )
        return
    connection = op.get_bind()
    definition = connection.execute(sa.text(_DEFINITION)).scalar_one()
    if _TTL_WITHOUT_DELAY not in definition:
        raise RuntimeError(
            "outbox_enqueue_many_core is not the definition migration 0014 left: "
            "it was changed by hand; restore it (downgrade and upgrade) and migrate again"
        )
    definition = definition.replace(_TTL_WITHOUT_DELAY, _TTL_FROM_NOW)
    connection.exec_driver_sql(definition)


def downgrade() -> None:
    if context.is_offline_mode():
        return
    connection = op.get_bind()
    definition = connection.execute(sa.text(_DEFINITION)).scalar_one()
    definition = definition.replace(_TTL_FROM_NOW, _TTL_WITHOUT_DELAY)
    connection.exec_driver_sql(definition)
