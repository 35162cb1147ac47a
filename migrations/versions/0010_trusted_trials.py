"""whether a trial was measured by a host the store trusts (its own tunes, a worker's or an
admin's publish) or only claimed by a submission (a `publish` token's): the fleet serves only
trusted trials to the hosts that rank their candidates by them (tunecache.tuning.ranking)

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # the trials kept before this revision are not known to be trusted: none is served
    op.add_column("trials", sa.Column("trusted", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("trusted")
