"""Opt-in settings beyond the paper (docs/choosing-a-strategy.md): expected-loss
selection, tracking the plug-in's predicted change, and rho from the batch's
measured errors. Each against values worked out by hand in the comments; the
defaults leave BOTS bit for bit as published."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bots_server.engine import EngineParams, PosteriorState, apply_outcomes, select
from bots_server.engine.scoring import closeness


def arr(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=float)


def ints(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# --------------------------------------------------------------------------
# selection_mode "expected": smallest E[(p - p*)^2] under the posterior
# --------------------------------------------------------------------------


def test_expected_mode_scores_are_the_posterior_expected_squared_distance() -> None:
    # E[(p - 0.5)^2] = (mu - 0.5)^2 + mu (1 - mu) / (n + 1):
    # Beta(1, 1): 0 + 0.25 / 3 = 1/12; Beta(8, 8): 0 + 0.25 / 17 = 1/68;
    # Beta(2, 6): mu = 0.25, 0.0625 + 0.1875 / 9 = 1/12; Beta(9, 1): 0.16 + 0.09 / 11.
    alpha, beta = arr(1, 8, 2, 9), arr(1, 8, 6, 1)
    params = EngineParams(selection_mode="expected")
    score = closeness(params, alpha, beta, np.random.default_rng(0))
    assert score.tolist() == pytest.approx([-1 / 12, -1 / 68, -1 / 12, -(0.16 + 0.09 / 11)], rel=1e-12)


def test_expected_mode_prefers_a_task_known_to_be_near_the_target() -> None:
    # Beta(8, 8) is picked first, Beta(9, 1) (0.172) last; the two 1/12 ties in between.
    alpha, beta = arr(1, 8, 2, 9), arr(1, 8, 6, 1)
    params = EngineParams(selection_mode="expected")
    available = np.ones(4, dtype=bool)
    for seed in range(5):
        picked = select(params, alpha, beta, available, 4, np.random.default_rng(seed)).tolist()
        assert picked[0] == 1 and picked[-1] == 3 and set(picked[1:3]) == {0, 2}


def test_expected_mode_respects_the_target() -> None:
    # p* = 0.25: Beta(2, 6) scores 0 + 0.1875 / 9, the best; Beta(8, 8) 0.0625 + 1/68.
    params = EngineParams(selection_mode="expected", target_success=0.25)
    picked = select(params, arr(1, 8, 2), arr(1, 8, 6), np.ones(3, dtype=bool), 1, np.random.default_rng(0))
    assert picked.tolist() == [2]


# --------------------------------------------------------------------------
# track_prediction: posteriors carried along the plug-in's predicted change
# --------------------------------------------------------------------------

WEAK = arr(0.2, np.nan, 0.1)
STRONG = arr(0.6, np.nan, 0.5)


def _state(capability: float) -> PosteriorState:
    return PosteriorState(arr(3.0, 2.0, 1.0), arr(1.0, 2.0, 1.0), WEAK, STRONG, capability)


def test_tracking_moves_the_mean_by_the_predicted_change_and_keeps_the_strength() -> None:
    # Capability 0.2; task 2 reports 12 of 16 (r = 0.75): c_hat = (0.75 - 0.1) / (0.4 + 1e-6),
    # c = 0.9 * 0.2 + 0.1 * c_hat. Task 0's prediction 0.2 + 0.4 c moves by 0.4 (c - 0.2); its
    # mean 3/4 moves with it at strength 4: alpha' = 4 (0.75 + 0.4 (c - 0.2)), beta' = 4 - alpha'.
    # Then the BOTS update (lambda = 0.02, rho = 0.1, m = 16) with prediction q = 0.2 + 0.4 c:
    # alpha = 0.98 alpha' + 0.02 + 1.6 q. Task 1 has no features: 0.98 * 2 + 0.02, unmoved.
    params = EngineParams(forgetting=0.02, track_prediction=1.0)
    c_hat = (0.75 - 0.1) / (0.4 + 1e-6)
    c = 0.9 * 0.2 + 0.1 * c_hat
    carried = 4 * (0.75 + 0.4 * (c - 0.2))
    q = 0.2 + 0.4 * c
    new = apply_outcomes(params, _state(0.2), ints(2), arr(12), arr(16)).state
    assert new.capability == pytest.approx(c, rel=1e-12)
    assert new.alpha[0] == pytest.approx(0.98 * carried + 0.02 + 1.6 * q, rel=1e-12)
    assert new.beta[0] == pytest.approx(0.98 * (4 - carried) + 0.02 + 1.6 * (1 - q), rel=1e-12)
    assert new.alpha[1] == pytest.approx(0.98 * 2 + 0.02, rel=1e-12)
    # Task 2 (reported) moved too, from mean 1/2 at strength 2, then its 16 rollouts (rho's
    # share of them at its observed rate): alpha = 0.98 * 2 (0.5 + 0.4 (c - 0.2)) + 0.02 + 12.
    assert new.alpha[2] == pytest.approx(0.98 * 2 * (0.5 + 0.4 * (c - 0.2)) + 0.02 + 12, rel=1e-12)


def test_tracking_half_moves_half_as_far() -> None:
    params = EngineParams(forgetting=0.02, track_prediction=0.5)
    c = 0.9 * 0.2 + 0.1 * (0.75 - 0.1) / (0.4 + 1e-6)
    q = 0.2 + 0.4 * c
    carried = 4 * (0.75 + 0.5 * 0.4 * (c - 0.2))
    new = apply_outcomes(params, _state(0.2), ints(2), arr(12), arr(16)).state
    assert new.alpha[0] == pytest.approx(0.98 * carried + 0.02 + 1.6 * q, rel=1e-12)


def test_tracking_keeps_the_mean_inside_the_unit_interval() -> None:
    # A jump of the capability from 0 to far above 1 pushes task 0's mean (3/4) past 1:
    # it stops at 1 - 1e-3, strength 4 kept: alpha' = 3.996, beta' = 0.004 (both positive).
    params = EngineParams(forgetting=0.0, implicit_weight=0.0, track_prediction=1.0, capability_ema=0.0)
    new = apply_outcomes(params, _state(0.0), ints(2), arr(16), arr(16)).state
    assert new.alpha[0] == pytest.approx(4 * 0.999, rel=1e-12)
    assert new.beta[0] == pytest.approx(4 * 0.001, rel=1e-9)


def test_tracking_needs_a_previous_capability() -> None:
    # First estimate (capability NaN before): nothing to carry, the paper's update.
    on = apply_outcomes(EngineParams(track_prediction=1.0), _state(math.nan), ints(2), arr(12), arr(16)).state
    off = apply_outcomes(EngineParams(), _state(math.nan), ints(2), arr(12), arr(16)).state
    assert on.alpha.tobytes() == off.alpha.tobytes() and on.beta.tobytes() == off.beta.tobytes()


# --------------------------------------------------------------------------
# implicit_reliability: rho from the batch's errors (a Kalman gain)
# --------------------------------------------------------------------------


def test_reliability_rho_is_the_kalman_gain_matched_by_the_update() -> None:
    # Two reported tasks (2, 3) with features; capability 0.5 before the batch.
    # Predictions q = w + (s - w) 0.5: task 2: 0.3, task 3: 0.6. Observed r = 8/16 = 0.5 and
    # 12/16 = 0.75. Posterior means: task 2 Beta(1, 1) -> 0.5, task 3 Beta(2, 2) -> 0.5.
    # Noise r (1 - r) / 15: 0.25 / 15 and 0.1875 / 15.
    # v_q  = mean((0.3 - 0.5)^2 - 0.25/15, (0.6 - 0.75)^2 - 0.1875/15)
    # v_mu = mean((0.5 - 0.5)^2 - 0.25/15, (0.5 - 0.75)^2 - 0.1875/15)
    # K = v_mu / (v_mu + v_q); N = 0.9 * mean(alpha + beta) + 0.1 * 2; rho = K N / ((1 - K) 16).
    weak, strong = arr(0.2, 0.0, 0.1, 0.4), arr(0.6, 0.0, 0.5, 0.8)
    alpha, beta = arr(3.0, 2.0, 1.0, 2.0), arr(1.0, 2.0, 1.0, 2.0)
    state = PosteriorState(alpha, beta, weak, strong, 0.5)
    v_q = ((0.2**2 - 0.25 / 15) + (0.15**2 - 0.1875 / 15)) / 2
    v_mu = ((0.0 - 0.25 / 15) + (0.25**2 - 0.1875 / 15)) / 2
    gain = v_mu / (v_mu + v_q)
    n_pool = 0.9 * (4 + 4 + 2 + 4) / 4 + 0.1 * 2
    rho = gain * n_pool / ((1 - gain) * 16)
    assert 0 < rho < 1
    params = EngineParams(implicit_reliability=1.0)
    new = apply_outcomes(params, state, ints(2, 3), arr(8, 12), arr(16, 16)).state
    # Task 0 (unreported): 0.9 * 3 + 0.1 + 16 rho q0 with q0 at the new capability.
    c_hat = (0.625 - 0.25) / (0.65 - 0.25 + 1e-6)
    c = 0.9 * 0.5 + 0.1 * c_hat
    q0 = 0.2 + 0.4 * c
    assert new.alpha[0] == pytest.approx(0.9 * 3 + 0.1 + 16 * rho * q0, rel=1e-12)
    assert new.beta[0] == pytest.approx(0.9 * 1 + 0.1 + 16 * rho * (1 - q0), rel=1e-12)


def test_reliability_factor_scales_rho_and_rho_stays_at_most_one() -> None:
    weak, strong = arr(0.2, 0.0, 0.1, 0.4), arr(0.6, 0.0, 0.5, 0.8)
    state = PosteriorState(arr(3.0, 2.0, 1.0, 2.0), arr(1.0, 2.0, 1.0, 2.0), weak, strong, 0.5)
    c = 0.9 * 0.5 + 0.1 * (0.625 - 0.25) / (0.65 - 0.25 + 1e-6)
    q0 = 0.2 + 0.4 * c
    # A factor of 1000 makes rho above 1: it is held at 1 (implicit only for task 0).
    new = apply_outcomes(EngineParams(implicit_reliability=1000.0), state, ints(2, 3), arr(8, 12), arr(16, 16)).state
    assert new.alpha[0] == pytest.approx(0.9 * 3 + 0.1 + 16 * q0, rel=1e-12)


def test_reliability_without_a_previous_prediction_uses_the_fixed_rho() -> None:
    state = PosteriorState.from_prior(EngineParams(), arr(0.2, 0.1), arr(0.6, 0.5))
    on = apply_outcomes(EngineParams(implicit_reliability=1.0), state, ints(1), arr(8), arr(16)).state
    off = apply_outcomes(EngineParams(), state, ints(1), arr(8), arr(16)).state
    assert on.alpha.tobytes() == off.alpha.tobytes() and on.beta.tobytes() == off.beta.tobytes()


def test_defaults_leave_the_paper_update_untouched() -> None:
    params = EngineParams()
    assert (params.track_prediction, params.implicit_reliability, params.selection_mode) == (0.0, 0.0, "thompson")
