"""A step's outcomes and a batch's tasks, each as one value in one row.

`outcomes` (one row per reported task) becomes `step_outcomes` (one row per
step), and `batch_tasks` (one row per selected task) becomes
`batch_task_lists` (one row per batch), in the formats of pieces.py. A step
then inserts a few rows, not two per task of its batch. What compaction
removed (steps at or before the horizon, batches reported by then) has no
row; every other step and batch gets one, empty if it had no rows.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23
"""

from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Any

import sqlalchemy as sa
from alembic import op

from bots_server.store import pieces

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_experiments = sa.table("experiments", sa.column("id"), sa.column("compacted_through"))
_steps = sa.table("steps", sa.column("experiment_id"), sa.column("step"))
_batches = sa.table("batches", sa.column("experiment_id"), sa.column("batch_id"), sa.column("reported_step"))
_step_outcomes = sa.table(
    "step_outcomes", sa.column("experiment_id"), sa.column("step"), sa.column("outcomes", sa.LargeBinary)
)
_batch_task_lists = sa.table(
    "batch_task_lists", sa.column("experiment_id"), sa.column("batch_id"), sa.column("tasks", sa.LargeBinary)
)
_outcomes = sa.table(
    "outcomes",
    sa.column("experiment_id"),
    sa.column("step"),
    sa.column("task_idx"),
    sa.column("successes"),
    sa.column("trials"),
)
_batch_tasks = sa.table(
    "batch_tasks", sa.column("experiment_id"), sa.column("batch_id"), sa.column("position"), sa.column("task_idx")
)

# Rows converted per statement: bounds the memory a large log needs.
_STEPS_PER_READ = 1000
_BATCHES_PER_READ = 1000


def upgrade() -> None:
    op.create_table(
        "step_outcomes",
        sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("step", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("outcomes", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "batch_task_lists",
        sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("tasks", sa.LargeBinary, nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        # Floats do not compress: no attempt on every write.
        op.execute("ALTER TABLE step_outcomes ALTER COLUMN outcomes SET STORAGE EXTERNAL")
        op.execute("ALTER TABLE batch_task_lists ALTER COLUMN tasks SET STORAGE EXTERNAL")
    conn = op.get_bind()
    for experiment_id, horizon in conn.execute(sa.select(_experiments.c.id, _experiments.c.compacted_through)).all():
        _pack_steps(conn, experiment_id, horizon)
        _pack_batches(conn, experiment_id, horizon)
    op.drop_table("outcomes")
    op.drop_table("batch_tasks")


def _pack_steps(conn: sa.Connection, experiment_id: int, horizon: int) -> None:
    steps = (
        sa.select(_steps.c.step)
        .where(_steps.c.experiment_id == experiment_id, _steps.c.step > horizon)
        .order_by(_steps.c.step)
    )
    for chunk in _chunks(conn.execute(steps).scalars().all(), _STEPS_PER_READ):
        rows = conn.execute(
            sa.select(_outcomes.c.step, _outcomes.c.task_idx, _outcomes.c.successes, _outcomes.c.trials)
            .where(_outcomes.c.experiment_id == experiment_id, _outcomes.c.step.between(chunk[0], chunk[-1]))
            .order_by(_outcomes.c.step, _outcomes.c.task_idx)
        ).all()
        by_step = {step: list(group) for step, group in groupby(rows, key=lambda r: r.step)}
        values = []
        for step in chunk:
            found = by_step.get(step, [])
            packed = pieces.pack_outcomes(
                [r.task_idx for r in found], [float(r.successes) for r in found], [int(r.trials) for r in found]
            )
            values.append({"experiment_id": experiment_id, "step": step, "outcomes": packed})
        conn.execute(_step_outcomes.insert(), values)


def _pack_batches(conn: sa.Connection, experiment_id: int, horizon: int) -> None:
    kept = sa.or_(_batches.c.reported_step.is_(None), _batches.c.reported_step > horizon)
    batch_ids = conn.execute(
        sa.select(_batches.c.batch_id)
        .where(_batches.c.experiment_id == experiment_id, kept)
        .order_by(_batches.c.batch_id)
    ).scalars()
    for chunk in _chunks(batch_ids.all(), _BATCHES_PER_READ):
        rows = conn.execute(
            sa.select(_batch_tasks.c.batch_id, _batch_tasks.c.task_idx)
            .where(_batch_tasks.c.experiment_id == experiment_id, _batch_tasks.c.batch_id.in_(chunk))
            .order_by(_batch_tasks.c.batch_id, _batch_tasks.c.position)
        ).all()
        by_batch = {
            batch_id: [r.task_idx for r in group] for batch_id, group in groupby(rows, key=lambda r: r.batch_id)
        }
        conn.execute(
            _batch_task_lists.insert(),
            [{"experiment_id": experiment_id, "batch_id": b, "tasks": pieces.pack_tasks(by_batch.get(b, []))} for b in chunk],
        )


def _chunks(values: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def downgrade() -> None:
    op.create_table(
        "outcomes",
        sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("step", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("task_idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("successes", sa.Double, nullable=False),
        sa.Column("trials", sa.Integer, nullable=False),
    )
    op.create_table(
        "batch_tasks",
        sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("task_idx", sa.BigInteger, nullable=False),
    )
    conn = op.get_bind()
    steps = sa.select(_step_outcomes.c.experiment_id, _step_outcomes.c.step, _step_outcomes.c.outcomes)
    for experiment_id, step, packed in conn.execute(steps).all():
        task_idx, successes, trials = pieces.unpack_outcomes(bytes(packed))
        if task_idx:
            conn.execute(
                _outcomes.insert(),
                [
                    {"experiment_id": experiment_id, "step": step, "task_idx": i, "successes": s, "trials": n}
                    for i, s, n in zip(task_idx, successes, trials, strict=True)
                ],
            )
    batches = sa.select(_batch_task_lists.c.experiment_id, _batch_task_lists.c.batch_id, _batch_task_lists.c.tasks)
    for experiment_id, batch_id, packed in conn.execute(batches).all():
        tasks = pieces.unpack_tasks(bytes(packed))
        if tasks:
            conn.execute(
                _batch_tasks.insert(),
                [
                    {"experiment_id": experiment_id, "batch_id": batch_id, "position": p, "task_idx": i}
                    for p, i in enumerate(tasks)
                ],
            )
    op.drop_table("batch_task_lists")
    op.drop_table("step_outcomes")
