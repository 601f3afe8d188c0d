"""BOTS (arXiv 2510.26374): Thompson selection near p*, explicit evidence of
the reported tasks plus the interpolation plug-in's implicit evidence for
every task, and every task forgets toward the prior each step."""

from __future__ import annotations

import math

import numpy as np

from bots_server.engine.params import EngineParams
from bots_server.engine.scoring import closeness
from bots_server.engine.state import PosteriorState, UpdateResult
from bots_server.engine.strategies.base import Strategy

# Denominator guard of the interpolation plug-in, as in the reference code.
_EPS = 1e-6

SELECTION_SETTINGS = ("target_success", "selection_mode", "temperature", "candidate_ratio")
UPDATE_SETTINGS = (
    "forgetting",
    "implicit_weight",
    "rollouts_per_task",
    "prior_alpha",
    "prior_beta",
    "capability_ema",
    "adaptive_rho_error",
    "track_prediction",
    "implicit_reliability",
)
# Bounds of the carried posterior mean (track_prediction): strictly inside
# (0, 1), so both Beta parameters stay positive.
_MEAN_FLOOR = 1e-3
# Smallest prediction variance implicit_reliability believes (a perfect batch
# would otherwise make the implicit evidence infinitely strong).
_MIN_VARIANCE = 1e-4


def update(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, successes: np.ndarray, trials: np.ndarray
) -> UpdateResult:
    rate = successes / trials
    lam, rho, m = params.forgetting, params.implicit_weight, params.rollouts_per_task
    n = state.num_tasks

    explicit_s = np.zeros(n)
    explicit_f = np.zeros(n)
    explicit_s[tasks] = rate * m
    explicit_f[tasks] = (1 - rate) * m

    capability, c_hat = _capability(params, state, tasks, rate)
    previous_alpha, previous_beta = state.alpha, state.beta
    if params.track_prediction > 0:
        previous_alpha, previous_beta = _carried(params, state, capability)
    if params.implicit_reliability > 0:
        rho = _reliable_rho(params, state, tasks, rate, trials)
    halvings = state.rho_halvings
    if halvings:
        rho = rho * 0.5**halvings  # only when adaptive rho has halved it: the default path is untouched
    # rho_i: rho where the plug-in predicts task i (it has both features, or it
    # was reported, in which case its prediction is its observed rate), else 0.
    if math.isnan(capability) or rho == 0:
        rho_i = np.zeros(n)
        predicted = np.zeros(n)
    else:
        predicted = np.clip(state.weak + (state.strong - state.weak) * capability, 0.0, 1.0)
        if params.adaptive_rho_error > 0 and _prediction_error(predicted[tasks], rate) >= params.adaptive_rho_error:
            # The reference's rule: the plug-in missed this batch by too much,
            # so trust it half as much from this step on.
            halvings += 1
            rho = rho * 0.5
        predicted[tasks] = rate
        has_prediction = ~np.isnan(predicted)
        rho_i = np.where(has_prediction, rho, 0.0)
        predicted = np.where(has_prediction, predicted, 0.0)

    alpha = (1 - lam) * previous_alpha + lam * params.prior_alpha + (1 - rho_i) * explicit_s + rho_i * m * predicted
    beta = (1 - lam) * previous_beta + lam * params.prior_beta + (1 - rho_i) * explicit_f + rho_i * m * (1 - predicted)
    return UpdateResult(PosteriorState(alpha, beta, state.weak, state.strong, capability, halvings), c_hat)


def _predict(state: PosteriorState, capability: float) -> np.ndarray:
    """The interpolation plug-in's pass rates at `capability` (NaN without features)."""
    return np.clip(state.weak + (state.strong - state.weak) * capability, 0.0, 1.0)


def _carried(params: EngineParams, state: PosteriorState, capability: float) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta) moved along the plug-in: each task's posterior mean shifts
    by track_prediction times the change of its prediction from the previous
    capability to this step's, its strength alpha + beta unchanged. Model:
    p_i(t) = prediction_i(t) + d_i with a task offset d_i that changes slowly,
    so what was observed about d_i stays true as the learner moves. Tasks
    without both features, and steps without two capability estimates, stay."""
    if math.isnan(state.capability) or math.isnan(capability) or capability == state.capability:
        return state.alpha, state.beta
    shift = params.track_prediction * (_predict(state, capability) - _predict(state, state.capability))
    shift = np.where(np.isnan(shift), 0.0, shift)
    strength = state.alpha + state.beta
    mean = np.clip(state.alpha / strength + shift, _MEAN_FLOOR, 1.0 - _MEAN_FLOOR)
    moved = shift != 0.0
    alpha = np.where(moved, mean * strength, state.alpha)
    return alpha, np.where(moved, strength - alpha, state.beta)


def _reliable_rho(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, rate: np.ndarray, trials: np.ndarray
) -> float:
    """rho from how well the plug-in predicted this batch, compared with the
    posterior (implicit_reliability).

    Before this batch, the plug-in predicted q_i (at the previous capability)
    and the posterior said mu_i. Their mean squared errors against the
    observed rates, less the binomial noise (estimated without bias by
    r (1 - r) / (n - 1)), estimate the variances v_q and v_mu of the two
    beliefs. Treating the prediction as a measurement of p_i, the Bayes
    (Kalman) step moves the posterior mean toward it by K = v_mu / (v_mu + v_q).
    The BOTS update moves an unreported task's mean toward q_i by
    rho m / (N + rho m), N = (1 - lambda) (alpha + beta) + lambda (a0 + b0)
    (the pool's mean). Equating: rho = K N / ((1 - K) m), times
    implicit_reliability, within [0, 1]. Without a prediction yet: the fixed rho.
    """
    if math.isnan(state.capability):
        return params.implicit_weight
    predicted = _predict(state, state.capability)[tasks]
    usable = ~np.isnan(predicted)
    if not usable.any():
        return params.implicit_weight
    q, r, n = predicted[usable], rate[usable], trials[usable]
    alpha, beta = state.alpha[tasks][usable], state.beta[tasks][usable]
    noise = r * (1 - r) / np.maximum(n - 1, 1)
    v_q = max(float(np.mean((q - r) ** 2 - noise)), _MIN_VARIANCE)
    v_mu = max(float(np.mean((alpha / (alpha + beta) - r) ** 2 - noise)), _MIN_VARIANCE)
    gain = v_mu / (v_mu + v_q)
    lam = params.forgetting
    strength = (1 - lam) * float(np.mean(state.alpha + state.beta)) + lam * (params.prior_alpha + params.prior_beta)
    rho = params.implicit_reliability * gain * strength / ((1 - gain) * params.rollouts_per_task)
    return float(min(1.0, rho))


def _prediction_error(predicted: np.ndarray, rate: np.ndarray) -> float:
    """Mean |prediction - observed rate| over the reported tasks the plug-in
    predicts (both features); -inf when there are none (no evidence, no halving)."""
    known = ~np.isnan(predicted)
    if not known.any():
        return -math.inf
    return float(np.mean(np.abs(predicted[known] - rate[known])))


def _capability(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, rate: np.ndarray
) -> tuple[float, float]:
    """(capability after this step, this batch's estimate c_hat).

    c_hat = (mean r - mean w) / (mean s - mean w + 1e-6) over the reported tasks
    that have both reference features; the capability is c_hat on the first
    estimate, then an EMA. Without such tasks it stays as it was.
    """
    weak = state.weak[tasks]
    strong = state.strong[tasks]
    usable = ~(np.isnan(weak) | np.isnan(strong))
    if not usable.any():
        return state.capability, math.nan
    mean_r = float(np.mean(rate[usable]))
    mean_w = float(np.mean(weak[usable]))
    mean_s = float(np.mean(strong[usable]))
    c_hat = (mean_r - mean_w) / (mean_s - mean_w + _EPS)
    if math.isnan(state.capability):
        return c_hat, c_hat
    ema = params.capability_ema
    return ema * state.capability + (1 - ema) * c_hat, c_hat


STRATEGY = Strategy(
    name="bots",
    doc="Thompson selection near p*, explicit + implicit evidence, every task forgets every step",
    settings=SELECTION_SETTINGS + UPDATE_SETTINGS,
    score=closeness,
    update=update,
)
