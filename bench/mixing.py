"""A two-dataset world: what group shares do to steps-to-target.

The learning-dynamics world of bench/simmodel.py, its tasks split into two
datasets by skill: "big" (skills 0-5, about 3/4 of the pool) and "small"
(skills 6-7, about 1/4). The goal is a balanced one, as when a run mixes
datasets to do well on each: the mean of the two datasets' held-out
accuracies. Each method runs the server's engine in-process (BOTS, reference
features, Thompson selection; the same seeding as the server) and differs
only in the shares: none, the natural proportion (0.75 / 0.25), or equal
shares (0.5 / 0.5). Same worlds (seeds) for every method, so the comparison
is paired.

    python -m bench.mixing [--seeds 8] [--steps 400] [--out bench/results/mixing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.simmodel import Learner, World, WorldConfig, sigmoid
from bots_server.engine import EngineParams, PosteriorState, apply_outcomes, select, step_rng
from bots_server.engine.quotas import GroupQuotas

SMALL_SKILLS = (6, 7)
BATCH = 32
ROLLOUTS = 16


@dataclass(frozen=True)
class Method:
    name: str
    shares: tuple[float, float] | None  # (big, small) fixed shares; None: no quotas


METHODS = (
    Method("no shares", None),
    Method("natural 0.75/0.25", (0.75, 0.25)),
    Method("equal 0.5/0.5", (0.5, 0.5)),
)


def dataset_accuracies(world: World, theta: np.ndarray) -> tuple[float, float]:
    """Expected held-out accuracy on the big and the small dataset."""
    p = sigmoid(world.heldout_discrimination * (theta[world.heldout_skill] - world.heldout_difficulty) + world.heldout_affinity)
    small = np.isin(world.heldout_skill, SMALL_SKILLS)
    return float(p[~small].mean()), float(p[small].mean())


def run(world: World, method: Method, seed: int, steps: int) -> list[float]:
    """The balanced accuracy after each step."""
    params = EngineParams(rollouts_per_task=ROLLOUTS)
    state = PosteriorState.from_prior(params, world.weak_ref.astype(np.float64), world.strong_ref.astype(np.float64))
    group_of = np.isin(world.skill, SMALL_SKILLS).astype(np.int64)  # 0 big, 1 small
    quotas = None
    if method.shares is not None:
        shares = np.array(method.shares)
        quotas = GroupQuotas(group_of, shares, shares)
    learner = Learner(world)
    rollout_rng = np.random.default_rng([seed, 7])
    available = np.ones(world.num_tasks, dtype=bool)
    balanced = []
    for step in range(steps):
        idx = select(params, state.alpha, state.beta, available, BATCH, step_rng(seed, step, f"step-{step}"), quotas)
        successes = learner.rollout(idx, ROLLOUTS, rollout_rng)
        learner.train(idx, successes, ROLLOUTS, BATCH)
        order = np.argsort(idx)
        state = apply_outcomes(
            params, state, idx[order], successes[order].astype(np.float64), np.full(BATCH, float(ROLLOUTS))
        ).state
        balanced.append(float(np.mean(dataset_accuracies(world, learner.theta))))
    return balanced


def first_reach(values: list[float], threshold: float) -> int | None:
    return next((i + 1 for i, v in enumerate(values) if v >= threshold), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--gain", type=float, default=0.15, help="target: the start's balanced accuracy + this")
    parser.add_argument("--out", default="bench/results/mixing.json")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {m.name: [] for m in METHODS}
    for seed in range(args.seeds):
        world = World.generate(WorldConfig(), seed)
        start = float(np.mean(dataset_accuracies(world, world.theta0)))
        target = start + args.gain
        for method in METHODS:
            curve = run(world, method, seed, args.steps)
            results[method.name].append(
                {"seed": seed, "start": start, "target": target, "steps_to_target": first_reach(curve, target),
                 "final": curve[-1]}
            )  # fmt: skip
    baseline = results[METHODS[0].name]
    summary = {}
    for method in METHODS:
        runs = results[method.name]
        reached = [r["steps_to_target"] for r in runs]
        paired = [
            (b["steps_to_target"] or args.steps + 1) - (r["steps_to_target"] or args.steps + 1)
            for r, b in zip(runs, baseline, strict=True)
        ]
        summary[method.name] = {
            "reached": sum(s is not None for s in reached),
            "steps_to_target_median": float(np.median([s if s is not None else np.inf for s in reached])),
            "steps_to_target": reached,
            "fewer_steps_than_no_shares_median": float(np.median(paired)),
            "fewer_steps_than_no_shares_min_max": [int(min(paired)), int(max(paired))],
            "final_balanced_accuracy_mean": float(np.mean([r["final"] for r in runs])),
        }
    info = {
        "command": f"python -m bench.mixing --seeds {args.seeds} --steps {args.steps} --gain {args.gain}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "batch": BATCH,
        "rollouts": ROLLOUTS,
    }
    Path(args.out).write_text(json.dumps({"info": info, "summary": summary, "runs": results}, indent=2) + "\n")
    print(json.dumps({"info": info, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
