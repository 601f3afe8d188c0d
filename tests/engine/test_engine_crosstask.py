"""Cross-task prediction from task embeddings (engine/crosstask.py): it
predicts tasks never visited, trusts embeddings that carry the pass rates and
not noise, replays bit for bit (also through a checkpoint and a replay of a
step from before tasks were added), and is off by default."""

from __future__ import annotations

import dataclasses

import numpy as np

from bots_server.core.checkpoint_state import decode_state, encode_state
from bots_server.engine import EngineParams, PosteriorState, apply_outcomes, select, step_rng

N, DIM, BATCH, M = 600, 12, 24, 16


def _world(informative: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings, true pass rates): with `informative`, the rates are a
    logistic function of the embedding plus a small residual; else the
    embeddings are noise drawn apart from the rates."""
    rng = np.random.default_rng(seed)
    embeddings = rng.normal(size=(N, DIM)).astype(np.float32)
    direction = rng.normal(size=DIM)
    logit = embeddings.astype(np.float64) @ direction / np.sqrt(DIM) * 2.5 + rng.normal(0, 0.3, N)
    if not informative:
        embeddings = rng.normal(size=(N, DIM)).astype(np.float32)
    return embeddings, 1 / (1 + np.exp(-logit))


def _run(
    params: EngineParams, embeddings: np.ndarray, truth: np.ndarray, steps: int, seed: int = 1
) -> list[PosteriorState]:
    n = embeddings.shape[0]
    state = PosteriorState.from_prior(params, np.full(n, np.nan), np.full(n, np.nan), embeddings=embeddings)
    outcomes = np.random.default_rng(seed)
    states = [state]
    for step in range(steps):
        batch = np.sort(select(params, state.alpha, state.beta, np.ones(n, bool), BATCH, step_rng(3, step, "k")))
        successes = outcomes.binomial(M, truth[batch]).astype(np.float64)
        state = apply_outcomes(params, state, batch, successes, np.full(BATCH, float(M))).state
        states.append(state)
    return states


def test_informative_embeddings_predict_unvisited_tasks_and_earn_trust() -> None:
    embeddings, truth = _world(informative=True)
    params = EngineParams(embedding_weight=16.0)
    final = _run(params, embeddings, truth, 15)[-1]
    assert final.own_alpha is not None and final.own_beta is not None and final.predicted is not None
    visited = final.own_alpha + final.own_beta > params.prior_alpha + params.prior_beta + 1e-9
    assert (~visited).sum() > N // 3  # most of the pool was never reported
    unvisited = ~visited
    assert np.corrcoef(final.predicted[unvisited], truth[unvisited])[0, 1] > 0.8
    assert final.embedding_trust > 0.5
    # the posterior selection reads is the own one plus trust * K pseudo-rollouts at the prediction
    pseudo = final.embedding_trust * params.embedding_weight
    assert np.allclose(final.alpha, final.own_alpha + pseudo * final.predicted)
    assert np.allclose(final.alpha + final.beta, final.own_alpha + final.own_beta + pseudo)


def test_noise_embeddings_get_little_trust() -> None:
    embeddings, truth = _world(informative=False)
    final = _run(EngineParams(embedding_weight=16.0), embeddings, truth, 15)[-1]
    assert final.embedding_trust < 0.25


def test_the_own_posterior_evolves_as_without_embeddings() -> None:
    embeddings, truth = _world(informative=True)
    with_prediction = _run(EngineParams(embedding_weight=16.0), embeddings, truth, 1)[-1]
    plain = _run(EngineParams(), embeddings, truth, 1)[-1]  # the first batch is the same: no prediction yet
    assert with_prediction.own_alpha is not None and with_prediction.own_beta is not None
    assert np.array_equal(with_prediction.own_alpha, plain.alpha)
    assert np.array_equal(with_prediction.own_beta, plain.beta)


def test_off_by_default_and_embeddings_ride_along() -> None:
    embeddings, truth = _world(informative=True)
    final = _run(EngineParams(), embeddings, truth, 3)[-1]
    assert final.own_alpha is None and final.predicted is None and final.embedding_trust == 0.0
    assert final.embeddings is embeddings


def test_replay_is_bit_for_bit_also_through_a_checkpoint() -> None:
    embeddings, truth = _world(informative=True)
    params = EngineParams(embedding_weight=16.0)
    states = _run(params, embeddings, truth, 8)
    again = _run(params, embeddings.copy(), truth, 8)
    for a, b in zip(states, again, strict=True):
        _assert_same(a, b)
    # a server that restarts at step 5 from its checkpoint continues exactly
    # (the embeddings come back from the tasks rows, not the checkpoint)
    restored = dataclasses.replace(decode_state(bytes(encode_state(states[5])), params), embeddings=embeddings)
    _assert_same(restored, states[5])
    batch = np.arange(0, N, N // BATCH)[:BATCH]
    successes = np.full(BATCH, 5.0)
    trials = np.full(BATCH, float(M))
    _assert_same(
        apply_outcomes(params, restored, batch, successes, trials).state,
        apply_outcomes(params, states[5], batch, successes, trials).state,
    )


def test_a_step_replayed_before_tasks_were_added_leaves_the_new_tasks_alone() -> None:
    embeddings, truth = _world(informative=True)
    params = EngineParams(embedding_weight=16.0)
    head = _run(params, embeddings[:400], truth[:400], 4)[-1]
    grown = head.extended(params, np.full(200, np.nan), np.full(200, np.nan), embeddings=embeddings[400:])
    batch = np.arange(0, 400, 20)
    successes, trials = np.full(20, 9.0), np.full(20, float(M))
    replayed = apply_outcomes(params, grown, batch, successes, trials, pool_size=400).state
    alone = apply_outcomes(params, head, batch, successes, trials).state
    for name in ("alpha", "beta", "own_alpha", "own_beta", "predicted"):
        whole, part = getattr(replayed, name), getattr(alone, name)
        np.testing.assert_array_equal(whole[:400], part)
        np.testing.assert_array_equal(whole[400:], getattr(grown, name)[400:])
    assert replayed.embedding_trust == alone.embedding_trust
    assert replayed.embeddings is not None and replayed.embeddings.shape == (N, DIM)


def _assert_same(a: PosteriorState, b: PosteriorState) -> None:
    for field in dataclasses.fields(PosteriorState):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=field.name)
        elif isinstance(x, float) and np.isnan(x):
            assert np.isnan(y), field.name
        else:
            assert x == y, field.name
