"""Initial schema: experiments, tasks, checkpoints, posteriors, event log, batches.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _experiment_fk() -> sa.Column:
    return sa.Column(
        "experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )


def upgrade() -> None:
    op.create_table(
        "experiments",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("strategy", sa.String(16), nullable=False),
        sa.Column("target_success", sa.Double, nullable=False),
        sa.Column("forgetting", sa.Double, nullable=False),
        sa.Column("implicit_weight", sa.Double, nullable=False),
        sa.Column("rollouts_per_task", sa.Integer, nullable=False),
        sa.Column("selection_mode", sa.String(16), nullable=False),
        sa.Column("temperature", sa.Double, nullable=False),
        sa.Column("weak_feature", sa.String(256), nullable=False),
        sa.Column("strong_feature", sa.String(256), nullable=False),
        sa.Column("prior_alpha", sa.Double, nullable=False),
        sa.Column("prior_beta", sa.Double, nullable=False),
        sa.Column("seed", sa.BigInteger, nullable=False),
        sa.Column("lease_ttl_seconds", sa.Double, nullable=False),
        sa.Column("capability_ema", sa.Double, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("num_tasks", sa.BigInteger, nullable=False),
        sa.Column("create_time", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "tasks",
        _experiment_fk(),
        sa.Column("task_idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("key", sa.String(1024), nullable=False),
        sa.Column("features", sa.Text, nullable=False),
        sa.UniqueConstraint("experiment_id", "key", name="uq_tasks_experiment_key"),
    )
    op.create_table(
        "checkpoints",
        _experiment_fk(),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("num_tasks", sa.BigInteger, nullable=False),
        sa.Column("capability", sa.Double, nullable=True),
        sa.Column("create_time", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "posteriors",
        _experiment_fk(),
        sa.Column("task_idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("alpha", sa.Double, nullable=False),
        sa.Column("beta", sa.Double, nullable=False),
    )
    op.create_table(
        "steps",
        _experiment_fk(),
        sa.Column("step", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("pool_size", sa.BigInteger, nullable=False),
        sa.Column("capability", sa.Double, nullable=True),
        sa.Column("capability_estimate", sa.Double, nullable=True),
        sa.Column("create_time", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "outcomes",
        _experiment_fk(),
        sa.Column("step", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("task_idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("successes", sa.Double, nullable=False),
        sa.Column("trials", sa.Integer, nullable=False),
    )
    op.create_table(
        "batches",
        _experiment_fk(),
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("request_key", sa.String(256), nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("batch_size", sa.Integer, nullable=False),
        sa.Column("create_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_expire_time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reported_step", sa.BigInteger, nullable=True),
        sa.UniqueConstraint("experiment_id", "request_key", name="uq_batches_experiment_request_key"),
    )
    op.create_index("ix_batches_open", "batches", ["experiment_id", "reported_step", "lease_expire_time"])
    op.create_table(
        "batch_tasks",
        _experiment_fk(),
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("task_idx", sa.BigInteger, nullable=False),
    )
    op.execute(
        """
        CREATE VIEW task_posteriors AS
        SELECT e.name AS experiment, t.key AS task_key, p.alpha, p.beta,
               p.alpha / (p.alpha + p.beta) AS mean, c.step AS checkpoint_step
        FROM posteriors p
        JOIN tasks t ON t.experiment_id = p.experiment_id AND t.task_idx = p.task_idx
        JOIN experiments e ON e.id = p.experiment_id
        JOIN checkpoints c ON c.experiment_id = p.experiment_id
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW task_posteriors")
    for table in ("batch_tasks", "batches", "outcomes", "steps", "posteriors", "checkpoints", "tasks", "experiments"):
        op.drop_table(table)
