"""Living pools: task groups, and the pool's event log (retiring and
re-activating tasks, setting group shares).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


# New tables and a nullable column (plain ADD COLUMN, no table rebuild):
# nothing existing is rewritten, and a database without rows in them serves
# exactly as before.
def upgrade() -> None:
    op.add_column("tasks", sa.Column("group_name", sa.String(256), nullable=True))
    op.create_table(
        "retirements",
        sa.Column(
            "experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("task_idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("retired", sa.Boolean, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("create_time", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "group_shares",
        sa.Column(
            "experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("shares", sa.Text, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("create_time", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("group_shares")
    op.drop_table("retirements")
    op.drop_column("tasks", "group_name")
