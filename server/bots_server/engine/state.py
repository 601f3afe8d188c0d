"""The posterior of every task, and the result of one update."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bots_server.engine.params import EngineParams


@dataclass(frozen=True)
class PosteriorState:
    """Beta(alpha_i, beta_i) per task, plus what the plug-in needs.

    `weak` and `strong` are the reference pass rates, NaN where a task has no
    such feature. `capability` is NaN until the plug-in's first estimate.
    Arrays are never modified in place: an update returns new arrays, so a
    state can be shared with readers while the next one is computed.
    """

    alpha: np.ndarray
    beta: np.ndarray
    weak: np.ndarray
    strong: np.ndarray
    capability: float = math.nan

    @property
    def num_tasks(self) -> int:
        return int(self.alpha.shape[0])

    @classmethod
    def from_prior(cls, params: EngineParams, weak: np.ndarray, strong: np.ndarray) -> PosteriorState:
        n = weak.shape[0]
        # float64 whatever the prior's Python type: an integer prior would make
        # integer arrays, and an in-place update (MoPPS) would truncate into them.
        return cls(_full(n, params.prior_alpha), _full(n, params.prior_beta), weak, strong)

    def extended(self, params: EngineParams, weak: np.ndarray, strong: np.ndarray) -> PosteriorState:
        """This state with new tasks appended at the prior."""
        return PosteriorState(
            np.concatenate([self.alpha, _full(weak.shape[0], params.prior_alpha)]),
            np.concatenate([self.beta, _full(weak.shape[0], params.prior_beta)]),
            np.concatenate([self.weak, weak]),
            np.concatenate([self.strong, strong]),
            self.capability,
        )


def _full(n: int, value: float) -> np.ndarray:
    return np.full(n, value, dtype=np.float64)


@dataclass(frozen=True)
class UpdateResult:
    state: PosteriorState
    capability_estimate: float  # this batch's c_hat, NaN if none
