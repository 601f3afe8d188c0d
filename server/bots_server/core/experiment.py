"""An experiment held in memory: the posterior arrays and the task keys."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from bots_server.core import embeddings
from bots_server.core.checkpoint_state import decode_state
from bots_server.core.domain import ExperimentConfig
from bots_server.core.limits import MAX_GROUPS
from bots_server.core.task_keys import TaskKeys
from bots_server.engine import PosteriorState, apply_outcomes
from bots_server.engine.quotas import GroupQuotas
from bots_server.store import BatchRow, LoadedRows, PoolEvent, RetirementEvent, StepEvent

# A task's group number: MAX_GROUPS fits in 2 bytes (8 for int64).
GROUP_DTYPE = np.int16
assert np.iinfo(GROUP_DTYPE).max >= MAX_GROUPS

# What an experiment costs beside its per-task arrays: the object, its
# config, dicts, lists, small arrays, its lock and metric series.
# bench/memory.py measured 18-27 KiB resident per experiment of 10 tasks
# (docs/operations.md).
EXPERIMENT_OVERHEAD_BYTES = 20_000


@dataclass
class LiveExperiment:
    """The authoritative in-memory copy of one experiment on this replica.

    `state` and `step` change together, and only after the store committed
    the step. Arrays are never mutated in place, so a reader may keep a
    reference to an old state.
    """

    id: int
    name: str
    config: ExperimentConfig  # also the engine's parameters
    create_time: dt.datetime
    keys: TaskKeys  # keys[i], keys.lookup([...]) -> task indices (-1: none)
    state: PosteriorState
    step: int
    checkpoint_step: int
    checkpoint_time: float = field(default_factory=time.monotonic)
    checkpoint_task: asyncio.Task[None] | None = None
    # Retired tasks (never selected; their posterior is updated as any
    # unselected task's). The fold of the retirement events up to
    # `pool_seq`, read back whole on every rebuild: the posterior does
    # not depend on it, so neither checkpoints nor the step replay carry it.
    retired: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # Groups: their names by first appearance in task order (so every replica
    # numbers them alike), each task's group number, and the shares in force
    # ({group: (min, max)}; empty: no quotas). Retirements and shares are the
    # pool's events; `pool_seq` is the last one applied.
    group_names: list[str] = field(default_factory=list)
    group_index: dict[str, int] = field(default_factory=dict)
    group_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=GROUP_DTYPE))
    shares: dict[str, tuple[float, float]] = field(default_factory=dict)
    pool_seq: int = 0
    # The experiment's open batches as this copy knows them, by id (their
    # leases may have expired since): a select leaves their tasks out, and
    # the store checks, in the select's own transaction, that exactly these
    # are open (another replica's batch makes it catch up and choose again).
    open_batches: dict[str, BatchRow] = field(default_factory=dict)
    # The keys of the batch this copy stored last, (batch id, keys): the
    # reply carries them, and a report of that batch (a trainer's next call)
    # matches against them without decoding them again.
    last_batch_keys: tuple[str, list[str]] | None = None

    def take(self, other: LiveExperiment) -> None:
        """Become `other` (a rebuild of this experiment), keeping this object
        and its running checkpoint task."""
        for f in dataclasses.fields(self):
            if f.name != "checkpoint_task":
                setattr(self, f.name, getattr(other, f.name))

    def memory_bytes(self) -> int:
        """About how much memory this experiment holds: its arrays (the
        embeddings among them), its keys and a fixed overhead
        (docs/operations.md compares it with the resident memory it adds)."""
        arrays = sum(a.nbytes for a in vars(self.state).values() if isinstance(a, np.ndarray))
        arrays += self.retired.nbytes + self.group_of.nbytes
        return arrays + self.keys.nbytes + EXPERIMENT_OVERHEAD_BYTES

    def batch_keys(self, batch: BatchRow) -> list[str]:
        """The keys of `batch`'s tasks, in its order (do not change the list)."""
        last = self.last_batch_keys
        if last is not None and last[0] == batch.batch_id:
            return last[1]
        return self.keys.take(batch.task_idx)

    @property
    def num_tasks(self) -> int:
        return len(self.keys)

    @property
    def capability(self) -> float | None:
        return None if math.isnan(self.state.capability) else self.state.capability

    def reference_rates(self, features: Sequence[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
        """Weak and strong reference pass rates of new tasks; NaN where missing."""
        return reference_rates(self.config, features)

    def append_tasks(
        self,
        keys: Sequence[str],
        weak: np.ndarray,
        strong: np.ndarray,
        groups: Sequence[str] | None = None,
        vectors: Sequence[bytes] = (),
    ) -> None:
        """New tasks at the prior; `weak`/`strong` their reference pass rates
        (NaN: none); `groups` their groups ("" or None: none); `vectors`
        their embeddings (validated: one each when the experiment has an
        embedding_dim)."""
        if self.config.embedding_dim and len(vectors) != len(keys):
            raise RuntimeError(f"experiment {self.name!r}: {len(keys)} new tasks, {len(vectors)} embeddings")
        self._take_keys(keys, groups)
        added = embeddings.matrix(vectors, self.config.embedding_dim)
        self.state = self.state.extended(self.config, weak, strong, added)

    def _take_keys(self, keys: Sequence[str], groups: Sequence[str] | None) -> None:
        """The keys and groups of tasks whose posterior `state` holds or is about to."""
        if not keys:
            return  # no group either: groups are numbered by first appearance
        self.keys.extend(keys)
        self.retired = np.concatenate([self.retired, np.zeros(len(keys), dtype=bool)])
        if groups:
            for name in dict.fromkeys(groups):  # new groups numbered in order of first appearance
                self._group_number(name)
            numbers = np.fromiter(map(self.group_index.__getitem__, groups), dtype=GROUP_DTYPE, count=len(keys))
        else:
            numbers = np.full(len(keys), self._group_number(""), dtype=GROUP_DTYPE)
        self.group_of = np.concatenate([self.group_of, numbers])

    def _group_number(self, name: str) -> int:
        number = self.group_index.get(name)
        if number is None:
            number = self.group_index[name] = len(self.group_names)
            self.group_names.append(name)
        return number

    def new_groups(self, groups: Sequence[str]) -> set[str]:
        """Which of `groups` the experiment does not have yet."""
        return set(groups) - set(self.group_index)

    def append_loaded(self, rows: LoadedRows) -> None:
        self.append_tasks(rows.keys, _floats(rows.weak), _floats(rows.strong), rows.groups or None, rows.embeddings)

    @property
    def has_groups(self) -> bool:
        """Whether any task has a group."""
        return bool(self.group_names) and self.group_names != [""]

    def group_counts(self, task_idx: Sequence[int]) -> dict[str, int]:
        """Tasks per group among `task_idx` (groups with none left out)."""
        counts = np.bincount(self.group_of[np.asarray(task_idx, dtype=np.int64)], minlength=len(self.group_names))
        return {self.group_names[g]: int(c) for g, c in enumerate(counts) if c}

    def quotas(self) -> GroupQuotas | None:
        """The shares in force as the engine takes them; None without any
        (adaptive shares: groups without shares set are [0, 1])."""
        if not self.shares and not (self.config.adaptive_shares > 0 and self.has_groups):
            return None
        low = np.zeros(len(self.group_names))
        high = np.ones(len(self.group_names))
        for name, (lo, hi) in self.shares.items():
            number = self.group_index.get(name)
            if number is not None:
                low[number], high[number] = lo, hi
        return GroupQuotas(self.group_of, low, high)

    def replay(self, events: Sequence[StepEvent]) -> None:
        """Apply committed events, exactly as their reports were applied."""
        for event in events:
            if event.step != self.step + 1:
                raise RuntimeError(f"experiment {self.name!r}: event for step {event.step} after step {self.step}")
            result = apply_outcomes(
                self.config,
                self.state,
                np.asarray(event.task_idx, dtype=np.int64),
                np.asarray(event.successes, dtype=np.float64),
                np.asarray(event.trials, dtype=np.float64),
                pool_size=event.pool_size,
            )
            self.state = result.state
            self.step = event.step
            self.open_batches.pop(event.batch_id, None)

    def apply_pool_events(self, events: Sequence[PoolEvent]) -> None:
        """Apply committed pool events, in order. A retirement sets its tasks'
        state (so the result is the last event's word on every task); a
        shares event replaces the shares."""
        for event in events:
            if event.seq != self.pool_seq + 1:
                raise RuntimeError(f"experiment {self.name!r}: pool event {event.seq} after {self.pool_seq}")
            if isinstance(event, RetirementEvent):
                retired = self.retired.copy()  # readers may hold the old mask
                retired[np.asarray(event.task_idx, dtype=np.int64)] = event.retired
                self.retired = retired
            else:
                self.shares = dict(event.shares)
            self.pool_seq = event.seq

    @property
    def num_retired(self) -> int:
        return int(np.count_nonzero(self.retired))

    def catch_up(self, rows: LoadedRows) -> None:
        """Take in what other writers committed: new tasks, then new steps
        and retirements.

        Tasks appended after an event's step do not take part in it (the
        event's pool_size), so adding them first is safe; a retirement may
        name any task added before it.
        """
        if rows.keys:
            self.append_loaded(rows)
        self.replay(rows.events)
        self.apply_pool_events(rows.pool_events)

    @classmethod
    def rebuild(cls, rows: LoadedRows, config: ExperimentConfig) -> LiveExperiment:
        """The last checkpoint, the tasks added after it, and a replay of
        every event after it."""
        checkpoint = rows.checkpoint
        assert checkpoint is not None
        exp = rows.experiment
        state = decode_state(checkpoint.state, config)
        covered = checkpoint.num_tasks
        vectors = rows.embeddings
        if config.embedding_dim and len(vectors) != len(rows.keys):
            raise RuntimeError(f"experiment {exp.name!r}: {len(rows.keys)} keys, {len(vectors)} embeddings")
        state = dataclasses.replace(state, embeddings=embeddings.matrix(vectors[:covered], config.embedding_dim))
        if state.num_tasks != covered or len(rows.keys) != covered + len(rows.weak):
            raise RuntimeError(
                f"experiment {exp.name!r}: checkpoint of {state.num_tasks} tasks (row: {covered}), "
                f"{len(rows.keys)} keys, {len(rows.weak)} tasks after it"
            )
        groups = rows.groups or [""] * len(rows.keys)
        live = cls(
            id=exp.id,
            name=exp.name,
            config=config,
            create_time=exp.create_time,
            keys=TaskKeys(),
            state=state,
            step=checkpoint.step,
            checkpoint_step=checkpoint.step,
        )
        live._take_keys(rows.keys[:covered], groups[:covered])
        if len(rows.keys) > covered:
            live.append_tasks(
                rows.keys[covered:], _floats(rows.weak), _floats(rows.strong), groups[covered:], vectors[covered:]
            )
        live.replay(rows.events)
        live.apply_pool_events(rows.pool_events)
        live.know_open_batches(rows)
        return live

    def know_open_batches(self, rows: LoadedRows) -> None:
        """Take the open batches a read found (when it asked for them)."""
        if rows.open_batches is not None:
            self.open_batches = {batch.batch_id: batch for batch in rows.open_batches}

    def leased_at(self, now: dt.datetime, besides: str | None = None) -> tuple[list[str], list[int]]:
        """The batches open at `now` (ids) and their tasks, as this copy
        knows them; `besides`: a batch left out (the one being reported)."""
        ids, tasks = [], []
        for batch in self.open_batches.values():
            if batch.lease_expire_time > now and batch.batch_id != besides:
                ids.append(batch.batch_id)
                tasks.extend(batch.task_idx)
        return ids, tasks


def reference_rates(config: ExperimentConfig, features: Sequence[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Weak and strong reference pass rates of tasks under `config`; NaN where missing."""
    weak_name, strong_name = config.reference_features
    weak = np.array([f.get(weak_name, math.nan) if weak_name else math.nan for f in features], dtype=np.float64)
    strong = np.array([f.get(strong_name, math.nan) if strong_name else math.nan for f in features], dtype=np.float64)
    return weak, strong


def _floats(values: Sequence[float | None]) -> np.ndarray:
    """Floats with NaN for None (a missing feature)."""
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)
