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
    pass
    # ---- B: leases, queue operations -------------------------------------------------------
    pass
    # ---- C: limits, tokens, audit ----------------------------------------------------------
    pass


def downgrade() -> None:
    # ---- C ----
    pass
    # ---- B ----
    pass
    # ---- A ----
    pass
