"""The Thompson draws' random streams (engine/draws.py): stream 2's parts
are the numbers the spawned generators give, whatever draws them, and
stream 1 is one draw over the pool."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bots_server.engine import EngineParams, draws, parallel, select, step_rng


def posterior(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.gamma(2.0, 3.0, n) + 1e-3, rng.gamma(2.0, 3.0, n) + 1e-3


def children_by_hand(seed: int, step: int, key: str) -> list[np.random.Generator]:
    """The 8 generators of stream 2's parts, built from the step's seed
    sequence directly rather than through Generator.spawn."""
    words = np.frombuffer(hashlib.sha256(key.encode()).digest(), dtype="<u4").tolist()
    entropy = np.random.SeedSequence([seed, step, *words])
    return [np.random.Generator(np.random.PCG64(child)) for child in entropy.spawn(8)]


@pytest.mark.parametrize("n", [32768, 100_003])
def test_stream_2_draws_part_i_with_the_ith_spawned_generator(n: int) -> None:
    alpha, beta = posterior(n)
    got = draws.beta_draws(step_rng(5, 9, "k"), alpha, beta, 2)
    bounds = [i * n // 8 for i in range(9)]
    expected = np.concatenate(
        [g.beta(alpha[lo:hi], beta[lo:hi]) for g, lo, hi in zip(children_by_hand(5, 9, "k"), bounds, bounds[1:])]
    )
    np.testing.assert_array_equal(got, expected)


def test_stream_2_leaves_the_step_generator_where_it_was() -> None:
    """What the step draws after the scores (ties at the cut) starts where a
    fresh generator starts."""
    alpha, beta = posterior(50_000)
    rng = step_rng(1, 2, "k")
    draws.beta_draws(rng, alpha, beta, 2)
    np.testing.assert_array_equal(rng.random(4), step_rng(1, 2, "k").random(4))


@pytest.fixture(params=[0, 1, 3, 7], ids=lambda h: f"{h}-helpers")
def helpers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The engine's parts run on the caller and this many helper threads."""
    with ThreadPoolExecutor(max(request.param, 1)) as pool:
        monkeypatch.setattr(parallel, "_helpers", lambda: pool)
        monkeypatch.setattr(parallel, "HELPERS", request.param)
        yield request.param


def test_stream_2_gives_the_same_numbers_on_any_number_of_threads(helpers: int) -> None:
    alpha, beta = posterior(70_000)
    bounds = [i * 70_000 // 8 for i in range(9)]
    expected = np.concatenate(
        [g.beta(alpha[lo:hi], beta[lo:hi]) for g, lo, hi in zip(children_by_hand(3, 4, "key"), bounds, bounds[1:])]
    )
    np.testing.assert_array_equal(draws.beta_draws(step_rng(3, 4, "key"), alpha, beta, 2), expected)


def test_below_the_parted_size_both_streams_are_one_draw() -> None:
    alpha, beta = posterior(draws.PARTED_MIN_TASKS - 1)
    expected = step_rng(1, 1, "k").beta(alpha, beta)
    for stream in draws.STREAMS:
        np.testing.assert_array_equal(draws.beta_draws(step_rng(1, 1, "k"), alpha, beta, stream), expected)


def test_stream_1_is_one_draw_at_any_size() -> None:
    alpha, beta = posterior(100_000)
    np.testing.assert_array_equal(
        draws.beta_draws(step_rng(1, 1, "k"), alpha, beta, 1), step_rng(1, 1, "k").beta(alpha, beta)
    )


def test_stream_2_draws_follow_each_tasks_beta() -> None:
    """Every part draws from its own tasks' posteriors: per part, the mean of
    Beta(2, 6) draws is 0.25 and of Beta(6, 2) is 0.75, within 6 standard
    errors (tasks alternate between the two)."""
    n = 400_000
    alpha = np.where(np.arange(n) % 2 == 0, 2.0, 6.0)
    beta = 8.0 - alpha
    p = draws.beta_draws(step_rng(0, 0, "k"), alpha, beta, 2)
    sd = np.sqrt(0.25 * 0.75 / 9)  # Beta(2, 6)'s standard deviation
    for lo, hi in zip(draws.part_bounds(n), draws.part_bounds(n)[1:]):
        part = p[lo:hi]
        count = (hi - lo) // 2
        assert abs(part[(lo % 2) :: 2].mean() - 0.25) < 6 * sd / np.sqrt(count)
        assert abs(part[1 - lo % 2 :: 2].mean() - 0.75) < 6 * sd / np.sqrt(count)


def test_the_stream_changes_the_batch_of_a_large_pool_only() -> None:
    """Stored experiments in stream 1 keep their batches: the two streams
    agree on small pools and differ on large ones."""
    for n, same in ((1000, True), (100_000, False)):
        alpha, beta = posterior(n)
        batches = [
            select(EngineParams(random_stream=s), alpha, beta, np.ones(n, dtype=bool), 64, step_rng(2, 3, "k")).tolist()
            for s in draws.STREAMS
        ]
        assert (batches[0] == batches[1]) is same
