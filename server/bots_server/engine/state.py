"""The posterior of every task, and the result of one update."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from bots_server.engine.params import EngineParams


@dataclass(frozen=True)
class PosteriorState:
    """Beta(alpha_i, beta_i) per task, plus what the plug-in needs.

    `weak` and `strong` are the reference pass rates, NaN where a task has no
    such feature. `capability` is NaN until the plug-in's first estimate.
    `rho_halvings` stays 0 unless adaptive rho is on.
    Arrays are never modified in place: an update returns new arrays, so a
    state can be shared with readers while the next one is computed.
    """

    alpha: np.ndarray
    beta: np.ndarray
    weak: np.ndarray
    strong: np.ndarray
    capability: float = math.nan
    # Adaptive rho (the reference's rule): how many times rho has been halved,
    # so the current rho is implicit_weight * 0.5 ** rho_halvings (exact in
    # binary floating point). Updated inside the update, so a replay of the
    # events reproduces it; checkpoints carry it like every field here
    # (core/checkpoint_state.py writes every field, whatever it is).
    rho_halvings: int = 0
    # Per-task embedding vectors, float32 of shape (num_tasks, dim), or None
    # when the experiment has none. Pool data, not posterior: updates carry
    # the same array along.
    embeddings: np.ndarray | None = None
    # Cross-task prediction (engine/crosstask.py, embedding_weight > 0):
    # alpha/beta above are the posteriors selection reads, each task's own
    # posterior plus the prediction's pseudo-rollouts; own_alpha/own_beta are
    # its own posterior alone (what the strategy's update evolves and the
    # regression learns from), `predicted` the pass rate predicted for every
    # task (NaN: none yet), `embedding_trust` the share of embedding_weight
    # the calibration grants. None / 0 while the prediction is off.
    own_alpha: np.ndarray | None = None
    own_beta: np.ndarray | None = None
    predicted: np.ndarray | None = None
    embedding_trust: float = 0.0

    @property
    def num_tasks(self) -> int:
        return int(self.alpha.shape[0])

    @classmethod
    def from_prior(
        cls, params: EngineParams, weak: np.ndarray, strong: np.ndarray, embeddings: np.ndarray | None = None
    ) -> PosteriorState:
        alpha, beta = starting_posterior(params, weak, strong)
        return cls(alpha, beta, weak, strong, embeddings=embeddings)

    def extended(
        self, params: EngineParams, weak: np.ndarray, strong: np.ndarray, embeddings: np.ndarray | None = None
    ) -> PosteriorState:
        """This state with new tasks appended at their starting posterior
        (and their embeddings, when the experiment has them)."""
        alpha, beta = starting_posterior(params, weak, strong)
        n = alpha.shape[0]
        if self.embeddings is not None and embeddings is not None:
            embeddings = np.concatenate([self.embeddings, embeddings])
        elif self.num_tasks > 0:
            embeddings = self.embeddings  # the dimension is the experiment's, fixed by its first tasks
        return dataclasses.replace(
            self,
            alpha=np.concatenate([self.alpha, alpha]),
            beta=np.concatenate([self.beta, beta]),
            weak=np.concatenate([self.weak, weak]),
            strong=np.concatenate([self.strong, strong]),
            embeddings=embeddings,
            own_alpha=None if self.own_alpha is None else np.concatenate([self.own_alpha, alpha]),
            own_beta=None if self.own_beta is None else np.concatenate([self.own_beta, beta]),
            predicted=None if self.predicted is None else np.concatenate([self.predicted, np.full(n, np.nan)]),
        )


def starting_posterior(params: EngineParams, weak: np.ndarray, strong: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta) of new tasks: the prior Beta(a0, b0), plus, with a warm
    start (MoPPS's prior evaluations), warm_start_scale pseudo-rollouts at the
    pass rate p0 = w + (s - w) * warm_start_position read off the reference
    models (position 0: the weak model's rate, 1: the strong one's). Tasks
    without both features start at the prior.

    Always float64: an integer prior would make integer arrays, and an
    in-place update (MoPPS) would truncate into them.
    """
    n = weak.shape[0]
    alpha = np.full(n, params.prior_alpha, dtype=np.float64)
    beta = np.full(n, params.prior_beta, dtype=np.float64)
    scale = params.warm_start_scale
    if scale > 0 and n > 0:
        p0 = np.clip(weak + (strong - weak) * params.warm_start_position, 0.0, 1.0)
        known = ~np.isnan(p0)
        alpha[known] += scale * p0[known]
        beta[known] += scale * (1.0 - p0[known])
    return alpha, beta


@dataclass(frozen=True)
class UpdateResult:
    state: PosteriorState
    capability_estimate: float  # this batch's c_hat, NaN if none
