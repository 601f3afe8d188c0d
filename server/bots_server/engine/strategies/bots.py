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
)


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

    alpha = (1 - lam) * state.alpha + lam * params.prior_alpha + (1 - rho_i) * explicit_s + rho_i * m * predicted
    beta = (1 - lam) * state.beta + lam * params.prior_beta + (1 - rho_i) * explicit_f + rho_i * m * (1 - predicted)
    return UpdateResult(PosteriorState(alpha, beta, state.weak, state.strong, capability, halvings), c_hat)


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
