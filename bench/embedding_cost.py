"""What the cross-task prediction (embedding_weight) costs a step, in-process.

On a pool of --tasks tasks with --dim-dimensional embeddings, after --warm
steps of reports, each repetition times on the same state and generator
seed, alternating which goes first: a select of --batch tasks with the
prediction off and on, and an update (one batch's outcomes) off and on.
Reported: median, interquartile range and min-max of each, and the median of
the per-repetition ratios (on / off).

    OPENBLAS_NUM_THREADS=1 nice .venv/bin/python -m bench.embedding_cost [--tasks 100000] [--dim 256] [--reps 15]

OPENBLAS_NUM_THREADS=1: on a machine whose cores are all busy, OpenBLAS's
worker threads wait for each other and a small product takes a hundred times
longer; one thread measures the arithmetic.

Writes bench/results/embedding-cost.json and .md.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, machine_info, machine_line, write_json
from bots_server.engine import EngineParams, PosteriorState, apply_outcomes, select, step_rng


def _states(tasks: int, dim: int, batch: int, warm: int) -> dict[str, tuple[EngineParams, PosteriorState]]:
    """The same reports applied with the prediction off and on."""
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(tasks, dim)).astype(np.float32)
    truth = 1 / (1 + np.exp(-(embeddings[:, :8].sum(axis=1) / 2)))
    nan = np.full(tasks, np.nan)
    out = {}
    for name, weight in (("off", 0.0), ("on", 16.0)):
        params = EngineParams(embedding_weight=weight)
        state = PosteriorState.from_prior(params, nan, nan, embeddings=embeddings)
        outcomes = np.random.default_rng(1)
        for step in range(warm):
            idx = np.sort(select(params, state.alpha, state.beta, np.ones(tasks, bool), batch, step_rng(0, step, "w")))
            k = outcomes.binomial(16, truth[idx]).astype(np.float64)
            state = apply_outcomes(params, state, idx, k, np.full(batch, 16.0)).state
        out[name] = (params, state)
    return out


def _time(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure(tasks: int, dim: int, batch: int, warm: int, reps: int) -> dict[str, Any]:
    states = _states(tasks, dim, batch, warm)
    available = np.ones(tasks, bool)
    idx = np.arange(0, tasks, tasks // batch)[:batch]
    k = np.full(batch, 8.0)
    n = np.full(batch, 16.0)
    calls: dict[str, dict[str, Callable[[], Any]]] = {"select": {}, "update": {}}
    for name, (params, state) in states.items():
        calls["select"][name] = lambda p=params, s=state: select(
            p, s.alpha, s.beta, available, batch, step_rng(0, 9, "t")
        )
        calls["update"][name] = lambda p=params, s=state: apply_outcomes(p, s, idx, k, n)
    result: dict[str, Any] = {}
    for what, pair in calls.items():
        seconds: dict[str, list[float]] = {"off": [], "on": []}
        for rep in range(reps):
            order = ("off", "on") if rep % 2 == 0 else ("on", "off")
            for name in order:
                seconds[name].append(_time(pair[name]))
        ratios = [b / a for a, b in zip(seconds["off"], seconds["on"], strict=True)]
        result[what] = {
            "off_ms": _spread(seconds["off"]),
            "on_ms": _spread(seconds["on"]),
            "ratio_median": float(np.median(ratios)),
        }
    return result


def markdown(result: dict[str, Any], args: argparse.Namespace, info: dict[str, Any]) -> str:
    lines = [
        "## Cost of the cross-task prediction",
        "",
        f"`OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')} nice .venv/bin/python -m "
        f"bench.embedding_cost --tasks {args.tasks} --dim {args.dim} --reps {args.reps}`: "
        f"{args.tasks} tasks with {args.dim}-dimensional embeddings, batch {args.batch}, after {args.warm} steps "
        f"of reports; {args.reps} repetitions, off and on alternating which goes first.",
        "",
        machine_line(info),
        "",
        "| call | off: median ms (IQR) [min-max] | on: median ms (IQR) [min-max] | median ratio on/off |",
        "|---|---|---|---|",
    ]
    for what, row in result.items():
        cells = [_cell(row["off_ms"]), _cell(row["on_ms"])]
        lines.append(f"| {what} | {cells[0]} | {cells[1]} | {row['ratio_median']:.2f} |")
    return "\n".join(lines) + "\n"


def _spread(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    p25, p50, p75 = np.percentile(ms, [25, 50, 75])
    return {"p25": float(p25), "p50": float(p50), "p75": float(p75), "min": float(ms.min()), "max": float(ms.max())}


def _cell(p: dict[str, float]) -> str:
    return f"{p['p50']:.1f} ({p['p25']:.1f}-{p['p75']:.1f}) [{p['min']:.1f}-{p['max']:.1f}]"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embedding_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS / "embedding-cost"))
    args = parser.parse_args(argv)
    info = machine_info()
    result = measure(args.tasks, args.dim, args.batch, args.warm, args.reps)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), {"machine": info, "args": vars(args), "result": result})
    text = markdown(result, args, info)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
