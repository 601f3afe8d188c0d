"""Task embeddings: each task's vector (the experiment's embedding_dim
float32 values, little-endian, as the API sends them) in its tasks row.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


# A nullable column (plain ADD COLUMN, no table rebuild): nothing existing is
# rewritten, and every task stored before it has no embedding (NULL), as the
# experiments it belongs to have no embedding_dim.
def upgrade() -> None:
    op.add_column("tasks", sa.Column("embedding", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    op.drop_column("tasks", "embedding")
