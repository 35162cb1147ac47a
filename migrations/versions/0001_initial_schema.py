"""tuned_configs, tuning_jobs and trials

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from tunecache_migrations.columns import backend_columns, digest_row_columns, result_columns

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _key_columns():
    return [*backend_columns(), sa.Column("problem", sa.JSON, nullable=False)]


def upgrade() -> None:
    op.create_table(
        "tuned_configs",
        *digest_row_columns(),
        *_key_columns(),
        sa.Column("device_name", sa.String(128), nullable=False, server_default=""),
        *result_columns(),
    )
    op.create_index("ix_tuned_configs_digest", "tuned_configs", ["digest"], unique=True)
    op.create_index("ix_tuned_configs_kernel", "tuned_configs", ["kernel"])

    op.create_table(
        "tuning_jobs",
        *digest_row_columns(),
        *_key_columns(),
        sa.Column("status", sa.String(16), nullable=False, server_default="queued"),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default="3"),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime, nullable=True),
        sa.Column("not_before", sa.DateTime, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_tuning_jobs_digest", "tuning_jobs", ["digest"], unique=True)
    op.create_index("ix_tuning_jobs_status", "tuning_jobs", ["status"])
    op.create_index("ix_tuning_jobs_arch", "tuning_jobs", ["arch"])

    op.create_table(
        "trials",
        *digest_row_columns(),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("kernel", sa.String(128), nullable=False),
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("median_ms", sa.Float, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_trials_digest", "trials", ["digest"])
    op.create_index("ix_trials_run_id", "trials", ["run_id"])


def downgrade() -> None:
    op.drop_table("trials")
    op.drop_table("tuning_jobs")
    op.drop_table("tuned_configs")
