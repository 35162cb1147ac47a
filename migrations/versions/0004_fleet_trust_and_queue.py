"""the fleet's trust model (submissions re-timed before they win), leases bound to their
claimer, and token expiry, ids and the admin audit log

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ---- A: trust model (who makes winners), provenance, purge ----------------------------
    # the submission that made a winner (`tunecache fleet purge --token` removes a token's
    # winners by it), and when a submission that claimed to beat the winner queued its
    # re-timing (a winner is re-timed once; a new winner clears it)
    op.add_column("tuned_configs", sa.Column("submission_id", sa.Integer, nullable=True))
    op.add_column("tuned_configs", sa.Column("retime_queued_at", sa.DateTime, nullable=True))
    # a job that re-times a key which has a winner: the worker tunes it although a winner is there
    op.add_column("tuning_jobs", sa.Column("retime", sa.Boolean, nullable=False, server_default=sa.false()))
    op.create_index("ix_submissions_submitted_by", "submissions", ["submitted_by"])
    # winners made before: by the latest accepted submission of their key
    op.execute(
        "UPDATE tuned_configs SET submission_id = (SELECT max(s.id) FROM submissions s "
        "WHERE s.digest = tuned_configs.digest AND s.accepted)"
    )
    # ---- B: leases, queue operations -------------------------------------------------------
    # the sha256 of the lease secret a claim returns (the secret itself is never stored); a
    # job running at the upgrade has none, so its lease runs out and it is claimed again
    op.add_column("tuning_jobs", sa.Column("lease_hash", sa.String(64), nullable=True))
    # ---- C: limits, tokens, audit ----------------------------------------------------------
    op.add_column("api_tokens", sa.Column("expires_at", sa.DateTime, nullable=True))
    # live names become unique (revoke by name must mean one token): of the live tokens that
    # share a name, all but the oldest are renamed NAME#ID
    conn = op.get_bind()
    dupes = conn.execute(
        sa.text(
            "SELECT id, name FROM api_tokens t WHERE revoked_at IS NULL AND EXISTS (SELECT 1 FROM api_tokens o "
            "WHERE o.name = t.name AND o.revoked_at IS NULL AND o.id < t.id)"
        )
    ).all()
    for token_id, name in dupes:
        suffix = f"#{token_id}"
        conn.execute(
            sa.text("UPDATE api_tokens SET name = :name WHERE id = :id"),
            {"name": name[: 128 - len(suffix)] + suffix, "id": token_id},
        )
    op.create_index(
        "uq_api_tokens_live_name",
        "api_tokens",
        ["name"],
        unique=True,
        sqlite_where=sa.text("revoked_at IS NULL"),
        postgresql_where=sa.text("revoked_at IS NULL"),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("at", sa.DateTime, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("actor_token_id", sa.Integer, nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(256), nullable=False, server_default=""),
        sa.Column("details", sa.JSON, nullable=True),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])


def downgrade() -> None:
    # ---- C ----
    op.drop_table("audit_log")
    op.drop_index("uq_api_tokens_live_name", table_name="api_tokens")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("expires_at")
    # ---- B ----
    op.execute("UPDATE tuning_jobs SET status = 'failed' WHERE status = 'quarantined'")
    with op.batch_alter_table("tuning_jobs") as batch:
        batch.drop_column("lease_hash")
    # ---- A ----
    op.drop_index("ix_submissions_submitted_by", table_name="submissions")
    with op.batch_alter_table("tuning_jobs") as batch:
        batch.drop_column("retime")
    with op.batch_alter_table("tuned_configs") as batch:
        batch.drop_column("retime_queued_at")
        batch.drop_column("submission_id")
