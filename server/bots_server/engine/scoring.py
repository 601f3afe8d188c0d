"""Selection building blocks: closeness scores and an exact top-k."""

from __future__ import annotations

import numpy as np

from bots_server.engine.params import EngineParams

# Modes that score the posterior mean rather than a Beta draw, and modes that
# sample the batch from softmax(score / tau) rather than taking the top-k.
_MEAN_MODES = ("mean", "softmax_mean")
_SOFTMAX_MODES = ("softmax", "softmax_mean")


def closeness(params: EngineParams, alpha: np.ndarray, beta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """s_i = -|p* - p_i| with p_i a Beta draw (thompson, softmax) or the
    posterior mean (mean, softmax_mean); the softmax modes add Gumbel noise to
    s / tau, so that the top-k is exactly sequential sampling without
    replacement from softmax(s / tau). softmax_mean is the reference selector's
    code default (do_sample off, tau > 0): no Beta draw at all."""
    if params.selection_mode == "expected":
        return expected_closeness(params.target_success, alpha, beta)
    if params.selection_mode in _MEAN_MODES:
        p = alpha / (alpha + beta)
    else:
        p = rng.beta(alpha, beta)
    score = -np.abs(params.target_success - p)
    if params.selection_mode in _SOFTMAX_MODES:
        score = score / params.temperature + rng.gumbel(size=score.shape[0])
    return score


def expected_closeness(target: float, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """-E[(p - p*)^2] under Beta(alpha, beta): -((mu - p*)^2 + mu (1 - mu) / (n + 1))
    with mu = alpha / n, n = alpha + beta. The Bayes choice for a squared
    loss: a task is picked for being near p* and for being known to be there,
    so exploration shrinks as the posteriors (and the plug-in's predictions)
    sharpen, without a random draw."""
    n = alpha + beta
    mu = alpha / n
    return -((mu - target) ** 2 + mu * (1 - mu) / (n + 1))


def top_k(score: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
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
