"""Selection building blocks: closeness scores and an exact top-k."""

from __future__ import annotations

import numpy as np

from bots_server.engine.draws import beta_draws
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
        p = beta_draws(rng, alpha, beta, params.random_stream)
    # -|p* - p| (then / tau + Gumbel) computed in place on the fresh array p:
    # the same operations per element as the expression, without temporaries.
    score = np.subtract(params.target_success, p, out=p)
    np.abs(score, out=score)
    np.negative(score, out=score)
    if params.selection_mode in _SOFTMAX_MODES:
        np.divide(score, params.temperature, out=score)
        np.add(score, rng.gumbel(size=score.shape[0]), out=score)
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


# The sampled-threshold top-k (top_k) pays off only on pools much larger
# than the batch; below these it takes the plain path.
_MIN_POOL_FOR_THRESHOLD = 8192
_MAX_BATCH_SHARE_FOR_THRESHOLD = 0.125
# Scores looked at to place the threshold, and how many more tasks than the
# batch it aims to keep (a few extra sample positions absorb sampling noise).
_THRESHOLD_SAMPLE = 4096
_THRESHOLD_HEADROOM = 2.0
_THRESHOLD_EXTRA_POSITIONS = 8


def top_k(score: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of the k largest scores, best first; random among ties at the cut.

    On a large pool, only the scores at or above a threshold read off a
    deterministic sample of the scores are ranked (no random draw: the
    stream is the same as ranking all of them). When at least k scores pass
    it and none is NaN, the k largest, the cut and every score tied at the
    cut are all among them, in the same relative order, so the batch is the
    one ranking every score would give (see _top_k_of); otherwise all
    scores are ranked."""
    kept = _at_or_above_sampled_threshold(score, k)
    if kept is None:
        return _top_k_of(score, k, rng)
    # kept is increasing, so mapping positions back preserves every order
    # _top_k_of relies on (tie list, sort of the tied picks, stable sort).
    return kept[_top_k_of(score[kept], k, rng)]


def _at_or_above_sampled_threshold(score: np.ndarray, k: int) -> np.ndarray | None:
    """Increasing indices of the scores not below a threshold that about
    _THRESHOLD_HEADROOM * k scores reach, or None where that cannot help or
    cannot be trusted (small pool, too few kept, NaN kept)."""
    n = score.shape[0]
    if n < _MIN_POOL_FOR_THRESHOLD or k > n * _MAX_BATCH_SHARE_FOR_THRESHOLD:
        return None
    sample = score[:: n // _THRESHOLD_SAMPLE]  # strided, not random: the stream stays untouched
    wanted = int(sample.shape[0] * _THRESHOLD_HEADROOM * k / n) + _THRESHOLD_EXTRA_POSITIONS
    position = sample.shape[0] - min(wanted, sample.shape[0])
    threshold = np.partition(sample, position)[position]
    # "not below" rather than ">=": a NaN is kept, then sends us to the full
    # path, whose handling of NaN this one does not try to reproduce.
    kept_mask = np.less(score, threshold)
    np.logical_not(kept_mask, out=kept_mask)
    kept = np.flatnonzero(kept_mask)
    if kept.shape[0] < k or kept.shape[0] > n // 2 or np.isnan(score[kept]).any():
        return None
    return kept


def _top_k_of(score: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Every score ranked: the cut is the k-th largest, the scores above it
    are taken, and k minus their number of the scores equal to it are drawn
    at random (rng.choice's draw depends only on how many are tied)."""
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
