"""One step of a strategy: select a batch, apply a batch's outcomes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from bots_server.engine import crosstask, strategies
from bots_server.engine.params import EngineParams
from bots_server.engine.quotas import GroupQuotas, select_with_quotas
from bots_server.engine.scoring import top_k
from bots_server.engine.state import PosteriorState, UpdateResult


def select(
    params: EngineParams,
    alpha: np.ndarray,
    beta: np.ndarray,
    available: np.ndarray,
    batch_size: int,
    rng: np.random.Generator,
    quotas: GroupQuotas | None = None,
) -> np.ndarray:
    """Indices of `batch_size` tasks among those where `available` is True,
    best first by the strategy's score; ties at the cut broken at random.
    With `quotas`, each group's share of the batch is honoured (quotas.py);
    without, the draws are the same as before groups existed."""
    n_available = int(np.count_nonzero(available))
    if not 0 < batch_size <= n_available:
        raise ValueError(f"batch_size {batch_size} not in [1, {n_available}]")
    if params.candidate_ratio > 0:
        available = _candidates(available, n_available, batch_size, params.candidate_ratio, rng)
    if quotas is not None:
        return select_with_quotas(params, alpha, beta, available, batch_size, rng, quotas)
    drawn = round(params.uniform_share * batch_size)
    if drawn > 0:
        return _with_uniform_share(params, alpha, beta, available, batch_size, drawn, rng)
    score = strategies.get(params.strategy).score(params, alpha, beta, rng)
    if available.all():
        return top_k(score, batch_size, rng)
    return top_k_available(score, available, batch_size, rng)


def _with_uniform_share(
    params: EngineParams,
    alpha: np.ndarray,
    beta: np.ndarray,
    available: np.ndarray,
    batch_size: int,
    drawn: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """uniform_share: `drawn` tasks uniformly at random among the available
    ones (drawn first, so the draw depends only on them), then the best of
    the rest by the strategy's score; the uniform picks come last."""
    uniform = rng.choice(np.flatnonzero(available), size=drawn, replace=False)
    if drawn == batch_size:
        return np.sort(uniform)
    rest = available.copy()
    rest[uniform] = False
    score = strategies.get(params.strategy).score(params, alpha, beta, rng)
    ranked = top_k_available(score, rest, batch_size - drawn, rng)
    return np.concatenate([ranked, np.sort(uniform)])


def top_k_available(score: np.ndarray, available: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """top_k(np.where(available, score, -inf), k, rng), ranking only the
    available tasks (a MoPPS candidate set is a few thousand of a million).

    Exact when their scores are finite: there are at least k of them, so the
    cut is finite and every score above or tied with it is an available one,
    in the same index order (see top_k). Otherwise, as that expression."""
    free = np.flatnonzero(available)
    free_scores = score[free]
    if not np.isfinite(free_scores).all():
        return top_k(np.where(available, score, -np.inf), k, rng)
    return free[top_k(free_scores, k, rng)]


def _candidates(
    available: np.ndarray, n_available: int, batch_size: int, ratio: float, rng: np.random.Generator
) -> np.ndarray:
    """MoPPS's pre-selection: a uniformly random candidate set of
    ceil(ratio * batch_size) available tasks (at least the batch, at most all
    of them), among which the strategy's score then picks. Drawn before the
    scores, and only when the setting is on, so the default draws the same
    numbers as before the setting existed."""
    size = min(n_available, max(batch_size, math.ceil(ratio * batch_size)))
    chosen = rng.choice(np.flatnonzero(available), size=size, replace=False)
    candidates = np.zeros_like(available, dtype=bool)
    candidates[chosen] = True
    return candidates


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
    if n >= state.num_tasks:
        return _update(params, state, tasks, successes, trials)
    heads: dict[str, Any] = {name: _head(getattr(state, name), n) for name in (*_PER_TASK, *_POOL)}
    result = _update(params, dataclasses.replace(state, **heads), tasks, successes, trials)
    new = result.state
    joined: dict[str, Any] = {name: _joined(getattr(new, name), _rest(state, name), n) for name in _PER_TASK}
    pool: dict[str, Any] = {name: getattr(state, name) for name in _POOL}
    return UpdateResult(dataclasses.replace(new, **joined, **pool), result.capability_estimate)


# The state's arrays with one entry per task that an update changes, and
# those it only reads (the pool's data).
_PER_TASK = ("alpha", "beta", "own_alpha", "own_beta", "predicted")
_POOL = ("weak", "strong", "embeddings")


def _update(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, successes: np.ndarray, trials: np.ndarray
) -> UpdateResult:
    """The strategy's update; with the cross-task prediction on, of the own
    posteriors, with the trust calibrated on this batch first and the
    prediction added after (engine/crosstask.py)."""
    update = strategies.get(params.strategy).update
    if not crosstask.active(params, state):
        return update(params, state, tasks, successes, trials)
    trust = crosstask.calibrated_trust(params, state, tasks, successes, trials)
    result = update(params, crosstask.own_state(state), tasks, successes, trials)
    return UpdateResult(crosstask.fused(params, result.state, trust), result.capability_estimate)


def _head(values: np.ndarray | None, n: int) -> np.ndarray | None:
    return None if values is None else values[:n]


def _rest(state: PosteriorState, name: str) -> np.ndarray:
    """A per-task array of `state` as the tasks after the updated ones keep
    it; where the state has none yet, what it stands for: the own posteriors
    are the posteriors, and there is no prediction."""
    values = getattr(state, name)
    if values is not None:
        return np.asarray(values)
    if name == "predicted":
        return np.full(state.num_tasks, np.nan)
    return state.alpha if name == "own_alpha" else state.beta


def _joined(head: np.ndarray | None, whole: np.ndarray, n: int) -> np.ndarray | None:
    """The updated first n entries followed by the rest as they were."""
    if head is None:
        return None
    return np.concatenate([head, whole[n:]])
