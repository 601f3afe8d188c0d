"""The engine's step in-process: select and update, fast paths against the
reference (the engine before them, kept in bench/reference_engine.py,
which checks that both give the same bits).

Each repetition times the reference and the engine on the same state and
the same generator seed, alternating which goes first, and checks that their
answers agree. Reported per pool size: median, interquartile range and
min-max of each, and the median of the per-repetition ratios.

    nice python -m bench.engine [--sizes 10000 100000 1000000] [--reps 21] [--batch 256]

Writes bench/results/engine.json and engine.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, machine_info, machine_line, percentiles, write_json
from bench.reference_engine import ref_apply_outcomes, ref_select, ref_top_k
from bots_server.engine import EngineParams, PosteriorState, UpdateResult, apply_outcomes, scoring, select

# A call under test: (posterior, generator seed) -> something comparable.
Call = Callable[[PosteriorState, int], Any]


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    reference: Call
    engine: Call
    # False only for a candidate that changes the random stream: timed for
    # comparison, not used by the engine.
    same_answer: bool = True


def posterior(n: int, seed: int) -> PosteriorState:
    """A posterior some steps into a run: spread-out Beta parameters, both
    reference features on 90% of the tasks, a capability estimate (so the
    update takes its implicit-evidence path)."""
    rng = np.random.default_rng(seed)
    weak = rng.random(n) * 0.6
    strong = np.minimum(weak + rng.random(n) * 0.4, 1.0)
    weak[rng.random(n) < 0.1] = np.nan
    return PosteriorState(rng.gamma(2.0, 4.0, n) + 0.5, rng.gamma(2.0, 4.0, n) + 0.5, weak, strong, 0.4)


def cases(batch: int, state: PosteriorState) -> list[Case]:
    scores = state.alpha / (state.alpha + state.beta)  # for top_k alone: any scores, the same for both
    default = EngineParams()
    mean = EngineParams(selection_mode="mean")
    candidates = EngineParams(candidate_ratio=8.0)
    extras = EngineParams(track_prediction=0.5, implicit_reliability=1.0, adaptive_rho_error=0.25)

    def selecting(params: EngineParams, chooser: Callable[..., np.ndarray], leased: float = 0.0) -> Call:
        available = np.random.default_rng(0).random(state.num_tasks) >= leased

        def call(state: PosteriorState, seed: int) -> list[int]:
            return chooser(params, state.alpha, state.beta, available, batch, np.random.default_rng(seed)).tolist()

        return call

    def ranking(top_k: Callable[..., np.ndarray]) -> Call:
        def call(state: PosteriorState, seed: int) -> list[int]:
            return top_k(scores, batch, np.random.default_rng(seed)).tolist()

        return call

    def updating(params: EngineParams, apply: Callable[..., UpdateResult]) -> Call:
        def call(state: PosteriorState, seed: int) -> UpdateResult:
            rng = np.random.default_rng(seed)
            tasks = rng.choice(state.num_tasks, size=batch, replace=False)
            trials = np.full(batch, 16.0)
            successes = rng.integers(0, 17, batch).astype(np.float64)
            return apply(params, state, tasks, successes, trials)

        return call

    def drawing(state: PosteriorState, seed: int) -> str:
        draw = np.random.default_rng(seed).beta(state.alpha, state.beta)
        return hashlib.sha256(draw.data).hexdigest()

    def drawing_float32(state: PosteriorState, seed: int) -> str:
        """Beta(a, b) as X / (X + Y), X, Y float32 gamma draws: another stream."""
        rng = np.random.default_rng(seed)
        x = rng.standard_gamma(state.alpha.astype(np.float32), dtype=np.float32)
        y = rng.standard_gamma(state.beta.astype(np.float32), dtype=np.float32)
        return hashlib.sha256((x / (x + y)).data).hexdigest()

    return [
        Case("beta_draw", "Beta draw alone (rng.beta, unchanged: the same call on both sides)", drawing, drawing),
        Case(
            "beta_draw_float32",
            "not used: rng.beta against float32 gamma draws (another random stream)",
            drawing,
            drawing_float32,
            same_answer=False,
        ),
        Case(
            "select", "select, thompson (Beta draw + top-k)", selecting(default, ref_select), selecting(default, select)
        ),
        Case(
            "select_mean",
            "select, mean mode (no draw: top-k dominates)",
            selecting(mean, ref_select),
            selecting(mean, select),
        ),
        Case(
            "select_leased",
            "select, mean mode, 5% of the tasks leased (not available)",
            selecting(mean, ref_select, leased=0.05),
            selecting(mean, select, leased=0.05),
        ),
        Case(
            "select_candidates",
            "select, thompson, MoPPS candidates (candidate_ratio 8)",
            selecting(candidates, ref_select),
            selecting(candidates, select),
        ),
        Case("top_k", "top-k alone", ranking(ref_top_k), ranking(scoring.top_k)),
        Case(
            "update", "update, default BOTS", updating(default, ref_apply_outcomes), updating(default, apply_outcomes)
        ),
        Case(
            "update_extras",
            "update, track_prediction + implicit_reliability + adaptive rho",
            updating(extras, ref_apply_outcomes),
            updating(extras, apply_outcomes),
        ),
    ]


def timed(call: Call, state: PosteriorState, seed: int) -> tuple[float, float, str]:
    """Wall and CPU seconds of the call, and a digest of its answer taken
    outside the timing (hashing, not copying: a copy would allocate fresh
    pages, which are slow to fault in on this machine kind). The CPU time
    shows the work when other processes share the cores (under `nice`, wall
    time includes the time the scheduler gives them)."""
    started, cpu = time.perf_counter(), time.process_time()
    result = call(state, seed)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    return seconds, cpu_seconds, digest(result)


def digest(result: Any) -> str:
    """The bits of a batch or of an update's posterior and capability."""
    hashed = hashlib.sha256()
    if isinstance(result, UpdateResult):
        hashed.update(result.state.alpha.data)
        hashed.update(result.state.beta.data)
        hashed.update(struct.pack("<dd", result.state.capability, result.capability_estimate))
    else:
        hashed.update(repr(result).encode())
    return hashed.hexdigest()


def spread(seconds: list[float]) -> dict[str, float]:
    """percentiles() plus min and the quartiles, in milliseconds."""
    ms = np.asarray(seconds) * 1e3
    p25, p75 = np.percentile(ms, [25, 75])
    return {**percentiles(seconds), "min": float(ms.min()), "p25": float(p25), "p75": float(p75)}


def measure(case: Case, state: PosteriorState, reps: int) -> dict[str, Any]:
    """Alternating reference and engine, same seed per repetition; two
    untimed warm-ups of each first."""
    wall: dict[str, list[float]] = {"reference": [], "engine": []}
    cpu: dict[str, list[float]] = {"reference": [], "engine": []}
    for rep in range(-2, reps):
        order = [("reference", case.reference), ("engine", case.engine)]
        if rep % 2:
            order.reverse()
        digests = {}
        for label, call in order:
            seconds, cpu_seconds, digests[label] = timed(call, state, rep + 2)
            if rep >= 0:
                wall[label].append(seconds)
                cpu[label].append(cpu_seconds)
        if case.same_answer and digests["reference"] != digests["engine"]:
            raise AssertionError(f"{case.name}: the engine and the reference disagree at repetition {rep}")
    ratios = np.asarray(wall["reference"]) / np.asarray(wall["engine"])
    return {
        "reference_ms": spread(wall["reference"]),
        "engine_ms": spread(wall["engine"]),
        "reference_cpu_ms": spread(cpu["reference"]),
        "engine_cpu_ms": spread(cpu["engine"]),
        "speedup_median_of_ratios": float(np.median(ratios)),
        "speedup_ratio_min_max": [float(ratios.min()), float(ratios.max())],
        "cpu_speedup_ratio_of_medians": float(np.median(cpu["reference"]) / np.median(cpu["engine"])),
    }


def cell(ms: dict[str, float]) -> str:
    return f"{ms['p50']:.2f} ({ms['p25']:.2f}-{ms['p75']:.2f}; {ms['min']:.2f}-{ms['max']:.2f})"


def markdown(out: dict[str, Any]) -> str:
    lines = [
        "# Engine step in-process: fast paths vs the reference",
        "",
        f"Machine: {machine_line(out['machine'])}; load at end {out['loadavg_at_end']}.",
        f"Command: `{out['command']}`. Batch {out['batch']}, {out['reps']} interleaved repetitions per cell "
        "(alternating which goes first); both answers compared every repetition (identical), except in the row "
        "marked not used, which draws another random stream.",
        "",
        "| case | pool | reference wall ms: median (IQR; min-max) | engine wall ms | wall speedup: median of ratios (min-max) "
        "| CPU ms medians: reference / engine (ratio) |",
        "|---|---|---|---|---|---|",
    ]
    for row in out["rows"]:
        r, e = row["reference_ms"], row["engine_ms"]
        lo, hi = row["speedup_ratio_min_max"]
        rc, ec = row["reference_cpu_ms"]["p50"], row["engine_cpu_ms"]["p50"]
        lines.append(
            f"| {row['what']} | {row['pool']:,} | {cell(r)} | {cell(e)} "
            f"| {row['speedup_median_of_ratios']:.1f}x ({lo:.1f}-{hi:.1f}) "
            f"| {rc:.2f} / {ec:.2f} ({row['cpu_speedup_ratio_of_medians']:.1f}x) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out", default=str(RESULTS / "engine.json"))
    args = parser.parse_args(argv)
    out: dict[str, Any] = {
        "machine": machine_info(),
        "command": f"nice python -m bench.engine --sizes {' '.join(map(str, args.sizes))} --reps {args.reps} --batch {args.batch}",
        "batch": args.batch,
        "reps": args.reps,
        "rows": [],
    }
    for n in args.sizes:
        state = posterior(n, seed=n)
        for case in cases(args.batch, state):
            row = {"case": case.name, "what": case.what, "pool": n, **measure(case, state, args.reps)}
            out["rows"].append(row)
            print(
                f"{case.name:14s} n={n:>9,}  reference {row['reference_ms']['p50']:8.2f} ms  "
                f"engine {row['engine_ms']['p50']:8.2f} ms  x{row['speedup_median_of_ratios']:.1f}",
                flush=True,
            )
    out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path = Path(args.out)
    write_json(path, out)
    path.with_suffix(".md").write_text(markdown(out))
    print(markdown(out))


if __name__ == "__main__":
    main()
