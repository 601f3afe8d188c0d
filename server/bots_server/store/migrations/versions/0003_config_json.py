"""Experiment config as one JSON object: a new setting needs no migration.

The 14 config columns of 0001 become one `config` column holding a JSON
object of every setting (text on both databases; read it with json_extract
on SQLite, `config::jsonb ->> 'forgetting'` on PostgreSQL). A stored config
lacking a setting added later reads with that setting's default.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# The config columns of revisions 0001-0002 and their types.
COLUMNS: dict[str, Any] = {
    "strategy": sa.String(16),
    "target_success": sa.Double,
    "forgetting": sa.Double,
    "implicit_weight": sa.Double,
    "rollouts_per_task": sa.Integer,
    "selection_mode": sa.String(16),
    "temperature": sa.Double,
    "weak_feature": sa.String(256),
    "strong_feature": sa.String(256),
    "prior_alpha": sa.Double,
    "prior_beta": sa.Double,
    "seed": sa.BigInteger,
    "lease_ttl_seconds": sa.Double,
    "capability_ema": sa.Double,
}


def _experiments(*columns: str) -> sa.TableClause:
    return sa.table("experiments", sa.column("id", sa.Integer), *(sa.column(c) for c in columns))


# Plain ADD/DROP COLUMN (SQLite >= 3.35 has both): no table rebuild, which the
# task_posteriors view over experiments would block on SQLite. SQLite adds a
# NOT NULL column only with a default; every row gets its real value below.
def upgrade() -> None:
    op.add_column("experiments", sa.Column("config", sa.Text, nullable=False, server_default="{}"))
    conn = op.get_bind()
    old = _experiments(*COLUMNS)
    new = _experiments("config")
    for row in conn.execute(sa.select(old)).mappings().all():
        config = json.dumps({c: row[c] for c in COLUMNS}, sort_keys=True)
        conn.execute(new.update().where(new.c.id == row["id"]).values(config=config))
    for column in COLUMNS:
        op.drop_column("experiments", column)


def downgrade() -> None:
    defaults = {"strategy": "bots", "selection_mode": "thompson", "weak_feature": "", "strong_feature": ""}
    for column, type_ in COLUMNS.items():
        default = defaults.get(column, "0")
        op.add_column("experiments", sa.Column(column, type_, nullable=False, server_default=default))
    conn = op.get_bind()
    old = _experiments(*COLUMNS)
    new = _experiments("config")
    for row in conn.execute(sa.select(new)).mappings().all():
        stored = json.loads(row["config"])
        conn.execute(old.update().where(old.c.id == row["id"]).values({c: stored[c] for c in COLUMNS if c in stored}))
    op.drop_column("experiments", "config")
