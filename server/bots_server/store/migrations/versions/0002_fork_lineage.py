"""Fork lineage: which experiment (and step) a fork or restore was copied from.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


# Plain ADD/DROP COLUMN (SQLite >= 3.35 has both): no table rebuild, which the
# task_posteriors view over experiments would block on SQLite.
def upgrade() -> None:
    op.add_column("experiments", sa.Column("forked_from", sa.String(256), nullable=True))
    op.add_column("experiments", sa.Column("forked_at_step", sa.BigInteger, nullable=True))


def downgrade() -> None:
    op.drop_column("experiments", "forked_at_step")
    op.drop_column("experiments", "forked_from")
