"""The learning-dynamics simulator (bench/simmodel.py, bench/simulate.py):
the model behaves as documented, the baselines do what they claim, and the
simulated trainer gets the same batches from a real server as in-process."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import bots_client
from bench import simulate
from bench.simmodel import Learner, World, WorldConfig, group_signal
from tests.support.servers import ServerProcess

TINY_WORLD = WorldConfig(num_tasks=300, num_heldout=200, num_skills=4)
TINY = simulate.SimConfig(world=TINY_WORLD, batch_size=8, rollouts=8, steps=40, probe_every=10, gains=(0.02, 0.05))


def test_signal_is_zero_for_all_correct_and_all_wrong_groups() -> None:
    signal = group_signal(np.array([0, 16, 8, 4]), 16)
    assert signal.tolist() == [0.0, 0.0, 0.25, 0.1875]


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9])
def test_signal_expectation_is_proportional_to_p_one_minus_p(p: float) -> None:
    m = 16
    draws = np.random.default_rng(0).binomial(m, p, size=200_000)
    expected = p * (1 - p) * (m - 1) / m
    assert group_signal(draws, m).mean() == pytest.approx(expected, rel=0.02)


def test_learner_learns_nothing_from_groups_without_signal() -> None:
    world = World.generate(TINY_WORLD, seed=0)
    learner = Learner(world)
    idx = np.arange(8)
    learner.train(idx, np.array([0, 8, 0, 8, 0, 8, 0, 8]), 8, batch_size=8)
    assert np.array_equal(learner.theta, world.theta0)
    learner.train(idx, np.full(8, 4), 8, batch_size=8)
    gain = learner.theta - world.theta0
    assert (gain > 0).all()  # transfer raises every skill
    trained = np.unique(world.skill[idx])
    untrained = np.setdiff1d(np.arange(TINY_WORLD.num_skills), trained)
    if untrained.size:
        assert gain[trained].min() > gain[untrained].max()  # the trained skills most


def test_accuracy_grows_with_ability() -> None:
    world = World.generate(TINY_WORLD, seed=1)
    assert world.accuracy(world.theta0 + 1.0) > world.accuracy(world.theta0) > world.accuracy(world.theta0 - 1.0)


def test_reference_pass_rates_are_noisy_measurements_of_weaker_and_stronger_models() -> None:
    cfg = dataclasses.replace(TINY_WORLD, num_tasks=2000)
    world = World.generate(cfg, seed=2)
    n = cfg.reference_samples
    for ref in (world.weak_ref, world.strong_ref):
        assert np.allclose(ref * n, np.round(ref * n))  # k / n from n attempts
        assert ((ref >= 0) & (ref <= 1)).all()
    assert world.weak_ref.mean() < world.success_prob(world.theta0).mean() < world.strong_ref.mean()
    truth = world.success_prob(world.theta0)
    corr = np.corrcoef(world.weak_ref, truth)[0, 1]
    assert 0.5 < corr < 0.99  # informative, not exact


def run_local(method: str, seed: int, sim: simulate.SimConfig = TINY) -> dict:
    return asyncio.run(simulate.run_one(simulate.METHODS[method], seed, sim, None, "test"))


def test_oracle_beats_uniform_on_a_tiny_pool() -> None:
    seeds = range(4)
    oracle = [run_local("oracle", s)["accuracy"][-1] for s in seeds]
    uniform = [run_local("uniform", s)["accuracy"][-1] for s in seeds]
    assert all(o > u for o, u in zip(oracle, uniform, strict=True)), (oracle, uniform)


def test_oracle_batches_are_all_informative_more_often_than_uniform() -> None:
    oracle = np.mean([np.mean(run_local("oracle", s)["informative"]) for s in range(3)])
    uniform = np.mean([np.mean(run_local("uniform", s)["informative"]) for s in range(3)])
    assert oracle > uniform


def test_dapo_trains_on_informative_groups_and_pays_for_the_others() -> None:
    dapo, uniform = run_local("dapo", 0), run_local("uniform", 0)
    per_step = TINY.batch_size * TINY.rollouts
    assert uniform["rollouts"][-1] == TINY.steps * per_step
    assert dapo["rollouts"][-1] > TINY.steps * per_step  # the dropped groups' rollouts count
    steps_generated = np.diff(dapo["rollouts"]) / per_step
    assert (steps_generated >= 1).all() and (steps_generated <= TINY.dapo_max_draws).all()
    # every trained group has signal: the step's total signal is positive
    assert min(dapo["signal"]) > 0


def test_band_filter_only_selects_tasks_in_the_band() -> None:
    world = World.generate(TINY_WORLD, seed=0)
    pool = simulate.band_pool(world, TINY)
    mid = (world.weak_ref + world.strong_ref) / 2
    assert ((mid[pool] >= TINY.band[0]) & (mid[pool] <= TINY.band[1])).all()
    assert pool.size < world.num_tasks


def test_runs_are_deterministic() -> None:
    assert run_local("bots", 3)["accuracy"] == run_local("bots", 3)["accuracy"]


def test_summary_and_claims_render(tmp_path: Path) -> None:
    methods = [simulate.METHODS[m] for m in ("uniform", "bots-explicit", "bots", "bots-implicit", "oracle")]
    runs = [run_local(m.name, s) for m in methods for s in range(2)]
    summary = simulate.summarize(runs, TINY, methods)
    assert set(summary["methods"]) == {m.name for m in methods}
    assert {c["claim"].split(" ")[0] for c in summary["claims"]} >= {"BOTS", "implicit-only", "explicit-only", "the"}
    text = simulate.markdown(
        summary,
        TINY,
        {"date": "-", "nproc": 1, "cpu": "-", "mem_gib": 1, "loadavg_at_start": [], "python": "-", "numpy": "-"},
        "local",
    )
    assert "| uniform random |" in text and "Claims:" in text
    assert "Steps relative to uniform" in text


def test_step_ratios_count_misses_at_the_budget_over_every_seed() -> None:
    # seeds 0..2: the method reaches at 10, misses, reaches at 30; the baseline
    # reaches at 20, at 50, misses. Budget 100: ratios 10/20, 100/50, 30/100.
    r = simulate._ratio_stats([10, None, 30], [20, 50, None], [0, 1, 2], [0, 1, 2], 100)
    assert r["per_seed"] == [0.5, 2.0, 0.3]
    assert r["mean"] == pytest.approx((0.5 + 2.0 + 0.3) / 3)
    assert r["bounds"] == 2


def test_memorisation_helps_the_trained_task_only_never_held_out_accuracy() -> None:
    cfg = dataclasses.replace(TINY_WORLD, memorisation=2.0, learning_rate=0.0)
    world = World.generate(cfg, seed=4)
    learner = Learner(world)
    before = learner.pass_rates()
    idx = np.array([3, 7])
    learner.train(idx, np.array([4, 4]), 8, batch_size=8)
    after = learner.pass_rates()
    others = np.setdiff1d(np.arange(cfg.num_tasks), idx)
    assert (after[idx] > before[idx]).all()
    assert np.array_equal(after[others], before[others])
    assert world.accuracy(learner.theta) == world.accuracy(world.theta0)
    # logit gain = memorisation * a_i * r (1 - r), r = 4 / 8
    logit = np.log(after[idx] / (1 - after[idx])) - np.log(before[idx] / (1 - before[idx]))
    assert np.allclose(logit, 2.0 * world.discrimination[idx] * 0.25)


def test_reference_models_have_abilities_of_their_own() -> None:
    # Their per-skill profiles do not follow the learner's: over many worlds the
    # correlation of (reference - level) with the learner's profile is near 0.
    cfg = dataclasses.replace(TINY_WORLD, num_tasks=50, num_heldout=10, num_skills=8)
    pairs = []
    for seed in range(200):
        w = World.generate(cfg, seed)
        pairs.append((w.theta0 - w.theta0.mean(), w.weak_theta - w.weak_theta.mean()))
    learner = np.concatenate([a for a, _ in pairs])
    weak = np.concatenate([b for _, b in pairs])
    assert abs(np.corrcoef(learner, weak)[0, 1]) < 0.1


def test_a_world_without_references_has_no_features() -> None:
    world = World.generate(dataclasses.replace(TINY_WORLD, references=False), seed=0)
    assert np.isnan(world.weak_ref).all() and np.isnan(world.strong_ref).all()
    sim = dataclasses.replace(TINY, world=world.config, world_name="none", steps=5)
    run = asyncio.run(simulate.run_one(simulate.METHODS["bots"], 0, sim, None, "t"))
    assert all(c is None for c in run["capability"])  # the plug-in never estimates anything


@pytest.mark.parametrize("method", ["bots", "mopps", "band", "dapo"])
def test_grpc_backend_gives_the_same_run_as_the_in_process_engine(sqlite_server: ServerProcess, method: str) -> None:
    sim = dataclasses.replace(TINY, steps=12)

    async def remote() -> dict:
        async with bots_client.AsyncClient(sqlite_server.address) as client:
            result = await simulate.run_one(simulate.METHODS[method], 5, sim, client, "t")
            names = [e.name for e in await client.list_experiments()]
        assert not [n for n in names if n.startswith("sim-t-")]  # the run deleted its experiment
        return result

    over_grpc = asyncio.run(remote())
    local = run_local(method, 5, sim)
    for field in ("accuracy", "rollouts", "informative", "capability", "posterior_error"):
        assert over_grpc[field] == local[field], field


def test_informative_embeddings_carry_the_pass_rates_and_noise_ones_do_not() -> None:
    def fit(kind: str) -> float:
        world = World.generate(dataclasses.replace(TINY_WORLD, references=False, embeddings=kind), seed=1)
        assert world.embeddings is not None and world.embeddings.shape == (TINY_WORLD.num_tasks, 32)
        logit = np.log(p := world.success_prob(world.theta0)) - np.log(1 - p)
        x = np.c_[np.ones(world.num_tasks), world.embeddings]
        half = world.num_tasks // 2  # fitted on one half, checked on the other
        coef, *_ = np.linalg.lstsq(x[:half], logit[:half], rcond=None)
        return float(np.corrcoef(x[half:] @ coef, logit[half:])[0, 1])

    assert fit("informative") > 0.7
    assert abs(fit("noise")) < 0.3
    assert World.generate(TINY_WORLD, seed=1).embeddings is None


def test_grpc_backend_gives_the_same_cross_task_run_as_the_in_process_engine(sqlite_server: ServerProcess) -> None:
    world = dataclasses.replace(TINY_WORLD, references=False, embeddings="informative")
    sim = dataclasses.replace(TINY, world=world, world_name="embed", steps=12)

    async def remote() -> dict:
        async with bots_client.AsyncClient(sqlite_server.address) as client:
            return await simulate.run_one(simulate.METHODS["bots-embed"], 5, sim, client, "t")

    over_grpc = asyncio.run(remote())
    local = run_local("bots-embed", 5, sim)
    for field in ("accuracy", "rollouts", "informative", "posterior_error"):
        assert over_grpc[field] == local[field], field
