"""Continuous rewards: a group's variance decides what the posterior takes
from it (engine/rewards.py), checked against values computed here from the
rewards themselves."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bots_server.engine import batch_signals
from bots_server.engine.rewards import evidence_successes, group_variance, informative


def sums(rewards: list[float]) -> tuple[float, int, float]:
    """(successes, trials, sum_squares) as a trainer reports them."""
    return math.fsum(rewards), len(rewards), math.fsum(r * r for r in rewards)


def bernoulli_rate_with_variance(variance: float, mean: float) -> float:
    """The root of p (1 - p) = variance on the side of 1/2 where the mean
    lies, from numpy's polynomial roots (not the closed form)."""
    roots = sorted(float(r.real) for r in np.roots([1.0, -1.0, variance]))
    return roots[1] if mean >= 0.5 else roots[0]


@pytest.mark.parametrize(
    "rewards",
    [[0.0, 1.0, 0.5, 0.5], [0.1, 0.2, 0.3, 0.9], [0.9, 0.95, 1.0, 0.7, 0.8], [0.0, 0.05, 0.1, 0.0], [0.25, 0.75]],
)
def test_a_group_counts_as_the_bernoulli_rate_with_its_variance(rewards: list[float]) -> None:
    s, n, ss = sums(rewards)
    variance = float(np.var(rewards))  # population variance, as GRPO's group statistics
    assert group_variance(s, n, ss) == pytest.approx(variance, abs=1e-12)
    expected = bernoulli_rate_with_variance(variance, float(np.mean(rewards)))
    assert evidence_successes(s, n, ss) == pytest.approx(n * expected, rel=1e-9)
    assert informative(s, n, ss)


def test_rewards_of_0_or_1_are_taken_exactly_as_without_sum_squares() -> None:
    for s in range(9):
        assert evidence_successes(float(s), 8, float(s)) == float(s)  # every r_i^2 = r_i
        assert evidence_successes(float(s), 8, None) == float(s)
        assert informative(float(s), 8, float(s)) == informative(float(s), 8, None) == (0 < s < 8)
    # One success in 2^31 - 1 trials: a variance below NO_SPREAD, still a mixed group.
    assert informative(1.0, 2**31 - 1, 1.0) and evidence_successes(1.0, 2**31 - 1, 1.0) == 1.0


def test_a_group_without_spread_teaches_nothing_whatever_its_mean() -> None:
    for value in (0.3, 0.5, 0.7):
        s, n, ss = sums([value] * 8)  # sums that are not exact in binary
        assert not informative(s, n, ss)
        assert evidence_successes(s, n, ss) == (8.0 if value >= 0.5 else 0.0)
    # The widest spread a mean of 1/2 allows is the Bernoulli one: p = 1/2.
    s, n, ss = sums([0.0, 1.0, 0.0, 1.0])
    assert evidence_successes(s, n, ss) == 2.0


def test_signals_count_groups_whose_rewards_differ() -> None:
    groups = [sums([0.5] * 4), sums([0.0, 1.0, 0.5, 0.5]), sums([0.3] * 4)]
    signals = batch_signals(
        [g[0] for g in groups] + [3.0, 4.0], [g[1] for g in groups] + [4, 4], [g[2] for g in groups] + [None, None]
    )
    assert signals.tasks == 5 and signals.informative == 2  # the spread group and the binary 3 of 4
    assert signals.successes == pytest.approx(2.0 + 2.0 + 1.2 + 3.0 + 4.0)  # the rewards as reported


def test_signals_of_a_report_of_0_or_1_count_the_mixed_groups() -> None:
    # 0 of 4, 4 of 4 and each count between: the whole-column path of batch_signals.
    successes = [0.0, 4.0, 1.0, 2.0, 3.0, 0.0]
    signals = batch_signals(successes, [4] * 6, [None] * 6)
    assert signals.tasks == 6 and signals.informative == 3
    assert signals.successes == 10.0 and signals.trials == 24.0


@pytest.mark.parametrize("seed", range(3))
def test_a_report_s_evidence_is_each_group_s_bit_for_bit(seed: int) -> None:
    """evidence_of over a report mixing 0/1 groups and graded ones equals
    evidence_successes group by group, to the last bit (the event log keeps
    these floats and a replay sums them)."""
    from bots_server.engine import evidence_of

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(200):
        n = int(rng.integers(1, 17))
        if rng.random() < 0.5:
            rows.append((float(rng.integers(0, n + 1)), n, None))
        else:
            rows.append(sums(rng.random(n).round(int(rng.integers(1, 4))).tolist()))
    successes, trials, sum_squares = (list(c) for c in zip(*rows, strict=True))
    expected = [evidence_successes(s, n, q) for s, n, q in rows]
    assert evidence_of(successes, trials, sum_squares).tolist() == expected
    assert batch_signals(successes, trials, sum_squares).informative == sum(informative(*r) for r in rows)
