"""BOTS (arXiv 2510.26374): Thompson selection near p*, explicit evidence of
the reported tasks plus the interpolation plug-in's implicit evidence for
every task, and every task forgets toward the prior each step."""

from __future__ import annotations

import dataclasses
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
    "keep_successes",
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
    """alpha_i' = (1 - lam_a) alpha_i + lam_a a0 + (1 - rho_i) e_i + rho_i m_i q_i
    (beta alike with lam, failures and 1 - q_i; lam_a = lam (1 - keep_successes)
    for a task without both features, else lam, and lam itself by default):
    m_i the trials n_i of a reported task (a report weighs what it holds;
    with report_weight = "rollouts_per_task", as experiments stored before
    the setting existed, m instead), rollouts_per_task m for every other
    task (the weight of a prediction);
    e_i the explicit evidence n_i r_i of a reported task (0 elsewhere), q_i
    the plug-in's prediction (the observed rate r_i for a reported task),
    rho_i = rho where there is a prediction, else 0. A reported task thus
    gains its own successes and failures, whatever rho, as in MoPPS; with
    n_i = m these are the reference's r_i m, to the bit.

    Computed as the formula's terms that are not zero, element by element in
    the same order, so the floats are those of evaluating the whole formula
    on every task (tests/engine/test_engine_fast_paths.py compares with it):
    an unreported task's explicit term (1 - rho_i) * 0 is +0.0 (rho_i is
    finite and at most 1) and, without a prediction, so is its implicit
    term; adding +0.0 changes nothing but -0.0, see _forget_into."""
    rate = successes / trials
    lam, rho, m = params.forgetting, params.implicit_weight, params.rollouts_per_task
    lam_alpha = _success_forgetting(params, state.weak[tasks], state.strong[tasks])

    capability, c_hat = _capability(params, state, tasks, rate)
    carry = _carry(params, state, capability)
    if params.implicit_reliability > 0:
        rho = _reliable_rho(params, state, tasks, rate, trials)
    halvings = state.rho_halvings
    if halvings:
        rho = rho * 0.5**halvings  # only when adaptive rho has halved it: the default path is untouched
    # rho_i and q_i at the reported tasks (see the docstring), and rho * m,
    # the weight of every other task's prediction (0: none this step).
    reported_rho = np.zeros(tasks.shape[0])
    reported_prediction = np.zeros(tasks.shape[0])
    weight = 0.0
    if not (math.isnan(capability) or rho == 0):
        if (
            params.adaptive_rho_error > 0
            and _prediction_error(_predict_at(state, capability, tasks), rate) >= params.adaptive_rho_error
        ):
            # The reference's rule: the plug-in missed this batch by too much,
            # so trust it half as much from this step on.
            halvings += 1
            rho = rho * 0.5
        weight = rho * m
        observed = ~np.isnan(rate)
        reported_rho = np.where(observed, rho, 0.0)
        reported_prediction = np.where(observed, rate, 0.0)
    alpha, beta = _blended(params, state, carry, capability, weight)
    previous_alpha, previous_beta = _previous(
        params, carry, state.weak[tasks], state.strong[tasks], state.alpha[tasks], state.beta[tasks]
    )
    # Reported tasks: the whole formula, recomputed from their previous
    # posterior (this overwrites what the passes above wrote there).
    weighed = trials if params.report_weight == "trials" else m
    alpha[tasks] = (
        (1 - lam_alpha) * previous_alpha
        + lam_alpha * params.prior_alpha
        + (1 - reported_rho) * (rate * weighed)
        + reported_rho * weighed * reported_prediction
    )
    beta[tasks] = (
        (1 - lam) * previous_beta
        + lam * params.prior_beta
        + (1 - reported_rho) * ((1 - rate) * weighed)
        + reported_rho * weighed * (1 - reported_prediction)
    )
    return UpdateResult(
        dataclasses.replace(state, alpha=alpha, beta=beta, capability=capability, rho_halvings=halvings), c_hat
    )


# Tasks per block of the pool-wide passes: small enough that a block's
# temporaries stay in the CPU cache between the ~15 operations on it, large
# enough that numpy's per-call overhead stays small (measured at 1M tasks:
# 16k-64k within 10% of each other, 4k and unblocked ~1.4x slower).
_BLOCK = 32768


def _blended(
    params: EngineParams,
    state: PosteriorState,
    carry: tuple[float, float] | None,
    capability: float,
    weight: float,
) -> tuple[np.ndarray, np.ndarray]:
    """New (alpha, beta) of every task as if unreported: forgetting, plus
    the prediction's pseudo-counts when weight > 0, from the posterior as
    stored or as carried (`carry`). Block by block, each element through the
    same operations as the whole-array formula."""
    n = state.num_tasks
    alpha, beta = np.empty(n), np.empty(n)
    predicted, term = np.empty(min(n, _BLOCK)), np.empty(min(n, _BLOCK))
    lam = params.forgetting
    for start in range(0, n, _BLOCK):
        block = slice(start, start + _BLOCK)
        a, b = alpha[block], beta[block]
        weak, strong = state.weak[block], state.strong[block]
        previous_alpha, previous_beta = _previous(params, carry, weak, strong, state.alpha[block], state.beta[block])
        _forget_alpha_into(previous_alpha, _success_forgetting(params, weak, strong), params.prior_alpha, a)
        _forget_into(previous_beta, lam, params.prior_beta, b)
        if weight > 0:
            size = a.shape[0]
            q = _predict_into(weak, strong, capability, predicted[:size])
            _add_implicit(a, b, q, weight, term[:size])
    return alpha, beta


def _success_forgetting(params: EngineParams, weak: np.ndarray, strong: np.ndarray) -> float | np.ndarray:
    """The forgetting of these tasks' alpha: lambda, less the share
    keep_successes spares for tasks without both reference features. For a
    learner that improves, past successes stay true (a solved task stays
    solved) while past failures go stale (a task becomes learnable); the
    plug-in already models the improvement of tasks with features, whose
    implicit pseudo-counts would pile up in an alpha that never forgets.
    Without keep_successes: lambda itself, a scalar (the paper's path)."""
    lam = params.forgetting
    if params.keep_successes == 0:
        return lam
    predicted = ~(np.isnan(weak) | np.isnan(strong))
    return np.where(predicted, lam, lam * (1 - params.keep_successes))


def _forget_alpha_into(previous: np.ndarray, lam: float | np.ndarray, prior: float, out: np.ndarray) -> None:
    """_forget_into with a forgetting per task: (1 - lam_i) previous_i +
    lam_i prior, then + 0.0 as the formula's zero terms (a -0.0 becomes
    +0.0, nothing else changes)."""
    if not isinstance(lam, np.ndarray):
        _forget_into(previous, lam, prior, out)
        return
    np.multiply(previous, 1 - lam, out=out)
    np.add(out, lam * prior, out=out)
    np.add(out, 0.0, out=out)


def _forget_into(previous: np.ndarray, lam: float, prior: float, out: np.ndarray) -> None:
    """(1 - lam) * previous + lam * prior, as the formula's first two terms.
    The formula then adds +0.0 terms, which turn a -0.0 into +0.0; a sum
    x + lam * prior is -0.0 only if lam * prior is -0.0 (lam = -0.0 passes
    validation), so only then is that +0.0 added here. The result is thus
    never -0.0, which _add_implicit relies on."""
    np.multiply(previous, 1 - lam, out=out)
    pulled = lam * prior
    np.add(out, pulled, out=out)
    if pulled == 0.0 and math.copysign(1.0, pulled) < 0:
        np.add(out, 0.0, out=out)


def _add_implicit(alpha: np.ndarray, beta: np.ndarray, predicted: np.ndarray, weight: float, term: np.ndarray) -> None:
    """Adds the implicit terms (rho m) q_i and (rho m) (1 - q_i) in place
    (`term`: scratch space). `weight` is rho * m, the same product rho_i * m
    gives. Without a prediction q_i is NaN and the formula adds +0.0 instead:
    fmax(term, 0) turns NaN into +0.0 and leaves every other term as it is,
    as weight > 0 (rho in (0, 1], m >= 1) and q_i in [0, 1] make every term
    a non-negative number or a zero, and adding a zero of either sign to a
    posterior that is not -0.0 (_forget_into) changes nothing. (A masked
    add, where=, gives the same floats several times slower.)"""
    np.multiply(predicted, weight, out=term)
    np.fmax(term, 0.0, out=term)
    np.add(alpha, term, out=alpha)
    np.subtract(1, predicted, out=term)
    np.multiply(term, weight, out=term)
    np.fmax(term, 0.0, out=term)
    np.add(beta, term, out=beta)


def _predict_into(weak: np.ndarray, strong: np.ndarray, capability: float, out: np.ndarray) -> np.ndarray:
    """clip(w + (s - w) * c, 0, 1) written into `out`, operation by operation."""
    np.subtract(strong, weak, out=out)
    np.multiply(out, capability, out=out)
    np.add(out, weak, out=out)
    return np.clip(out, 0.0, 1.0, out=out)


def _predict_at(state: PosteriorState, capability: float, tasks: np.ndarray) -> np.ndarray:
    """The plug-in's pass rates of these tasks at `capability` (NaN without features)."""
    return _predict_into(state.weak[tasks], state.strong[tasks], capability, np.empty(tasks.shape[0]))


def _carry(params: EngineParams, state: PosteriorState, capability: float) -> tuple[float, float] | None:
    """(previous capability, this step's) when track_prediction moves the
    posterior this step; None when it is off or there are not two different
    capability estimates."""
    previous = state.capability
    if params.track_prediction <= 0 or math.isnan(previous) or math.isnan(capability) or capability == previous:
        return None
    return previous, capability


def _previous(
    params: EngineParams,
    carry: tuple[float, float] | None,
    weak: np.ndarray,
    strong: np.ndarray,
    alpha: np.ndarray,
    beta: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The posterior these tasks start the step from: as stored, or moved
    along the plug-in (track_prediction): each task's posterior mean shifts
    by track_prediction times the change of its prediction from the previous
    capability to this step's, its strength alpha + beta unchanged. Model:
    p_i(t) = prediction_i(t) + d_i with a task offset d_i that changes slowly,
    so what was observed about d_i stays true as the learner moves. Tasks
    without both features stay. Element-wise, so a block or the reported
    tasks alone get what the whole pool would."""
    if carry is None:
        return alpha, beta
    before, after = carry
    now = _predict_into(weak, strong, after, np.empty(alpha.shape[0]))
    shift = params.track_prediction * (now - _predict_into(weak, strong, before, np.empty(alpha.shape[0])))
    shift = np.where(np.isnan(shift), 0.0, shift)
    strength = alpha + beta
    mean = np.clip(alpha / strength + shift, _MEAN_FLOOR, 1.0 - _MEAN_FLOOR)
    moved = shift != 0.0
    carried_alpha = np.where(moved, mean * strength, alpha)
    return carried_alpha, np.where(moved, strength - carried_alpha, beta)


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
    predicted = _predict_at(state, state.capability, tasks)
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
