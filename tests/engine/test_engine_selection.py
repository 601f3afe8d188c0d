"""Batch selection of the engine against hand-made rankings and hand-computed probabilities.

Statistical checks use fixed seeds and generous tolerances (several standard
errors), so they are deterministic and not flaky.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from bots_server.engine import EngineParams, select

MEAN = EngineParams(selection_mode="mean")
THOMPSON = EngineParams(selection_mode="thompson")

# Hand-made posteriors, means and distance to p* = 0.5:
#   task 0: Beta(1, 9)  mean 0.1   distance 0.4
#   task 1: Beta(9, 11) mean 0.45  distance 0.05
#   task 2: Beta(9, 1)  mean 0.9   distance 0.4
#   task 3: Beta(3, 2)  mean 0.6   distance 0.1
#   task 4: Beta(3, 7)  mean 0.3   distance 0.2
#   task 5: Beta(1, 1)  mean 0.5   distance 0.0
# Ranking by closeness to 0.5: 5, 1, 3, 4, then 0 and 2 (tied).
ALPHA = np.array([1.0, 9.0, 9.0, 3.0, 3.0, 1.0])
BETA = np.array([9.0, 11.0, 1.0, 2.0, 7.0, 1.0])
ALL = np.ones(6, dtype=bool)


def concentrated(means: list[float], scale: float = 1e6) -> tuple[np.ndarray, np.ndarray]:
    """Beta parameters with the given means and a tiny spread (sd ~ 0.5/sqrt(scale))."""
    m = np.array(means)
    return m * scale, (1 - m) * scale


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_valid(result: np.ndarray, available: np.ndarray, batch_size: int) -> None:
    assert result.shape == (batch_size,)
    assert np.issubdtype(result.dtype, np.integer)
    assert len(set(result.tolist())) == batch_size
    assert all(available[i] for i in result.tolist())


# --------------------------------------------------------------------------
# Mean and Thompson top-k
# --------------------------------------------------------------------------


def test_mean_mode_picks_closest_to_target_best_first() -> None:
    """Mean mode returns the B tasks whose posterior mean is closest to p*, closest first."""
    for batch_size, expected in [(1, [5]), (2, [5, 1]), (3, [5, 1, 3]), (4, [5, 1, 3, 4])]:
        result = select(MEAN, ALPHA, BETA, ALL, batch_size, rng(0))
        assert_valid(result, ALL, batch_size)
        assert result.tolist() == expected


def test_mean_mode_respects_target() -> None:
    """The target success rate p* changes the ranking (p* = 0.9: 0.9, 0.6, 0.5, 0.45, ...)."""
    params = EngineParams(selection_mode="mean", target_success=0.9)
    # distances to 0.9: task 2: 0.0, task 3: 0.3, task 5: 0.4, task 1: 0.45, task 4: 0.6, task 0: 0.8
    assert select(params, ALPHA, BETA, ALL, 5, rng(0)).tolist() == [2, 3, 5, 1, 4]


def test_mean_mode_same_for_mopps() -> None:
    """MoPPS selects with the same closeness score."""
    params = EngineParams(strategy="mopps", selection_mode="mean")
    assert select(params, ALPHA, BETA, ALL, 3, rng(0)).tolist() == [5, 1, 3]


@pytest.mark.parametrize("strategy", ["bots", "mopps"])
def test_thompson_with_concentrated_posteriors_equals_mean_ranking(strategy: str) -> None:
    """Thompson draws from very concentrated posteriors rank tasks like their means."""
    params = EngineParams(strategy=strategy, selection_mode="thompson")
    # means 0.1, 0.45, 0.9, 0.6, 0.3, 0.52, 0.75 -> distances .4 .05 .4 .1 .2 .02 .25 ; sd ~ 5e-4
    alpha, beta = concentrated([0.1, 0.45, 0.9, 0.6, 0.3, 0.52, 0.75])
    available = np.ones(7, dtype=bool)
    for seed in range(20):
        assert select(params, alpha, beta, available, 5, rng(seed)).tolist() == [5, 1, 3, 4, 6]


def test_thompson_selection_probability_matches_hand_computation() -> None:
    """Thompson is random: Beta(1,1) beats a task pinned at 0.3 iff |U - 0.5| < 0.2, i.e. w.p. 0.4."""
    alpha = np.array([0.3 * 1e8, 1.0])
    beta = np.array([0.7 * 1e8, 1.0])
    g = rng(123)
    n = 10_000
    wins = sum(int(select(THOMPSON, alpha, beta, np.ones(2, dtype=bool), 1, g)[0] == 1) for _ in range(n))
    assert wins / n == pytest.approx(0.4, abs=0.02)


# --------------------------------------------------------------------------
# Availability and batch size
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        MEAN,
        THOMPSON,
        EngineParams(selection_mode="softmax", temperature=0.05),
        # tiny tau: available scores / tau reach -4000, masked tasks must still lose
        EngineParams(selection_mode="softmax", temperature=1e-4),
        EngineParams(strategy="uniform"),
        EngineParams(strategy="mopps"),
    ],
    ids=["mean", "thompson", "softmax", "softmax-cold", "uniform", "mopps"],
)
def test_unavailable_tasks_never_selected(params: EngineParams) -> None:
    """Tasks masked out are never returned, even when they are the best ones."""
    available = np.array([True, False, True, True, True, False])  # the two best (5, 1) are out
    g = rng(7)
    seen: set[int] = set()
    for _ in range(300):
        result = select(params, ALPHA, BETA, available, 3, g)
        assert_valid(result, available, 3)
        seen.update(result.tolist())
    assert seen <= {0, 2, 3, 4}
    if params.selection_mode == "mean" and params.strategy == "bots":
        # next best after 5 and 1: 3, 4, then one of the tied 0 / 2
        assert select(params, ALPHA, BETA, available, 2, g).tolist() == [3, 4]


@pytest.mark.parametrize(
    "params", [MEAN, THOMPSON, EngineParams(strategy="uniform")], ids=["mean", "thompson", "uniform"]
)
def test_batch_of_all_available_returns_exactly_them(params: EngineParams) -> None:
    """batch_size equal to the number of available tasks returns each of them once."""
    available = np.array([True, False, True, True, False, False])
    result = select(params, ALPHA, BETA, available, 3, rng(3))
    assert sorted(result.tolist()) == [0, 2, 3]


@pytest.mark.parametrize("batch_size", [0, -1, 4, 7])
def test_batch_size_out_of_range_raises(batch_size: int) -> None:
    """batch_size must lie in [1, number of available tasks] (3 of 6 available here)."""
    available = np.array([True, False, True, True, False, False])
    for params in (MEAN, THOMPSON, EngineParams(strategy="uniform")):
        with pytest.raises(ValueError):
            select(params, ALPHA, BETA, available, batch_size, rng(0))


def test_no_available_task_raises() -> None:
    """With nothing available any batch size is rejected."""
    with pytest.raises(ValueError):
        select(MEAN, ALPHA, BETA, np.zeros(6, dtype=bool), 1, rng(0))


# --------------------------------------------------------------------------
# Ties at the cut
# --------------------------------------------------------------------------


def test_ties_at_cut_broken_randomly_but_deterministically() -> None:
    """Equal scores at the cut: same rng seed -> same pick, different seeds -> every tied task occurs."""
    # task 0 mean 0.5 (best); tasks 1, 2, 3 all Beta(2, 3) (mean 0.4, tied); task 4 mean 0.1
    alpha = np.array([1.0, 2.0, 2.0, 2.0, 1.0])
    beta = np.array([1.0, 3.0, 3.0, 3.0, 9.0])
    available = np.ones(5, dtype=bool)
    counts: Counter[int] = Counter()
    n = 3000
    for seed in range(n):
        first = select(MEAN, alpha, beta, available, 2, rng(seed))
        again = select(MEAN, alpha, beta, available, 2, rng(seed))
        assert first.tolist() == again.tolist()
        assert first[0] == 0
        counts[int(first[1])] += 1
    assert set(counts) == {1, 2, 3}
    for task in (1, 2, 3):  # fair among the tied: 1/3 each (se ~ 0.009)
        assert counts[task] / n == pytest.approx(1 / 3, abs=0.05)


def test_ties_everywhere_give_varied_batches() -> None:
    """When all tasks score the same, the batch depends on the seed (not always the lowest indices)."""
    alpha = np.full(8, 2.0)
    beta = np.full(8, 2.0)
    available = np.ones(8, dtype=bool)
    batches = {tuple(sorted(select(MEAN, alpha, beta, available, 3, rng(s)).tolist())) for s in range(50)}
    assert len(batches) > 5
    assert select(MEAN, alpha, beta, available, 3, rng(11)).tolist() == select(
        MEAN, alpha, beta, available, 3, rng(11)
    ).tolist()


# --------------------------------------------------------------------------
# Uniform strategy
# --------------------------------------------------------------------------


def test_uniform_strategy_frequencies() -> None:
    """Uniform draws B of the available tasks uniformly, ignoring the posteriors."""
    alpha = np.array([1.0, 1e6, 9.0, 1.0, 50.0, 1.0, 3.0, 1.0, 1.0, 2.0])
    beta = np.array([1.0, 1e6, 1.0, 30.0, 1.0, 1.0, 3.0, 9.0, 1.0, 7.0])
    available = np.ones(10, dtype=bool)
    available[[0, 5]] = False  # 8 available
    params = EngineParams(strategy="uniform")
    g = rng(2024)
    n = 10_000
    included: Counter[int] = Counter()
    first: Counter[int] = Counter()
    for _ in range(n):
        result = select(params, alpha, beta, available, 3, g)
        included.update(result.tolist())
        first[int(result[0])] += 1
    assert included[0] == 0 and included[5] == 0
    for task in np.flatnonzero(available).tolist():
        # inclusion 3/8 = 0.375 (se ~0.005), first pick 1/8 = 0.125 (se ~0.0033)
        assert included[task] / n == pytest.approx(0.375, abs=0.025)
        assert first[task] / n == pytest.approx(0.125, abs=0.02)


# --------------------------------------------------------------------------
# Softmax
# --------------------------------------------------------------------------


def softmax_weights(scores: list[float], temperature: float) -> list[float]:
    """Normalized exp(score / tau), by hand."""
    e = [math.exp(s / temperature) for s in scores]
    total = sum(e)
    return [x / total for x in e]


def test_softmax_first_pick_frequencies() -> None:
    """B=1 softmax picks task i with probability softmax(score / tau)_i."""
    tau = 0.1
    # means 0.5, 0.3, 0.1 -> scores 0, -0.2, -0.4 -> score/tau = 0, -2, -4
    # weights e^0, e^-2, e^-4 = 1, 0.13534, 0.01832, sum 1.15365 -> 0.8668, 0.1173, 0.0159
    w = softmax_weights([0.0, -0.2, -0.4], tau)
    assert w == pytest.approx([0.8668, 0.1173, 0.0159], abs=1e-4)
    alpha, beta = concentrated([0.5, 0.3, 0.1], scale=1e8)
    params = EngineParams(selection_mode="softmax", temperature=tau)
    g = rng(99)
    n = 20_000
    counts = Counter(int(select(params, alpha, beta, np.ones(3, dtype=bool), 1, g)[0]) for _ in range(n))
    for task in range(3):
        assert counts[task] / n == pytest.approx(w[task], abs=0.02)


def test_softmax_pair_probabilities_follow_successive_sampling() -> None:
    """B=2 softmax draws without replacement: P({i,j}) = w_i w_j/(1-w_i) + w_j w_i/(1-w_j)."""
    tau = 0.2
    # scores 0, -0.2, -0.4 -> /tau = 0, -1, -2 -> weights ~0.6652, 0.2447, 0.0900
    w = softmax_weights([0.0, -0.2, -0.4], tau)
    assert w == pytest.approx([0.6652, 0.2447, 0.0900], abs=1e-4)

    def pair(i: int, j: int) -> float:
        return w[i] * w[j] / (1 - w[i]) + w[j] * w[i] / (1 - w[j])

    # ~0.7017, ~0.2446, ~0.0537
    expected = {(0, 1): pair(0, 1), (0, 2): pair(0, 2), (1, 2): pair(1, 2)}
    assert sum(expected.values()) == pytest.approx(1.0)
    alpha, beta = concentrated([0.5, 0.3, 0.1], scale=1e8)
    params = EngineParams(selection_mode="softmax", temperature=tau)
    g = rng(5)
    n = 20_000
    pairs: Counter[tuple[int, int]] = Counter()
    firsts: Counter[int] = Counter()
    for _ in range(n):
        result = select(params, alpha, beta, np.ones(3, dtype=bool), 2, g)
        pairs[tuple(sorted(result.tolist()))] += 1
        firsts[int(result[0])] += 1
    for key, prob in expected.items():
        assert pairs[key] / n == pytest.approx(prob, abs=0.02)
    # the first element of the batch is the first draw of the sequential sampling
    for task in range(3):
        assert firsts[task] / n == pytest.approx(w[task], abs=0.02)


def test_softmax_low_temperature_is_greedy() -> None:
    """As tau -> 0 softmax selection becomes the top-k by closeness."""
    alpha, beta = concentrated([0.1, 0.45, 0.9, 0.6, 0.3, 0.52, 0.75])
    params = EngineParams(selection_mode="softmax", temperature=1e-4)
    for seed in range(10):
        assert select(params, alpha, beta, np.ones(7, dtype=bool), 3, rng(seed)).tolist() == [5, 1, 3]
