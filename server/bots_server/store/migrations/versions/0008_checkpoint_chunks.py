"""Checkpoint values in chunks, task keys in blocks: O(bytes) on every path.

`checkpoints.state` (one value, written in one transaction that held
SQLite's write lock while 32 MB were written for 1M tasks) becomes rows of
`checkpoint_chunks`, each written in its own short transaction;
`checkpoints.version` names the chunks of the current value and
`checkpoints.chunk_bytes` their size. `task_key_blocks` holds the task keys
and groups of consecutive tasks as one value per block, so that a rebuild
reads a few values instead of a row per task; existing tasks are copied into
blocks here.

On PostgreSQL the view `task_posteriors` keeps its columns, now reading each
alpha and beta from the chunk that holds it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

import importlib

import sqlalchemy as sa
from alembic import op

from bots_server.store import pieces

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_checkpoints = sa.table(
    "checkpoints",
    sa.column("experiment_id", sa.Integer),
    sa.column("step", sa.BigInteger),
    sa.column("state", sa.LargeBinary),
    sa.column("version", sa.BigInteger),
    sa.column("chunk_bytes", sa.BigInteger),
)
_chunks = sa.table(
    "checkpoint_chunks",
    sa.column("experiment_id", sa.Integer),
    sa.column("version", sa.BigInteger),
    sa.column("seq", sa.Integer),
    sa.column("step", sa.BigInteger),
    sa.column("data", sa.LargeBinary),
)
_tasks = sa.table("tasks", sa.column("experiment_id"), sa.column("task_idx"), sa.column("key"), sa.column("group_name"))
_blocks = sa.table(
    "task_key_blocks",
    sa.column("experiment_id", sa.Integer),
    sa.column("first_task", sa.BigInteger),
    sa.column("num_tasks", sa.BigInteger),
    sa.column("keys", sa.LargeBinary),
    sa.column("groups", sa.LargeBinary),
)
_experiments = sa.table("experiments", sa.column("id"), sa.column("num_tasks"))

# Each float8 is read from the chunk holding it: chunk_bytes is a multiple of
# 8 and the arrays start at multiples of 8, so none straddles two chunks.
# The header is read from the first chunk (it is never longer than one).
_VIEW = """
CREATE VIEW task_posteriors AS
SELECT experiment, task_key, alpha, beta, alpha / (alpha + beta) AS mean, checkpoint_step
FROM (
  SELECT e.name AS experiment, t.key AS task_key,
         bots_checkpoint_float8(ca.data, (h.alpha_at + 8 * t.task_idx) % c.chunk_bytes) AS alpha,
         bots_checkpoint_float8(cb.data, (h.beta_at + 8 * t.task_idx) % c.chunk_bytes) AS beta,
         c.step AS checkpoint_step
  FROM checkpoints c
  JOIN experiments e ON e.id = c.experiment_id
  CROSS JOIN LATERAL (
    SELECT (header ->> 'data_start')::bigint + (header -> 'arrays' -> 'alpha' ->> 'offset')::bigint AS alpha_at,
           (header ->> 'data_start')::bigint + (header -> 'arrays' -> 'beta' ->> 'offset')::bigint AS beta_at
    FROM (
      SELECT bots_checkpoint_header(first.data) AS header
      FROM checkpoint_chunks first
      WHERE first.experiment_id = c.experiment_id AND first.version = c.version AND first.seq = 0
    ) AS parsed
    WHERE header -> 'arrays' -> 'alpha' ->> 'dtype' = '<f8' AND header -> 'arrays' -> 'beta' ->> 'dtype' = '<f8'
  ) AS h
  JOIN tasks t ON t.experiment_id = c.experiment_id AND t.task_idx < c.num_tasks
  JOIN checkpoint_chunks ca ON ca.experiment_id = c.experiment_id AND ca.version = c.version
    AND ca.seq = (h.alpha_at + 8 * t.task_idx) / c.chunk_bytes
  JOIN checkpoint_chunks cb ON cb.experiment_id = c.experiment_id AND cb.version = c.version
    AND cb.seq = (h.beta_at + 8 * t.task_idx) / c.chunk_bytes
) AS decoded
"""


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    if postgresql:
        op.execute("DROP VIEW task_posteriors")
    op.add_column("checkpoints", sa.Column("version", sa.BigInteger, nullable=False, server_default="0"))
    op.add_column("checkpoints", sa.Column("chunk_bytes", sa.BigInteger, nullable=False, server_default="0"))
    op.create_table(
        "checkpoint_chunks",
        sa.Column(
            "experiment_id",
            sa.Integer,
            sa.ForeignKey("checkpoints.experiment_id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("version", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "task_key_blocks",
        sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("first_task", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("num_tasks", sa.BigInteger, nullable=False),
        sa.Column("keys", sa.LargeBinary, nullable=False),
        sa.Column("groups", sa.LargeBinary, nullable=True),
    )
    if postgresql:
        op.execute("ALTER TABLE checkpoint_chunks ALTER COLUMN data SET STORAGE EXTERNAL")
    conn = op.get_bind()
    for experiment_id, step, state in conn.execute(
        sa.select(_checkpoints.c.experiment_id, _checkpoints.c.step, _checkpoints.c.state)
    ).all():
        state = bytes(state)
        size = pieces.chunk_bytes(state)
        for seq, data in enumerate(pieces.chunks(state, size)):
            conn.execute(_chunks.insert().values(experiment_id=experiment_id, version=1, seq=seq, step=step, data=data))
        conn.execute(
            _checkpoints.update()
            .where(_checkpoints.c.experiment_id == experiment_id)
            .values(version=1 if state else 0, chunk_bytes=size)
        )
    for (experiment_id,) in conn.execute(sa.select(_experiments.c.id)).all():
        _write_key_blocks(conn, experiment_id)
    op.drop_column("checkpoints", "state")
    if postgresql:
        op.execute(_VIEW)


def _write_key_blocks(conn: sa.Connection, experiment_id: int) -> None:
    rows = conn.execute(
        sa.select(_tasks.c.key, _tasks.c.group_name)
        .where(_tasks.c.experiment_id == experiment_id)
        .order_by(_tasks.c.task_idx)
    ).all()
    for first in range(0, len(rows), pieces.KEY_BLOCK_TASKS):
        block = rows[first : first + pieces.KEY_BLOCK_TASKS]
        groups = [g or "" for _, g in block]
        conn.execute(
            _blocks.insert().values(
                experiment_id=experiment_id,
                first_task=first,
                num_tasks=len(block),
                keys=pieces.join_texts([k for k, _ in block]),
                groups=pieces.join_texts(groups) if any(groups) else None,
            )
        )


def downgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    if postgresql:
        op.execute("DROP VIEW task_posteriors")
    op.add_column("checkpoints", sa.Column("state", sa.LargeBinary, nullable=True))
    conn = op.get_bind()
    for experiment_id, version in conn.execute(sa.select(_checkpoints.c.experiment_id, _checkpoints.c.version)).all():
        data = conn.execute(
            sa.select(_chunks.c.data)
            .where(_chunks.c.experiment_id == experiment_id, _chunks.c.version == version)
            .order_by(_chunks.c.seq)
        ).scalars()
        state = b"".join(bytes(d) for d in data)
        conn.execute(_checkpoints.update().where(_checkpoints.c.experiment_id == experiment_id).values(state=state))
    op.drop_table("task_key_blocks")
    op.drop_table("checkpoint_chunks")
    op.drop_column("checkpoints", "chunk_bytes")
    op.drop_column("checkpoints", "version")
    with op.batch_alter_table("checkpoints") as batch:
        batch.alter_column("state", existing_type=sa.LargeBinary, nullable=False)
    if postgresql:
        op.execute("ALTER TABLE checkpoints ALTER COLUMN state SET STORAGE EXTERNAL")
        op.execute(importlib.import_module("bots_server.store.migrations.versions.0006_checkpoint_blob")._VIEW)
