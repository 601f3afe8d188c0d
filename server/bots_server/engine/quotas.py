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
