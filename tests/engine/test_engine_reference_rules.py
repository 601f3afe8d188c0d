"""The reference implementation's rules that the paper's defaults leave off
(Trinity-RFT's DifficultyBasedSelector and its estimator; MoPPS), each an
opt-in setting, against values worked out by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest

from bots_server.engine import EngineParams, PosteriorState, apply_outcomes, select


def arr(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=float)


def ints(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# --------------------------------------------------------------------------
# Integer priors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["mopps", "bots"])
def test_integer_prior_gives_float_arrays_and_no_truncation(strategy: str) -> None:
    # a0 = b0 = 2 given as Python ints, lambda = 0.5, task 0 reports 1.5 of 4.
    # MoPPS: alpha0 = 0.5*2 + 0.5*2 + 1.5 = 3.5, beta0 = 0.5*2 + 0.5*2 + 2.5 = 4.5.
    # BOTS without features (rho acts as 0), the report weighing its own 4
    # trials: alpha0 = 2 + 4*0.375 = 3.5, beta0 = 2 + 4*0.625 = 4.5; task 1:
    # 0.5*2 + 0.5*2 = 2.0. The strategies agree on a reported task here.
    params = EngineParams(strategy=strategy, prior_alpha=2, prior_beta=2, forgetting=0.5)
    state = PosteriorState.from_prior(params, arr(np.nan, np.nan), arr(np.nan, np.nan))
    assert state.alpha.dtype == np.float64 and state.beta.dtype == np.float64
    grown = state.extended(params, arr(np.nan), arr(np.nan))
    assert grown.alpha.dtype == np.float64 and grown.beta.dtype == np.float64
    new = apply_outcomes(params, state, ints(0), arr(1.5), arr(4.0)).state
    assert new.alpha.tolist() == [3.5, 2.0]
    assert new.beta.tolist() == [4.5, 2.0]


# --------------------------------------------------------------------------
# softmax_mean: softmax over the posterior means, no Beta draw
# --------------------------------------------------------------------------


def _first_pick_frequency(params: EngineParams, alpha: np.ndarray, beta: np.ndarray, draws: int) -> np.ndarray:
    counts = np.zeros(alpha.shape[0])
    available = np.ones(alpha.shape[0], dtype=bool)
    for i in range(draws):
        counts[select(params, alpha, beta, available, 1, np.random.default_rng(i))[0]] += 1
    return counts / draws


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_softmax_mean_first_pick_follows_softmax_of_mean_closeness(scale: float) -> None:
    # means 0.5, 0.3, 0.9; p* = 0.5, tau = 0.1: s = 0, -0.2, -0.4; s / tau = 0, -2, -4.
    # P = e^0, e^-2, e^-4 over their sum 1.15365: 0.86681, 0.11731, 0.01588.
    # Means only: ten times the evidence (scale 10) gives the same probabilities.
    params = EngineParams(selection_mode="softmax_mean", temperature=0.1)
    alpha = scale * arr(5, 3, 9)
    beta = scale * arr(5, 7, 1)
    freq = _first_pick_frequency(params, alpha, beta, 20_000)
    expected = arr(0.86681, 0.11731, 0.01588)
    sd = np.sqrt(expected * (1 - expected) / 20_000)
    assert np.all(np.abs(freq - expected) < 4.5 * sd), (freq, expected)


def test_softmax_mean_pair_follows_successive_sampling() -> None:
    # Two tasks out of three with the probabilities above: P(batch = {0, 1})
    # = P(0 then 1) + P(1 then 0) = 0.86681 * 0.11731 / (1 - 0.86681)
    #                               + 0.11731 * 0.86681 / (1 - 0.11731) = 0.76349 + 0.11520 = 0.87869.
    params = EngineParams(selection_mode="softmax_mean", temperature=0.1)
    alpha, beta = arr(5, 3, 9), arr(5, 7, 1)
    available = np.ones(3, dtype=bool)
    draws = 10_000
    hits = sum(
        set(select(params, alpha, beta, available, 2, np.random.default_rng(i)).tolist()) == {0, 1}
        for i in range(draws)
    )
    sd = np.sqrt(0.87869 * (1 - 0.87869) / draws)
    assert abs(hits / draws - 0.87869) < 4.5 * sd


# --------------------------------------------------------------------------
# MoPPS candidate pre-selection
# --------------------------------------------------------------------------


def test_candidate_set_probability_of_picking_the_best_task() -> None:
    # Ten tasks, mean selection, task 0 alone at the target. Batch 1, ratio 3:
    # three random candidates, so task 0 is picked exactly when it is one of
    # them: P = 3 / 10. Without pre-selection it is always picked.
    alpha = arr(5, 1, 1, 1, 1, 1, 1, 1, 1, 1)
    beta = arr(5, 9, 9, 9, 9, 9, 9, 9, 9, 9)
    available = np.ones(10, dtype=bool)
    draws = 20_000
    on = EngineParams(selection_mode="mean", candidate_ratio=3.0)
    hits = sum(select(on, alpha, beta, available, 1, np.random.default_rng(i))[0] == 0 for i in range(draws))
    sd = np.sqrt(0.3 * 0.7 / draws)
    assert abs(hits / draws - 0.3) < 4.5 * sd
    off = EngineParams(selection_mode="mean")
    assert all(select(off, alpha, beta, available, 1, np.random.default_rng(i))[0] == 0 for i in range(50))


def test_candidate_set_size_and_availability() -> None:
    # Ratio 2.5, batch 2: ceil(5.0) = 5 candidates among the 6 available of 8
    # tasks (tasks 6, 7 are leased). Mean selection then takes the 2 closest
    # to p* among the candidates: never a leased task, and the task left out of
    # the candidates (exactly one of the six) is never picked. Ratio 0.5 acts
    # as 1: the candidate set is the batch itself, a uniformly random pair.
    alpha = arr(5, 4, 6, 3, 7, 2, 5, 5)
    beta = arr(5, 6, 4, 7, 3, 8, 5, 5)  # means 0.5, 0.4, 0.6, 0.3, 0.7, 0.2, (0.5, 0.5 leased)
    available = np.array([True] * 6 + [False] * 2)
    params = EngineParams(selection_mode="mean", candidate_ratio=2.5)
    seen: set[tuple[int, ...]] = set()
    for i in range(400):
        batch = select(params, alpha, beta, available, 2, np.random.default_rng(i)).tolist()
        assert not {6, 7} & set(batch)
        seen.add(tuple(sorted(batch)))
    # Leaving out one of 0, 1, 2 (the best three: 0.5, then 0.4 and 0.6 tied)
    # changes the pair; leaving out 3, 4 or 5 gives {0} plus one of {1, 2}.
    assert seen <= {(0, 1), (0, 2), (1, 2)}
    assert (1, 2) in seen  # task 0 was left out at least once (P = 1/6 per draw)
    tiny = EngineParams(selection_mode="mean", candidate_ratio=0.5)
    pairs = {tuple(sorted(select(tiny, alpha, beta, available, 2, np.random.default_rng(i)).tolist())) for i in range(400)}
    assert len(pairs) == 15  # every pair of the six available tasks: C(6, 2)


# --------------------------------------------------------------------------
# MoPPS warm start from prior evaluations
# --------------------------------------------------------------------------


def test_warm_start_pseudo_rollouts_at_the_reference_rate() -> None:
    # Scale 10, position 0.5, prior (1, 2):
    #   task 0: w 0.2, s 0.6 -> p0 0.4 -> alpha 1 + 4 = 5, beta 2 + 6 = 8
    #   task 1: w 0.0, s 1.0 -> p0 0.5 -> alpha 6, beta 7
    #   task 2: no features -> the prior (1, 2)
    # Added later (extended): w 0.9, s 0.9 -> p0 0.9 -> alpha 10, beta 3.
    params = EngineParams(prior_alpha=1.0, prior_beta=2.0, warm_start_scale=10.0, warm_start_position=0.5)
    state = PosteriorState.from_prior(params, arr(0.2, 0.0, np.nan), arr(0.6, 1.0, np.nan))
    assert state.alpha.tolist() == pytest.approx([5.0, 6.0, 1.0], abs=1e-12)
    assert state.beta.tolist() == pytest.approx([8.0, 7.0, 2.0], abs=1e-12)
    grown = state.extended(params, arr(0.9), arr(0.9))
    assert grown.alpha.tolist() == pytest.approx([5.0, 6.0, 1.0, 10.0], abs=1e-12)
    assert grown.beta.tolist() == pytest.approx([8.0, 7.0, 2.0, 3.0], abs=1e-12)


def test_warm_start_position_zero_and_one_read_the_weak_and_strong_rate() -> None:
    # Scale 4, prior (1, 1), w 0.25, s 0.75: position 0 -> 1 + 1, 1 + 3; position 1 -> 1 + 3, 1 + 1.
    weak, strong = arr(0.25), arr(0.75)
    at_weak = PosteriorState.from_prior(EngineParams(warm_start_scale=4.0), weak, strong)
    at_strong = PosteriorState.from_prior(EngineParams(warm_start_scale=4.0, warm_start_position=1.0), weak, strong)
    assert (at_weak.alpha.tolist(), at_weak.beta.tolist()) == ([2.0], [4.0])
    assert (at_strong.alpha.tolist(), at_strong.beta.tolist()) == ([4.0], [2.0])


def test_warm_start_off_by_default_is_the_prior() -> None:
    state = PosteriorState.from_prior(EngineParams(), arr(0.2, 0.9), arr(0.6, 1.0))
    assert state.alpha.tolist() == [1.0, 1.0] and state.beta.tolist() == [1.0, 1.0]


# --------------------------------------------------------------------------
# Adaptive rho (the reference estimator's halving rule)
# --------------------------------------------------------------------------
# Three tasks, w = (0, 0, 0.2), s = (1, 1, 0.6), lambda 0.1, rho 0.1, m 16, prior (1, 1).
# Step 1 reports tasks 0 and 1 at rates 1 and 0:
#   c_hat = (0.5 - 0) / (1 - 0 + 1e-6) = 0.5 / 1.000001; first estimate, so c = c_hat.
#   predictions of the reported tasks: c, c; errors |c - 1|, |c - 0|; mean error 0.5 >= 0.25: halve, rho 0.05.
#   task 2 (unreported): p = 0.2 + 0.4 c; alpha = 1 + 0.05 * 16 * p, beta = 1 + 0.05 * 16 * (1 - p).
# Step 2 reports task 2 at 8 of 20 = 0.4:
#   c_hat2 = (0.4 - 0.2) / (0.6 - 0.2 + 1e-6); c2 = 0.9 c + 0.1 c_hat2;
#   prediction 0.2 + 0.4 c2 (about 0.4): error far below 0.25, rho stays 0.05 (it does not recover);
#   task 0 (unreported): p = c2; alpha = 0.9 * 17 + 0.1 + 0.05 * 16 * c2, beta = 0.9 * 1 + 0.1 + 0.8 * (1 - c2).

WEAK3 = arr(0.0, 0.0, 0.2)
STRONG3 = arr(1.0, 1.0, 0.6)
C1 = 0.5 / 1.000001
C2 = 0.9 * C1 + 0.1 * (0.2 / 0.400001)


def _two_steps(params: EngineParams) -> tuple[PosteriorState, PosteriorState]:
    state = PosteriorState.from_prior(params, WEAK3, STRONG3)
    first = apply_outcomes(params, state, ints(0, 1), arr(16, 0), arr(16, 16)).state
    second = apply_outcomes(params, first, ints(2), arr(8), arr(20)).state
    return first, second


def test_adaptive_rho_halves_when_the_batch_error_reaches_the_threshold() -> None:
    first, second = _two_steps(EngineParams(adaptive_rho_error=0.25))
    p = 0.2 + 0.4 * C1
    assert first.rho_halvings == 1
    assert first.alpha.tolist() == pytest.approx([17.0, 1.0, 1 + 0.8 * p], rel=1e-12)
    assert first.beta.tolist() == pytest.approx([1.0, 17.0, 1 + 0.8 * (1 - p)], rel=1e-12)
    assert second.rho_halvings == 1
    assert second.capability == pytest.approx(C2, rel=1e-12)
    assert second.alpha[0] == pytest.approx(0.9 * 17 + 0.1 + 0.8 * C2, rel=1e-12)
    assert second.beta[0] == pytest.approx(0.9 * 1 + 0.1 + 0.8 * (1 - C2), rel=1e-12)


def test_adaptive_rho_below_the_threshold_and_off_keep_rho() -> None:
    # Threshold 0.6 > 0.5, and the default (off): rho stays 0.1, so task 2 after
    # step 1 is 1 + 1.6 p, 1 + 1.6 (1 - p): the paper's BOTS.
    p = 0.2 + 0.4 * C1
    for params in (EngineParams(adaptive_rho_error=0.6), EngineParams()):
        first, second = _two_steps(params)
        assert (first.rho_halvings, second.rho_halvings) == (0, 0)
        assert first.alpha[2] == pytest.approx(1 + 1.6 * p, rel=1e-12)
        assert first.beta[2] == pytest.approx(1 + 1.6 * (1 - p), rel=1e-12)


def test_adaptive_rho_halves_again_on_every_bad_batch_and_replays() -> None:
    # The step-1 report three times: each batch misses by 0.5 in mean, so rho
    # halves each time: 0.05, 0.025, 0.0125 (three halvings). A replay of the
    # same events from the prior reproduces the state bit for bit.
    params = EngineParams(adaptive_rho_error=0.25)

    def run() -> PosteriorState:
        state = PosteriorState.from_prior(params, WEAK3, STRONG3)
        for _ in range(3):
            state = apply_outcomes(params, state, ints(0, 1), arr(16, 0), arr(16, 16)).state
        return state

    state = run()
    assert state.rho_halvings == 3
    again = run()
    assert again.alpha.tobytes() == state.alpha.tobytes() and again.beta.tobytes() == state.beta.tobytes()


def test_adaptive_rho_state_survives_a_partial_pool_update() -> None:
    # pool_size: a replayed step from before a fourth task was added.
    params = EngineParams(adaptive_rho_error=0.25)
    state = PosteriorState.from_prior(params, arr(0.0, 0.0, 0.2, 0.5), arr(1.0, 1.0, 0.6, 0.5))
    new = apply_outcomes(params, state, ints(0, 1), arr(16, 0), arr(16, 16), pool_size=3).state
    assert new.rho_halvings == 1
    assert (new.alpha[3], new.beta[3]) == (1.0, 1.0)


def test_adaptive_rho_is_accepted_over_the_api() -> None:
    # Checkpoints carry rho_halvings (tests/api/test_restart.py checks a rebuild).
    from bots_server.engine import settings

    declared = {name: s for name, s, _ in settings(EngineParams)}["adaptive_rho_error"]
    assert declared.problem(0.0) is None and declared.problem(0.25) is None
    assert declared.problem(1.5) is not None and declared.problem(-0.1) is not None
