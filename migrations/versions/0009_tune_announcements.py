"""keys a host of the fleet said it is tuning, so that the other hosts that miss them wait for
its result instead of tuning them again (Store.announce)

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

from tunecache_migrations.columns import digest_row_columns

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tune_announcements",
        *digest_row_columns(),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("token_name", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_tune_announcements_digest", "tune_announcements", ["digest"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_tune_announcements_digest", "tune_announcements")
    op.drop_table("tune_announcements")
