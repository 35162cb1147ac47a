"""submissions (every published result) and api_tokens (the service's hashed tokens)

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

from tunecache_migrations.columns import backend_columns, digest_row_columns, result_columns

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "submissions",
        *digest_row_columns(),
        *backend_columns(),
        sa.Column("device_name", sa.String(128), nullable=False, server_default=""),
        sa.Column("problem", sa.JSON, nullable=False),
        *result_columns(),
        sa.Column("submitted_by", sa.String(128), nullable=False, server_default=""),
        sa.Column("accepted", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("tune_seconds", sa.Float, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_submissions_digest", "submissions", ["digest"])

    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("scopes", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("revoked_at", sa.DateTime, nullable=True),
    )
    op.create_index("ix_api_tokens_name", "api_tokens", ["name"])
    op.create_index("ix_api_tokens_token_hash", "api_tokens", ["token_hash"], unique=True)


def downgrade() -> None:
    op.drop_table("api_tokens")
    op.drop_table("submissions")
