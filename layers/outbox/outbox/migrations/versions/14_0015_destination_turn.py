"""Two indexes of ``outbox_destination``, so that the claim's cost does not
grow with the number of destinations that ever throttled:

* ``outbox_destination_turn``: the bucketed destinations in the order the
  claim gives them turns (least recently drawn first); the claim reads the
  first BUCKET_CANDIDATES of it instead of sorting them all;
* ``outbox_destination_channel_wide``: the channels limited as a whole
  (destination ``*``), which every claim reads, without a scan of the table.

Revision ID: 0015
Revises: 0014
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX outbox_destination_turn ON outbox_destination (tokens_at NULLS FIRST) "
        "WHERE (rate IS NOT NULL OR limit_rate IS NOT NULL) AND destination <> '*'"
    )
    op.execute(
        "CREATE INDEX outbox_destination_channel_wide ON outbox_destination (channel) "
        "WHERE destination = '*'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX outbox_destination_channel_wide")
    op.execute("DROP INDEX outbox_destination_turn")
