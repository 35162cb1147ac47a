"""fleet copies (when a host last checked its copy of a fleet winner, and under which fleet
generation), the fleet's generation counter, and backend self-check verdicts

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from tunecache_migrations.columns import backend_columns

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tuned_configs", sa.Column("fleet_checked_at", sa.DateTime, nullable=True))
    op.add_column("tuned_configs", sa.Column("fleet_generation", sa.Integer, nullable=True))
    op.create_table(
        "fleet_meta",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("value", sa.Integer, nullable=False),
    )
    op.create_table(
        "selfchecks",
        sa.Column("id", sa.Integer, primary_key=True),
        *backend_columns(),
        sa.Column("ok", sa.Boolean, nullable=False),
        sa.Column("detail", sa.Text, nullable=True),
        sa.Column("seconds", sa.Float, nullable=True),
        sa.Column("device_name", sa.String(128), nullable=False, server_default=""),
        sa.Column("checked_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint(
            "kernel", "kernel_version", "triton_version", "arch", "sm_count", name="uq_selfchecks_backend_device"
        ),
    )


def downgrade() -> None:
    op.drop_table("selfchecks")
    op.drop_table("fleet_meta")
    with op.batch_alter_table("tuned_configs") as batch:
        batch.drop_column("fleet_generation")
        batch.drop_column("fleet_checked_at")
