"""What the store reads and writes, as plain data."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# The tenant of experiments created without one, and of every experiment
# written before tenants existed (revision 0004).
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class ExperimentRow:
    id: int
    name: str
    config: Mapping[str, Any]  # the JSON object as stored
    step: int
    num_tasks: int
    capability: float | None  # after the latest step
    create_time: dt.datetime
    forked_from: str | None = None
    forked_at_step: int | None = None
    # Steps whose outcomes compaction removed (store.compact): 1..this.
    compacted_through: int = 0


@dataclass(frozen=True)
class StepEvent:
    """One applied report: the batch's outcomes and the scalars after it."""

    step: int
    batch_id: str
    pool_size: int
    task_idx: list[int]  # ascending
    successes: list[float]
    trials: list[int]
    capability: float | None
    capability_estimate: float | None
    # False for a step compaction emptied: its outcomes are gone, the
    # scalars stay (read_event of an old step).
    complete: bool = True


@dataclass(frozen=True)
class RetirementEvent:
    """One RetireTasks / ReactivateTasks call: the tasks whose state it
    changed, set to `retired`, at the experiment's `step` then."""

    seq: int  # 1, 2, ... per experiment
    step: int
    task_idx: list[int]  # ascending
    retired: bool


@dataclass(frozen=True)
class SharesEvent:
    """One SetGroupShares call: the share range of each named group from
    then on (groups not named: [0, 1]; empty: no quotas)."""

    seq: int
    step: int
    shares: dict[str, tuple[float, float]]


# The pool's events, numbered together (seq), applied in that order.
PoolEvent = RetirementEvent | SharesEvent


@dataclass(frozen=True)
class CheckpointRow:
    """The state of tasks 0..num_tasks-1 as of `step`, as the core wrote it
    (checkpoint_blob.py's format; empty before the first checkpoint of tasks)."""

    step: int
    num_tasks: int
    state: bytes
    create_time: dt.datetime


@dataclass(frozen=True)
class BatchRow:
    batch_id: str
    request_key: str
    step: int
    task_idx: list[int]  # in selection order
    create_time: dt.datetime
    lease_expire_time: dt.datetime
    reported_step: int | None
    compacted: bool = False  # reported at or before the compaction horizon: its tasks are gone


@dataclass(frozen=True)
class Lookup:
    """Rows a call needs besides the experiment's new state, read in the same
    transaction: a batch (by id or request key) and the batches open at
    `leases_at` (selected, not reported, lease not expired)."""

    batch_id: str = ""
    request_key: str = ""
    leases_at: dt.datetime | None = None


@dataclass(frozen=True)
class LoadedRows:
    """A consistent read of an experiment from one transaction."""

    experiment: ExperimentRow
    keys: list[str]  # tasks from the requested start index on
    # Reference pass rates (load's reference_features) of the tasks the
    # checkpoint does not cover: with a checkpoint, of tasks
    # checkpoint.num_tasks on; without, of every task in `keys`.
    weak: list[float | None]
    strong: list[float | None]
    checkpoint: CheckpointRow | None  # None when only reading what is new
    events: list[StepEvent]  # steps after the requested one, ascending
    batch: BatchRow | None = None  # Lookup.batch_id / request_key
    open_batches: list[BatchRow] | None = None  # with Lookup.leases_at
    pool_events: list[PoolEvent] = field(default_factory=list)  # after load's after_pool_event, by seq
    groups: list[str] = field(default_factory=list)  # the group of each task in `keys` ("": none)
    # With load's `embeddings`: the embedding of each task in `keys`, as stored.
    embeddings: list[bytes] = field(default_factory=list)

    @property
    def leased(self) -> list[int] | None:
        """The tasks of the open batches (with Lookup.leases_at)."""
        if self.open_batches is None:
            return None
        return [idx for batch in self.open_batches for idx in batch.task_idx]


@dataclass(frozen=True)
class ExperimentCopy:
    """Everything a forked or restored experiment starts from."""

    name: str
    config: Mapping[str, Any]  # the JSON object as stored
    step: int
    capability: float | None  # returned in the new experiment's row
    num_tasks: int
    state: bytes | memoryview  # its checkpoint: the state of its num_tasks tasks at `step`
    forked_from: str
    # Tasks: either copied row by row from an experiment in this database
    # (source_id, the first num_tasks tasks) or given (keys and features).
    source_id: int | None = None
    keys: list[str] | None = None
    features: list[dict[str, float]] | None = None
    retired: Sequence[int] = ()  # task indices that start retired
    groups: list[str] | None = None  # with given keys: each task's group ("": none)
    embeddings: list[bytes] | None = None  # with given keys: each task's embedding (None: none)
    shares: Mapping[str, tuple[float, float]] | None = None  # group shares in force
    tenant: str = DEFAULT_TENANT


class Compacted(NamedTuple):
    """What one compact() call did."""

    horizon: int  # the experiment's compacted_through afterwards
    steps: int  # steps whose outcomes were removed
    batches: int  # batches whose tasks were removed


class TenantUsage(NamedTuple):
    experiments: int
    tasks: int


@dataclass(frozen=True)
class TenantLimits:
    """Bounds a write must keep `tenant` within (None: no bound): at most
    `max_experiments` experiments and `max_tasks` tasks in all of them. The
    caller decides them; the store counts and compares in the write's own
    transaction."""

    tenant: str
    max_experiments: int | None = None
    max_tasks: int | None = None


class SchemaStatus(NamedTuple):
    """Where the database's schema stands against the code's migrations."""

    current: bool  # the database is at the code's head revision(s)
    revisions: list[str]  # the database's revisions (empty: no schema yet)
    heads: list[str]  # the code's head revisions
