"""what tuning bought: the untuned default config's time and the vendor op's time (cuBLAS /
cuDNN), measured in the same tuning run, on winners and on submissions

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# both tables hold a tuning result (tunecache.store.rows.ResultColumns); null: not measured (every
# result stored before this revision)
TABLES = ("tuned_configs", "submissions")
COLUMNS = ("default_ms", "vendor_ms")


def upgrade() -> None:
    for table in TABLES:
        for column in COLUMNS:
            op.add_column(table, sa.Column(column, sa.Float, nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            for column in reversed(COLUMNS):
                batch.drop_column(column)
