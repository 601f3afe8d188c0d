"""Tenants: the tenant each experiment belongs to (core/tenancy.py).

Every experiment written before tenants existed belongs to the tenant
"default", whose stored names are the plain names: no row changes but for
the new column's default.

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


# Plain ADD/DROP COLUMN (SQLite >= 3.35 has both): no table rebuild, which the
# task_posteriors view over experiments would block on SQLite.
def upgrade() -> None:
    op.add_column("experiments", sa.Column("tenant", sa.String(63), nullable=False, server_default="default"))
    op.create_index("ix_experiments_tenant_name", "experiments", ["tenant", "name"])


def downgrade() -> None:
    op.drop_index("ix_experiments_tenant_name", table_name="experiments")
    op.drop_column("experiments", "tenant")
