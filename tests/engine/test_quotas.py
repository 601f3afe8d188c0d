"""Group quotas in selection, against counts and picks worked out by hand.

Mean selection with target 0.5 makes the score -|0.5 - mean|, so the best
tasks are read off the means below."""

from __future__ import annotations

import numpy as np
import pytest

from bots_server.engine import EngineParams, select, step_rng
from bots_server.engine.quotas import GroupQuotas, quota_bounds, share_problem

MEAN = EngineParams(selection_mode="mean")
# Group A: tasks 0-5, means 0.50 0.45 0.40 0.30 0.20 0.10 (best first)
# Group B: tasks 6-11, means 0.52 0.60 0.65 0.75 0.85 0.95 (best first)
MEANS = np.array([0.50, 0.45, 0.40, 0.30, 0.20, 0.10, 0.52, 0.60, 0.65, 0.75, 0.85, 0.95])
ALPHA = MEANS * 100.0
BETA = (1.0 - MEANS) * 100.0
GROUP_OF = np.array([0] * 6 + [1] * 6)


def pick(batch: int, low: list[float], high: list[float], available: np.ndarray | None = None, seed: int = 0) -> list[int]:
    quotas = GroupQuotas(GROUP_OF, np.array(low), np.array(high))
    free = np.ones(12, dtype=bool) if available is None else available
    chosen = select(MEAN, ALPHA, BETA, free, batch, step_rng(seed, 0, "k"), quotas)
    return chosen.tolist()


def test_bounds_are_floor_of_min_and_ceil_of_max() -> None:
    lower, upper = quota_bounds(10, np.array([0.25, 0.1, 0.0]), np.array([0.25, 0.7, 1.0]))
    assert lower.tolist() == [2, 1, 0] and upper.tolist() == [3, 7, 10]
    # Decimal shares that are whole in tasks stay whole despite binary rounding: 0.1 * 30 = 3.0000000000000004.
    lower, upper = quota_bounds(30, np.array([0.1]), np.array([0.1]))
    assert lower.tolist() == [3] and upper.tolist() == [3]


def test_fixed_shares_take_each_groups_best_tasks() -> None:
    # 8 tasks, A 0.25 -> 2, B 0.75 -> 6. Unconstrained the top 8 would be
    # 0, 6, 1, 2, 7, 8, 3, 9 (A has 4 of them); with the shares A gives only 0 and 1.
    assert pick(8, [0.25, 0.75], [0.25, 0.75]) == [0, 6, 1, 7, 8, 9, 10, 11]


def test_a_minimum_share_brings_in_a_far_group() -> None:
    # B min 0.75 of 4: B's best three (6, 7, 8), then the best remaining task (0).
    assert sorted(pick(4, [0.0, 0.75], [1.0, 1.0])) == [0, 6, 7, 8]
    # Without the minimum: the plain top 4 by closeness: 0 (0.00), 6 (0.02), 1 (0.05), 2 and 7 tie at 0.10.
    top = pick(4, [0.0, 0.0], [1.0, 1.0])
    assert top[:3] == [0, 6, 1] and top[3] in (2, 7)


def test_a_maximum_share_caps_a_close_group() -> None:
    # A max 0.25 of 4 -> at most 1 task of A (its best, 0); B gives 6, 7, 8.
    assert sorted(pick(4, [0.0, 0.0], [0.25, 1.0])) == [0, 6, 7, 8]


def test_a_share_that_is_not_whole_gives_floor_or_ceil() -> None:
    # A in [1/3, 1/3] of 4: 1 or 2 tasks; B in [2/3, 2/3]: 2 or 3. The free slot
    # goes to the better remaining task: A's 1 (0.05) beats B's 8 (0.15).
    assert sorted(pick(4, [1 / 3, 2 / 3], [1 / 3, 2 / 3])) == [0, 1, 6, 7]


def test_a_short_group_gives_what_it_has_and_the_others_fill_in() -> None:
    # A min 0.5 of 4, but only task 5 of A is free: A gives 5; B fills 3.
    free = np.array([False] * 5 + [True] * 7)
    assert sorted(pick(4, [0.5, 0.5], [0.5, 0.5], free)) == [5, 6, 7, 8]


def test_maxima_that_cannot_fill_the_batch_are_exceeded() -> None:
    # A max 0.5 of 4 (2 tasks), B has only task 11 free: A's best 2, B's 11, then A's next best beyond its max.
    free = np.array([True] * 6 + [False] * 5 + [True])
    assert sorted(pick(4, [0.0, 0.0], [0.5, 1.0], free)) == [0, 1, 2, 11]


def test_shares_are_exact_over_many_batches_with_tied_scores() -> None:
    # All at the prior: every score ties; ties are broken at random, the counts never move.
    n = 90
    group_of = np.arange(n) % 3
    quotas = GroupQuotas(group_of, np.array([0.5, 0.3, 0.2]), np.array([0.5, 0.3, 0.2]))
    seen = np.zeros(n, dtype=int)
    for step in range(300):
        chosen = select(MEAN, np.ones(n), np.ones(n), np.ones(n, dtype=bool), 10, step_rng(1, step, "k"), quotas)
        assert np.bincount(group_of[chosen], minlength=3).tolist() == [5, 3, 2]
        seen[chosen] += 1
    assert (seen > 0).all()  # random tie-breaking reaches every task


def test_selection_is_a_function_of_seed_step_and_key() -> None:
    quotas = GroupQuotas(GROUP_OF, np.array([0.5, 0.5]), np.array([0.5, 0.5]))
    thompson = EngineParams()
    runs = [select(thompson, ALPHA, BETA, np.ones(12, dtype=bool), 6, step_rng(3, 7, "k"), quotas) for _ in range(2)]
    assert runs[0].tolist() == runs[1].tolist()


@pytest.mark.parametrize(
    ("shares", "groups", "problem"),
    [
        ({"a": (0.5, 0.5), "b": (0.4, 0.4)}, ["a", "b"], "fixed shares of every group sum to 0.9, not 1"),
        ({"a": (0.7, 1.0), "b": (0.4, 1.0)}, ["a", "b", "c"], "minimum shares sum to 1.1, more than 1"),
        ({"a": (0.0, 0.3), "b": (0.0, 0.3)}, ["a", "b"], "maximum shares sum to 0.6, less than 1"),
        ({"a": (0.6, 0.5)}, ["a", "b"], "0 <= min <= max <= 1"),
        ({"a": (-0.1, 0.5)}, ["a", "b"], "0 <= min <= max <= 1"),
        ({"a": (0.1, float("nan"))}, ["a", "b"], "0 <= min <= max <= 1"),
    ],
)
def test_impossible_shares_are_named(shares: dict[str, tuple[float, float]], groups: list[str], problem: str) -> None:
    found = share_problem(shares, groups)
    assert found is not None and problem in found


def test_possible_shares_pass() -> None:
    assert share_problem({"a": (0.1, 0.1), "b": (0.2, 0.2), "c": (0.7, 0.7)}, ["a", "b", "c"]) is None
    assert share_problem({"a": (0.5, 0.5)}, ["a", "b"]) is None  # b takes the rest
    assert share_problem({"a": (0.2, 0.6), "b": (0.1, 0.5)}, ["a", "b"]) is None
    assert share_problem({}, ["a"]) is None
