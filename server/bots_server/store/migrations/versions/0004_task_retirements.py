"""Task retirements: the event log of retiring and re-activating tasks.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


# A new table only: nothing existing is rewritten, and a database without
# rows in it serves exactly as before.
def upgrade() -> None:
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


def downgrade() -> None:
    op.drop_table("retirements")
