"""The engine's fast select and update give exactly what the formulas give.

`select` ranks with a sampled threshold and writes scores in place; the BOTS
update skips the terms that are zero. Both must leave every batch and every
posterior bit for bit as before, for the same inputs and random stream:
stored experiments replay their events and re-answer request keys with them.
The reference is the engine as it was before those changes (kept in
bench/reference_engine.py, independent of the engine's code), and every comparison is on the bits of the
floats (-0.0 and NaN included) and on the generator's state afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from bench.reference_engine import ref_apply_outcomes, ref_closeness, ref_select, ref_top_k
from bots_server.engine import EngineParams, GroupQuotas, PosteriorState, UpdateResult, apply_outcomes, scoring, select
from bots_server.engine.steps import top_k_available

# --------------------------------------------------------------------------
# Bit-level comparisons
# --------------------------------------------------------------------------


def assert_same_bits(new: np.ndarray, old: np.ndarray) -> None:
    """Equal as stored bytes: tells -0.0 from 0.0 and compares NaN payloads."""
    assert new.dtype == old.dtype and new.shape == old.shape
    assert np.array_equal(new.view(np.uint64), old.view(np.uint64)), np.flatnonzero(
        new.view(np.uint64) != old.view(np.uint64)
    )[:5]


def float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same_result(new: UpdateResult, old: UpdateResult) -> None:
    assert_same_bits(new.state.alpha, old.state.alpha)
    assert_same_bits(new.state.beta, old.state.beta)
    assert new.state.weak is old.state.weak or np.array_equal(new.state.weak, old.state.weak, equal_nan=True)
    assert float_bits(new.state.capability) == float_bits(old.state.capability)
    assert float_bits(new.capability_estimate) == float_bits(old.capability_estimate)
    assert new.state.rho_halvings == old.state.rho_halvings


def same_generators(seed: int | list[int]) -> tuple[np.random.Generator, np.random.Generator]:
    return np.random.default_rng(seed), np.random.default_rng(seed)


# --------------------------------------------------------------------------
# Random configurations and states
# --------------------------------------------------------------------------

POOL_SIZES = (1, 2, 3, 7, 64, 300, 8191, 8192, 20_000, 70_000)


def random_params(rng: np.random.Generator) -> EngineParams:
    def pick(*values: Any) -> Any:
        return values[int(rng.integers(len(values)))]

    return EngineParams(
        strategy=str(pick("bots", "bots", "uniform", "mopps")),
        selection_mode=str(pick("thompson", "mean", "softmax", "softmax_mean", "expected")),
        target_success=float(pick(0.5, 0.0, 1.0, rng.random())),
        temperature=float(pick(1.0, 0.05, 3.0)),
        forgetting=float(pick(0.1, 0.0, -0.0, 1.0, rng.random())),
        keep_successes=float(pick(0.0, 0.0, 1.0, rng.random())),
        implicit_weight=float(pick(0.1, 0.0, 1.0, rng.random())),
        rollouts_per_task=int(pick(16, 1, 8, 1000)),
        prior_alpha=float(pick(1.0, 0.5, 3.7)),
        prior_beta=float(pick(1.0, 2.0, 0.3)),
        capability_ema=float(pick(0.9, 0.0, 1.0, rng.random())),
        candidate_ratio=float(pick(0.0, 0.0, 0.5, 2.0, 8.0)),
        adaptive_rho_error=float(pick(0.0, 0.0, 0.25, 0.05)),
        track_prediction=float(pick(0.0, 0.0, 0.5, 1.0)),
        implicit_reliability=float(pick(0.0, 0.0, 1.0, 7.0)),
        random_stream=int(pick(1, 2)),
    )


def random_state(rng: np.random.Generator, n: int) -> PosteriorState:
    """A posterior with features missing at random (one, the other or both)."""
    weak = rng.random(n) * 0.6
    strong = np.minimum(weak + rng.random(n) * 0.6, 1.0)
    weak[rng.random(n) < 0.2] = np.nan
    strong[rng.random(n) < 0.2] = np.nan
    if rng.random() < 0.2:  # whole pools without features
        weak[:] = np.nan
    alpha = rng.gamma(2.0, 3.0, n) + 1e-3
    beta = rng.gamma(2.0, 3.0, n) + 1e-3
    if rng.random() < 0.3:  # coarse posteriors: many tied scores in the mean modes
        alpha = rng.integers(1, 4, n).astype(np.float64)
        beta = rng.integers(1, 4, n).astype(np.float64)
    capability = math.nan if rng.random() < 0.3 else float(rng.random() * 1.4 - 0.2)
    return PosteriorState(alpha, beta, weak, strong, capability, int(rng.integers(0, 3)))


def random_outcomes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    count = int(rng.integers(1, min(n, 300) + 1))
    tasks = rng.choice(n, size=count, replace=False)
    trials = rng.integers(1, 17, count).astype(np.float64)
    successes = np.floor(rng.random(count) * (trials + 1))
    if rng.random() < 0.3:
        successes = rng.random(count) * trials  # fractional successes
    return tasks, successes, trials


def cases(count: int, seed: int) -> Iterator[tuple[int, np.random.Generator]]:
    for case in range(count):
        yield case, np.random.default_rng([seed, case])


# --------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", POOL_SIZES)
def test_select_same_batch_and_stream_as_the_reference(n: int) -> None:
    """Every strategy, mode, candidate ratio and availability: the same batch,
    in the same order, and the generator left in the same state."""
    for case, rng in cases(40 if n < 50_000 else 12, seed=n):
        params = random_params(rng)
        state = random_state(rng, n)
        available = rng.random(n) < float(rng.choice([1.0, 0.9, 0.3]))
        available[int(rng.integers(n))] = True
        n_available = int(available.sum())
        batch_size = int(rng.choice([1, n_available, min(n_available, 256), max(1, n_available // 3)]))
        new_rng, old_rng = same_generators(case)
        new = select(params, state.alpha, state.beta, available, batch_size, new_rng)
        old = ref_select(params, state.alpha, state.beta, available, batch_size, old_rng)
        assert new.tolist() == old.tolist(), (params, n, batch_size)
        assert new_rng.bit_generator.state == old_rng.bit_generator.state


def test_select_with_quotas_same_batch_as_the_reference() -> None:
    for case, rng in cases(30, seed=7):
        n = int(rng.choice([5, 300, 20_000]))
        params = random_params(rng)
        state = random_state(rng, n)
        available = rng.random(n) < 0.8
        available[0] = True
        quotas = GroupQuotas(rng.integers(0, 3, n), np.array([0.2, 0.0, 0.1]), np.array([0.5, 1.0, 0.6]))
        batch_size = int(min(available.sum(), rng.integers(1, 64)))
        new_rng, old_rng = same_generators(case)
        new = select(params, state.alpha, state.beta, available, batch_size, new_rng, quotas)
        old = ref_select(params, state.alpha, state.beta, available, batch_size, old_rng, quotas)
        assert new.tolist() == old.tolist()
        assert new_rng.bit_generator.state == old_rng.bit_generator.state


@pytest.mark.parametrize("mode", ["thompson", "mean", "softmax", "softmax_mean", "expected"])
def test_closeness_scores_same_bits(mode: str) -> None:
    rng = np.random.default_rng(3)
    state = random_state(rng, 5000)
    params = EngineParams(selection_mode=mode, temperature=0.3, target_success=0.37)
    new_rng, old_rng = same_generators(11)
    assert_same_bits(
        scoring.closeness(params, state.alpha, state.beta, new_rng),
        ref_closeness(params, state.alpha, state.beta, old_rng),
    )
    assert new_rng.bit_generator.state == old_rng.bit_generator.state


def tied_scores(rng: np.random.Generator, n: int, levels: int) -> np.ndarray:
    """Scores on `levels` distinct values (many ties at any cut), with -0.0
    and 0.0 both present and some unavailable tasks at -inf."""
    score = -rng.integers(0, levels, n).astype(np.float64) / levels
    score[rng.random(n) < 0.01] = 0.0
    score[rng.random(n) < 0.01] = -0.0
    score[rng.random(n) < 0.1] = -np.inf
    return score


@pytest.mark.parametrize("levels", [3, 50, 2000, 1_000_000])
@pytest.mark.parametrize("k", [1, 17, 256, 1000])
def test_top_k_threshold_path_same_as_full_ranking_with_ties(levels: int, k: int) -> None:
    """Ties at the cut (few levels: thousands tied; many: a few) are broken
    by the same draw. The threshold path is checked to be the one taken
    wherever it can be, so the comparison is of the fast path."""
    taken = 0
    for case, rng in cases(20, seed=levels + k):
        n = int(rng.choice([8192, 30_000, 100_000]))
        score = tied_scores(rng, n, levels)
        new_rng, old_rng = same_generators(case)
        new = scoring.top_k(score, k, new_rng)
        old = ref_top_k(score, k, old_rng)
        assert new.tolist() == old.tolist()
        assert new_rng.bit_generator.state == old_rng.bit_generator.state
        taken += scoring._at_or_above_sampled_threshold(score, k) is not None
    if levels >= 2000:
        assert taken == 20


def test_top_k_with_nan_scores_behaves_as_the_reference() -> None:
    """NaN scores (not produced by the strategies, but possible in a state
    restored from elsewhere) get the full ranking's answer, error included."""
    for case, rng in cases(20, seed=99):
        n = int(rng.choice([10, 20_000]))
        score = rng.random(n)
        score[rng.random(n) < float(rng.choice([1e-4, 0.01, 0.5]))] = np.nan
        k = int(rng.choice([1, 10, 100])) if n > 100 else 3
        new_rng, old_rng = same_generators(case)
        outcomes = []
        for top_k, generator in ((scoring.top_k, new_rng), (ref_top_k, old_rng)):
            try:
                outcomes.append(top_k(score, k, generator).tolist())
            except ValueError as error:
                outcomes.append(type(error).__name__)
        assert outcomes[0] == outcomes[1]


def test_top_k_whole_pool_and_sorted_pools() -> None:
    """k == n, and adversarial orders for the strided sample (sorted up, down)."""
    for n in (8192, 50_000):
        base = np.random.default_rng(n).random(n)
        for score in (base, np.sort(base), np.sort(base)[::-1].copy()):
            for k in (1, 256, n // 8, n):
                new_rng, old_rng = same_generators(k)
                assert scoring.top_k(score, k, new_rng).tolist() == ref_top_k(score, k, old_rng).tolist()
                assert new_rng.bit_generator.state == old_rng.bit_generator.state


# --------------------------------------------------------------------------
# Update
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", POOL_SIZES)
def test_update_same_bits_as_the_reference(n: int) -> None:
    for _, rng in cases(40 if n < 50_000 else 12, seed=1000 + n):
        params = random_params(rng)
        state = random_state(rng, n)
        tasks, successes, trials = random_outcomes(rng, n)
        pool_size = None if rng.random() < 0.7 else int(rng.integers(tasks.max() + 1, n + 2))
        new = apply_outcomes(params, state, tasks, successes, trials, pool_size)
        old = ref_apply_outcomes(params, state, tasks, successes, trials, pool_size)
        assert_same_result(new, old)


def test_many_steps_stay_bit_identical() -> None:
    """Chains of select + update (adaptive rho halving, tracking and
    reliability carried from step to step): the two never part."""
    for case, rng in cases(12, seed=5):
        n = int(rng.choice([50, 3000, 20_000]))
        params = dataclasses.replace(random_params(rng), strategy=str(rng.choice(["bots", "uniform"])))
        new_state = old_state = random_state(rng, n)
        truth = rng.random(n)
        for step in range(15):
            available = rng.random(n) < 0.9
            batch_size = int(min(available.sum(), 64))
            if batch_size == 0:
                continue
            new_rng, old_rng = same_generators([case, step])
            batch = select(params, new_state.alpha, new_state.beta, available, batch_size, new_rng)
            assert (
                batch.tolist()
                == ref_select(params, old_state.alpha, old_state.beta, available, batch_size, old_rng).tolist()
            )
            trials = np.full(batch_size, 8.0)
            successes = rng.binomial(8, truth[batch]).astype(np.float64)
            new = apply_outcomes(params, new_state, batch, successes, trials)
            old = ref_apply_outcomes(params, old_state, batch, successes, trials)
            assert_same_result(new, old)
            new_state, old_state = new.state, old.state


def test_update_keeps_negative_zero_as_the_formula_does() -> None:
    """forgetting = -0.0 passes validation; then a -0.0 posterior entry becomes
    +0.0 through the formula's +0.0 terms, and must here too."""
    alpha = np.array([-0.0, 0.0, 1.0, -0.0, 2.0, -0.0, 3.0, 0.5, -0.0, 1.0])
    beta = alpha[::-1].copy()
    weak = np.array([0.1, np.nan, 0.2, 0.0, 0.3, np.nan, 0.1, 0.2, 0.0, 0.4])
    strong = np.array([0.5, 0.6, np.nan, 0.0, 0.9, np.nan, 0.8, 0.7, 0.0, 0.9])
    tasks, successes, trials = np.array([2, 4]), np.array([1.0, 3.0]), np.array([4.0, 4.0])
    for lam in (-0.0, 0.0):
        for capability in (math.nan, 0.0, -0.0, 0.5):
            for rho in (0.0, 0.3, 1.0):
                params = EngineParams(forgetting=lam, implicit_weight=rho)
                state = PosteriorState(alpha, beta, weak, strong, capability)
                assert_same_result(
                    apply_outcomes(params, state, tasks, successes, trials),
                    ref_apply_outcomes(params, state, tasks, successes, trials),
                )


def test_update_does_not_touch_the_previous_state() -> None:
    """States are shared with readers: the update must build new arrays."""
    rng = np.random.default_rng(8)
    state = random_state(rng, 1000)
    copies = [a.copy() for a in (state.alpha, state.beta, state.weak, state.strong)]
    tasks, successes, trials = random_outcomes(rng, 1000)
    for params in (EngineParams(), EngineParams(track_prediction=1.0, implicit_reliability=1.0)):
        apply_outcomes(params, state, tasks, successes, trials)
        for before, now in zip(copies, (state.alpha, state.beta, state.weak, state.strong), strict=True):
            assert_same_bits(now, before)


def test_update_without_reported_tasks_and_with_zero_trials() -> None:
    """An empty report (every task forgets, nothing else), and a rate of
    0/0 (NaN: no prediction at that task, NaN evidence) as the formula does."""
    rng = np.random.default_rng(21)
    for params in (EngineParams(), EngineParams(implicit_weight=1.0, track_prediction=1.0, adaptive_rho_error=0.05)):
        for n in (1, 40, 40_000):
            state = dataclasses.replace(random_state(rng, n), capability=0.3)
            empty = np.array([], dtype=np.int64), np.array([]), np.array([])
            assert_same_result(apply_outcomes(params, state, *empty), ref_apply_outcomes(params, state, *empty))
            tasks = np.array([0, n - 1]) if n > 1 else np.array([0])
            successes, trials = np.zeros(tasks.shape[0]), np.array([0.0, 4.0])[: tasks.shape[0]]
            with np.errstate(invalid="ignore"):
                new = apply_outcomes(params, state, tasks, successes, trials)
                old = ref_apply_outcomes(params, state, tasks, successes, trials)
            assert_same_result(new, old)


def test_top_k_of_available_tasks_as_the_masked_ranking() -> None:
    """Only the available tasks ranked: the same batch as ranking every task
    with the others at -inf, also when available scores are -inf or NaN
    (then it ranks them all) and when the free tasks are few (candidates)."""
    for case, rng in cases(40, seed=31):
        n = int(rng.choice([20, 9000, 60_000]))
        score = tied_scores(rng, n, int(rng.choice([5, 3000, 10**6])))
        score[score == -np.inf] = 0.25
        if rng.random() < 0.3:
            score[rng.random(n) < 0.001] = float(rng.choice([-np.inf, np.nan]))
        available = rng.random(n) < float(rng.choice([0.002, 0.5, 0.99]))
        available[:3] = True
        k = int(rng.integers(1, int(available.sum()) + 1))
        if case % 4 == 0:  # -inf among the free tasks at the cut: the tie spans unavailable tasks too
            score[np.flatnonzero(available)[:2]] = -np.inf
            k = int(available.sum())
        new_rng, old_rng = same_generators(case)
        outcomes = []
        for top_k, generator in (
            (lambda g: top_k_available(score, available, k, g), new_rng),
            (lambda g: ref_top_k(np.where(available, score, -np.inf), k, g), old_rng),
        ):
            try:
                outcomes.append(top_k(generator).tolist())
            except ValueError as error:
                outcomes.append(type(error).__name__)
        assert outcomes[0] == outcomes[1]
        assert new_rng.bit_generator.state == old_rng.bit_generator.state
