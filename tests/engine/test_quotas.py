"""Group quotas in selection, against counts and picks worked out by hand.

Mean selection with target 0.5 makes the score -|0.5 - mean|, so the best
tasks are read off the means below."""

from __future__ import annotations

import numpy as np
import pytest

from bots_server.engine import EngineParams, select, step_rng
from bots_server.engine.quotas import GroupQuotas, _scale_into, informative_fractions, quota_bounds, share_problem

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


# -- adaptive shares ------------------------------------------------------------------
# m = 4 rollouts; a group of 4 at pass rate p has rewards that differ with
# chance 1 - p^4 - (1 - p)^4 (worked out by hand below).
ADAPTIVE = EngineParams(selection_mode="mean", rollouts_per_task=4, adaptive_shares=1.0)


def test_informative_fractions_weigh_each_task_by_its_evidence_and_the_prior_as_one_report() -> None:
    # Group 0: Beta(9, 1) (8 rollouts beyond the prior, mean 0.9) and Beta(1, 1) (no evidence);
    # group 1: Beta(3, 3) (4 beyond the prior, mean 0.5); task 3 (group 1) is leased.
    alpha, beta = np.array([9.0, 1.0, 3.0, 1.0]), np.array([1.0, 1.0, 3.0, 50.0])
    free = np.array([True, True, True, False])
    fraction, count = informative_fractions(ADAPTIVE, alpha, beta, free, np.array([0, 0, 1, 1]), 2)
    # Reported rates beyond the prior: task 0 8 of 8 (never differs), task 2 2 of 4 (0.5).
    at_prior = 1 - 2 * 0.5**4  # 0.875: the prior's mean is 0.5
    assert fraction[0] == pytest.approx((8 * 0.0 + 4 * at_prior) / (8 + 4), rel=1e-12)
    assert fraction[1] == pytest.approx((4 * at_prior + 4 * at_prior) / (4 + 4), rel=1e-12)
    assert count.tolist() == [2, 1]


def adaptive_pick(params: EngineParams, low: list[float], high: list[float], means_a: float, batch: int = 10) -> np.ndarray:
    """Tasks picked per group from 20 + 20 tasks: group 0's at `means_a` with
    100 rollouts of evidence each, group 1's at the prior (never tried)."""
    group_of = np.array([0] * 20 + [1] * 20)
    alpha = np.where(group_of == 0, 1 + 100 * means_a, 1.0)
    beta = np.where(group_of == 0, 1 + 100 * (1 - means_a), 1.0)
    quotas = GroupQuotas(group_of, np.array(low), np.array(high))
    chosen = select(params, alpha, beta, np.ones(40, dtype=bool), batch, step_rng(0, 0, "k"), quotas)
    return np.bincount(group_of[chosen], minlength=2)


def test_a_groups_recent_reports_speak_for_its_stale_tasks() -> None:
    # Group 0: 15 tasks forgotten back to the prior (mean 0.5, no evidence) and 5 reported solved
    # just now (Beta(101, 1)); group 1: 20 tasks at Beta(3, 5) (mean 0.375, 6 rollouts of evidence).
    group_of = np.array([0] * 20 + [1] * 20)
    alpha = np.array([1.0] * 15 + [101.0] * 5 + [3.0] * 20)
    beta = np.array([1.0] * 15 + [1.0] * 5 + [5.0] * 20)
    quotas = GroupQuotas(group_of, np.zeros(2), np.ones(2))
    free = np.ones(40, dtype=bool)

    def per_group(params: EngineParams) -> list[int]:
        chosen = select(params, alpha, beta, free, 10, step_rng(0, 0, "k"), quotas)
        return np.bincount(group_of[chosen], minlength=2).tolist()

    # The ranking alone takes the forgotten tasks: their means sit at the target 0.5.
    assert per_group(EngineParams(selection_mode="mean", rollouts_per_task=4)) == [10, 0]
    # Adaptive: the reported rates are 100 of 100 (group 0) and 2 of 6 (group 1), so
    # f0 = (500 * u(1) + 4 * u(0.5)) / (500 + 4) and f1 = (20 * 6 * u(1/3) + 4 * u(0.5)) / (120 + 4)
    # with u(p) = 1 - p^4 - (1 - p)^4; shares in proportion.
    def u(p: float) -> float:
        return 1 - p**4 - (1 - p) ** 4

    f0 = (500 * u(1.0) + 4 * u(0.5)) / 504
    f1 = (120 * u(1 / 3) + 4 * u(0.5)) / 124
    share0 = f0 / (f0 + f1)  # 0.0085: none of 10
    assert per_group(ADAPTIVE)[0] in (int(share0 * 10), int(share0 * 10) + 1)


def test_bounds_hold_against_the_adaptation() -> None:
    # Group 0 solved (mean 0.99): in proportion it would get 0.045 of the batch; its minimum 0.2 holds.
    assert adaptive_pick(ADAPTIVE, [0.2, 0.0], [1.0, 1.0], 0.99).tolist() == [2, 8]
    assert adaptive_pick(ADAPTIVE, [0.0, 0.0], [1.0, 0.5], 0.99).tolist() == [5, 5]  # and group 1's maximum


def test_part_of_the_batch_stays_equal_below_full_adaptation() -> None:
    # a = 0.5: t = 0.5 * 1/2 + 0.5 * f / sum(f): group 0 0.25 + 0.5 * 0.045 = 0.272 -> 2 or 3 of 10.
    params = EngineParams(selection_mode="mean", rollouts_per_task=4, adaptive_shares=0.5)
    f0 = (20 * 100 * (1 - 0.99**4 - 0.01**4) + 4 * 0.875) / (20 * 100 + 4)  # group 1: 0.875, at the prior
    share = 0.25 + 0.5 * f0 / (f0 + 0.875)
    assert adaptive_pick(params, [0.0, 0.0], [1.0, 1.0], 0.99)[0] in (int(share * 10), int(share * 10) + 1)


def test_fixed_shares_do_not_move() -> None:
    assert adaptive_pick(ADAPTIVE, [0.7, 0.3], [0.7, 0.3], 0.99).tolist() == [7, 3]


def test_a_group_without_free_tasks_leaves_its_share_to_the_others() -> None:
    group_of = np.array([0] * 10 + [1] * 10 + [2] * 10)
    free = group_of != 2
    quotas = GroupQuotas(group_of, np.array([0.0, 0.0, 0.5]), np.ones(3))
    chosen = select(ADAPTIVE, np.ones(30), np.ones(30), free, 10, step_rng(0, 0, "k"), quotas)
    # Groups 0 and 1 are alike (at the prior): 5 each; group 2's minimum cannot be met.
    assert np.bincount(group_of[chosen], minlength=3).tolist() == [5, 5, 0]


def test_shares_scale_into_their_bounds() -> None:
    # In proportion 0.6 : 0.3 : 0.1, group 0 capped at 0.5: the rest scale up to fill 1 (0.375, 0.125).
    share = _scale_into(np.array([0.6, 0.3, 0.1]), np.zeros(3), np.array([0.5, 1.0, 1.0]))
    assert share == pytest.approx([0.5, 0.375, 0.125], abs=1e-12)
    # Minima that take the whole batch, or maxima that cannot fill it, are returned as they are.
    assert _scale_into(np.array([0.9, 0.1]), np.array([0.2, 0.8]), np.ones(2)).tolist() == [0.2, 0.8]
    assert _scale_into(np.array([0.5, 0.5]), np.zeros(2), np.array([0.3, 0.4])).tolist() == [0.3, 0.4]


def test_a_group_short_of_free_tasks_does_not_push_another_past_its_maximum() -> None:
    # X: 2 free tasks at the prior, [0, 1]; Y: 10 tasks, at most 0.3 of the batch; Z: 10 tasks, [0, 1].
    # Y and Z reported half right (Beta(5, 5)), so all three look alike and X would get about a third
    # of 10, more than its 2 tasks: its share is capped at 2 / 10, and Y stays within its 3.
    group_of = np.array([0] * 2 + [1] * 10 + [2] * 10)
    alpha = np.array([1.0] * 2 + [5.0] * 20)
    quotas = GroupQuotas(group_of, np.zeros(3), np.array([1.0, 0.3, 1.0]))
    chosen = select(ADAPTIVE, alpha, alpha.copy(), np.ones(22, dtype=bool), 10, step_rng(0, 0, "k"), quotas)
    counts = np.bincount(group_of[chosen], minlength=3)
    assert counts[0] == 2 and counts[1] <= 3 and counts.sum() == 10, counts


def test_one_rollout_per_task_gives_equal_shares() -> None:
    # m = 1: a single rollout never disagrees with itself, so every f_g is 0 and the shares are equal.
    params = EngineParams(selection_mode="mean", rollouts_per_task=1, adaptive_shares=1.0)
    assert adaptive_pick(params, [0.0, 0.0], [1.0, 1.0], 0.9).tolist() == [5, 5]
