"""Checkpoint as one value per experiment: O(bytes), not O(rows).

The `posteriors` table (one row per task, rewritten at every checkpoint)
goes; `checkpoints.state` holds the whole in-memory state of the tasks it
covers (alpha, beta, the reference pass rates, the capability, ...) in the
format of store/checkpoint_blob.py. Existing checkpoints are converted: their
alpha and beta rows, the reference pass rates read from their tasks'
features (the names in the experiment's config, NaN where missing, as a
rebuild read them), the capability, and rho_halvings 0 (no earlier
checkpoint carried it, and the API only accepted adaptive rho off).

On PostgreSQL the view `task_posteriors` keeps its columns, decoding alpha
and beta from the value in SQL (functions bots_checkpoint_header and
bots_checkpoint_float8); the column is stored uncompressed (STORAGE
EXTERNAL) so that the view reads 8-byte slices without detoasting the whole
value per row. SQLite has no view any more (it cannot turn bytes into a
float in SQL): `bots-server export` reads the posterior on both databases.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

import json
import math

import numpy as np
import sqlalchemy as sa
from alembic import op

from bots_server.store import checkpoint_blob

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_checkpoints = sa.table(
    "checkpoints",
    sa.column("experiment_id", sa.Integer),
    sa.column("num_tasks", sa.BigInteger),
    sa.column("capability", sa.Double),
    sa.column("state", sa.LargeBinary),
)
_posteriors = sa.table(
    "posteriors", sa.column("experiment_id"), sa.column("task_idx"), sa.column("alpha"), sa.column("beta")
)
_tasks = sa.table("tasks", sa.column("experiment_id"), sa.column("task_idx"), sa.column("features"))
_experiments = sa.table("experiments", sa.column("id"), sa.column("config"))

# The float8 at a byte offset of a value, little-endian IEEE 754, decoded
# exactly (every step is a power-of-two scaling of an integer below 2**53).
_FLOAT8 = """
CREATE FUNCTION bots_checkpoint_float8(blob bytea, byte_offset bigint) RETURNS double precision
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT CASE
    WHEN e = 2047 THEN (CASE WHEN m <> 0 THEN 'NaN' WHEN s = 1 THEN '-Infinity' ELSE 'Infinity' END)::float8
    WHEN e = 0 THEN (1 - 2 * s) * (m * (2::float8 ^ -1074))
    ELSE (1 - 2 * s) * ((1 + m * (2::float8 ^ -52)) * (2::float8 ^ (e - 1023)))
  END
  FROM (
    SELECT get_byte(b, 7) >> 7 AS s,
           ((get_byte(b, 7) & 127) << 4) | (get_byte(b, 6) >> 4) AS e,
           ((get_byte(b, 6) & 15)::bigint << 48) | (get_byte(b, 5)::bigint << 40) | (get_byte(b, 4)::bigint << 32)
             | (get_byte(b, 3)::bigint << 24) | (get_byte(b, 2)::bigint << 16) | (get_byte(b, 1)::bigint << 8)
             | get_byte(b, 0)::bigint AS m
    FROM (SELECT substring(blob FROM (byte_offset + 1)::integer FOR 8) AS b) AS raw
  ) AS bits
$$
"""

# The JSON header of a checkpoint value, with `data_start` (the byte offset
# the arrays' offsets count from) added; NULL for an empty value.
_HEADER = """
CREATE FUNCTION bots_checkpoint_header(blob bytea) RETURNS jsonb
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT convert_from(substring(blob FROM 13 FOR length::integer), 'UTF8')::jsonb || jsonb_build_object('data_start', 12 + length)
  FROM (
    SELECT get_byte(p, 8)::bigint | (get_byte(p, 9)::bigint << 8) | (get_byte(p, 10)::bigint << 16)
             | (get_byte(p, 11)::bigint << 24) AS length
    FROM (SELECT substring(blob FROM 1 FOR 12) AS p) AS prefix
    WHERE length(p) = 12
  ) AS h
$$
"""

_VIEW = """
CREATE VIEW task_posteriors AS
SELECT experiment, task_key, alpha, beta, alpha / (alpha + beta) AS mean, checkpoint_step
FROM (
  SELECT e.name AS experiment, t.key AS task_key,
         bots_checkpoint_float8(c.state, h.alpha_at + 8 * t.task_idx) AS alpha,
         bots_checkpoint_float8(c.state, h.beta_at + 8 * t.task_idx) AS beta,
         c.step AS checkpoint_step
  FROM checkpoints c
  JOIN experiments e ON e.id = c.experiment_id
  CROSS JOIN LATERAL (
    SELECT (header ->> 'data_start')::bigint + (header -> 'arrays' -> 'alpha' ->> 'offset')::bigint AS alpha_at,
           (header ->> 'data_start')::bigint + (header -> 'arrays' -> 'beta' ->> 'offset')::bigint AS beta_at
    FROM (SELECT bots_checkpoint_header(c.state) AS header) AS parsed
    WHERE header -> 'arrays' -> 'alpha' ->> 'dtype' = '<f8' AND header -> 'arrays' -> 'beta' ->> 'dtype' = '<f8'
  ) AS h
  JOIN tasks t ON t.experiment_id = c.experiment_id AND t.task_idx < c.num_tasks
) AS decoded
"""


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    op.execute("DROP VIEW task_posteriors")
    op.add_column("checkpoints", sa.Column("state", sa.LargeBinary, nullable=True))
    conn = op.get_bind()
    checkpoints = conn.execute(
        sa.select(
            _checkpoints.c.experiment_id, _checkpoints.c.num_tasks, _checkpoints.c.capability, _experiments.c.config
        ).join(_experiments, _experiments.c.id == _checkpoints.c.experiment_id)
    ).all()
    for experiment_id, num_tasks, capability, config_json in checkpoints:
        blob = _old_checkpoint(conn, experiment_id, num_tasks, capability, json.loads(config_json))
        conn.execute(_checkpoints.update().where(_checkpoints.c.experiment_id == experiment_id).values(state=blob))
    with op.batch_alter_table("checkpoints") as batch:
        batch.alter_column("state", existing_type=sa.LargeBinary, nullable=False)
        batch.drop_column("capability")
    op.drop_table("posteriors")
    if postgresql:
        op.execute("ALTER TABLE checkpoints ALTER COLUMN state SET STORAGE EXTERNAL")
        op.execute(_FLOAT8)
        op.execute(_HEADER)
        op.execute(_VIEW)


def _old_checkpoint(
    conn: sa.Connection, experiment_id: int, num_tasks: int, capability: float | None, config: dict
) -> memoryview:
    """A per-row checkpoint as one value, holding what a rebuild read with it."""
    rows = conn.execute(
        sa.select(_posteriors.c.alpha, _posteriors.c.beta)
        .where(_posteriors.c.experiment_id == experiment_id)
        .order_by(_posteriors.c.task_idx)
    ).all()
    if len(rows) != num_tasks:
        raise RuntimeError(f"checkpoint of experiment {experiment_id} has {len(rows)} rows, expected {num_tasks}")
    features = conn.execute(
        sa.select(_tasks.c.features)
        .where(_tasks.c.experiment_id == experiment_id, _tasks.c.task_idx < num_tasks)
        .order_by(_tasks.c.task_idx)
    ).scalars()
    weak_name, strong_name = config.get("weak_feature", ""), config.get("strong_feature", "")
    weak, strong = [], []
    for text in features:
        f = json.loads(text)
        weak.append(float(f[weak_name]) if weak_name and f.get(weak_name) is not None else math.nan)
        strong.append(float(f[strong_name]) if strong_name and f.get(strong_name) is not None else math.nan)
    arrays = {
        "alpha": np.array([r[0] for r in rows], dtype=np.float64),
        "beta": np.array([r[1] for r in rows], dtype=np.float64),
        "weak": np.array(weak, dtype=np.float64),
        "strong": np.array(strong, dtype=np.float64),
    }
    scalars = {"capability": math.nan if capability is None else float(capability), "rho_halvings": 0}
    return checkpoint_blob.encode(num_tasks, arrays, scalars)


def downgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    if postgresql:
        op.execute("DROP VIEW task_posteriors")
        op.execute("DROP FUNCTION bots_checkpoint_header(bytea)")
        op.execute("DROP FUNCTION bots_checkpoint_float8(bytea, bigint)")
    op.create_table(
        "posteriors",
        sa.Column("experiment_id", sa.Integer, sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("task_idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("alpha", sa.Double, nullable=False),
        sa.Column("beta", sa.Double, nullable=False),
    )
    op.add_column("checkpoints", sa.Column("capability", sa.Double, nullable=True))
    conn = op.get_bind()
    for experiment_id, blob in conn.execute(sa.select(_checkpoints.c.experiment_id, _checkpoints.c.state)).all():
        content = checkpoint_blob.decode(blob) if blob else None
        if content is None or content.num_tasks == 0:
            continue
        capability = float(content.scalars.get("capability", math.nan))
        conn.execute(
            _checkpoints.update()
            .where(_checkpoints.c.experiment_id == experiment_id)
            .values(capability=None if math.isnan(capability) else capability)
        )
        alpha, beta = content.arrays["alpha"].tolist(), content.arrays["beta"].tolist()
        conn.execute(
            _posteriors.insert(),
            [
                {"experiment_id": experiment_id, "task_idx": i, "alpha": a, "beta": b}
                for i, (a, b) in enumerate(zip(alpha, beta))
            ],
        )
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("state")
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
