"""Posterior update of the engine (DESIGN.md section 2) against independent values.

Expected numbers are either worked out by hand (arithmetic in the comments) or
produced by `ref_update`, a plain scalar re-statement of the update rules with
loops over tasks that never calls engine code.

Default parameters (EngineParams()): lambda = 0.1, rho = 0.1, m = 16,
a0 = b0 = 1, capability EMA 0.9. So with the defaults:
    decay(x)    = 0.9 * x + 0.1
    explicit    = (1 - rho) * r * m = 0.9 * 16 * r
    implicit    = rho * m * p = 1.6 * p
and for a reported task the two add up to m * r whatever rho is.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bots_server.engine import EngineParams, PosteriorState, apply_outcomes

NAN = math.nan
EPS = 1e-6  # denominator guard of c_hat, as in the reference code
REL = 1e-12


def arr(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=float)


def ints(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def approx(expected, rel: float = REL):
    return pytest.approx(expected, rel=rel, abs=1e-12)


# --------------------------------------------------------------------------
# Independent scalar reference of the update
# --------------------------------------------------------------------------


def ref_update(
    params: EngineParams,
    alpha: list[float],
    beta: list[float],
    weak: list[float],
    strong: list[float],
    capability: float,
    tasks: list[int],
    successes: list[float],
    trials: list[float],
    pool_size: int | None = None,
) -> tuple[list[float], list[float], float, float]:
    """(alpha, beta, capability, capability_estimate) after one step, by plain loops."""
    lam = params.forgetting
    rho = params.implicit_weight
    m = params.rollouts_per_task
    a0, b0 = params.prior_alpha, params.prior_beta
    n = len(alpha) if pool_size is None else pool_size
    new_alpha = [float(x) for x in alpha]
    new_beta = [float(x) for x in beta]

    if params.strategy == "mopps":
        for j, t in enumerate(tasks):
            k, nt = float(successes[j]), float(trials[j])
            new_alpha[t] = (1 - lam) * alpha[t] + lam * a0 + k
            new_beta[t] = (1 - lam) * beta[t] + lam * b0 + (nt - k)
        return new_alpha, new_beta, capability, NAN

    rate: dict[int, float] = {}
    for j, t in enumerate(tasks):
        rate[int(t)] = float(successes[j]) / float(trials[j])

    # capability (interpolation plug-in)
    sum_r = sum_w = sum_s = 0.0
    count = 0
    for t in rate:
        if not math.isnan(weak[t]) and not math.isnan(strong[t]):
            sum_r += rate[t]
            sum_w += weak[t]
            sum_s += strong[t]
            count += 1
    if count:
        c_hat = (sum_r / count - sum_w / count) / (sum_s / count - sum_w / count + EPS)
        if math.isnan(capability):
            cap = c_hat
        else:
            ema = params.capability_ema
            cap = ema * capability + (1 - ema) * c_hat
    else:
        c_hat = NAN
        cap = capability

    weight = {int(t): float(trials[j]) for j, t in enumerate(tasks)}  # a report weighs its own trials
    for i in range(n):
        m_i = weight.get(i, m)
        if i in rate:
            s_bar, f_bar = rate[i] * m_i, (1 - rate[i]) * m_i
        else:
            s_bar = f_bar = 0.0
        if math.isnan(cap) or rho == 0:
            rho_i, p = 0.0, 0.0
        elif i in rate:
            rho_i, p = rho, rate[i]
        elif not math.isnan(weak[i]) and not math.isnan(strong[i]):
            rho_i, p = rho, min(1.0, max(0.0, weak[i] + (strong[i] - weak[i]) * cap))
        else:
            rho_i, p = 0.0, 0.0
        new_alpha[i] = (1 - lam) * alpha[i] + lam * a0 + (1 - rho_i) * s_bar + rho_i * m_i * p
        new_beta[i] = (1 - lam) * beta[i] + lam * b0 + (1 - rho_i) * f_bar + rho_i * m_i * (1 - p)
    return new_alpha, new_beta, cap, c_hat


def state_of(alpha, beta, weak, strong, capability: float = NAN) -> PosteriorState:
    return PosteriorState(arr(*alpha), arr(*beta), arr(*weak), arr(*strong), capability)


def same_float(a: float, b: float, rel: float = REL) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == pytest.approx(b, rel=rel, abs=1e-12)


# --------------------------------------------------------------------------
# 1. A small hand-made BOTS case
# --------------------------------------------------------------------------

# Five tasks, tasks 0 and 3 reported (rates 0.4 and 0.7, each of a full
# group of m = 16 rollouts: 6.4/16 and 11.2/16, fractional rewards).
CASE1_ALPHA = (2.0, 3.0, 1.0, 4.0, 1.0)
CASE1_BETA = (2.0, 1.0, 5.0, 4.0, 1.0)
CASE1_WEAK = (0.2, 0.4, 0.0, 0.5, 0.1)
CASE1_STRONG = (0.6, 0.8, 0.4, 0.9, 0.5)
CASE1_TASKS = ints(0, 3)
CASE1_SUCC = arr(6.4, 11.2)
CASE1_TRIALS = arr(16, 16)
# r = (0.4, 0.7); mean r = 0.55, mean w = (0.2 + 0.5)/2 = 0.35, mean s = (0.6 + 0.9)/2 = 0.75
# c_hat = (0.55 - 0.35) / (0.75 - 0.35 + 1e-6) = 0.2 / 0.400001  (~0.49999875)
CASE1_C = 0.2 / 0.400001


def _case1() -> PosteriorState:
    return state_of(CASE1_ALPHA, CASE1_BETA, CASE1_WEAK, CASE1_STRONG)


def test_bots_hand_case_selected_and_unselected_tasks() -> None:
    """One BOTS step: reported tasks get m*r in total, unselected tasks decay plus rho*m*p_tilde."""
    params = EngineParams()
    result = apply_outcomes(params, _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    c = CASE1_C
    p1 = 0.4 + (0.8 - 0.4) * c  # ~0.6
    p2 = 0.0 + (0.4 - 0.0) * c  # ~0.2
    p4 = 0.1 + (0.5 - 0.1) * c  # ~0.3
    expected_alpha = [
        # task 0: 0.9*2 + 0.1 + 0.9*(0.4*16) + 1.6*0.4 = 1.9 + 5.76 + 0.64
        8.3,
        # task 1: 0.9*3 + 0.1 + 1.6*p1
        2.8 + 1.6 * p1,
        # task 2: 0.9*1 + 0.1 + 1.6*p2
        1.0 + 1.6 * p2,
        # task 3: 0.9*4 + 0.1 + 0.9*(0.7*16) + 1.6*0.7 = 3.7 + 10.08 + 1.12
        14.9,
        # task 4: 0.9*1 + 0.1 + 1.6*p4
        1.0 + 1.6 * p4,
    ]
    expected_beta = [
        # task 0: 1.9 + 0.9*(0.6*16) + 1.6*0.6 = 1.9 + 8.64 + 0.96
        11.5,
        # task 1: 0.9*1 + 0.1 + 1.6*(1 - p1)
        1.0 + 1.6 * (1 - p1),
        # task 2: 0.9*5 + 0.1 + 1.6*(1 - p2)
        4.6 + 1.6 * (1 - p2),
        # task 3: 3.7 + 0.9*(0.3*16) + 1.6*0.3 = 3.7 + 4.32 + 0.48
        8.5,
        # task 4: 1.0 + 1.6*(1 - p4)
        1.0 + 1.6 * (1 - p4),
    ]
    assert result.state.alpha.tolist() == approx(expected_alpha)
    assert result.state.beta.tolist() == approx(expected_beta)
    # rough magnitudes, as a sanity check of the hand arithmetic
    assert result.state.alpha.tolist() == pytest.approx([8.3, 3.76, 1.32, 14.9, 1.48], abs=1e-5)
    assert result.state.beta.tolist() == pytest.approx([11.5, 1.64, 5.88, 8.5, 2.12], abs=1e-5)
    # features are carried over unchanged
    np.testing.assert_array_equal(result.state.weak, arr(*CASE1_WEAK))
    np.testing.assert_array_equal(result.state.strong, arr(*CASE1_STRONG))


def test_a_report_weighs_its_own_trials_in_every_strategy() -> None:
    """A group of n != m rollouts adds its own successes and failures to a
    reported task, in bots, uniform and mopps alike; m stays the weight of
    the prediction of the tasks not reported."""
    tasks, successes, trials = CASE1_TASKS, arr(4, 7), arr(10, 10)  # 4/10 and 7/10
    bots = apply_outcomes(EngineParams(), _case1(), tasks, successes, trials)
    # task 0: 0.9*2 + 0.1 + 0.9*(0.4*10) + 0.1*10*0.4 = 1.9 + 4 ; beta 1.9 + 6
    # task 3: 0.9*4 + 0.1 + 7 = 10.7 ; beta 3.7 + 3 = 6.7 ; task 1 as with m = 16
    p1 = 0.4 + (0.8 - 0.4) * CASE1_C
    assert bots.state.alpha[[0, 1, 3]].tolist() == approx([5.9, 2.8 + 1.6 * p1, 10.7])
    assert bots.state.beta[[0, 1, 3]].tolist() == approx([7.9, 1.0 + 1.6 * (1 - p1), 6.7])
    uniform = apply_outcomes(EngineParams(strategy="uniform"), _case1(), tasks, successes, trials)
    mopps = apply_outcomes(EngineParams(strategy="mopps"), _case1(), tasks, successes, trials)
    for other in (uniform, mopps):
        assert other.state.alpha[[0, 3]].tolist() == approx([5.9, 10.7])
        assert other.state.beta[[0, 3]].tolist() == approx([7.9, 6.7])


def test_bots_hand_case_matches_scalar_reference() -> None:
    """The hand case also agrees with the loop re-statement of the formulas."""
    params = EngineParams()
    result = apply_outcomes(params, _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    a, b, cap, c_hat = ref_update(
        params, list(CASE1_ALPHA), list(CASE1_BETA), list(CASE1_WEAK), list(CASE1_STRONG), NAN,
        [0, 3], [6.4, 11.2], [16, 16],
    )
    assert result.state.alpha.tolist() == approx(a)
    assert result.state.beta.tolist() == approx(b)
    assert result.state.capability == approx(cap)
    assert result.capability_estimate == approx(c_hat)


def test_uniform_strategy_uses_bots_update() -> None:
    """"uniform" only changes selection: its update is the BOTS one."""
    bots = apply_outcomes(EngineParams(), _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    uniform = apply_outcomes(
        EngineParams(strategy="uniform"), _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS
    )
    np.testing.assert_array_equal(uniform.state.alpha, bots.state.alpha)
    np.testing.assert_array_equal(uniform.state.beta, bots.state.beta)
    assert uniform.state.capability == bots.state.capability


# --------------------------------------------------------------------------
# 2. Capability: first estimate and EMA
# --------------------------------------------------------------------------


def test_capability_first_update_is_c_hat() -> None:
    """With no previous estimate the capability becomes this batch's c_hat, which is also returned."""
    result = apply_outcomes(EngineParams(), _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    assert result.capability_estimate == approx(CASE1_C)
    assert result.state.capability == approx(CASE1_C)
    assert result.capability_estimate == pytest.approx(0.5, abs=1e-5)


def test_capability_second_update_is_ema() -> None:
    """A later batch moves the capability by the EMA 0.9*c + 0.1*c_hat; the estimate is the batch's c_hat."""
    params = EngineParams()
    first = apply_outcomes(params, _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    # second batch: task 2 (w = 0.0, s = 0.4) with 1 of 4 -> r = 0.25
    # c_hat2 = (0.25 - 0.0) / (0.4 - 0.0 + 1e-6) = 0.25 / 0.400001  (~0.625)
    c_hat2 = 0.25 / 0.400001
    cap2 = 0.9 * CASE1_C + 0.1 * c_hat2  # ~0.5125
    second = apply_outcomes(params, first.state, ints(2), arr(1), arr(4))
    assert second.capability_estimate == approx(c_hat2)
    assert second.state.capability == approx(cap2)
    assert second.state.capability == pytest.approx(0.5125, abs=1e-5)

    # The new capability drives the prediction of unselected tasks, e.g. task 4:
    # p4' = 0.1 + 0.4*cap2; alpha4' = 0.9*alpha4 + 0.1 + 1.6*p4'
    p4 = 0.1 + 0.4 * CASE1_C
    alpha4 = 1.0 + 1.6 * p4
    beta4 = 1.0 + 1.6 * (1 - p4)
    p4_new = 0.1 + 0.4 * cap2
    assert second.state.alpha[4] == approx(0.9 * alpha4 + 0.1 + 1.6 * p4_new)
    assert second.state.beta[4] == approx(0.9 * beta4 + 0.1 + 1.6 * (1 - p4_new))
    # the reported task 2: 0.9*alpha2 + 0.1 + 1 (explicit + implicit add up to
    # the report's own 1 success and 3 failures: a report weighs its trials)
    alpha2 = 1.0 + 1.6 * (0.4 * CASE1_C)
    beta2 = 4.6 + 1.6 * (1 - 0.4 * CASE1_C)
    assert second.state.alpha[2] == approx(0.9 * alpha2 + 0.1 + 1.0)
    assert second.state.beta[2] == approx(0.9 * beta2 + 0.1 + 3.0)


def test_capability_ema_uses_params_value() -> None:
    """The EMA weight comes from params.capability_ema."""
    params = EngineParams(capability_ema=0.5)
    state = state_of((1, 1), (1, 1), (0.0, 0.5), (1.0, 1.0), capability=0.2)
    # task 0: w=0, s=1, r = 3/4 -> c_hat = 0.75 / 1.000001; cap = 0.5*0.2 + 0.5*c_hat
    result = apply_outcomes(params, state, ints(0), arr(3), arr(4))
    c_hat = 0.75 / 1.000001
    assert result.capability_estimate == approx(c_hat)
    assert result.state.capability == approx(0.5 * 0.2 + 0.5 * c_hat)


# --------------------------------------------------------------------------
# 3. Clipping of p_tilde
# --------------------------------------------------------------------------


def test_prediction_clipped_at_one_and_zero_for_large_capability() -> None:
    """Predictions above 1 or below 0 are clipped before they enter alpha/beta."""
    # task 0 reported: w=0.2, s=0.4, r = 8/16 = 0.5 -> c = 0.3/0.200001 ~ 1.5
    # task 1: 0.6 + 0.4*1.5 = 1.2  -> clipped to 1
    # task 2: 0.5 + (0.0-0.5)*1.5 = -0.25 -> clipped to 0
    # task 3: 0.3 + 0.2*1.5 = 0.6  (not clipped, control)
    state = state_of((1, 1, 1, 1), (1, 1, 1, 1), (0.2, 0.6, 0.5, 0.3), (0.4, 1.0, 0.0, 0.5))
    result = apply_outcomes(EngineParams(), state, ints(0), arr(8), arr(16))
    c = 0.3 / 0.200001
    assert result.state.capability == approx(c)
    p3 = 0.3 + 0.2 * c
    # task 0: 1 + 16*0.5 = 9 both; task 1: alpha = 1 + 1.6*1, beta = 1 + 1.6*0
    # task 2: alpha = 1 + 0, beta = 1 + 1.6; task 3: 1 + 1.6*p3, 1 + 1.6*(1-p3)
    assert result.state.alpha.tolist() == approx([9.0, 2.6, 1.0, 1.0 + 1.6 * p3])
    assert result.state.beta.tolist() == approx([9.0, 1.0, 2.6, 1.0 + 1.6 * (1 - p3)])


def test_prediction_clipped_for_negative_capability() -> None:
    """A negative capability (batch worse than the weak model) also clips predictions into [0, 1]."""
    # task 0 reported: w=0.4, s=0.6, r = 0/16 -> c = -0.4/0.200001 ~ -2
    # task 1: 0.3 + 0.6*(-2) = -0.9 -> 0 ; task 2: 0.8 + (0.2-0.8)*(-2) = 2.0 -> 1
    state = state_of((2, 2, 2), (3, 3, 3), (0.4, 0.3, 0.8), (0.6, 0.9, 0.2))
    result = apply_outcomes(EngineParams(), state, ints(0), arr(0), arr(16))
    assert result.state.capability == approx(-0.4 / 0.200001)
    # decay: alpha 0.9*2 + 0.1 = 1.9 ; beta 0.9*3 + 0.1 = 2.8
    # task 0: alpha 1.9 + 0, beta 2.8 + 16 ; task 1 (p=0): 1.9, 2.8 + 1.6 ; task 2 (p=1): 1.9 + 1.6, 2.8
    assert result.state.alpha.tolist() == approx([1.9, 1.9, 3.5])
    assert result.state.beta.tolist() == approx([18.8, 4.4, 2.8])


# --------------------------------------------------------------------------
# 4. rho = 0 and rho = 1
# --------------------------------------------------------------------------


def test_rho_zero_is_explicit_evidence_plus_forgetting() -> None:
    """With rho = 0 unselected tasks only decay to the prior; reported tasks add s_bar, f_bar."""
    params = EngineParams(implicit_weight=0.0)
    result = apply_outcomes(params, _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    # reported: task 0: 1.9 + 6.4, 1.9 + 9.6 ; task 3: 3.7 + 11.2, 3.7 + 4.8
    # unselected: 0.9*x + 0.1 -> alpha (3,1,1) -> (2.8, 1.0, 1.0); beta (1,5,1) -> (1.0, 4.6, 1.0)
    assert result.state.alpha.tolist() == approx([8.3, 2.8, 1.0, 14.9, 1.0])
    assert result.state.beta.tolist() == approx([11.5, 1.0, 4.6, 8.5, 1.0])
    # the plug-in estimate is still reported
    assert result.capability_estimate == approx(CASE1_C)


def test_rho_one_is_implicit_only() -> None:
    """With rho = 1 reported tasks get m*r / m*(1-r) and unselected ones m*p_tilde / m*(1-p_tilde)."""
    params = EngineParams(implicit_weight=1.0)
    result = apply_outcomes(params, _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    c = CASE1_C
    p1, p2, p4 = 0.4 + 0.4 * c, 0.4 * c, 0.1 + 0.4 * c
    # reported: task 0: 1.9 + 16*0.4, 1.9 + 16*0.6 ; task 3: 3.7 + 16*0.7, 3.7 + 16*0.3
    expected_alpha = [8.3, 2.8 + 16 * p1, 1.0 + 16 * p2, 14.9, 1.0 + 16 * p4]
    expected_beta = [11.5, 1.0 + 16 * (1 - p1), 4.6 + 16 * (1 - p2), 8.5, 1.0 + 16 * (1 - p4)]
    assert result.state.alpha.tolist() == approx(expected_alpha)
    assert result.state.beta.tolist() == approx(expected_beta)
    # ~ [8.3, 12.4, 4.2, 14.9, 5.8] / [11.5, 7.4, 17.4, 8.5, 12.2]
    assert result.state.alpha.tolist() == pytest.approx([8.3, 12.4, 4.2, 14.9, 5.8], abs=1e-4)
    assert result.state.beta.tolist() == pytest.approx([11.5, 7.4, 17.4, 8.5, 12.2], abs=1e-4)


def test_forgetting_and_prior_parameters() -> None:
    """lambda, m, a0 and b0 come from the params (lambda = 1 resets to prior + evidence)."""
    params = EngineParams(forgetting=1.0, implicit_weight=0.0, rollouts_per_task=8, prior_alpha=2.0, prior_beta=3.0)
    state = state_of((10, 20, 30), (5, 6, 7), (NAN,) * 3, (NAN,) * 3)
    result = apply_outcomes(params, state, ints(1), arr(2), arr(8))
    # r = 0.25, s_bar = 2, f_bar = 6 ; all tasks reset to (2, 3)
    assert result.state.alpha.tolist() == approx([2.0, 4.0, 2.0])
    assert result.state.beta.tolist() == approx([3.0, 9.0, 3.0])

    params = EngineParams(forgetting=0.0, implicit_weight=0.0, rollouts_per_task=8)
    result = apply_outcomes(params, state, ints(1), arr(2), arr(8))
    # no forgetting: unchanged except task 1: 20 + 2, 6 + 6
    assert result.state.alpha.tolist() == approx([10.0, 22.0, 30.0])
    assert result.state.beta.tolist() == approx([5.0, 12.0, 7.0])


def test_keep_successes_spares_alpha_its_share_of_the_forgetting() -> None:
    """keep_successes = k forgets alpha at lambda (1 - k), beta at lambda."""
    state = state_of((10, 20, 30), (5, 6, 7), (NAN,) * 3, (NAN,) * 3)
    params = EngineParams(forgetting=0.5, keep_successes=1.0, implicit_weight=0.0, rollouts_per_task=8)
    result = apply_outcomes(params, state, ints(1), arr(2), arr(8))
    # alpha kept (10, 20 + 2, 30); beta 0.5 * b + 0.5: (3, 3.5 + 6, 4)
    assert result.state.alpha.tolist() == approx([10.0, 22.0, 30.0])
    assert result.state.beta.tolist() == approx([3.0, 9.5, 4.0])
    params = EngineParams(forgetting=0.5, keep_successes=0.5, implicit_weight=0.0, rollouts_per_task=8)
    result = apply_outcomes(params, state, ints(1), arr(2), arr(8))
    # alpha forgets at 0.25: 0.75 a + 0.25 -> (7.75, 15.25 + 2, 22.75)
    assert result.state.alpha.tolist() == approx([7.75, 17.25, 22.75])
    assert result.state.beta.tolist() == approx([3.0, 9.5, 4.0])


# --------------------------------------------------------------------------
# 5. Missing features
# --------------------------------------------------------------------------


def test_tasks_without_features_in_mixed_pool() -> None:
    """Tasks lacking a feature get no implicit evidence and do not enter c_hat; reported ones use r."""
    # task 0: both features, reported 8/16 (r = 0.5)
    # task 1: both features, unselected
    # task 2: weak missing, reported 4/16 (r = 0.25) -> not in c_hat
    # task 3: no features, unselected -> pure decay
    # task 4: strong missing, unselected -> pure decay
    state = state_of((1,) * 5, (1,) * 5, (0.2, 0.4, NAN, NAN, 0.3), (0.6, 0.8, 0.7, NAN, NAN))
    result = apply_outcomes(EngineParams(), state, ints(0, 2), arr(8, 4), arr(16, 16))
    # c_hat over task 0 only: (0.5 - 0.2) / (0.6 - 0.2 + 1e-6) = 0.3 / 0.400001 (~0.75)
    c = 0.3 / 0.400001
    assert result.capability_estimate == approx(c)
    assert result.state.capability == approx(c)
    p1 = 0.4 + 0.4 * c  # ~0.7
    # task 0: 1 + 8, 1 + 8 ; task 2: 1 + 0.9*4 + 1.6*0.25 = 5, 1 + 0.9*12 + 1.6*0.75 = 13
    assert result.state.alpha.tolist() == approx([9.0, 1.0 + 1.6 * p1, 5.0, 1.0, 1.0])
    assert result.state.beta.tolist() == approx([9.0, 1.0 + 1.6 * (1 - p1), 13.0, 1.0, 1.0])
    assert np.all(np.isfinite(result.state.alpha)) and np.all(np.isfinite(result.state.beta))


def test_pool_without_any_features_acts_as_rho_zero() -> None:
    """With no reference features at all, the update is explicit evidence plus forgetting, every step."""
    state = state_of((2, 1, 1, 3), (1, 1, 4, 2), (NAN,) * 4, (NAN,) * 4)
    params = EngineParams()  # rho = 0.1, but no plug-in
    first = apply_outcomes(params, state, ints(1), arr(12), arr(16))
    # task 1: 1 + 0.9*12 + ... = 0.9*1 + 0.1 + 12 = 13, beta 1 + 4 = 5
    # others decay: alpha (2, 1, 3) -> (1.9, 1.0, 2.8); beta (1, 4, 2) -> (1.0, 3.7, 1.9)
    assert first.state.alpha.tolist() == approx([1.9, 13.0, 1.0, 2.8])
    assert first.state.beta.tolist() == approx([1.0, 5.0, 3.7, 1.9])
    assert math.isnan(first.state.capability)
    assert math.isnan(first.capability_estimate)

    second = apply_outcomes(params, first.state, ints(0, 2), arr(4, 0), arr(16, 16))
    # task 0: 0.9*1.9 + 0.1 + 16*0.25 = 1.81 + 4 ; beta 0.9*1.0 + 0.1 + 12 = 13
    # task 2: 0.9*1.0 + 0.1 + 0 = 1.0 ; beta 0.9*3.7 + 0.1 + 16 = 3.43 + 16
    # task 1: 0.9*13 + 0.1 = 11.8 ; beta 0.9*5 + 0.1 = 4.6 ; task 3: 0.9*2.8 + 0.1 = 2.62 ; 0.9*1.9 + 0.1 = 1.81
    assert second.state.alpha.tolist() == approx([5.81, 11.8, 1.0, 2.62])
    assert second.state.beta.tolist() == approx([13.0, 4.6, 19.43, 1.81])
    assert math.isnan(second.state.capability)
    assert math.isnan(second.capability_estimate)


def test_report_without_features_keeps_known_capability() -> None:
    """A batch with no featured task leaves the capability as it was; featured tasks still get predictions."""
    state = state_of((1, 1, 1), (1, 1, 1), (0.2, NAN, 0.4), (0.6, NAN, 1.0), capability=0.5)
    result = apply_outcomes(EngineParams(), state, ints(1), arr(4), arr(16))
    assert math.isnan(result.capability_estimate)
    assert result.state.capability == 0.5
    # task 0: p = 0.2 + 0.4*0.5 = 0.4 -> 1 + 1.6*0.4 = 1.64, 1 + 1.6*0.6 = 1.96
    # task 1: reported r = 0.25 -> 1 + 4, 1 + 12
    # task 2: p = 0.4 + 0.6*0.5 = 0.7 -> 1 + 1.12 = 2.12, 1 + 0.48 = 1.48
    assert result.state.alpha.tolist() == approx([1.64, 5.0, 2.12])
    assert result.state.beta.tolist() == approx([1.96, 13.0, 1.48])


def test_report_without_features_before_any_estimate() -> None:
    """Until a first capability estimate exists, no task receives implicit evidence."""
    state = state_of((1, 1, 1), (1, 1, 1), (0.2, NAN, 0.4), (0.6, NAN, 1.0))
    result = apply_outcomes(EngineParams(), state, ints(1), arr(4), arr(16))
    assert math.isnan(result.capability_estimate)
    assert math.isnan(result.state.capability)
    assert result.state.alpha.tolist() == approx([1.0, 5.0, 1.0])
    assert result.state.beta.tolist() == approx([1.0, 13.0, 1.0])


def test_empty_report_decays_and_applies_known_capability() -> None:
    """A step with no reported task still forgets, and predicts from the known capability."""
    state = state_of((3, 1), (1, 2), (0.2, NAN), (0.6, NAN), capability=0.5)
    result = apply_outcomes(EngineParams(), state, ints(), arr(), arr())
    # task 0: p = 0.4 -> 0.9*3 + 0.1 + 0.64 = 3.44 ; 0.9*1 + 0.1 + 0.96 = 1.96
    # task 1: no features -> 1.0, 1.9
    assert result.state.alpha.tolist() == approx([3.44, 1.0])
    assert result.state.beta.tolist() == approx([1.96, 1.9])
    assert result.state.capability == 0.5
    assert math.isnan(result.capability_estimate)


# --------------------------------------------------------------------------
# 6. Fractional successes
# --------------------------------------------------------------------------


def test_fractional_successes_bots() -> None:
    """Non-binary rewards: a fractional success count enters as the rate r = k/n."""
    state = state_of((1, 1, 1), (1, 1, 1), (0.25, 0.5, 0.0), (0.75, 1.0, 0.5))
    result = apply_outcomes(EngineParams(), state, ints(0), arr(10.0), arr(16))
    # r = 0.625: s_bar = 10, f_bar = 6 -> task 0: 1 + 10 = 11, 1 + 6 = 7
    # c_hat = (0.625 - 0.25) / (0.75 - 0.25 + 1e-6) = 0.375 / 0.500001 (~0.75)
    c = 0.375 / 0.500001
    assert result.capability_estimate == approx(c)
    p1 = 0.5 + 0.5 * c  # ~0.875
    p2 = 0.0 + 0.5 * c  # ~0.375
    assert result.state.alpha.tolist() == approx([11.0, 1.0 + 1.6 * p1, 1.0 + 1.6 * p2])
    assert result.state.beta.tolist() == approx([7.0, 1.0 + 1.6 * (1 - p1), 1.0 + 1.6 * (1 - p2)])


def test_fractional_successes_mopps() -> None:
    """MoPPS adds fractional raw counts: k and n - k."""
    params = EngineParams(strategy="mopps")
    state = state_of((1, 1), (1, 1), (NAN, NAN), (NAN, NAN))
    result = apply_outcomes(params, state, ints(0), arr(2.5), arr(4))
    # 1 + 2.5, 1 + 1.5
    assert result.state.alpha.tolist() == approx([3.5, 1.0])
    assert result.state.beta.tolist() == approx([2.5, 1.0])


# --------------------------------------------------------------------------
# 7. MoPPS
# --------------------------------------------------------------------------


def test_mopps_updates_only_reported_tasks_with_raw_counts() -> None:
    """MoPPS: reported tasks decay and add raw k / n-k; others and the capability are untouched."""
    params = EngineParams(strategy="mopps")
    state = state_of((2, 3, 1, 4), (2, 1, 5, 4), (0.2, 0.4, 0.0, 0.5), (0.6, 0.8, 0.4, 0.9), capability=0.3)
    result = apply_outcomes(params, state, ints(1, 3), arr(3, 0), arr(8, 5))
    # task 1: 0.9*3 + 0.1 + 3 = 5.8 ; 0.9*1 + 0.1 + 5 = 6.0
    # task 3: 0.9*4 + 0.1 + 0 = 3.7 ; 0.9*4 + 0.1 + 5 = 8.7
    assert result.state.alpha[[1, 3]].tolist() == approx([5.8, 3.7])
    assert result.state.beta[[1, 3]].tolist() == approx([6.0, 8.7])
    # unselected tasks exactly unchanged
    assert result.state.alpha[[0, 2]].tolist() == [2.0, 1.0]
    assert result.state.beta[[0, 2]].tolist() == [2.0, 5.0]
    assert result.state.capability == 0.3
    assert math.isnan(result.capability_estimate)


def test_mopps_does_not_estimate_capability() -> None:
    """MoPPS never starts a capability estimate, even when reported tasks have features."""
    params = EngineParams(strategy="mopps")
    result = apply_outcomes(params, _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    assert math.isnan(result.state.capability)
    assert math.isnan(result.capability_estimate)
    # task 0: 1.9 + 6.4, 1.9 + 9.6 ; task 3: 3.7 + 11.2, 3.7 + 4.8 ; tasks 1, 2, 4 unchanged
    assert result.state.alpha.tolist() == approx([8.3, 3.0, 1.0, 14.9, 1.0])
    assert result.state.beta.tolist() == approx([11.5, 1.0, 5.0, 8.5, 1.0])


# --------------------------------------------------------------------------
# 8. pool_size (replay of a step from before tasks were added)
# --------------------------------------------------------------------------


def test_pool_size_updates_only_the_prefix() -> None:
    """pool_size=n: the first n tasks update as if the pool had n tasks; later ones are unchanged."""
    # tasks 0-2 as in case 1 (tasks 0, 1, 2); tasks 3, 4 were added later
    state = state_of((2, 3, 1, 4, 5), (2, 1, 5, 4, 6), (0.2, 0.4, 0.0, 0.9, 0.1), (0.6, 0.8, 0.4, 1.0, 0.2))
    result = apply_outcomes(EngineParams(), state, ints(0), arr(6.4), arr(16), pool_size=3)
    # r = 0.4 ; c = (0.4 - 0.2) / (0.6 - 0.2 + 1e-6) = 0.2 / 0.400001
    c = 0.2 / 0.400001
    p1, p2 = 0.4 + 0.4 * c, 0.4 * c
    assert result.state.alpha[:3].tolist() == approx([8.3, 2.8 + 1.6 * p1, 1.0 + 1.6 * p2])
    assert result.state.beta[:3].tolist() == approx([11.5, 1.0 + 1.6 * (1 - p1), 4.6 + 1.6 * (1 - p2)])
    assert result.state.alpha[3:].tolist() == [4.0, 5.0]
    assert result.state.beta[3:].tolist() == [4.0, 6.0]
    assert result.state.num_tasks == 5
    np.testing.assert_array_equal(result.state.weak, state.weak)
    np.testing.assert_array_equal(result.state.strong, state.strong)
    assert result.state.capability == approx(c)
    assert result.capability_estimate == approx(c)


def test_pool_size_equal_to_pool_is_full_update() -> None:
    """pool_size equal to the number of tasks is the same as no pool_size."""
    full = apply_outcomes(EngineParams(), _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS)
    same = apply_outcomes(EngineParams(), _case1(), CASE1_TASKS, CASE1_SUCC, CASE1_TRIALS, pool_size=5)
    np.testing.assert_array_equal(full.state.alpha, same.state.alpha)
    np.testing.assert_array_equal(full.state.beta, same.state.beta)
    assert full.state.capability == same.state.capability


def test_pool_size_with_mopps() -> None:
    """pool_size with MoPPS: reported prefix tasks update, the tail is unchanged."""
    params = EngineParams(strategy="mopps")
    state = state_of((2, 3, 1, 4), (2, 1, 5, 4), (NAN,) * 4, (NAN,) * 4)
    result = apply_outcomes(params, state, ints(1), arr(2), arr(3), pool_size=2)
    # task 1: 0.9*3 + 0.1 + 2 = 4.8 ; 0.9*1 + 0.1 + 1 = 2.0
    assert result.state.alpha.tolist() == approx([2.0, 4.8, 1.0, 4.0])
    assert result.state.beta.tolist() == approx([2.0, 2.0, 5.0, 4.0])


# --------------------------------------------------------------------------
# Randomised agreement with the scalar reference over several chained steps
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_chains_match_scalar_reference(seed: int) -> None:
    """Across random pools, parameters, missing features and pool sizes, several steps match the reference."""
    g = np.random.default_rng(1000 + seed)
    n = int(g.integers(3, 12))
    strategy = ["bots", "uniform", "mopps"][seed % 3]
    params = EngineParams(
        strategy=strategy,
        forgetting=float(g.choice([0.0, 0.1, 0.37, 1.0])),
        implicit_weight=float(g.choice([0.0, 0.1, 0.5, 1.0])),
        rollouts_per_task=int(g.choice([1, 8, 16])),
        prior_alpha=float(g.uniform(0.5, 3)),
        prior_beta=float(g.uniform(0.5, 3)),
        capability_ema=float(g.choice([0.9, 0.5])),
    )
    weak = g.uniform(0, 1, n)
    strong = np.clip(weak + g.uniform(-0.2, 0.6, n), 0, 1)
    weak[g.random(n) < 0.25] = np.nan
    strong[g.random(n) < 0.25] = np.nan
    if seed == 0:  # one pool without any feature
        weak[:] = np.nan
    alpha = g.uniform(0.5, 20, n)
    beta = g.uniform(0.5, 20, n)
    state = PosteriorState(alpha.copy(), beta.copy(), weak.copy(), strong.copy())
    ref = (alpha.tolist(), beta.tolist(), NAN)
    for _ in range(6):
        pool = int(g.integers(2, n + 1)) if g.random() < 0.4 else None
        limit = n if pool is None else pool
        k = int(g.integers(0, min(4, limit) + 1))
        tasks = g.choice(limit, size=k, replace=False)
        trials = g.integers(1, 20, k).astype(float)
        successes = np.round(g.uniform(0, 1, k) * trials * 2) / 2  # halves: fractional allowed
        result = apply_outcomes(params, state, tasks, successes, trials, pool_size=pool)
        a, b, cap, c_hat = ref_update(
            params, ref[0], ref[1], weak.tolist(), strong.tolist(), ref[2],
            tasks.tolist(), successes.tolist(), trials.tolist(), pool,
        )
        assert result.state.alpha.tolist() == pytest.approx(a, rel=1e-9, abs=1e-9)
        assert result.state.beta.tolist() == pytest.approx(b, rel=1e-9, abs=1e-9)
        assert same_float(result.state.capability, cap, rel=1e-9)
        assert same_float(result.capability_estimate, c_hat, rel=1e-9)
        state = result.state
        ref = (a, b, cap)


# --------------------------------------------------------------------------
# Inputs are not mutated
# --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["bots", "mopps"])
@pytest.mark.parametrize("pool_size", [None, 3])
def test_apply_outcomes_does_not_mutate_inputs(strategy: str, pool_size: int | None) -> None:
    """The input state and report arrays are left as they were; the result does not alias them."""
    state = _case1()
    originals = [x.copy() for x in (state.alpha, state.beta, state.weak, state.strong)]
    tasks, succ, trials = CASE1_TASKS.copy(), CASE1_SUCC.copy(), CASE1_TRIALS.copy()
    tasks[1] = 2  # keep within a pool_size of 3
    tasks_in, succ_in, trials_in = tasks.copy(), succ.copy(), trials.copy()
    result = apply_outcomes(EngineParams(strategy=strategy), state, tasks, succ, trials, pool_size=pool_size)
    for before, after in zip(originals, (state.alpha, state.beta, state.weak, state.strong)):
        np.testing.assert_array_equal(before, after)
    assert math.isnan(state.capability)
    np.testing.assert_array_equal(tasks, tasks_in)
    np.testing.assert_array_equal(succ, succ_in)
    np.testing.assert_array_equal(trials, trials_in)
    # the state actually changed, and in new arrays
    assert not np.array_equal(result.state.alpha, state.alpha)
    assert not np.shares_memory(result.state.alpha, state.alpha)
    assert not np.shares_memory(result.state.beta, state.beta)


def test_report_weight_rollouts_per_task_weighs_a_report_by_m_whatever_it_holds() -> None:
    """A 1-of-4 report under m = 16: 'trials' adds 1 success and 3 failures,
    'rollouts_per_task' the rate times m, 4 and 12 (no forgetting, no rho)."""
    nan = np.full(2, np.nan)
    for weight, expected in (("trials", (2.0, 4.0)), ("rollouts_per_task", (5.0, 13.0))):
        params = EngineParams(forgetting=0.0, implicit_weight=0.0, rollouts_per_task=16, report_weight=weight)
        state = PosteriorState.from_prior(params, nan, nan)
        new = apply_outcomes(params, state, np.array([0]), np.array([1.0]), np.array([4.0])).state
        assert (new.alpha[0], new.beta[0]) == expected
        assert (new.alpha[1], new.beta[1]) == (1.0, 1.0)
