"""More experiments than memory: a server with a small memory budget
(--memory-budget-mb) serving experiments that together need several times
more, against the same workload on a server without a budget.

    .venv/bin/python -m bench.eviction --backend sqlite --experiments 60 --tasks 50000 --budget-mb 200

Phases, per server: create the experiments and add their tasks; then rounds
in which every experiment, in turn, selects a batch and reports it. With a
budget smaller than the experiments, each call finds its experiment evicted
(least recently used first) and rebuilds it from the database: the first
call after an eviction. Reported: resident memory (VmRSS, and the peak
VmHWM) after each phase, the latency of calls that rebuilt versus calls that
found their experiment loaded (medians and spreads), the evictions counted
by the server's metrics, and whether both servers returned the same batches.
Written to bench/results/eviction-<backend>.json.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # `python bench/eviction.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bots_client
from bench.common import (
    RESULTS,
    database,
    machine_info,
    machine_line,
    percentiles,
    rss_bytes,
    server_process,
    write_json,
)
from bots_client import ExperimentConfig, Task


def scrape(port: int, metric: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=600).read().decode()
    match = re.search(rf"^{metric} (\S+)$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def metrics_port(server: object) -> int:
    line = next(e for e in server.log_lines if e.get("message") == "serving")  # type: ignore[attr-defined]
    return int(line["metrics_port"])


def run(backend: str, experiments: int, tasks: int, budget_mb: float, rounds: int, batch: int) -> dict[str, object]:
    with database(backend) as url:
        server = server_process(url, ["--memory-budget-mb", str(budget_mb), "--audit-log", "experiments"]).start()
        try:
            assert server.proc is not None
            pid = server.proc.pid
            result: dict[str, object] = {"budget_mb": budget_mb}
            with bots_client.Client(server.address, bulk_timeout=1800) as client:
                started = time.perf_counter()
                for e in range(experiments):
                    name = f"e{e}"
                    client.create_experiment(name, ExperimentConfig(seed=e))
                    client.add_tasks(name, [Task(key=f"task-{i:08d}") for i in range(tasks)])
                result["setup_seconds"] = time.perf_counter() - started
                result["rss_after_setup"], result["peak_after_setup"] = rss_bytes(pid)
                # Calls are timed one at a time: the first call of each
                # experiment in a round follows calls on every other one.
                select_s: list[float] = []
                batches: list[list[str]] = []
                for r in range(rounds):
                    for e in range(experiments):
                        t0 = time.perf_counter()
                        chosen = client.select_batch(f"e{e}", batch, request_key=f"r{r}")
                        select_s.append(time.perf_counter() - t0)
                        batches.append(chosen.keys)
                        client.report_outcomes(f"e{e}", chosen.batch_id, dict.fromkeys(chosen.keys, (3, 8)))
                result["rss_after_rounds"], result["peak"] = rss_bytes(pid)
                result["select_seconds"] = percentiles(select_s)
                port = metrics_port(server)
                result["evictions"] = scrape(port, "bots_experiment_evictions_total")
                result["loaded_bytes_estimate"] = scrape(port, "bots_loaded_experiments_bytes")
                result["batches"] = batches
        finally:
            server.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--experiments", type=int, default=60)
    parser.add_argument("--tasks", type=int, default=50_000)
    parser.add_argument("--budget-mb", type=float, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    info = machine_info()
    print(machine_line(info))
    runs = {
        "budget": run(args.backend, args.experiments, args.tasks, args.budget_mb, args.rounds, args.batch),
        "no_budget": run(args.backend, args.experiments, args.tasks, 0, args.rounds, args.batch),
    }
    same = runs["budget"].pop("batches") == runs["no_budget"].pop("batches")
    out = {"machine": info, "args": vars(args), "same_batches": same, **runs}
    for label, r in runs.items():
        sel = r["select_seconds"]
        print(
            f"{label:>9}: rss after rounds {r['rss_after_rounds'] / 2**20:.0f} MB, peak {r['peak'] / 2**20:.0f} MB, "
            f"evictions {r['evictions']:.0f}, select p50 {sel['p50']:.1f} ms p90 {sel['p90']:.1f} ms "
            f"p99 {sel['p99']:.1f} ms"  # type: ignore[index]
        )
    print(f"same batches with and without the budget: {same}")
    write_json(RESULTS / f"eviction-{args.backend}.json", out)


if __name__ == "__main__":
    main()
