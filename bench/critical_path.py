"""The service's time on a trainer's critical path, per step.

A trainer loop drives `BotsSampler` through a `DataLoader`, with a stand-in
for the GPU: each step sleeps `step_s / 2` for the rollouts, reports the
rewards, then sleeps `step_s / 2` for the gradient step. The critical path
is the time the loop spends in the service's calls: drawing the next batch
(`next(loader)`) and `report()`. Synchronous reports (`overlap=False`) and
reports in the background (`overlap=True`, the default: the report and the
next selection run during the gradient step) are measured interleaved, on
forks of one experiment, repeated, at each pool size and step time.

    .venv/bin/python -m bench.critical_path --pools 10000,100000,1000000 --step-s 0.25,1.0
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, database, machine_info, machine_line, server_process, write_json

BATCH = 128  # tasks per step (the GPU measurement: 128 tasks x 8 rollouts)
ROLLOUTS = 8


class _Rows:
    """A map-style dataset of row indices (the trainer's rows)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def run_loop(
    address: str, experiment: str, keys: list[str], *, overlap: bool, steps: int, step_s: float, seed: int
) -> list[float]:
    """One training loop; the critical-path seconds of each step after the
    first (the first draw has nothing to overlap with)."""
    from torch.utils.data import DataLoader

    from bots_client.integrations.torch import BotsSampler

    sampler = BotsSampler(address, experiment, keys, batch_size=BATCH, num_batches=10**9, overlap=overlap,
                          resume=True)  # fmt: skip
    loader = iter(DataLoader(_Rows(len(keys)), batch_size=BATCH, sampler=sampler))
    rng = np.random.default_rng(seed)
    critical: list[float] = []
    for step in range(steps):
        started = time.perf_counter()
        rows = next(loader)
        in_service = time.perf_counter() - started
        time.sleep(step_s / 2)  # rollouts and rewards
        successes = rng.binomial(ROLLOUTS, 0.4, size=len(rows))
        outcomes = {keys[int(i)]: (float(s), ROLLOUTS) for i, s in zip(rows, successes)}
        started = time.perf_counter()
        sampler.report(outcomes)
        in_service += time.perf_counter() - started
        time.sleep(step_s / 2)  # the gradient step
        if step:
            critical.append(in_service)
    sampler.wait()
    sampler.curriculum.client.close()
    return critical


def measure(pool: int, step_times: Sequence[float], steps: int, repeats: int, backend: str) -> list[dict[str, Any]]:
    import bots_client

    rows: list[dict[str, Any]] = []
    with database(backend) as url:
        server = server_process(url).start()
        try:
            with bots_client.Client(server.address, bulk_timeout=1800) as client:
                base = f"base-{pool}"
                client.create_experiment(base, bots_client.ExperimentConfig(seed=1, rollouts_per_task=ROLLOUTS))
                keys = [f"task-{i:07d}" for i in range(pool)]
                client.add_tasks(base, (bots_client.Task(k) for k in keys))
                for step_s in step_times:
                    samples: dict[bool, list[list[float]]] = {False: [], True: []}
                    for repeat in range(repeats):
                        # Alternate which mode goes first, so drift hits both alike.
                        order = (False, True) if repeat % 2 == 0 else (True, False)
                        for overlap in order:
                            name = f"run-{uuid.uuid4().hex[:8]}"
                            client.fork_experiment(base, name)
                            run = run_loop(
                                server.address, name, keys, overlap=overlap, steps=steps, step_s=step_s, seed=repeat
                            )
                            samples[overlap].append(run)
                            client.delete_experiment(name)
                    for overlap, runs in samples.items():
                        medians = [statistics.median(r) * 1e3 for r in runs]
                        means = [statistics.fmean(r) * 1e3 for r in runs]
                        p90s = [float(np.percentile(r, 90)) * 1e3 for r in runs]
                        rows.append({
                            "pool": pool, "step_s": step_s, "mode": "overlap" if overlap else "sync",
                            "median_ms": medians, "mean_ms": means, "p90_ms": p90s,
                            "mean_share_of_step": [m / (step_s * 1e3) for m in means],
                        })  # fmt: skip
        finally:
            server.stop()
    return rows


def _spread(values: Sequence[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report_markdown(rows: Sequence[dict[str, Any]], info: dict[str, object], args: argparse.Namespace) -> str:
    lines = [
        "# The service's time on the trainer's critical path",
        "",
        f"{machine_line(info)}",
        "",
        f"`{' '.join(args.argv)}`: {args.backend}, batches of {BATCH} tasks, {args.steps} steps a run "
        f"(the first left out), {args.repeats} runs a mode, modes interleaved. Per step: the time in "
        "`next(loader)` and `report()`; median over a run's steps, then the median (range) over runs.",
        "",
        "| tasks | step | mode | median ms | mean ms | p90 ms | mean share of the step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pool']:,} | {r['step_s']:g} s | {r['mode']} | {_spread(r['median_ms'])} | "
            f"{_spread(r['mean_ms'])} | {_spread(r['p90_ms'])} | {_spread([100 * s for s in r['mean_share_of_step']], 3)} % |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", default="10000,100000,1000000")
    parser.add_argument("--step-s", default="0.25,1.0", help="stand-in GPU step times, seconds")
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="sqlite", choices=["sqlite", "postgresql"])
    parser.add_argument("--output", default=str(RESULTS / "critical-path"), help="path without suffix (.json, .md)")
    args = parser.parse_args(argv)
    args.argv = ["python -m bench.critical_path", *(sys.argv[1:] if argv is None else argv)]
    info = machine_info()
    step_times = [float(s) for s in args.step_s.split(",")]
    rows: list[dict[str, Any]] = []
    for pool in (int(p) for p in args.pools.split(",")):
        rows += measure(pool, step_times, args.steps, args.repeats, args.backend)
    out = Path(args.output)
    write_json(out.with_suffix(".json"), {"machine": info, "args": args.argv, "rows": rows})
    text = report_markdown(rows, info, args)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
