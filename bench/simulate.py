"""Learning-dynamics simulator: how much data each task-selection method saves.

A simulated RL trainer (bench/simmodel.py: item-response tasks with skills, a
learner grown by the p(1-p) gradient signal of the groups it trains on and
memorising the tasks it trains on, reference models with abilities of their
own, held-out accuracy) picks its batches from a real BOTS server over gRPC,
or from the same engine in-process (`--backend local`, bit-identical numbers,
no server). It runs in three worlds: good reference models, poor ones, none;
and, when named, in two without reference models whose tasks carry
embeddings, informative ("embed") or noise ("embed-noise"):

    .venv/bin/python -m bench.simulate --backend local --worlds embed,embed-noise --methods uniform,bots,bots-embed,oracle --seeds 20

    .venv/bin/python -m bench.simulate              # 3 worlds x 5 seeds x 600 steps, sweeps in `good`
    .venv/bin/python -m bench.simulate --quick      # 2 seeds, 150 steps, 1500 tasks, no sweeps
    .venv/bin/python -m bench.simulate --backend local --seeds 10 --worlds poor

Targets are held-out accuracy gains over each seed's starting accuracy; steps
to a target are compared per seed with uniform's (and the oracle's), a miss
counted at the step budget, over every seed.

Writes bench/results/simulate.json, a markdown summary (bench/results/simulate.md)
and PNG plots per world (bench/results/sim_*_<world>.png, needs matplotlib).

Methods: uniform random, an offline band filter on the reference pass rates,
DAPO dynamic sampling (over-sample uniform batches, drop all-correct and
all-wrong groups, count every rollout), MoPPS, BOTS explicit-only (rho = 0),
implicit-only (rho = 1), BOTS with the reference defaults, and an oracle that
knows the learner's true pass rates. Ablations sweep the forgetting factor
lambda and the implicit weight rho. Baselines that are not server strategies
run client-side; band and DAPO still draw their batches from a server
experiment with strategy "uniform".
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

if __package__ in (None, ""):  # `python bench/simulate.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.simmodel import WORLDS, Learner, World, WorldConfig, reference_correlations

# -- methods --------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    kind: str = "server"  # server | band | dapo | oracle
    strategy: str = "bots"
    forgetting: float = 0.1
    implicit_weight: float = 0.1
    group: str = "main"  # main | lambda | rho | engine
    settings: tuple[tuple[str, Any], ...] = ()  # further ExperimentConfig fields

    def config(self, rollouts: int, seed: int) -> Any:
        import bots_client

        return bots_client.ExperimentConfig(
            strategy=self.strategy,
            forgetting=self.forgetting,
            implicit_weight=self.implicit_weight,
            rollouts_per_task=rollouts,
            weak_feature="weak",
            strong_feature="strong",
            seed=seed,
            **dict(self.settings),
        )


MAIN = (
    Method("uniform", "uniform random", strategy="uniform"),
    Method("band", "offline band filter", kind="band", strategy="uniform"),
    Method("dapo", "DAPO dynamic sampling", kind="dapo", strategy="uniform"),
    Method("mopps", "MoPPS", strategy="mopps"),
    Method("bots-explicit", "BOTS explicit only (rho=0)", implicit_weight=0.0),
    Method("bots-implicit", "BOTS implicit only (rho=1)", implicit_weight=1.0),
    Method("bots", "BOTS defaults (lambda=0.1, rho=0.1)"),
    Method("oracle", "oracle (knows true p)", kind="oracle"),
)
ABLATIONS = (
    Method("bots-lam0", "BOTS lambda=0", forgetting=0.0, group="lambda"),
    Method("bots-lam0.03", "BOTS lambda=0.03", forgetting=0.03, group="lambda"),
    Method("bots-lam0.3", "BOTS lambda=0.3", forgetting=0.3, group="lambda"),
    Method("bots-lam1", "BOTS lambda=1", forgetting=1.0, group="lambda"),
    Method("bots-rho0.3", "BOTS rho=0.3", implicit_weight=0.3, group="rho"),
    Method("bots-rho0.6", "BOTS rho=0.6", implicit_weight=0.6, group="rho"),
)
# Opt-in engines beyond the paper (docs/choosing-a-strategy.md).
# Tracking is measured at half the predicted change (track 0.5) and at the
# full change (track 1, unstable when the reference models are poor), both
# with lambda = 0.05 and against BOTS at lambda = 0.05 alone.
_EXPECTED = ("selection_mode", "expected")
ENGINES: tuple[Method, ...] = (
    Method("bots-lam0.05", "BOTS lambda=0.05 (control of tracking)", forgetting=0.05, group="engine"),
    Method(
        "bots-track",
        "BOTS + tracking 0.5 (lambda=0.05)",
        forgetting=0.05,
        group="engine",
        settings=(("track_prediction", 0.5),),
    ),
    Method(
        "bots-track1",
        "BOTS + tracking 1 (lambda=0.05)",
        forgetting=0.05,
        group="engine",
        settings=(("track_prediction", 1.0),),
    ),
    Method("bots-reliable", "BOTS + reliability rho", group="engine", settings=(("implicit_reliability", 1.0),)),
    Method("bots-expected", "BOTS + expected-loss selection", group="engine", settings=(_EXPECTED,)),
    Method(
        "bots-plus",
        "BOTS + expected + tracking 0.5 (lambda=0.05)",
        forgetting=0.05,
        group="engine",
        settings=(("track_prediction", 0.5), _EXPECTED),
    ),
    Method("bots-keep", "BOTS + successes kept (keep_successes=1)", group="engine", settings=(("keep_successes", 1.0),)),
    Method(
        "bots-keep-lam0.3",
        "BOTS + successes kept, failures forgotten at lambda=0.3",
        forgetting=0.3,
        group="engine",
        settings=(("keep_successes", 1.0),),
    ),
    Method(
        "bots-keep-lam0.5",
        "BOTS + successes kept, failures forgotten at lambda=0.5",
        forgetting=0.5,
        group="engine",
        settings=(("keep_successes", 1.0),),
    ),
    Method(
        "bots-keep-lam1",
        "BOTS + successes kept, failures forgotten at lambda=1",
        forgetting=1.0,
        group="engine",
        settings=(("keep_successes", 1.0),),
    ),
    Method(
        "bots-plus-keep",
        "bots-plus + successes kept (keep_successes=1)",
        forgetting=0.05,
        group="engine",
        settings=(("track_prediction", 0.5), _EXPECTED, ("keep_successes", 1.0)),
    ),
    Method(
        "bots-expected-keep-lam0.3",
        "BOTS + expected, successes kept, failures forgotten at lambda=0.3",
        forgetting=0.3,
        group="engine",
        settings=(_EXPECTED, ("keep_successes", 1.0)),
    ),
    Method(
        "bots-all",
        "BOTS + all three (tracking 0.5, lambda=0.05)",
        forgetting=0.05,
        group="engine",
        settings=(("track_prediction", 0.5), ("implicit_reliability", 1.0), _EXPECTED),
    ),
)
# Cross-task prediction from task embeddings (worlds "embed" and
# "embed-noise"): BOTS with embedding_weight pseudo-rollouts at most.
EMBEDDING: tuple[Method, ...] = (
    Method("bots-embed", "BOTS + cross-task prediction (embedding_weight=64)", group="embedding",
           settings=(("embedding_weight", 64.0),)),
    Method("bots-half", "BOTS, half of every batch uniform (uniform_share=0.5)", group="embedding",
           settings=(("uniform_share", 0.5),)),
)  # fmt: skip
METHODS = {m.name: m for m in (*MAIN, *ABLATIONS, *ENGINES, *EMBEDDING)}
# The lambda and rho sweeps, each with the default value and extremes from MAIN.
LAMBDA_SWEEP = (("bots-lam0", 0.0), ("bots-lam0.03", 0.03), ("bots", 0.1), ("bots-lam0.3", 0.3), ("bots-lam1", 1.0))
RHO_SWEEP = (("bots-explicit", 0.0), ("bots", 0.1), ("bots-rho0.3", 0.3), ("bots-rho0.6", 0.6), ("bots-implicit", 1.0))


@dataclass(frozen=True)
class SimConfig:
    world: WorldConfig = field(default_factory=WorldConfig)
    batch_size: int = 32  # tasks per step (B)
    rollouts: int = 16  # attempts per task (m)
    steps: int = 600
    band_feature: str = "mean"  # weak | strong | mean: the reference pass rate the band filter uses
    band: tuple[float, float] = (0.1, 0.9)
    dapo_max_draws: int = 8  # DAPO: at most this many batches generated per step
    probe_every: int = 10  # posterior-vs-truth error every this many steps
    # Targets: held-out accuracy gains over the seed's starting accuracy (the
    # same for every method of a seed, which shares its world and learner).
    gains: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4)
    world_name: str = "good"  # bench/simmodel.py WORLDS; `world` is its config


# -- selectors: where a method's batches come from ------------------------------------


class Selector(Protocol):
    async def select(self, batch_size: int, request_key: str) -> np.ndarray: ...

    async def report(self, idx: np.ndarray, successes: np.ndarray, trials: int) -> float | None: ...

    async def posterior_mean(self) -> np.ndarray | None: ...

    async def close(self) -> None: ...


class RemoteSelector:
    """An experiment on a real server over gRPC; tasks are the pool indices `pool`."""

    def __init__(
        self,
        client: Any,
        name: str,
        config: Any,
        pool: np.ndarray,
        weak: np.ndarray,
        strong: np.ndarray,
        embeddings: np.ndarray | None = None,
    ):
        self.client, self.name, self.config, self.pool = client, name, config, pool
        self._weak, self._strong, self._embeddings = weak, strong, embeddings
        self._batch_id = ""
        self.select_s: list[float] = []
        self.report_s: list[float] = []

    async def open(self) -> RemoteSelector:
        import bots_client

        await self.client.create_experiment(self.name, self.config)
        tasks = [
            bots_client.Task(
                f"t{i}",
                {} if math.isnan(self._weak[i]) else {"weak": float(self._weak[i]), "strong": float(self._strong[i])},
                embedding=None if self._embeddings is None else self._embeddings[i],
            )
            for i in self.pool
        ]
        await self.client.add_tasks(self.name, tasks)
        return self

    async def select(self, batch_size: int, request_key: str) -> np.ndarray:
        started = time.perf_counter()
        batch = await self.client.select_batch(self.name, batch_size, request_key)
        self.select_s.append(time.perf_counter() - started)
        self._batch_id = batch.batch_id
        return np.fromiter((int(k[1:]) for k in batch.keys), dtype=np.int64, count=len(batch.keys))

    async def report(self, idx: np.ndarray, successes: np.ndarray, trials: int) -> float | None:
        outcomes = {f"t{i}": (float(s), trials) for i, s in zip(idx.tolist(), successes.tolist(), strict=True)}
        started = time.perf_counter()
        result = await self.client.report_outcomes(self.name, self._batch_id, outcomes)
        self.report_s.append(time.perf_counter() - started)
        return result.capability

    async def posterior_mean(self) -> np.ndarray:
        snap = await self.client.snapshot(self.name)
        mean = np.full(int(self.pool.max()) + 1, np.nan)
        mean[[int(k[1:]) for k in snap.keys]] = snap.mean
        return mean

    async def close(self) -> None:
        await self.client.delete_experiment(self.name)


class LocalSelector:
    """The server's engine in-process, with the server's seeding: the same
    batches and posteriors as RemoteSelector, without a server."""

    def __init__(
        self, config: Any, pool: np.ndarray, weak: np.ndarray, strong: np.ndarray, embeddings: np.ndarray | None = None
    ):
        from bots_server.engine import EngineParams, PosteriorState

        self.config, self.pool = config, pool
        self.params = EngineParams.of(config)
        self.position = {int(i): j for j, i in enumerate(pool)}
        self.state = PosteriorState.from_prior(
            self.params,
            weak[pool].astype(np.float64),
            strong[pool].astype(np.float64),
            embeddings=None if embeddings is None else embeddings[pool],
        )
        self.step = 0

    async def select(self, batch_size: int, request_key: str) -> np.ndarray:
        from bots_server.engine import select, step_rng

        available = np.ones(self.pool.shape[0], dtype=bool)
        rng = step_rng(self.config.seed, self.step, request_key)
        return self.pool[select(self.params, self.state.alpha, self.state.beta, available, batch_size, rng)]

    async def report(self, idx: np.ndarray, successes: np.ndarray, trials: int) -> float | None:
        from bots_server.engine import apply_outcomes

        local = np.array([self.position[int(i)] for i in idx], dtype=np.int64)
        order = np.argsort(local)  # the server applies outcomes sorted by task index
        result = apply_outcomes(
            self.params,
            self.state,
            local[order],
            np.asarray(successes, dtype=np.float64)[order],
            np.full(local.shape[0], float(trials)),
        )
        self.state = result.state
        self.step += 1
        return None if math.isnan(self.state.capability) else float(self.state.capability)

    async def posterior_mean(self) -> np.ndarray:
        mean = np.full(int(self.pool.max()) + 1, np.nan)
        mean[self.pool] = self.state.alpha / (self.state.alpha + self.state.beta)
        return mean

    async def close(self) -> None:
        pass


class OracleSelector:
    """Knows the learner's true pass rates: the B tasks closest to p = 0.5
    (largest expected signal p (1 - p)), ties broken at random."""

    def __init__(self, world: World, learner: Learner, seed: int):
        self.world, self.learner = world, learner
        self.rng = np.random.default_rng([seed, 0x0AC1E])

    async def select(self, batch_size: int, request_key: str) -> np.ndarray:
        p = self.learner.pass_rates()
        score = np.abs(p - 0.5) + self.rng.random(p.shape[0]) * 1e-9
        return np.argpartition(score, batch_size)[:batch_size]

    async def report(self, idx: np.ndarray, successes: np.ndarray, trials: int) -> float | None:
        return None

    async def posterior_mean(self) -> np.ndarray | None:
        return None

    async def close(self) -> None:
        pass


# -- one run -------------------------------------------------------------------------------


def band_pool(world: World, sim: SimConfig) -> np.ndarray:
    """Tasks whose reference pass rate lies in the band (inclusive)."""
    ref = {
        "weak": world.weak_ref,
        "strong": world.strong_ref,
        "mean": (world.weak_ref + world.strong_ref) / 2,
    }[sim.band_feature]
    lo, hi = sim.band
    pool = np.flatnonzero((ref >= lo) & (ref <= hi))
    if pool.shape[0] < sim.batch_size:
        raise ValueError(f"band {sim.band} on {sim.band_feature} keeps {pool.shape[0]} tasks, fewer than a batch")
    return pool


async def make_selector(
    method: Method, world: World, learner: Learner, seed: int, sim: SimConfig, client: Any | None, run_tag: str
) -> Selector:
    if method.kind == "oracle":
        return OracleSelector(world, learner, seed)
    if method.kind == "band" and not sim.world.references:
        raise ValueError("the band filter needs reference pass rates; this world has none")
    pool = band_pool(world, sim) if method.kind == "band" else np.arange(world.num_tasks)
    config = method.config(sim.rollouts, seed)
    embeddings = world.embeddings
    if embeddings is not None:
        config = dataclasses.replace(config, embedding_dim=embeddings.shape[1])
    if client is None:
        return LocalSelector(config, pool, world.weak_ref, world.strong_ref, embeddings)
    name = f"sim-{run_tag}-{sim.world_name}-{method.name}-s{seed}"
    return await RemoteSelector(client, name, config, pool, world.weak_ref, world.strong_ref, embeddings).open()


async def run_one(method: Method, seed: int, sim: SimConfig, client: Any | None, run_tag: str) -> dict[str, Any]:
    """Train one learner for sim.steps steps with `method`; every number per step."""
    world = World.generate(sim.world, seed)
    learner = Learner(world)
    rng = np.random.default_rng([seed, 0xB075])  # rollouts
    selector = await make_selector(method, world, learner, seed, sim, client, run_tag)
    b, m = sim.batch_size, sim.rollouts
    accuracy = [world.accuracy(learner.theta)]
    rollouts = [0]
    informative: list[float] = []  # share of generated groups with signal (0 < k < m)
    target_gap: list[float] = []  # mean |p - 0.5| of the trained tasks (true p, before the step)
    regret: list[float] = []  # target_gap minus the smallest possible (the oracle's B tasks, same learner)
    signal: list[float] = []
    capability: list[float | None] = []
    probes: list[tuple[int, float]] = []  # (step, mean |posterior mean - true p| over the pool)
    tracks_posterior = method.kind == "server" and method.strategy != "uniform"
    started = time.perf_counter()
    try:
        for step in range(sim.steps):
            if tracks_posterior and step % sim.probe_every == 0:
                await _probe(selector, world, learner, step, probes)
            if method.kind == "dapo":
                idx, k, generated, useful, cap = await _dapo_step(selector, learner, sim, step, rng)
            else:
                idx = await selector.select(b, f"step-{step}")
                k = learner.rollout(idx, m, rng)
                cap = await selector.report(idx, k, m)
                generated, useful = b, int(np.count_nonzero((k > 0) & (k < m)))
            gap_all = np.abs(learner.pass_rates() - 0.5)
            best = float(np.mean(np.partition(gap_all, b - 1)[:b]))
            signal.append(learner.train(idx, k, m, b))
            target_gap.append(float(np.mean(gap_all[idx])))
            regret.append(target_gap[-1] - best)
            informative.append(useful / generated)
            capability.append(cap)
            accuracy.append(world.accuracy(learner.theta))
            rollouts.append(rollouts[-1] + generated * m)
        if tracks_posterior:
            await _probe(selector, world, learner, sim.steps, probes)
    finally:
        await selector.close()
    result: dict[str, Any] = {
        "method": method.name,
        "world": sim.world_name,
        "seed": seed,
        "reference_correlation": list(reference_correlations(world)),
        "accuracy": accuracy,
        "rollouts": rollouts,
        "informative": informative,
        "target_gap": target_gap,
        "regret": regret,
        "signal": signal,
        "capability": capability,
        "posterior_error": probes,
        "seconds": time.perf_counter() - started,
    }
    if isinstance(selector, RemoteSelector):
        result["select_ms"] = common.percentiles(selector.select_s)
        result["report_ms"] = common.percentiles(selector.report_s)
    return result


async def _dapo_step(
    selector: Selector, learner: Learner, sim: SimConfig, step: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, int, int, float | None]:
    """DAPO dynamic sampling: generate uniform batches until B groups with
    signal are collected (at most dapo_max_draws batches); train on the
    first B. Every generated group costs its rollouts; every batch is
    reported to the server so its lease is released."""
    b, m = sim.batch_size, sim.rollouts
    kept_idx: list[np.ndarray] = []
    kept_k: list[np.ndarray] = []
    have = generated = useful = 0
    cap = None
    for draw in range(sim.dapo_max_draws):
        idx = await selector.select(b, f"step-{step}-draw-{draw}")
        k = learner.rollout(idx, m, rng)
        cap = await selector.report(idx, k, m)
        generated += b
        keep = (k > 0) & (k < m)
        useful += int(keep.sum())
        kept_idx.append(idx[keep])
        kept_k.append(k[keep])
        have += int(keep.sum())
        if have >= b:
            break
    idx = np.concatenate(kept_idx)[:b]
    k = np.concatenate(kept_k)[:b]
    return idx, k, generated, useful, cap


async def _probe(
    selector: Selector, world: World, learner: Learner, step: int, probes: list[tuple[int, float]]
) -> None:
    mean = await selector.posterior_mean()
    if mean is None:
        return
    truth = learner.pass_rates()
    full = np.full(truth.shape[0], np.nan)
    full[: mean.shape[0]] = mean[: truth.shape[0]]
    known = ~np.isnan(full)
    probes.append((step, float(np.mean(np.abs(full[known] - truth[known])))))


# -- many runs ---------------------------------------------------------------------------


async def run_all(
    jobs: Sequence[tuple[Method, int, SimConfig]],
    target: str | None,
    concurrency: int,
    progress: bool,
) -> list[dict[str, Any]]:
    """Every (method, seed, world's SimConfig) run; against a server at
    `target`, or in-process when it is None."""
    client = None
    if target is not None:
        import bots_client

        client = bots_client.AsyncClient(target, timeout=120.0)
    run_tag = uuid.uuid4().hex[:8]
    semaphore = asyncio.Semaphore(concurrency if client is not None else 1)
    done = 0
    total = len(jobs)

    async def one(method: Method, seed: int, sim: SimConfig) -> dict[str, Any]:
        nonlocal done
        async with semaphore:
            result = await run_one(method, seed, sim, client, run_tag)
        done += 1
        if progress:
            print(
                f"  [{done:3d}/{total}] {sim.world_name:5s} {method.name:14s} seed {seed}: final accuracy "
                f"{result['accuracy'][-1]:.3f} ({result['seconds']:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        return result

    try:
        return await asyncio.gather(*(one(m, s, sim) for m, s, sim in jobs))
    finally:
        if client is not None:
            await client.close()


# -- summary -------------------------------------------------------------------------------


def first_reach(values: Sequence[float], threshold: float) -> int | None:
    """First index whose value is >= threshold."""
    hits = np.flatnonzero(np.asarray(values) >= threshold)
    return int(hits[0]) if hits.size else None


def summarize(runs: list[dict[str, Any]], sim: SimConfig, methods: Sequence[Method]) -> dict[str, Any]:
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    early = max(1, sim.steps // 10)
    correlations = np.array([r["reference_correlation"] for r in runs if "reference_correlation" in r], dtype=float)
    summary: dict[str, Any] = {"world": sim.world_name, "methods": {}}
    if correlations.size:
        summary["reference_correlation"] = {
            "weak": _stats(correlations[:, 0]) if not np.isnan(correlations[:, 0]).any() else None,
            "strong": _stats(correlations[:, 1]) if not np.isnan(correlations[:, 1]).any() else None,
        }
    steps_of: dict[str, dict[str, list[int | None]]] = {}  # method -> target key -> steps per seed
    for method in methods:
        rs = sorted(by_method.get(method.name, []), key=lambda r: r["seed"])
        if not rs:
            continue
        acc = np.array([r["accuracy"] for r in rs])
        entry: dict[str, Any] = {
            "label": method.label,
            "group": method.group,
            "seeds": [r["seed"] for r in rs],
            "start_accuracy": _stats(acc[:, 0]),
            "final_accuracy": _stats(acc[:, -1]),
            "mean_accuracy": _stats(acc[:, 1:].mean(axis=1)),  # area under the curve / steps
            "informative": _stats([np.mean(r["informative"]) for r in rs]),
            "informative_early": _stats([np.mean(r["informative"][:early]) for r in rs]),
            "accuracy_early": _stats(acc[:, early]),
            "rollouts_total": _stats([r["rollouts"][-1] for r in rs]),
            "targets": {},
        }
        steps_of[method.name] = {}
        for gain in sim.gains:
            key = f"+{gain:.2f}"
            steps = [first_reach(r["accuracy"], r["accuracy"][0] + gain) for r in rs]
            rollouts = [None if s is None else r["rollouts"][s] for s, r in zip(steps, rs, strict=True)]
            steps_of[method.name][key] = steps
            entry["targets"][key] = {
                "gain": gain,
                "reached": sum(s is not None for s in steps),
                "steps": steps,
                "rollouts": rollouts,
                "steps_stats": _censored_stats(steps, sim.steps),
                "rollouts_stats": _censored_stats(rollouts, None),
            }
        summary["methods"][method.name] = entry
    # Per-seed ratios of steps to a target, a miss counted at the step budget
    # (so a miss by the baseline makes the ratio an upper bound, a miss by the
    # method a lower bound), averaged over every seed: never over only the
    # seeds that reached it.
    for name, entry in summary["methods"].items():
        for key, t in entry["targets"].items():
            for base in ("uniform", "oracle", "bots"):
                if base in steps_of and base != name:
                    t[f"ratio_to_{base}"] = _ratio_stats(
                        steps_of[name][key],
                        steps_of[base][key],
                        entry["seeds"],
                        summary["methods"][base]["seeds"],
                        sim.steps,
                    )
    for method in methods:
        if method.name not in summary["methods"]:
            continue
        entry = summary["methods"][method.name]
        rs = sorted(by_method[method.name], key=lambda r: r["seed"])
        probes = [r["posterior_error"] for r in rs if r["posterior_error"]]
        if probes:
            errors = np.array([[e for _, e in p] for p in probes])
            entry["posterior_error"] = {
                "steps": [s for s, _ in probes[0]],
                "mean": errors.mean(axis=0).tolist(),
                "std": errors.std(axis=0).tolist(),
            }
        gaps = np.array([r["target_gap"] for r in rs])
        quarter = max(1, sim.steps // 4)
        entry["target_gap_first_quarter"] = _stats(gaps[:, :quarter].mean(axis=1))
        entry["target_gap_last_quarter"] = _stats(gaps[:, -quarter:].mean(axis=1))
        regrets = np.array([r["regret"] for r in rs])
        entry["regret_first_quarter"] = _stats(regrets[:, :quarter].mean(axis=1))
        entry["regret_last_quarter"] = _stats(regrets[:, -quarter:].mean(axis=1))
        if "select_ms" in rs[0]:
            entry["select_p50_ms"] = float(np.median([r["select_ms"]["p50"] for r in rs]))
            entry["report_p50_ms"] = float(np.median([r["report_ms"]["p50"] for r in rs]))
        summary["methods"][method.name] = entry
    summary["claims"] = check_claims(by_method, summary, sim)
    return summary


def _ratio_stats(
    steps: Sequence[int | None],
    base: Sequence[int | None],
    seeds: Sequence[int],
    base_seeds: Sequence[int],
    budget: int,
) -> dict[str, Any]:
    """Per-seed steps / baseline steps over the seeds both ran, a miss counted
    at the budget; how many of those ratios are bounds (a miss on either side)."""
    by_seed = dict(zip(base_seeds, base, strict=True))
    ratios, bounds = [], 0
    for seed, s in zip(seeds, steps, strict=True):
        if seed not in by_seed:
            continue
        b = by_seed[seed]
        bounds += s is None or b is None
        ratios.append((budget if s is None else max(s, 1)) / (budget if b is None else max(b, 1)))
    if not ratios:
        return {"mean": None, "std": None, "per_seed": [], "bounds": 0}
    return {**_stats(ratios), "per_seed": [round(r, 4) for r in ratios], "bounds": bounds}


def _stats(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0}


def _censored_stats(values: Sequence[int | None], budget: int | None) -> dict[str, Any]:
    reached = [v for v in values if v is not None]
    if not reached:
        return {"mean": None, "std": None, "censored": len(values)}
    return {
        "mean": float(np.mean(reached)),
        "std": float(np.std(reached, ddof=1)) if len(reached) > 1 else 0.0,
        "censored": len(values) - len(reached),
    }


def _paired(by_method: dict[str, list[dict[str, Any]]], a: str, b: str, metric: Any) -> tuple[float, int, int] | None:
    """Mean over seeds of metric(a) - metric(b), and in how many seeds a > b."""
    ra = {r["seed"]: r for r in by_method.get(a, [])}
    rb = {r["seed"]: r for r in by_method.get(b, [])}
    seeds = sorted(set(ra) & set(rb))
    if not seeds:
        return None
    diffs = [metric(ra[s]) - metric(rb[s]) for s in seeds]
    return float(np.mean(diffs)), sum(d > 0 for d in diffs), len(seeds)


def check_claims(
    by_method: dict[str, list[dict[str, Any]]], summary: dict[str, Any], sim: SimConfig
) -> list[dict[str, Any]]:
    """The paper's qualitative claims, checked on paired seeds (same world)."""
    claims: list[dict[str, Any]] = []
    early = max(1, sim.steps // 10)

    def auc(r: dict[str, Any]) -> float:
        return float(np.mean(r["accuracy"][1:]))

    def add(claim: str, held: bool | None, evidence: str) -> None:
        claims.append({"claim": claim, "held": held, "evidence": evidence})

    methods = summary["methods"]
    # 1. BOTS beats uniform: fewer steps to every accuracy gain, per seed.
    if "bots" in methods and "uniform" in methods:
        ratios = {k: t.get("ratio_to_uniform") for k, t in methods["bots"]["targets"].items()}
        p = _paired(by_method, "bots", "uniform", auc)
        if all(r is not None and r["mean"] is not None for r in ratios.values()) and p is not None:
            add(
                "BOTS (defaults) needs fewer steps than uniform to every accuracy gain (mean per-seed ratio < 1)",
                all(r["mean"] < 1 for r in ratios.values()),  # type: ignore[index]
                "steps relative to uniform, per seed, misses at the budget: "
                + ", ".join(f"{k}: {r['mean']:.2f} ± {r['std']:.2f}" for k, r in ratios.items())  # type: ignore[index]
                + f"; mean-accuracy gain {p[0]:+.3f}, higher in {p[1]}/{p[2]} seeds",
            )
    # Claims about the plug-in (2, 3 and the rho sweep) mean nothing in a
    # world without reference models: every rho is the same method there.
    plugin = sim.world.references
    # 2. Implicit-only drifts. Measured as selection regret: mean |p - 0.5| of
    # the batch minus that of the best possible batch for the same learner, so
    # that a learner further along (fewer useful tasks left) is not penalized.
    if plugin and "bots-implicit" in methods and "bots" in methods:
        quarter = max(1, sim.steps // 4)

        def regret(r: dict[str, Any], part: slice) -> float:
            return float(np.mean(r["regret"][part]))

        first = slice(0, quarter)
        last = slice(sim.steps - quarter, sim.steps)
        grew = [regret(r, last) - regret(r, first) for r in by_method["bots-implicit"]]
        late = _paired(by_method, "bots-implicit", "bots", lambda r: regret(r, last))
        early_cmp = _paired(by_method, "bots-implicit", "bots", lambda r: regret(r, first))
        assert late is not None and early_cmp is not None
        imp, bots = methods["bots-implicit"], methods["bots"]
        evidence = (
            f"selection regret (batch mean |p - 0.5| above the best possible batch): implicit-only "
            f"{imp['regret_first_quarter']['mean']:.3f} in the first quarter -> {imp['regret_last_quarter']['mean']:.3f} "
            f"in the last (grew in {sum(g > 0 for g in grew)}/{len(grew)} seeds); BOTS defaults "
            f"{bots['regret_first_quarter']['mean']:.3f} -> {bots['regret_last_quarter']['mean']:.3f}; implicit-only worse "
            f"than BOTS in {early_cmp[1]}/{early_cmp[2]} seeds early and {late[1]}/{late[2]} late"
        )
        if "posterior_error" in imp and "posterior_error" in bots:
            err, bots_err = imp["posterior_error"]["mean"], bots["posterior_error"]["mean"]
            evidence += (
                f"; pool-wide posterior error |mean - p| at the end {err[-1]:.3f} vs BOTS {bots_err[-1]:.3f} "
                f"(implicit-only's lowest {min(err):.3f} at step {imp['posterior_error']['steps'][int(np.argmin(err))]})"
            )
        evidence += (
            f"; mean accuracy over training: implicit-only {imp['mean_accuracy']['mean']:.4f}, "
            f"BOTS {bots['mean_accuracy']['mean']:.4f}"
        )
        add(
            "implicit-only (rho=1) drifts: its selections get worse over training and end worse than BOTS defaults' "
            "(selection regret grows and exceeds BOTS's in the last quarter)",
            float(np.mean(grew)) > 0 and late[0] > 0,
            evidence,
        )
    # 3. Explicit-only starts slowly.
    if plugin and "bots-explicit" in methods and "bots" in methods:
        p_inf = _paired(by_method, "bots", "bots-explicit", lambda r: float(np.mean(r["informative"][:early])))
        p_acc = _paired(by_method, "bots", "bots-explicit", lambda r: r["accuracy"][early])
        if p_inf is not None and p_acc is not None:
            add(
                f"explicit-only (rho=0) starts slowly: fewer useful groups and lower accuracy in the first {early} steps",
                p_inf[0] > 0 and p_acc[0] > 0,
                f"first {early} steps: BOTS informative share {methods['bots']['informative_early']['mean']:.3f} vs "
                f"explicit-only {methods['bots-explicit']['informative_early']['mean']:.3f} "
                f"(higher in {p_inf[1]}/{p_inf[2]} seeds); accuracy at step {early}: {p_acc[0]:+.4f} "
                f"(higher in {p_acc[1]}/{p_acc[2]} seeds)",
            )
    # 4. A moderate lambda beats both extremes; the same for rho.
    for sweep, symbol in ((LAMBDA_SWEEP, "lambda"), (RHO_SWEEP, "rho")):
        present = [(name, value) for name, value in sweep if name in methods]
        if len(present) < 3 or (symbol == "rho" and not plugin):
            continue
        scores = {name: methods[name]["mean_accuracy"]["mean"] for name, _ in present}
        low, high = present[0], present[-1]
        moderate = [(n, v) for n, v in present[1:-1]]
        best_name, best_value = max(moderate, key=lambda nv: scores[nv[0]])
        p_low = _paired(by_method, best_name, low[0], auc)
        p_high = _paired(by_method, best_name, high[0], auc)
        assert p_low is not None and p_high is not None
        add(
            f"a moderate {symbol} beats both extremes ({symbol}={low[1]} and {symbol}={high[1]})",
            scores[best_name] > scores[low[0]] and scores[best_name] > scores[high[0]],
            "mean held-out accuracy over training: "
            + ", ".join(f"{symbol}={v}: {scores[n]:.4f}" for n, v in present)
            + f"; best moderate {symbol}={best_value} beats {symbol}={low[1]} in {p_low[1]}/{p_low[2]} seeds "
            f"and {symbol}={high[1]} in {p_high[1]}/{p_high[2]}",
        )
    # 5. The oracle bounds every method.
    if "oracle" in methods:
        best_other = max((n for n in methods if n != "oracle"), key=lambda n: methods[n]["mean_accuracy"]["mean"])
        add(
            "the oracle is the best (a sanity check of the simulator)",
            methods["oracle"]["mean_accuracy"]["mean"] >= methods[best_other]["mean_accuracy"]["mean"],
            f"oracle mean accuracy {methods['oracle']['mean_accuracy']['mean']:.4f}, best other "
            f"{best_other} {methods[best_other]['mean_accuracy']['mean']:.4f}",
        )
    return claims


def _fmt(stats: dict[str, Any] | None, digits: int = 3, budget_marker: bool = False) -> str:
    if stats is None or stats.get("mean") is None:
        return "not reached"
    text = f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"
    if budget_marker and stats.get("censored"):
        text += f" ({stats['censored']} not reached)"
    return text


def markdown(summary: dict[str, Any], sim: SimConfig, info: dict[str, Any], backend: str) -> str:
    """One world's tables and claims."""
    methods = summary["methods"]
    n_seeds = len(next(iter(methods.values()))["seeds"])
    corr = summary.get("reference_correlation") or {}
    if corr.get("weak") and corr.get("strong"):
        refs = (
            f"reference models' pass rates correlate {corr['weak']['mean']:.2f} ± {corr['weak']['std']:.2f} (weak) and "
            f"{corr['strong']['mean']:.2f} ± {corr['strong']['std']:.2f} (strong) with the learner's initial ones"
        )
    else:
        refs = "no reference models"
    lines = [
        f"### World `{summary['world']}`",
        "",
        (
            f"{sim.world.num_tasks} training tasks, {sim.world.num_skills} skills, batch {sim.batch_size} tasks x "
            f"{sim.rollouts} rollouts, {sim.steps} steps, {n_seeds} seeds (mean ± std), backend {backend}; {refs}."
        ),
        f"Machine: {common.machine_line(info)}.",
        "",
        (
            f"| method | start acc | final acc | mean acc | informative groups | acc @ step {max(1, sim.steps // 10)} "
            "| rollouts (k) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for e in methods.values():
        lines.append(
            f"| {e['label']} | {_fmt(e['start_accuracy'])} | {_fmt(e['final_accuracy'])} | {_fmt(e['mean_accuracy'])} | "
            f"{_fmt(e['informative'], 2)} | {_fmt(e['accuracy_early'])} | {e['rollouts_total']['mean'] / 1000:.0f} |"
        )
    keys = list(next(iter(methods.values()))["targets"].keys())
    header = "| method | " + " | ".join(f"acc {k}" for k in keys) + " |"
    rule = "|---|" + "---|" * len(keys)
    lines += [
        "",
        f"Steps to each held-out accuracy gain over the start: mean ± std over all {n_seeds} seeds, a miss counted "
        f"at the budget ({sim.steps}; '≥' and the number of misses when some seeds missed):",
        "",
        header,
        rule,
    ]
    for e in methods.values():
        cells = []
        for k in keys:
            t = e["targets"][k]
            at_budget = [sim.steps if v is None else v for v in t["steps"]]
            missed = len(at_budget) - t["reached"]
            cell = f"{np.mean(at_budget):.0f} ± {np.std(at_budget, ddof=1) if len(at_budget) > 1 else 0:.0f}"
            cells.append(f"≥{cell} ({missed} missed)" if missed else cell)
        lines.append(f"| {e['label']} | " + " | ".join(cells) + " |")
    for base in ("uniform", "oracle", *(["bots"] if any(m.startswith("bots-embed") for m in methods) else [])):
        if base not in methods:
            continue
        lines += [
            "",
            f"Steps relative to {base}, per seed (a miss at the budget; 'b' = how many seeds' ratios are bounds "
            "because one side missed), mean ± std:",
            "",
            header,
            rule,
        ]
        for name, e in methods.items():
            if name == base:
                continue
            cells = []
            for k in keys:
                r = e["targets"][k].get(f"ratio_to_{base}")
                if r is None or r["mean"] is None:
                    cells.append("-")
                else:
                    cells.append(f"{r['mean']:.2f} ± {r['std']:.2f}" + (f" ({r['bounds']}b)" if r["bounds"] else ""))
            lines.append(f"| {e['label']} | " + " | ".join(cells) + " |")
    lines += _over_targets(methods, keys)
    lines += ["", "Claims:", ""]
    for c in summary["claims"]:
        verdict = "HELD" if c["held"] else "DID NOT HOLD"
        lines.append(f"- **{verdict}**: {c['claim']}. {c['evidence']}.")
    return "\n".join(lines) + "\n"


def _over_targets(methods: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """Each seed's ratio averaged over the targets, then mean ± standard
    error over the seeds, against each baseline present."""
    bases = [b for b in ("uniform", "bots") if b in methods]
    if not bases:
        return []
    lines = [
        "",
        "Per seed, the ratio averaged over the targets (a miss at the budget); mean ± standard error over seeds:",
        "",
        "| method | " + " | ".join(f"vs {b}" for b in bases) + " |",
        "|---|" + "---|" * len(bases),
    ]
    for name, e in methods.items():
        cells = []
        for base in bases:
            per_target = [e["targets"][k].get(f"ratio_to_{base}") for k in keys]
            if name == base or any(r is None or not r["per_seed"] for r in per_target):
                cells.append("-")
                continue
            per_seed = np.mean([r["per_seed"] for r in per_target if r is not None], axis=0)
            error = per_seed.std(ddof=1) / math.sqrt(per_seed.size) if per_seed.size > 1 else 0.0
            cells.append(f"{per_seed.mean():.3f} ± {error:.3f} ({per_seed.size} seeds)")
        lines.append(f"| {e['label']} | " + " | ".join(cells) + " |")
    return lines


# -- plots ---------------------------------------------------------------------------------


def plot(runs: list[dict[str, Any]], summary: dict[str, Any], sim: SimConfig, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_method.setdefault(r["method"], []).append(r)
    main = [m.name for m in (*MAIN, *ENGINES) if m.name in by_method]
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = dict(zip(main, palette * 3, strict=False))
    styles = {name: ("--" if i >= len(palette) else "-") for i, name in enumerate(main)}
    suffix = f"_{sim.world_name}"
    written = []

    def band(ax: Any, x: np.ndarray, ys: np.ndarray, name: str, label: str) -> None:
        mean, std = ys.mean(axis=0), ys.std(axis=0)
        ax.plot(x, mean, label=label, color=colors.get(name), ls=styles.get(name, "-"))
        ax.fill_between(x, mean - std, mean + std, alpha=0.15, color=colors.get(name))

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for name in main:
        rs = by_method[name]
        # Gains over each seed's start, the quantity the step targets are defined on.
        acc = np.array([r["accuracy"] for r in rs])
        acc = acc - acc[:, :1]
        band(axes[0], np.arange(acc.shape[1]), acc, name, METHODS[name].label)
        rollouts = np.array([r["rollouts"] for r in rs]) / 1000
        mean_x = rollouts.mean(axis=0)
        band(axes[1], mean_x, acc, name, METHODS[name].label)
    for t in sim.gains:
        for ax in axes:
            ax.axhline(t, color="grey", lw=0.5, ls=":")
    title = f"world {sim.world_name}: "
    axes[0].set(
        xlabel="training step",
        ylabel="held-out accuracy gain over the start",
        title=title + "gain vs steps (mean ± std)",
    )
    axes[1].set(xlabel="rollouts (thousands)", ylabel="held-out accuracy gain", title=title + "gain vs rollouts")
    axes[1].set_xlim(0, sim.steps * sim.batch_size * sim.rollouts / 1000 * 1.05)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out_dir / f"sim_accuracy{suffix}.png"))

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    window = max(1, sim.steps // 20)
    for name in main:
        inf = np.array([r["informative"] for r in by_method[name]])
        smooth = np.array([np.convolve(row, np.ones(window) / window, mode="valid") for row in inf])
        band(axes[0], np.arange(smooth.shape[1]) + window, smooth, name, METHODS[name].label)
        if "posterior_error" in summary["methods"].get(name, {}):
            pe = summary["methods"][name]["posterior_error"]
            axes[1].errorbar(
                pe["steps"], pe["mean"], yerr=pe["std"], label=METHODS[name].label, color=colors.get(name), capsize=2
            )
    axes[0].set(
        xlabel="training step",
        ylabel="share of rollout groups with signal",
        title=f"informative groups (0 < k < m), moving average over {window} steps",
    )
    axes[1].set(
        xlabel="training step", ylabel="mean |posterior mean - true p|", title="posterior error over the pool (drift)"
    )
    axes[0].legend(fontsize=7, loc="lower left")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out_dir / f"sim_signal_drift{suffix}.png"))

    sweeps = [
        (s, sym)
        for s, sym in ((LAMBDA_SWEEP, "lambda (forgetting)"), (RHO_SWEEP, "rho (implicit weight)"))
        if all(n in summary["methods"] for n, _ in s)
    ]
    if sweeps:
        fig, axes = plt.subplots(1, len(sweeps), figsize=(6.5 * len(sweeps), 4.5), squeeze=False)
        for ax, (sweep, symbol) in zip(axes[0], sweeps, strict=True):
            # Each curve with the baselines' value of the same quantity.
            for key, label, ls in (
                ("mean_accuracy", "mean accuracy over training", ":"),
                ("final_accuracy", "final accuracy", "--"),
            ):
                means = [summary["methods"][n][key]["mean"] for n, _ in sweep]
                stds = [summary["methods"][n][key]["std"] for n, _ in sweep]
                ax.errorbar([str(v) for _, v in sweep], means, yerr=stds, marker="o", capsize=3, label=label)
                for name in ("uniform", "oracle"):
                    if name in summary["methods"]:
                        ax.axhline(
                            summary["methods"][name][key]["mean"],
                            ls=ls,
                            color=colors.get(name),
                            label=f"{name}: {label}",
                        )
            ax.set(xlabel=symbol, ylabel="held-out accuracy", title=f"BOTS: sweep of {symbol}")
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"sim_ablations{suffix}.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, 150 steps, 1500 tasks, no ablations")
    plain = ",".join(name for name, world in WORLDS.items() if world.embeddings == "none")
    parser.add_argument(
        "--worlds",
        default=plain,
        help=f"comma-separated worlds of bench/simmodel.py, of {','.join(WORLDS)} (default {plain}; the embedding "
        "worlds with --methods uniform,bots,bots-embed,oracle)",
    )
    parser.add_argument(
        "--ablation-worlds", default="good", help="worlds where the lambda and rho sweeps run (default good)"
    )
    parser.add_argument("--seeds", type=int, default=5, help="number of seeds (worlds); default 5")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 600)")
    parser.add_argument("--tasks", type=int, default=None, help="training pool size (default 3000)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--methods", default="", help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--no-ablations", action="store_true", help="skip the lambda and rho sweeps")
    parser.add_argument(
        "--backend",
        choices=("grpc", "local"),
        default="grpc",
        help="grpc: a real server (default); local: the engine in-process",
    )
    parser.add_argument(
        "--target", default=None, help="address of a running server (default: start one on a scratch SQLite file)"
    )
    parser.add_argument(
        "--db", default=None, help="database URL for the server started here (default: SQLite on tmpfs)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="runs in flight at once against the server")
    parser.add_argument("--out", default=str(common.RESULTS), help="directory for simulate.json, simulate.md and plots")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="re-summarize and re-plot the runs of an earlier simulate.json instead of running",
    )
    parser.add_argument(
        "--world",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a WorldConfig field (bench/simmodel.py), e.g. --world idiosyncrasy_sd=1.5; repeatable",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    worlds = [w for w in args.worlds.split(",") if w]
    unknown_worlds = [w for w in worlds if w not in WORLDS]
    if unknown_worlds or not worlds:
        raise SystemExit(f"--worlds: unknown {unknown_worlds}; expected some of {list(WORLDS)}")
    steps = SimConfig.steps
    seeds = args.seeds
    if args.quick:
        steps, seeds = 150, min(seeds, 2)
    overrides: dict[str, Any] = {}
    if args.quick:
        overrides.update(num_tasks=1500, num_heldout=500)
    if args.tasks:
        overrides["num_tasks"] = args.tasks
    kinds = {f.name: f.type for f in dataclasses.fields(WorldConfig)}
    for override in args.world:
        field_name, _, value = override.partition("=")
        if field_name not in kinds or not value:
            raise SystemExit(f"--world {override!r}: expected FIELD=VALUE with FIELD one of {sorted(kinds)}")
        kind = kinds[field_name]
        overrides[field_name] = int(value) if kind == "int" else (value == "true" if kind == "bool" else float(value))
    sims = {
        name: SimConfig(
            world=dataclasses.replace(WORLDS[name], **overrides),
            batch_size=args.batch_size,
            rollouts=args.rollouts,
            steps=args.steps or steps,
            world_name=name,
        )
        for name in worlds
    }
    if args.methods:
        unknown = [m for m in args.methods.split(",") if m not in METHODS]
        if unknown:
            raise SystemExit(f"unknown methods {unknown}; expected some of {list(METHODS)}")
        methods = [METHODS[m] for m in args.methods.split(",")]
    else:
        methods = list(MAIN) + list(ENGINES)
    ablation_worlds = [] if args.no_ablations or args.quick or args.methods else args.ablation_worlds.split(",")
    out = Path(args.out)
    if args.from_json:
        earlier = json.loads(Path(args.from_json).read_text())
        sims = {name: _sim_from_dict(d) for name, d in earlier["sims"].items()}
        return _finish(
            earlier["runs"], sims, earlier["machine"], earlier["backend"], earlier["seconds"], out, args.no_plots
        )
    jobs = []
    for name, sim in sims.items():
        world_methods = methods + (list(ABLATIONS) if name in ablation_worlds else [])
        for method in world_methods:
            if method.kind == "band" and not sim.world.references:
                continue  # nothing to filter on
            jobs += [(method, seed, sim) for seed in range(seeds)]
    info = common.machine_info()
    print(f"simulating {len(jobs)} runs ({', '.join(sims)}), {steps} steps, backend {args.backend}", file=sys.stderr)
    started = time.perf_counter()
    server = None
    scratch = None
    try:
        target = args.target
        if args.backend == "grpc" and target is None:
            scratch = common.scratch_dir()
            server = common.server_process(args.db or f"sqlite:///{scratch}/simulate.db").start()
            target = server.address
        runs = asyncio.run(run_all(jobs, target if args.backend == "grpc" else None, args.concurrency, True))
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - started
    return _finish(runs, sims, info, args.backend, elapsed, out, args.no_plots)


def _finish(
    runs: list[dict[str, Any]],
    sims: dict[str, SimConfig],
    info: dict[str, Any],
    backend: str,
    elapsed: float,
    out: Path,
    no_plots: bool,
) -> int:
    summaries: dict[str, Any] = {}
    texts = []
    for name, sim in sims.items():
        world_runs = [r for r in runs if r.get("world", "good") == name]
        present = list(dict.fromkeys(r["method"] for r in world_runs))
        methods = [m for m in METHODS.values() if m.name in present]
        summaries[name] = summarize(world_runs, sim, methods)
        texts.append(markdown(summaries[name], sim, info, backend))
    text = "\n".join(texts) + f"\nWall time of the whole run: {elapsed:.0f} s.\n"
    print(text)
    print(f"({elapsed:.0f} s)", file=sys.stderr)
    common.write_json(
        out / "simulate.json",
        {
            "machine": info,
            "backend": backend,
            "seconds": elapsed,
            "sims": {name: dataclasses.asdict(sim) for name, sim in sims.items()},
            "summaries": summaries,
            "runs": [_rounded(r) for r in runs],
        },
        indent=None,
    )
    (out / "simulate.md").write_text(text)
    if not no_plots:
        for name, sim in sims.items():
            world_runs = [r for r in runs if r.get("world", "good") == name]
            for path in plot(world_runs, summaries[name], sim, out):
                print(f"wrote {path}", file=sys.stderr)
    return 0


def _rounded(run: dict[str, Any]) -> dict[str, Any]:
    """Per-step series with 6 significant decimals (the JSON stays small)."""

    def r(x: Any) -> Any:
        if isinstance(x, float):
            return round(x, 6)
        if isinstance(x, (list, tuple)):
            return [r(v) for v in x]
        return x

    return {k: r(v) for k, v in run.items()}


def _sim_from_dict(d: dict[str, Any]) -> SimConfig:
    fields = {**d, "world": WorldConfig(**d["world"]), "band": tuple(d["band"]), "gains": tuple(d["gains"])}
    return SimConfig(**fields)


if __name__ == "__main__":
    sys.exit(main())
