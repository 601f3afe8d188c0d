"""What a strategy is: a selection score and a posterior update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bots_server.engine.params import EngineParams
from bots_server.engine.state import PosteriorState, UpdateResult


class Score(Protocol):
    def __call__(
        self, params: EngineParams, alpha: np.ndarray, beta: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray: ...


class Update(Protocol):
    def __call__(
        self,
        params: EngineParams,
        state: PosteriorState,
        tasks: np.ndarray,
        successes: np.ndarray,
        trials: np.ndarray,
    ) -> UpdateResult: ...


@dataclass(frozen=True)
class Strategy:
    """`score`: one number per task, the batch is the top-k of the available
    tasks. `update`: one step's outcomes (distinct task indices; successes may
    be fractional) applied to the whole pool. `settings`: the EngineParams
    fields the two read (documentation, and checked by the tests)."""

    name: str
    doc: str
    settings: tuple[str, ...]
    score: Score
    update: Update
