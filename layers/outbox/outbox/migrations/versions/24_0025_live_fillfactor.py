"""The live partition at fillfactor 70 (issue 30, item 4), measured.

A sender's receipt (``received_at``) is the one update of a live row that can
stay on its page (a HOT update: no index entry written): the claim changes
``status``, which every live index's predicate names, and the settle moves
the row to another partition. At 0018's fillfactor 90 a page rarely had the
room: 14 % of the live partition's updates were HOT on the Lambda path; at 70,
37 %, and the WAL a message fell from 3,545 to 2,819 bytes (a fifth less) at the
same rate (``python -m bench.fillfactor``, bench/README.md). The partition
holds only the rows in flight, so the room costs next to nothing. Pages
written from now on keep it; nothing is rewritten.

Revision ID: 0025
Revises: 0024
"""

from __future__ import annotations

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE outbox_message_live SET (fillfactor = 70)")


def downgrade() -> None:
    op.execute("ALTER TABLE outbox_message_live SET (fillfactor = 90)")
