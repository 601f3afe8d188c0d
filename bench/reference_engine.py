"""The engine before its fast paths (issue 14), kept as plain numpy.

Two uses: the independent reference the fast select and update are tested
against bit for bit (tests/engine/test_engine_fast_paths.py), and the
in-process step a trainer could run instead of the service, which
bench/perf.py times interleaved with the socket calls (the selector code of
Trinity-RFT's kind: a Beta draw, a full top-k, an update over every task).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bots_server.engine import EngineParams, GroupQuotas, PosteriorState, UpdateResult
from bots_server.engine.quotas import select_with_quotas
from bots_server.engine.strategies import mopps


def ref_closeness(params: EngineParams, alpha: np.ndarray, beta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if params.selection_mode == "expected":
        n = alpha + beta
        mu = alpha / n
        return -((mu - params.target_success) ** 2 + mu * (1 - mu) / (n + 1))
    if params.selection_mode in ("mean", "softmax_mean"):
        p = alpha / (alpha + beta)
    else:
        p = ref_beta_draws(rng, alpha, beta, params.random_stream)
    score = -np.abs(params.target_success - p)
    if params.selection_mode in ("softmax", "softmax_mean"):
        score = score / params.temperature + rng.gumbel(size=score.shape[0])
    return score


def ref_beta_draws(rng: np.random.Generator, alpha: np.ndarray, beta: np.ndarray, stream: int) -> np.ndarray:
    """Stream 1: one draw over the pool. Stream 2, from 32768 tasks: 8 parts
    of (i * n) // 8 to ((i + 1) * n) // 8, part i drawn, one after another,
    by the i-th generator rng.spawn(8) gives."""
    n = alpha.shape[0]
    if stream == 1 or n < 32768:
        return rng.beta(alpha, beta)
    children = rng.spawn(8)
    return np.concatenate(
        [g.beta(alpha[i * n // 8 : (i + 1) * n // 8], beta[i * n // 8 : (i + 1) * n // 8]) for i, g in enumerate(children)]
    )


def ref_score(params: EngineParams, alpha: np.ndarray, beta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if params.strategy == "uniform":
        return rng.random(size=(alpha.shape[0],))
    return ref_closeness(params, alpha, beta, rng)


def ref_top_k(score: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    n = score.shape[0]
    if k < n:
        cut = score[np.argpartition(score, n - k)[n - k]]
    else:
        cut = score.min()
    above = np.flatnonzero(score > cut)
    at_cut = np.flatnonzero(score == cut)
    chosen_at_cut = rng.choice(at_cut, size=k - above.shape[0], replace=False)
    chosen = np.concatenate([above, np.sort(chosen_at_cut)])
    order = np.argsort(-score[chosen], kind="stable")
    return chosen[order]


def ref_select(
    params: EngineParams,
    alpha: np.ndarray,
    beta: np.ndarray,
    available: np.ndarray,
    batch_size: int,
    rng: np.random.Generator,
    quotas: GroupQuotas | None = None,
) -> np.ndarray:
    n_available = int(np.count_nonzero(available))
    if not 0 < batch_size <= n_available:
        raise ValueError(f"batch_size {batch_size} not in [1, {n_available}]")
    if params.candidate_ratio > 0:
        size = min(n_available, max(batch_size, math.ceil(params.candidate_ratio * batch_size)))
        chosen = rng.choice(np.flatnonzero(available), size=size, replace=False)
        available = np.zeros_like(available, dtype=bool)
        available[chosen] = True
    if quotas is not None:  # unchanged code, over the (separately compared) scores
        return select_with_quotas(params, alpha, beta, available, batch_size, rng, quotas)
    score = ref_score(params, alpha, beta, rng)
    return ref_top_k(np.where(available, score, -np.inf), batch_size, rng)


def ref_predict(state: PosteriorState, capability: float) -> np.ndarray:
    return np.clip(state.weak + (state.strong - state.weak) * capability, 0.0, 1.0)


def ref_capability(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, rate: np.ndarray
) -> tuple[float, float]:
    weak = state.weak[tasks]
    strong = state.strong[tasks]
    usable = ~(np.isnan(weak) | np.isnan(strong))
    if not usable.any():
        return state.capability, math.nan
    mean_r = float(np.mean(rate[usable]))
    mean_w = float(np.mean(weak[usable]))
    mean_s = float(np.mean(strong[usable]))
    c_hat = (mean_r - mean_w) / (mean_s - mean_w + 1e-6)
    if math.isnan(state.capability):
        return c_hat, c_hat
    ema = params.capability_ema
    return ema * state.capability + (1 - ema) * c_hat, c_hat


def ref_carried(params: EngineParams, state: PosteriorState, capability: float) -> tuple[np.ndarray, np.ndarray]:
    if math.isnan(state.capability) or math.isnan(capability) or capability == state.capability:
        return state.alpha, state.beta
    shift = params.track_prediction * (ref_predict(state, capability) - ref_predict(state, state.capability))
    shift = np.where(np.isnan(shift), 0.0, shift)
    strength = state.alpha + state.beta
    mean = np.clip(state.alpha / strength + shift, 1e-3, 1.0 - 1e-3)
    moved = shift != 0.0
    alpha = np.where(moved, mean * strength, state.alpha)
    return alpha, np.where(moved, strength - alpha, state.beta)


def ref_reliable_rho(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, rate: np.ndarray, trials: np.ndarray
) -> float:
    if math.isnan(state.capability):
        return params.implicit_weight
    predicted = ref_predict(state, state.capability)[tasks]
    usable = ~np.isnan(predicted)
    if not usable.any():
        return params.implicit_weight
    q, r, n = predicted[usable], rate[usable], trials[usable]
    alpha, beta = state.alpha[tasks][usable], state.beta[tasks][usable]
    noise = r * (1 - r) / np.maximum(n - 1, 1)
    v_q = max(float(np.mean((q - r) ** 2 - noise)), 1e-4)
    v_mu = max(float(np.mean((alpha / (alpha + beta) - r) ** 2 - noise)), 1e-4)
    gain = v_mu / (v_mu + v_q)
    lam = params.forgetting
    strength = (1 - lam) * float(np.mean(state.alpha + state.beta)) + lam * (params.prior_alpha + params.prior_beta)
    rho = params.implicit_reliability * gain * strength / ((1 - gain) * params.rollouts_per_task)
    return float(min(1.0, rho))


def ref_prediction_error(predicted: np.ndarray, rate: np.ndarray) -> float:
    known = ~np.isnan(predicted)
    if not known.any():
        return -math.inf
    return float(np.mean(np.abs(predicted[known] - rate[known])))


def ref_bots_update(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, successes: np.ndarray, trials: np.ndarray
) -> UpdateResult:
    rate = successes / trials
    lam, rho, m = params.forgetting, params.implicit_weight, params.rollouts_per_task
    n = state.num_tasks
    explicit_s = np.zeros(n)
    explicit_f = np.zeros(n)
    # What a reported task's outcome counts for: its own trials, or m
    # (report_weight = "rollouts_per_task"); every other task's prediction: m.
    weighed = trials if params.report_weight == "trials" else np.full(tasks.shape[0], float(m))
    explicit_s[tasks] = rate * weighed
    explicit_f[tasks] = (1 - rate) * weighed
    weight = np.full(n, float(m))
    weight[tasks] = weighed
    capability, c_hat = ref_capability(params, state, tasks, rate)
    previous_alpha, previous_beta = state.alpha, state.beta
    if params.track_prediction > 0:
        previous_alpha, previous_beta = ref_carried(params, state, capability)
    if params.implicit_reliability > 0:
        rho = ref_reliable_rho(params, state, tasks, rate, trials)
    halvings = state.rho_halvings
    if halvings:
        rho = rho * 0.5**halvings
    if math.isnan(capability) or rho == 0:
        rho_i = np.zeros(n)
        predicted = np.zeros(n)
    else:
        predicted = np.clip(state.weak + (state.strong - state.weak) * capability, 0.0, 1.0)
        if params.adaptive_rho_error > 0 and ref_prediction_error(predicted[tasks], rate) >= params.adaptive_rho_error:
            halvings += 1
            rho = rho * 0.5
        predicted[tasks] = rate
        has_prediction = ~np.isnan(predicted)
        rho_i = np.where(has_prediction, rho, 0.0)
        predicted = np.where(has_prediction, predicted, 0.0)
    # alpha's forgetting: keep_successes spares its share for tasks without both features
    lam_a = np.where(np.isnan(state.weak) | np.isnan(state.strong), lam * (1 - params.keep_successes), lam)
    alpha = (1 - lam_a) * previous_alpha + lam_a * params.prior_alpha + (1 - rho_i) * explicit_s + rho_i * weight * predicted
    beta = (1 - lam) * previous_beta + lam * params.prior_beta + (1 - rho_i) * explicit_f + rho_i * weight * (1 - predicted)
    return UpdateResult(PosteriorState(alpha, beta, state.weak, state.strong, capability, halvings), c_hat)


def ref_apply_outcomes(
    params: EngineParams,
    state: PosteriorState,
    tasks: np.ndarray,
    successes: np.ndarray,
    trials: np.ndarray,
    pool_size: int | None = None,
) -> UpdateResult:
    update = mopps.update if params.strategy == "mopps" else ref_bots_update
    n = state.num_tasks if pool_size is None else pool_size
    if n >= state.num_tasks:
        return update(params, state, tasks, successes, trials)
    head = dataclasses.replace(
        state, alpha=state.alpha[:n], beta=state.beta[:n], weak=state.weak[:n], strong=state.strong[:n]
    )
    result = update(params, head, tasks, successes, trials)
    new = result.state
    return UpdateResult(
        dataclasses.replace(
            new,
            alpha=np.concatenate([new.alpha, state.alpha[n:]]),
            beta=np.concatenate([new.beta, state.beta[n:]]),
            weak=state.weak,
            strong=state.strong,
        ),
        result.capability_estimate,
    )
