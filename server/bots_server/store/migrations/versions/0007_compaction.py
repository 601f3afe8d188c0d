"""Compaction horizon: the step through which an experiment's outcomes and
its reported batches' tasks were removed (docs/design.md, Bounded storage).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


# Plain ADD/DROP COLUMN (SQLite >= 3.35 has both): no table rebuild.
def upgrade() -> None:
    op.add_column("experiments", sa.Column("compacted_through", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("experiments", "compacted_through")
