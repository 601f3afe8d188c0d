"""Group quotas: batches that mix groups of tasks (datasets) in set shares.

Each group g has a share range [min_g, max_g] of the batch (a fixed share is
min_g = max_g; a group without one is [0, 1]). In tasks, for a batch of B:
at least floor(min_g * B) and at most ceil(max_g * B), so a fixed share p
gives floor(p * B) or ceil(p * B) tasks, exactly p * B when that is whole.

Selection ranks every available task once by the strategy's score (ties in
random order), then takes, in that order:
  1. each group's best tasks up to its minimum;
  2. the best remaining tasks of groups still below their maximum, until the
     batch is full.
Degrading when tasks run short (leased, retired, or a small group):
  - a group with fewer free tasks than its minimum gives all it has, and the
    other groups fill the rest (step 2);
  - if the maxima then cannot fill the batch, the best remaining tasks of any
    group do (step 3), exceeding those maxima.
So a select never fails for its quotas: only when the pool has fewer free
tasks than the batch, as without groups.

Adaptive shares (the setting `adaptive_shares` = a > 0) first replace each
group's range by one share inside it, for this batch only:

  share_g = clip(s * t_g, min_g, max_g),  t_g = (1 - a) / G + a * f_g / sum(f),

with s the scale that makes the shares sum to 1 (as far as the bounds allow),
max_g also capped at the group's free tasks over the batch, and G the groups
with free tasks (the candidate set, with candidate_ratio). f_g estimates the
fraction of g's groups of m rollouts whose rewards differ (the ones that
carry a GRPO gradient). Per
task, the evidence beyond the prior, e_s = alpha - a0 and e_f = beta - b0,
is what its reports gave (the forgetting scales both by (1 - lambda) a step,
so their ratio r = e_s / (e_s + e_f) stays the reported rate; keep_successes
spares e_s, so r leans toward the successes there); a group of m
at rate r differs with chance u(r) = 1 - r^m - (1 - r)^m, which is 0 for a
task reported all right or all wrong. f_g is the mean of u(r) over g's free
tasks weighted by e_s + e_f: an exponentially weighted average over g's
recent reports, fresher than any one task's posterior since it pools every
report of the group. Evidence the posterior holds without a report counts
the same: the plug-in's implicit pseudo-counts (tasks with reference
features) and a warm start. The prior counts as one report of m rollouts at
its mean, so a group never tried and without such evidence starts near the
top, and the (1 - a) / G part keeps exploring groups whose estimate is low.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bots_server.engine import strategies
from bots_server.engine.params import EngineParams

# Shares are compared with this tolerance (they arrive as decimal fractions:
# 0.1 + 0.2 + 0.7 is not exactly 1 in binary).
SHARE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class GroupQuotas:
    """Task i is in group group_of[i]; group g's share range is
    [min_shares[g], max_shares[g]]."""

    group_of: np.ndarray
    min_shares: np.ndarray
    max_shares: np.ndarray


def quota_bounds(batch_size: int, min_shares: np.ndarray, max_shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) task counts per group for a batch of `batch_size`."""
    lower = np.floor(min_shares * batch_size + SHARE_TOLERANCE).astype(np.int64)
    upper = np.ceil(max_shares * batch_size - SHARE_TOLERANCE).astype(np.int64)
    return np.clip(lower, 0, batch_size), np.clip(upper, 0, batch_size)


def select_with_quotas(
    params: EngineParams,
    alpha: np.ndarray,
    beta: np.ndarray,
    available: np.ndarray,
    batch_size: int,
    rng: np.random.Generator,
    quotas: GroupQuotas,
) -> np.ndarray:
    """Indices of `batch_size` available tasks (`available`: after any
    candidate pre-selection), best first, honouring each group's share range
    as the module docstring says."""
    if params.adaptive_shares > 0:
        num_groups = quotas.min_shares.shape[0]
        fraction, free = informative_fractions(params, alpha, beta, available, quotas.group_of, num_groups)
        quotas = adapted_quotas(params, quotas, fraction, free, batch_size)
    candidates = np.flatnonzero(available)
    score = strategies.get(params.strategy).score(params, alpha, beta, rng)[candidates]
    tie_break = rng.random(candidates.shape[0])
    order = candidates[np.lexsort((tie_break, -score))]  # best first, ties in random order
    groups = quotas.group_of[order]
    rank = _rank_within_group(groups, quotas.min_shares.shape[0])
    lower, upper = quota_bounds(batch_size, quotas.min_shares, quotas.max_shares)
    first = rank < lower[groups]
    taken = int(np.count_nonzero(first))
    if taken > batch_size:  # minima summing past 1 (validation forbids it): keep the best
        first &= np.cumsum(first) <= batch_size
        taken = batch_size
    within_max = ~first & (rank < upper[groups])
    second = np.flatnonzero(within_max)[: batch_size - taken]
    taken += second.shape[0]
    third = np.flatnonzero(~first & ~within_max)[: batch_size - taken]
    positions = np.sort(np.concatenate([np.flatnonzero(first), second, third]))
    return order[positions]


def adapted_quotas(
    params: EngineParams, quotas: GroupQuotas, fraction: np.ndarray, free: np.ndarray, batch_size: int | None = None
) -> GroupQuotas:
    """`quotas` with each group's range replaced by its adaptive share (the
    module docstring): min = max = share_g. `fraction` and `free` are
    informative_fractions' answer. With `batch_size`, no group's share
    exceeds its free tasks (free_g / batch_size), so a group short of tasks
    leaves its slots to the others within their own maxima."""
    present = free > 0
    if not present.any():
        raise ValueError("adaptive shares need at least one free task")
    equal = 1.0 / int(np.count_nonzero(present))
    total = fraction[present].sum()  # 0 only for m = 1, where no group of rollouts can differ
    lean = fraction / total if total > 0 else np.full(fraction.shape[0], equal)
    a = params.adaptive_shares
    target = np.where(present, (1 - a) * equal + a * lean, 0.0)
    high = np.where(present, quotas.max_shares, 0.0)
    if batch_size is not None:
        high = np.minimum(high, free / batch_size)
    low = np.minimum(np.where(present, quotas.min_shares, 0.0), high)
    share = _scale_into(target, low, high)
    return GroupQuotas(quotas.group_of, share, share)


def informative_fractions(
    params: EngineParams, alpha: np.ndarray, beta: np.ndarray, available: np.ndarray, group_of: np.ndarray,
    num_groups: int,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(f_g, free tasks) per group: f_g as the module docstring says."""
    free = np.flatnonzero(available)
    successes = np.maximum(alpha[free] - params.prior_alpha, 0.0)
    failures = np.maximum(beta[free] - params.prior_beta, 0.0)
    weight = successes + failures
    rate = np.divide(successes, weight, out=np.zeros_like(weight), where=weight > 0)
    m = params.rollouts_per_task
    groups = group_of[free]
    evidence = np.bincount(groups, weights=weight, minlength=num_groups)
    mass = np.bincount(groups, weights=weight * _differ(rate, m), minlength=num_groups)
    prior = _differ(params.prior_alpha / (params.prior_alpha + params.prior_beta), m)
    return (mass + m * prior) / (evidence + m), np.bincount(groups, minlength=num_groups)


def _differ(rate: np.ndarray | float, m: int) -> np.ndarray | float:
    """The chance that m rollouts at pass rate `rate` do not all agree."""
    return 1.0 - rate**m - (1.0 - rate) ** m


def _scale_into(target: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """clip(s * target, low, high) with the s >= 0 that makes it sum to 1; the
    bounds' own sums where they cannot (bisection: the sum rises with s)."""
    if low.sum() >= 1.0 - SHARE_TOLERANCE:
        return low
    highest = np.where(target > 0, high, low)
    if highest.sum() <= 1.0 + SHARE_TOLERANCE:
        return highest
    lo, hi = 0.0, float(np.max(high[target > 0] / target[target > 0]))
    for _ in range(64):
        mid = (lo + hi) / 2
        if np.clip(mid * target, low, high).sum() < 1.0:
            lo = mid
        else:
            hi = mid
    return np.clip(hi * target, low, high)


def _rank_within_group(groups: np.ndarray, num_groups: int) -> np.ndarray:
    """For each position, how many earlier positions hold the same group."""
    by_group = np.argsort(groups, kind="stable")
    counts = np.bincount(groups, minlength=num_groups)
    starts = np.cumsum(counts) - counts
    rank = np.empty(groups.shape[0], dtype=np.int64)
    rank[by_group] = np.arange(groups.shape[0]) - starts[groups[by_group]]
    return rank


def share_problem(shares: dict[str, tuple[float, float]], all_groups: list[str]) -> str | None:
    """Why these shares cannot be met, or None. `all_groups`: every group the
    experiment has (groups not in `shares` are [0, 1])."""
    for name, (low, high) in shares.items():
        if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high <= 1.0):
            return f"group {name!r}: shares must satisfy 0 <= min <= max <= 1 (got min {low!r}, max {high!r})"
    if not shares:
        return None
    total_min = math.fsum(low for low, _ in shares.values())
    fixed = all(low == high for low, high in shares.values())
    if fixed and set(shares) >= set(all_groups) and abs(total_min - 1.0) > SHARE_TOLERANCE:
        return f"the fixed shares of every group sum to {total_min:g}, not 1"
    if total_min > 1.0 + SHARE_TOLERANCE:
        return f"minimum shares sum to {total_min:g}, more than 1"
    if set(shares) >= set(all_groups):
        total_max = math.fsum(high for _, high in shares.values())
        if total_max < 1.0 - SHARE_TOLERANCE:
            return f"maximum shares sum to {total_max:g}, less than 1: no batch could be filled"
    return None
