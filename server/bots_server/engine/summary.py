"""Summaries of a posterior and of a reported batch, for monitoring."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bots_server.engine import rewards
from bots_server.engine.state import PosteriorState

# Half-width of the band around p* a task's success rate should lie in to be
# worth rolling out: with 16 rollouts, a task at 0.3 or 0.7 still gives most
# groups a mixed (informative) outcome.
TARGET_BAND = 0.2
# Quantiles of the posterior means reported to monitoring.
MEAN_QUANTILES = (0.1, 0.5, 0.9)
# The labels of PosteriorSummary.shares, in order.
SHARE_BANDS = ("below", "near", "above", "uncertain")


@dataclass(frozen=True)
class PosteriorSummary:
    """Where the pool stands relative to the target, from the posterior itself.

    `shares` classifies each task by where its posterior puts most (> half) of
    its mass: below p* - TARGET_BAND (too hard), within the band (near), above
    p* + TARGET_BAND (too easy), or nowhere in particular (uncertain: the
    posterior is too wide to say, e.g. a task whose evidence forgetting has
    worn away). A fixed band on posterior *means* cannot do this: forgetting
    pulls every mean toward the prior's, so a pool of unsolvable tasks reads
    as "in between". Here such tasks read as below (if their evidence is
    recent) or uncertain (if not), never as near.
    """

    mean_quantiles: tuple[float, ...]  # at MEAN_QUANTILES
    shares: tuple[float, float, float, float]  # in SHARE_BANDS order; they sum to 1


# The Beta mass in each band is integrated on this many cells of [0, 1]
# (midpoint rule, normalized numerically): numpy has no incomplete beta
# function, and the normal approximation calls a flat Beta(1, 1) "near p*".
# Deciding which band holds more than half the mass is robust to the grid's
# error (at most about one cell's mass at each band edge).
GRID_CELLS = 64
# Tasks integrated at once: bounds the scrape's scratch memory to about
# CHUNK * GRID_CELLS * 8 bytes * a few (~25 MB).
CHUNK = 16_384


# Posteriors with alpha + beta at least this are close enough to a normal
# distribution of the same mean and variance for the "more than half the
# mass" decision, which then costs O(1) per task instead of GRID_CELLS.
NORMAL_MIN_CONCENTRATION = 40.0


def posterior_summary(state: PosteriorState, target: float, band: float = TARGET_BAND) -> PosteriorSummary:
    """O(pool), up to GRID_CELLS per wide posterior: call it at scrape time, not per step."""
    a, b = state.alpha, state.beta
    n = a.shape[0]
    if n == 0:
        return PosteriorSummary(tuple(math.nan for _ in MEAN_QUANTILES), (0.0, 0.0, 0.0, 0.0))
    low_edge, high_edge = target - band, target + band
    narrow = (a + b) >= NORMAL_MIN_CONCENTRATION
    counts = _normal_winners(a[narrow], b[narrow], low_edge, high_edge)
    wide_a, wide_b = a[~narrow], b[~narrow]
    for start in range(0, wide_a.shape[0], CHUNK):
        counts += _grid_winners(wide_a[start : start + CHUNK], wide_b[start : start + CHUNK], low_edge, high_edge)
    shares = counts / n
    quantiles = tuple(float(q) for q in np.quantile(a / (a + b), MEAN_QUANTILES))
    return PosteriorSummary(quantiles, (float(shares[0]), float(shares[1]), float(shares[2]), float(shares[3])))


def _winners(mass: np.ndarray) -> np.ndarray:
    """Counts per band (below, near, above, uncertain) of rows of `mass`
    (n, 3): a band wins with more than half the mass, else uncertain."""
    winner = np.where(mass.max(axis=1) > 0.5, mass.argmax(axis=1), 3)
    return np.bincount(winner, minlength=4).astype(np.int64)


def _grid_winners(a: np.ndarray, b: np.ndarray, low_edge: float, high_edge: float) -> np.ndarray:
    grid = (np.arange(GRID_CELLS) + 0.5) / GRID_CELLS
    region = np.where(grid < low_edge, 0, np.where(grid > high_edge, 2, 1))
    onehot = np.eye(3)[region]  # (cells, 3): a matrix product sums each band's cells
    log_pdf = (a[:, None] - 1.0) * np.log(grid) + (b[:, None] - 1.0) * np.log1p(-grid)
    log_pdf -= log_pdf.max(axis=1, keepdims=True)
    mass = np.exp(log_pdf, out=log_pdf) @ onehot
    mass /= mass.sum(axis=1, keepdims=True)
    return _winners(mass)


def _normal_winners(a: np.ndarray, b: np.ndarray, low_edge: float, high_edge: float) -> np.ndarray:
    total = a + b
    mean = a / total
    sd = np.sqrt(mean * (1.0 - mean) / (total + 1.0))
    below = _normal_cdf((low_edge - mean) / sd)
    above = 1.0 - _normal_cdf((high_edge - mean) / sd)
    return _winners(np.stack([below, 1.0 - below - above, above], axis=1))


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """Phi(z) through Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), vectorized."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return np.asarray(0.5 * (1.0 + np.sign(z) * erf))


@dataclass(frozen=True)
class BatchSignals:
    """What one report says about the curriculum."""

    tasks: int
    informative: int  # tasks whose rewards differ (engine/rewards.py): a GRPO gradient
    successes: float
    trials: float

    @property
    def success_rate(self) -> float | None:
        return self.successes / self.trials if self.trials > 0 else None

    @property
    def informative_fraction(self) -> float | None:
        return self.informative / self.tasks if self.tasks else None


def batch_signals(
    successes: Sequence[float], trials: Sequence[int], sum_squares: Sequence[float | None]
) -> BatchSignals:
    """A report's signals from the outcomes as reported (`sum_squares`: per
    task, None where the rewards were 0 or 1)."""
    s = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if sum_squares.count(None) == len(sum_squares):  # 0/1 rewards: rewards.informative over whole columns
        informative = int(np.count_nonzero((s > 0.0) & (s < n)))
    else:
        informative = sum(map(rewards.informative, successes, trials, sum_squares))
    return BatchSignals(tasks=len(trials), informative=informative, successes=float(s.sum()), trials=float(n.sum()))


@dataclass(frozen=True)
class GroupSummary:
    """Per group (indexed by group number): tasks, retired tasks, the mean of
    its tasks' posterior means, and the fraction of its tasks whose posterior
    mean lies within TARGET_BAND of the target (NaN for an empty group)."""

    tasks: np.ndarray
    retired: np.ndarray
    mean_success: np.ndarray
    near_target: np.ndarray


def group_summary(
    state: PosteriorState, group_of: np.ndarray, retired: np.ndarray, num_groups: int, target: float,
    band: float = TARGET_BAND,
) -> GroupSummary:  # fmt: skip
    """O(pool): for a ListGroups call or a scrape, not per step."""
    mean = state.alpha / (state.alpha + state.beta)
    tasks = np.bincount(group_of, minlength=num_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_success = np.bincount(group_of, weights=mean, minlength=num_groups) / tasks
        near = np.bincount(group_of, weights=np.abs(mean - target) <= band, minlength=num_groups) / tasks
    return GroupSummary(tasks, np.bincount(group_of, weights=retired, minlength=num_groups).astype(np.int64), mean_success, near)
