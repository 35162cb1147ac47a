"""reports against a winner: hosts that could not launch it (their pruning refused it, or the
launch raised) since it became the winner; a worker's re-time that finds only other configs
then replaces it (Store.publish)

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tuned_configs", sa.Column("reports", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("tuned_configs") as batch:
        batch.drop_column("reports")
