"""An experiment held in memory: the posterior arrays and the task keys."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from bots_server.core.checkpoint_state import decode_state
from bots_server.core.domain import ExperimentConfig
from bots_server.engine import PosteriorState, apply_outcomes
from bots_server.store import LoadedRows, StepEvent


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

    @property
    def num_tasks(self) -> int:
        return len(self.keys)

    @property
    def capability(self) -> float | None:
        return None if math.isnan(self.state.capability) else self.state.capability

    def reference_rates(self, features: Sequence[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
        """Weak and strong reference pass rates of new tasks; NaN where missing."""
        return reference_rates(self.config, features)

    def append_tasks(self, keys: Sequence[str], weak: np.ndarray, strong: np.ndarray) -> None:
        """New tasks at the prior; `weak`/`strong` their reference pass rates (NaN: none)."""
        start = len(self.keys)
        self.keys.extend(keys)
        self.index.update((key, start + i) for i, key in enumerate(keys))
        self.state = self.state.extended(self.config, weak, strong)

    def append_loaded(self, rows: LoadedRows) -> None:
        self.append_tasks(rows.keys, _floats(rows.weak), _floats(rows.strong))

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

    def catch_up(self, rows: LoadedRows) -> None:
        """Take in what other writers committed: new tasks, then new steps.

        Tasks appended after an event's step do not take part in it (the
        event's pool_size), so adding them first is safe.
        """
        if rows.keys:
            self.append_loaded(rows)
        self.replay(rows.events)

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
        keys = rows.keys[:covered]
        live = cls(
            id=exp.id,
            name=exp.name,
            config=config,
            create_time=exp.create_time,
            keys=keys,
            index={key: i for i, key in enumerate(keys)},
            state=state,
            step=checkpoint.step,
            checkpoint_step=checkpoint.step,
        )
        if len(rows.keys) > covered:
            live.append_tasks(rows.keys[covered:], _floats(rows.weak), _floats(rows.strong))
        live.replay(rows.events)
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
