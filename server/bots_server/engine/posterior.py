"""The posterior update of one step (DESIGN.md section 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bots_server.engine.params import EngineParams, Strategy

# Denominator guard of the interpolation plug-in, as in the reference code.
_EPS = 1e-6


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
        return cls(np.full(n, params.prior_alpha), np.full(n, params.prior_beta), weak, strong)

    def extended(self, params: EngineParams, weak: np.ndarray, strong: np.ndarray) -> PosteriorState:
        """This state with new tasks appended at the prior."""
        return PosteriorState(
            np.concatenate([self.alpha, np.full(weak.shape[0], params.prior_alpha)]),
            np.concatenate([self.beta, np.full(weak.shape[0], params.prior_beta)]),
            np.concatenate([self.weak, weak]),
            np.concatenate([self.strong, strong]),
            self.capability,
        )


@dataclass(frozen=True)
class UpdateResult:
    state: PosteriorState
    capability_estimate: float  # this batch's c_hat, NaN if none


def apply_outcomes(
    params: EngineParams,
    state: PosteriorState,
    tasks: np.ndarray,
    successes: np.ndarray,
    trials: np.ndarray,
    pool_size: int | None = None,
) -> UpdateResult:
    """One step: the outcomes of the reported tasks update every task.

    `tasks` are distinct indices; `successes` may be fractional. Only the first
    `pool_size` tasks take part (replay of a step from before tasks were added);
    the rest are carried over unchanged.
    """
    n = state.num_tasks if pool_size is None else pool_size
    if n < state.num_tasks:
        head = PosteriorState(state.alpha[:n], state.beta[:n], state.weak[:n], state.strong[:n], state.capability)
        result = apply_outcomes(params, head, tasks, successes, trials)
        new = result.state
        return UpdateResult(
            PosteriorState(
                np.concatenate([new.alpha, state.alpha[n:]]),
                np.concatenate([new.beta, state.beta[n:]]),
                state.weak,
                state.strong,
                new.capability,
            ),
            result.capability_estimate,
        )
    rate = successes / trials
    if params.strategy is Strategy.MOPPS:
        return UpdateResult(_mopps(params, state, tasks, successes, trials), math.nan)
    return _bots(params, state, tasks, rate)


def _mopps(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, successes: np.ndarray, trials: np.ndarray
) -> PosteriorState:
    """MoPPS: raw counts, and only the selected tasks decay toward the prior."""
    lam = params.forgetting
    alpha = state.alpha.copy()
    beta = state.beta.copy()
    alpha[tasks] = (1 - lam) * alpha[tasks] + lam * params.prior_alpha + successes
    beta[tasks] = (1 - lam) * beta[tasks] + lam * params.prior_beta + (trials - successes)
    return PosteriorState(alpha, beta, state.weak, state.strong, state.capability)


def _bots(params: EngineParams, state: PosteriorState, tasks: np.ndarray, rate: np.ndarray) -> UpdateResult:
    lam, rho, m = params.forgetting, params.implicit_weight, params.rollouts_per_task
    n = state.num_tasks

    explicit_s = np.zeros(n)
    explicit_f = np.zeros(n)
    explicit_s[tasks] = rate * m
    explicit_f[tasks] = (1 - rate) * m

    capability, c_hat = _capability(params, state, tasks, rate)
    # rho_i: rho where the plug-in predicts task i (it has both features, or it
    # was reported, in which case its prediction is its observed rate), else 0.
    if math.isnan(capability) or rho == 0:
        rho_i = np.zeros(n)
        predicted = np.zeros(n)
    else:
        predicted = np.clip(state.weak + (state.strong - state.weak) * capability, 0.0, 1.0)
        predicted[tasks] = rate
        has_prediction = ~np.isnan(predicted)
        rho_i = np.where(has_prediction, rho, 0.0)
        predicted = np.where(has_prediction, predicted, 0.0)

    alpha = (1 - lam) * state.alpha + lam * params.prior_alpha + (1 - rho_i) * explicit_s + rho_i * m * predicted
    beta = (1 - lam) * state.beta + lam * params.prior_beta + (1 - rho_i) * explicit_f + rho_i * m * (1 - predicted)
    return UpdateResult(PosteriorState(alpha, beta, state.weak, state.strong, capability), c_hat)


def _capability(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, rate: np.ndarray
) -> tuple[float, float]:
    """(capability after this step, this batch's estimate c_hat).

    c_hat = (mean r - mean w) / (mean s - mean w + 1e-6) over the reported tasks
    that have both reference features; the capability is c_hat on the first
    estimate, then an EMA. Without such tasks it stays as it was.
    """
    weak = state.weak[tasks]
    strong = state.strong[tasks]
    usable = ~(np.isnan(weak) | np.isnan(strong))
    if not usable.any():
        return state.capability, math.nan
    mean_r = float(np.mean(rate[usable]))
    mean_w = float(np.mean(weak[usable]))
    mean_s = float(np.mean(strong[usable]))
    c_hat = (mean_r - mean_w) / (mean_s - mean_w + _EPS)
    if math.isnan(state.capability):
        return c_hat, c_hat
    ema = params.capability_ema
    return ema * state.capability + (1 - ema) * c_hat, c_hat
