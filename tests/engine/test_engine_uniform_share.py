"""uniform_share: part of every batch drawn uniformly at random, the rest
ranked by the strategy; off by default, with the same draws as without it."""

from __future__ import annotations

import numpy as np

from bots_server.engine import EngineParams, select, step_rng

N = 200


def _posterior() -> tuple[np.ndarray, np.ndarray]:
    mean = np.linspace(0.01, 0.9, N)  # task i's mean, no two equally close to 0.5
    return mean * 50, (1 - mean) * 50


def test_the_ranked_part_is_the_best_of_the_rest_and_the_drawn_part_is_uniform() -> None:
    alpha, beta = _posterior()
    params = EngineParams(selection_mode="mean", uniform_share=0.5)
    available = np.ones(N, bool)
    picked_far = 0
    for step in range(200):
        batch = select(params, alpha, beta, available, 10, step_rng(1, step, "k"))
        assert len(set(batch.tolist())) == 10
        ranked, drawn = batch[:5], batch[5:]
        rest = np.setdiff1d(np.arange(N), drawn)
        closeness = -np.abs(0.5 - alpha / (alpha + beta))
        assert set(ranked.tolist()) == set(rest[np.argsort(-closeness[rest], kind="stable")[:5]].tolist())
        picked_far += int(np.count_nonzero(closeness[drawn] < -0.2))
    # a share of the pool lies far from p*: about that share of the uniform picks does
    far = np.count_nonzero(-np.abs(0.5 - alpha / (alpha + beta)) < -0.2) / N
    assert abs(picked_far / (200 * 5) - far) < 0.08


def test_only_available_tasks_and_the_same_batch_for_the_same_key() -> None:
    alpha, beta = _posterior()
    params = EngineParams(uniform_share=0.3)
    available = np.arange(N) % 3 != 0
    first = select(params, alpha, beta, available, 20, step_rng(4, 7, "key"))
    again = select(params, alpha, beta, available, 20, step_rng(4, 7, "key"))
    assert np.array_equal(first, again) and available[first].all()
    whole = select(EngineParams(uniform_share=1.0), alpha, beta, available, 20, step_rng(4, 7, "key"))
    assert available[whole].all() and len(set(whole.tolist())) == 20


def test_off_draws_what_it_drew_before() -> None:
    alpha, beta = _posterior()
    tiny = EngineParams(uniform_share=0.01)  # rounds to no uniform pick in a batch of 10
    for step in range(5):
        plain = select(EngineParams(), alpha, beta, np.ones(N, bool), 10, step_rng(2, step, "k"))
        assert np.array_equal(plain, select(tiny, alpha, beta, np.ones(N, bool), 10, step_rng(2, step, "k")))
