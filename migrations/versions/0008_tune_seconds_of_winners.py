"""how long the tune that made a winner took on this host: its wall seconds, and of them the
trial runner's start (what a warm runner does not pay), so that the next tune's announcement
learns its estimate from the store's past tunes (tunecache.tuning.estimate)

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# null: not measured here (every winner stored before this revision, fleet copies, imports)
COLUMNS = ("tune_seconds", "start_seconds")


def upgrade() -> None:
    for column in COLUMNS:
        op.add_column("tuned_configs", sa.Column(column, sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tuned_configs") as batch:
        for column in reversed(COLUMNS):
            batch.drop_column(column)
