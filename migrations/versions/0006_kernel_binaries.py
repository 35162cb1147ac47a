"""a winner's compiled kernels (Triton cache entries), so that a host that copies the winner
need not compile it

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

from tunecache_migrations.columns import digest_row_columns

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kernel_binaries",
        *digest_row_columns(),
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("triton_hash", sa.String(64), nullable=False),
        sa.Column("files", sa.JSON, nullable=False),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("uploaded_by", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("digest", "triton_hash", name="uq_kernel_binaries_digest_hash"),
    )
    op.create_index("ix_kernel_binaries_digest", "kernel_binaries", ["digest"])
    op.create_index("ix_kernel_binaries_uploaded_by", "kernel_binaries", ["uploaded_by"])


def downgrade() -> None:
    op.drop_index("ix_kernel_binaries_uploaded_by", "kernel_binaries")
    op.drop_index("ix_kernel_binaries_digest", "kernel_binaries")
    op.drop_table("kernel_binaries")
