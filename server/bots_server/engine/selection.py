"""Batch selection: score every task by closeness to the target, take the best."""

from __future__ import annotations

import numpy as np

from bots_server.engine.params import EngineParams, SelectionMode, Strategy


def select(
    params: EngineParams,
    alpha: np.ndarray,
    beta: np.ndarray,
    available: np.ndarray,
    batch_size: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Indices of `batch_size` tasks among those where `available` is True.

    Best first. BOTS and MoPPS score s_i = -|p* - p_i| with p_i a Beta draw
    (thompson, softmax) or the posterior mean (mean); thompson and mean take
    the top-k, softmax draws k without replacement from softmax(s / tau)
    (Gumbel top-k, which is exactly sequential sampling without replacement).
    Uniform draws k uniformly. Ties at the cut are broken at random.
    """
    n_available = int(np.count_nonzero(available))
    if not 0 < batch_size <= n_available:
        raise ValueError(f"batch_size {batch_size} not in [1, {n_available}]")
    if params.strategy is Strategy.UNIFORM:
        score = rng.random(alpha.shape[0])
    else:
        if params.selection_mode is SelectionMode.MEAN:
            p = alpha / (alpha + beta)
        else:
            p = rng.beta(alpha, beta)
        score = -np.abs(params.target_success - p)
        if params.selection_mode is SelectionMode.SOFTMAX:
            score = score / params.temperature + rng.gumbel(size=score.shape[0])
    score = np.where(available, score, -np.inf)
    return _top_k(score, batch_size, rng)


def _top_k(score: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of the k largest scores, best first; random among ties at the cut."""
    n = score.shape[0]
    if k < n:
        cut = score[np.argpartition(score, n - k)[n - k]]
    else:
        cut = score.min()
    above = np.flatnonzero(score > cut)
    at_cut = np.flatnonzero(score == cut)
    chosen_at_cut = rng.choice(at_cut, size=k - above.shape[0], replace=False)
    chosen = np.concatenate([above, np.sort(chosen_at_cut)])
    order = np.argsort(-score[chosen], kind="stable")
    return chosen[order]
