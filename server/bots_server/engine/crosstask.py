"""Cross-task prediction from task embeddings (embedding_weight > 0).

Each task keeps its own posterior (PosteriorState.own_alpha / own_beta), which
the strategy's update evolves exactly as it would without embeddings. After
each update, a weighted ridge regression of the own posteriors' logits on
the tasks' embeddings predicts every task's pass rate q_i, visited or not, and
the posterior selection reads is the own one plus pseudo-rollouts at q_i:

    alpha_i = own_alpha_i + t K q_i,   beta_i = own_beta_i + t K (1 - q_i)

with K = embedding_weight and t in [0, 1] the trust. The trust is calibrated
on every batch before its outcomes update anything: of the weights w in a
grid on [0, 1], the one under which the posteriors the batch was selected
from (own + w K pseudo-rollouts at the prediction made one step earlier)
give the batch's outcomes the highest binomial log-likelihood; t follows it
as an average over steps. Embeddings that predict nothing lose to the own
posteriors and get a trust near 0.

Regression: features are the embeddings scaled to unit length and, above
_MAX_FEATURES dimensions, projected on _MAX_FEATURES fixed random directions
(seeded, the same on every replica), then standardised, with an intercept.
Target: the logit of each task's own posterior mean; weight: its evidence
(own strength above the prior) e / (e + _EVIDENCE_HALF), so a task seen once
counts less than one seen often, and never more than one. A deterministic
function of the state (no random draw), so replays reproduce it.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from bots_server.engine.params import EngineParams
from bots_server.engine.state import PosteriorState

# Above this many embedding dimensions the regression works on a random
# projection: the cost of a step is then O(tasks x _MAX_FEATURES^2)
# whatever the embedding's length.
_MAX_FEATURES = 48
_PROJECTION_SEED = 0x5EED_E3B
# Ridge penalty per standardised feature, in units of fully weighted tasks.
_RIDGE = 4.0
# Evidence (pseudo-rollouts above the prior) at which a task's weight is 1/2.
_EVIDENCE_HALF = 4.0
# Tasks with less weight are left out of the fit (never visited).
_MIN_WEIGHT = 1e-3
# Posterior means are clipped to this margin before the logit.
_MEAN_MARGIN = 0.02
# The trust's grid and how much of it each batch's best weight moves.
_TRUST_GRID = np.linspace(0.0, 1.0, 21)
_TRUST_RATE = 0.3

_features_lock = threading.Lock()
_features_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
_FEATURES_CACHE_SIZE = 8


def active(params: EngineParams, state: PosteriorState) -> bool:
    """Whether the cross-task prediction runs on this state."""
    return params.embedding_weight > 0 and state.embeddings is not None and state.num_tasks > 0


def own_state(state: PosteriorState) -> PosteriorState:
    """The state with each task's own posterior as alpha/beta (a state
    written before the prediction was on has no own posterior: its alpha
    and beta are taken as such)."""
    if state.own_alpha is None or state.own_beta is None:
        return state
    return dataclasses.replace(state, alpha=state.own_alpha, beta=state.own_beta)


def calibrated_trust(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, successes: np.ndarray, trials: np.ndarray
) -> float:
    """The trust after this batch: moved toward the weight in _TRUST_GRID
    under which the batch's outcomes were most likely (see the module doc).
    Unchanged when no reported task had a prediction yet."""
    trust = state.embedding_trust
    if state.predicted is None:
        return trust
    q = state.predicted[tasks]
    known = ~np.isnan(q)
    if not known.any():
        return trust
    own = own_state(state)
    a, b = own.alpha[tasks][known], own.beta[tasks][known]
    k, n, q = successes[known], trials[known], q[known]
    pseudo = params.embedding_weight * _TRUST_GRID[:, None]  # (grid, tasks)
    p = np.clip((a + pseudo * q) / (a + b + pseudo), 1e-9, 1 - 1e-9)
    loglik = (k * np.log(p) + (n - k) * np.log1p(-p)).sum(axis=1)
    best = float(_TRUST_GRID[int(np.argmax(loglik))])  # the first (smallest) of equals
    return (1 - _TRUST_RATE) * trust + _TRUST_RATE * best


def fused(params: EngineParams, own: PosteriorState, trust: float) -> PosteriorState:
    """`own` (the strategy's update of the own posteriors) with the
    prediction fitted on it added as pseudo-rollouts; carries the own
    posteriors, the prediction and the trust."""
    assert own.embeddings is not None
    q = predict(params, own.alpha, own.beta, own.embeddings)
    weight = trust * params.embedding_weight
    known = ~np.isnan(q)
    alpha, beta = own.alpha.copy(), own.beta.copy()
    if weight > 0:
        alpha[known] += weight * q[known]
        beta[known] += weight * (1 - q[known])
    return dataclasses.replace(
        own, alpha=alpha, beta=beta, own_alpha=own.alpha, own_beta=own.beta, predicted=q, embedding_trust=trust
    )


def predict(params: EngineParams, alpha: np.ndarray, beta: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
    """Every task's predicted pass rate from the ridge regression on the
    embeddings (NaN everywhere while fewer than two tasks have evidence)."""
    n = alpha.shape[0]
    strength = alpha + beta
    evidence = np.maximum(strength - (params.prior_alpha + params.prior_beta), 0.0)
    weight = evidence / (evidence + _EVIDENCE_HALF)
    fit = np.flatnonzero(weight > _MIN_WEIGHT)
    if fit.shape[0] < 2:
        return np.full(n, np.nan)
    features, penalty = _features(embeddings)
    mean = np.clip(alpha[fit] / strength[fit], _MEAN_MARGIN, 1 - _MEAN_MARGIN)
    target = np.log(mean / (1 - mean))
    x = features[fit]
    w = weight[fit]
    gram = (x * w[:, None]).T @ x + np.diag(penalty)
    coef = np.linalg.solve(gram, x.T @ (w * target))
    logit = features @ coef
    return 1.0 / (1.0 + np.exp(-logit))


def _features(embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(standardised features with an intercept column, the ridge penalty
    per column), computed once per embeddings array (the state carries the
    same array from step to step; a new pool is a new array)."""
    key = id(embeddings)
    with _features_lock:
        hit = _features_cache.get(key)
    if hit is not None and hit[0] is embeddings:
        return hit[1], _penalty(hit[1].shape[1])
    x = np.asarray(embeddings, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.where(norms > 0, norms, 1.0)
    if x.shape[1] > _MAX_FEATURES:
        directions = np.random.default_rng(_PROJECTION_SEED).standard_normal((x.shape[1], _MAX_FEATURES))
        x = x @ directions
    spread = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(spread > 0, spread, 1.0)
    features = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)
    with _features_lock:
        while len(_features_cache) >= _FEATURES_CACHE_SIZE:
            _features_cache.pop(next(iter(_features_cache)))
        _features_cache[key] = (embeddings, features)  # holds the array, so its id is not reused
    return features, _penalty(features.shape[1])


def _penalty(columns: int) -> np.ndarray:
    """Ridge on every coefficient but the intercept."""
    penalty = np.full(columns, _RIDGE)
    penalty[0] = 0.0
    return penalty
