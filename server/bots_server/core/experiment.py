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

from bots_server.core.checkpoint_state import decode_state
from bots_server.core.domain import ExperimentConfig
from bots_server.engine import PosteriorState, apply_outcomes
from bots_server.engine.quotas import GroupQuotas
from bots_server.store import LoadedRows, PoolEvent, RetirementEvent, StepEvent

# Per task key beyond its characters: the str object (49 bytes), its slot in
# `keys` (8), its entry in `index` with the int it maps to (about 80).
BYTES_PER_KEY = 137


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
    keys: list[str]
    index: dict[str, int]
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
    group_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    shares: dict[str, tuple[float, float]] = field(default_factory=dict)
    pool_seq: int = 0
    key_characters: int = 0  # of every key, for memory_bytes

    def take(self, other: LiveExperiment) -> None:
        """Become `other` (a rebuild of this experiment), keeping this object
        and its running checkpoint task."""
        for f in dataclasses.fields(self):
            if f.name != "checkpoint_task":
                setattr(self, f.name, getattr(other, f.name))

    def memory_bytes(self) -> int:
        """About how much memory this experiment holds: its arrays, plus each
        key as a str in `keys` and in `index` (docs/operations.md measures
        the per-key figure)."""
        arrays = sum(a.nbytes for a in vars(self.state).values() if isinstance(a, np.ndarray))
        arrays += self.retired.nbytes + self.group_of.nbytes
        return arrays + self.num_tasks * BYTES_PER_KEY + self.key_characters

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
        self, keys: Sequence[str], weak: np.ndarray, strong: np.ndarray, groups: Sequence[str] | None = None
    ) -> None:
        """New tasks at the prior; `weak`/`strong` their reference pass rates
        (NaN: none); `groups` their groups ("" or None: none)."""
        self._take_keys(keys, groups)
        self.state = self.state.extended(self.config, weak, strong)

    def _take_keys(self, keys: Sequence[str], groups: Sequence[str] | None) -> None:
        """The keys and groups of tasks whose posterior `state` holds or is about to."""
        start = len(self.keys)
        self.key_characters += sum(map(len, keys))
        self.keys.extend(keys)
        self.index.update((key, start + i) for i, key in enumerate(keys))
        self.retired = np.concatenate([self.retired, np.zeros(len(keys), dtype=bool)])
        numbers = [self._group_number(g) for g in (groups or [""] * len(keys))]
        self.group_of = np.concatenate([self.group_of, np.asarray(numbers, dtype=np.int64)])

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
        self.append_tasks(rows.keys, _floats(rows.weak), _floats(rows.strong), rows.groups or None)

    @property
    def has_groups(self) -> bool:
        """Whether any task has a group."""
        return bool(self.group_names) and self.group_names != [""]

    def group_counts(self, task_idx: Sequence[int]) -> dict[str, int]:
        """Tasks per group among `task_idx` (groups with none left out)."""
        counts = np.bincount(self.group_of[np.asarray(task_idx, dtype=np.int64)], minlength=len(self.group_names))
        return {self.group_names[g]: int(c) for g, c in enumerate(counts) if c}

    def quotas(self) -> GroupQuotas | None:
        """The shares in force as the engine takes them; None without any."""
        if not self.shares:
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
            keys=[],
            index={},
            state=state,
            step=checkpoint.step,
            checkpoint_step=checkpoint.step,
        )
        live._take_keys(rows.keys[:covered], groups[:covered])
        if len(rows.keys) > covered:
            live.append_tasks(rows.keys[covered:], _floats(rows.weak), _floats(rows.strong), groups[covered:])
        live.replay(rows.events)
        live.apply_pool_events(rows.pool_events)
        return live


def reference_rates(config: ExperimentConfig, features: Sequence[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Weak and strong reference pass rates of tasks under `config`; NaN where missing."""
    weak_name, strong_name = config.reference_features
    weak = np.array([f.get(weak_name, math.nan) if weak_name else math.nan for f in features], dtype=np.float64)
    strong = np.array([f.get(strong_name, math.nan) if strong_name else math.nan for f in features], dtype=np.float64)
    return weak, strong


def _floats(values: Sequence[float | None]) -> np.ndarray:
    """Floats with NaN for None (a missing feature)."""
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)
