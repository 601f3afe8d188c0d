"""Tables. The migrations in store/migrations create exactly this schema
(tests/store/test_migrations.py compares them).

The posterior is checkpointed as one value per experiment, holding every
array and scalar of the in-memory state of tasks 0..num_tasks-1 as of
`checkpoints.step`, in the format of checkpoint_blob.py (revision 0006;
before it, one `posteriors` row per task, which made a checkpoint cost a row
per task). The value is stored in `checkpoint_chunks` (revision 0008), each
chunk written in its own short transaction, so that no write transaction
holds SQLite's write lock for long; `checkpoints.version` names the chunks
that make up the current value. `steps` and `step_outcomes` (a step's
outcomes as one value, revision 0009) are the append-only event log after
it. On PostgreSQL the view `task_posteriors` reads keys and the checkpointed
alpha and beta out of it for plain-SQL reading.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()


def _experiment_id() -> Column:
    return Column("experiment_id", Integer, ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True)


experiments = Table(
    "experiments",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(128), nullable=False, unique=True),
    # Every setting as one JSON object (revision 0003): a new setting needs
    # no migration. The store does not interpret it.
    Column("config", Text, nullable=False, server_default="{}"),
    # Number of reports applied; the compare-and-set target of every report.
    Column("step", BigInteger, nullable=False),
    Column("num_tasks", BigInteger, nullable=False),
    Column("create_time", DateTime(timezone=True), nullable=False),
    # Set on experiments made by ForkExperiment / RestoreExperiment (revision 0002).
    Column("forked_from", String(256), nullable=True),
    Column("forked_at_step", BigInteger, nullable=True),
    # The tenant (revision 0004; core/tenancy.py). `name` is the stored name:
    # "tenant/name", or the plain name in the tenant "default".
    Column("tenant", String(63), nullable=False, server_default="default"),
    Index("ix_experiments_tenant_name", "tenant", "name"),
    # Outcomes of steps up to here, and the tasks of batches reported up to
    # here, were removed by compaction (revision 0007); never past the checkpoint.
    Column("compacted_through", BigInteger, nullable=False, server_default="0"),
)

tasks = Table(
    "tasks",
    metadata,
    _experiment_id(),
    Column("task_idx", BigInteger, primary_key=True, autoincrement=False),
    Column("key", String(1024), nullable=False),
    Column("features", Text, nullable=False),  # JSON object of named floats
    Column("group_name", String(256), nullable=True),  # its group (revision 0005); NULL: none
    # Its embedding (revision 0010): embedding_dim little-endian float32 values; NULL: none.
    Column("embedding", LargeBinary, nullable=True),
    UniqueConstraint("experiment_id", "key", name="uq_tasks_experiment_key"),
)

checkpoints = Table(
    "checkpoints",
    metadata,
    _experiment_id(),
    Column("step", BigInteger, nullable=False),
    Column("num_tasks", BigInteger, nullable=False),  # the state covers tasks 0..num_tasks-1
    Column("create_time", DateTime(timezone=True), nullable=False),
    # The chunks of the current value (revision 0008): those of
    # checkpoint_chunks with this version, in seq order, each `chunk_bytes`
    # long but the last. No chunks: the empty value (no checkpoint of tasks yet).
    Column("version", BigInteger, nullable=False, server_default="0"),
    Column("chunk_bytes", BigInteger, nullable=False, server_default="0"),
)

# The checkpoint value in pieces (revision 0008). A writer adds the chunks of
# a new version first, then switches `checkpoints.version` to it; chunks of
# a version that is not current and whose `step` is at or below the
# checkpoint's can never become current, and are removed. The foreign key
# names `checkpoints`, not `experiments`: inserting a chunk then locks
# nothing that selects and reports lock (PostgreSQL). Stored uncompressed on
# PostgreSQL (STORAGE EXTERNAL): floats do not compress, and the view reads
# 8-byte slices without detoasting a chunk.
checkpoint_chunks = Table(
    "checkpoint_chunks",
    metadata,
    Column(
        "experiment_id",
        Integer,
        ForeignKey("checkpoints.experiment_id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("version", BigInteger, primary_key=True, autoincrement=False),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("step", BigInteger, nullable=False),
    Column("data", LargeBinary, nullable=False),
)

# The task keys (and groups) in blocks of consecutive tasks (revision 0008),
# written with the tasks: a rebuild reads a million keys as a few values
# instead of a million rows. `keys`: the keys of tasks first_task ..
# first_task+num_tasks-1 in UTF-8, joined by NUL (no key holds one);
# `groups`: their groups likewise, NULL when none of them has one.
task_key_blocks = Table(
    "task_key_blocks",
    metadata,
    _experiment_id(),
    Column("first_task", BigInteger, primary_key=True, autoincrement=False),
    Column("num_tasks", BigInteger, nullable=False),
    Column("keys", LargeBinary, nullable=False),
    Column("groups", LargeBinary, nullable=True),
)

steps = Table(
    "steps",
    metadata,
    _experiment_id(),
    Column("step", BigInteger, primary_key=True, autoincrement=False),
    Column("batch_id", String(64), nullable=False),
    Column("pool_size", BigInteger, nullable=False),  # tasks that took part in this step
    Column("capability", Double, nullable=True),  # after this step
    Column("capability_estimate", Double, nullable=True),  # this batch's c_hat
    Column("create_time", DateTime(timezone=True), nullable=False),
)

# A step's outcomes as one value (pieces.pack_outcomes; revision 0009, before
# it one `outcomes` row per task), in a row of their own so that compaction
# deletes rows: a value set to NULL in place would leave its space in pages
# that SQLite never fills again. No row: removed by compaction.
step_outcomes = Table(
    "step_outcomes",
    metadata,
    _experiment_id(),
    Column("step", BigInteger, primary_key=True, autoincrement=False),
    Column("outcomes", LargeBinary, nullable=False),
)

batches = Table(
    "batches",
    metadata,
    _experiment_id(),
    Column("batch_id", String(64), primary_key=True),
    Column("request_key", String(256), nullable=False),
    Column("step", BigInteger, nullable=False),  # selected at
    Column("batch_size", Integer, nullable=False),
    Column("create_time", DateTime(timezone=True), nullable=False),
    Column("lease_expire_time", DateTime(timezone=True), nullable=False),
    Column("reported_step", BigInteger, nullable=True),
    UniqueConstraint("experiment_id", "request_key", name="uq_batches_experiment_request_key"),
    Index("ix_batches_open", "experiment_id", "reported_step", "lease_expire_time"),
)

# A batch's tasks in selection order as one value (pieces.pack_tasks; revision
# 0009, before it one `batch_tasks` row per task), in a row of their own as a
# step's outcomes are. No row: the batch was reported at or before the
# compaction horizon.
batch_task_lists = Table(
    "batch_task_lists",
    metadata,
    _experiment_id(),
    Column("batch_id", String(64), primary_key=True),
    Column("tasks", LargeBinary, nullable=False),
)

# The pool's event log (revision 0005): retiring and re-activating tasks, and
# setting group shares. Events are numbered `seq` 1, 2, ... per experiment
# across both tables; each carries the experiment's step when it was
# committed. Replayed in `seq` order they give the retired mask and the
# shares in force; selection is the only thing they affect.
# `retirements`: one row per task an event changed.
retirements = Table(
    "retirements",
    metadata,
    _experiment_id(),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("task_idx", BigInteger, primary_key=True, autoincrement=False),
    Column("retired", Boolean, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("create_time", DateTime(timezone=True), nullable=False),
)

# `group_shares`: one row per event, the shares as a JSON object
# {group: [min, max]} (an empty object clears them).
group_shares = Table(
    "group_shares",
    metadata,
    _experiment_id(),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("shares", Text, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("create_time", DateTime(timezone=True), nullable=False),
)
