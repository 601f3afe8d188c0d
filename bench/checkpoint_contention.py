"""What a checkpoint, an upload or a delete costs the writes that run
meanwhile, in-process.

    .venv/bin/python -m bench.checkpoint_contention                  # SQLite, 1M tasks, 3 repeats
    .venv/bin/python -m bench.checkpoint_contention --backends sqlite,postgresql
    .venv/bin/python -m bench.checkpoint_contention --during upload,delete --tasks 250000

A thread commits a small write transaction (an UPDATE of the experiment row,
durable, as a report's commit is) every 5 ms while the store writes one
checkpoint of `--tasks` tasks (alpha, beta, weak, strong: 32 bytes per
task), or adds `--tasks` tasks to another experiment, or deletes that
experiment with its tasks (`--during`). Reported per repeat: the write's
duration and the latency of the commits made during it (p50, p99, max)
against those made before it. On SQLite a commit that needs the database's
single write lock while the write holds it waits; the server's own write
path (SelectBatch, ReportOutcomes) commits the same way.

To compare two versions of the store, run it with
PYTHONPATH=<other checkout>/server (the store calls used here exist in both).
Writes bench/results/checkpoint-contention.json (or --output).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

if __package__ in (None, ""):  # `python bench/checkpoint_contention.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.perf import log


def _commits(store: Any, experiment_id: int, latencies: list[float], stop: threading.Event) -> None:
    """Small durable write transactions, one every 5 ms, until `stop`."""
    while not stop.is_set():
        started = time.perf_counter()
        with store._write() as conn:
            conn.execute(sa.text("UPDATE experiments SET step = step WHERE id = :id"), {"id": experiment_id})
        latencies.append(time.perf_counter() - started)
        time.sleep(0.005)


def run_once(url: str, tasks: int, repeats: int, during: str = "checkpoint") -> list[dict[str, Any]]:
    from bots_server.store import checkpoint_blob, open_store

    store: Any = open_store(url)  # SqlStore: its _write is the transaction every write path uses
    try:
        store.migrate()
        now = dt.datetime.now(dt.UTC)
        row = store.create_experiment("contention", {}, now)
        store.add_tasks(row.id, 0, ["a"], [{}])
        rng = np.random.default_rng(0)
        arrays = {name: rng.random(tasks) for name in ("alpha", "beta", "weak", "strong")}
        blob = checkpoint_blob.encode(tasks, arrays, {"capability": 0.5})
        keys, features = [f"t-{i:07d}" for i in range(tasks)], [{"weak": 0.5, "strong": 0.5}] * tasks
        other = 0
        runs = []
        for step in range(1, repeats + 1):
            if during == "delete":  # the experiment to delete, made before the commits start
                other = store.create_experiment(f"other-{step}", {}, now).id
                store.add_tasks(other, 0, keys, features)
            latencies: list[float] = []
            stop = threading.Event()

            thread = threading.Thread(target=_commits, args=(store, row.id, latencies, stop))
            thread.start()
            time.sleep(0.3)
            before = list(latencies)
            latencies.clear()
            started = time.perf_counter()
            if during == "checkpoint":
                store.write_checkpoint(row.id, step, tasks, blob, dt.datetime.now(dt.UTC))
            elif during == "upload":
                store.add_tasks(store.create_experiment(f"other-{step}", {}, now).id, 0, keys, features)
            else:
                store.delete_experiment(other)
            seconds = time.perf_counter() - started
            stop.set()
            thread.join()
            meanwhile, earlier = common.percentiles(latencies), common.percentiles(before)
            runs.append({"checkpoint_s": seconds, "commits_during": meanwhile, "commits_before": earlier})
            log(
                f"    {url.split(':')[0]} {tasks:,}: {during} {seconds:.2f} s; {meanwhile['n']} commits during it, "
                f"p50 {meanwhile['p50']:.1f} ms, p99 {meanwhile['p99']:.1f} ms, max {meanwhile['max']:.1f} ms; "
                f"before it p50 {earlier['p50']:.1f} ms"
            )
        return runs
    finally:
        store.close()


# (label, one repeat's values) for the before/after comparison.
METRICS: list[tuple[str, Any]] = [
    ("the write, s", lambda r: [r["checkpoint_s"]]),
    ("commits during it, p50 ms", lambda r: [r["commits_during"]["p50"]]),
    ("commits during it, p99 ms", lambda r: [r["commits_during"]["p99"]]),
    ("commits during it, max ms", lambda r: [r["commits_during"]["max"]]),
    ("commits before it, p50 ms", lambda r: [r["commits_before"]["p50"]]),
]


def compare(before: list[Path], after: list[Path]) -> list[str]:
    """Before/after per backend: median over every repeat of every file (range, n)."""

    def by_backend(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
        runs: dict[str, list[dict[str, Any]]] = {}
        for p in paths:
            for backend, repeats in json.loads(p.read_text())["runs"].items():
                runs.setdefault(backend, []).extend(repeats)
        return runs

    return common.before_after(METRICS, by_backend(before), by_backend(after))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite")
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--during", default="checkpoint", help="comma-separated: checkpoint, upload, delete (default checkpoint)"
    )
    parser.add_argument("--output", default=str(common.RESULTS / "checkpoint-contention.json"))
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="print the before/after table of two comma-separated lists of result files, and exit",
    )
    args = parser.parse_args(argv)
    if args.compare:
        before, after = ([Path(p) for p in group.split(",")] for group in args.compare)
        print("\n".join(compare(before, after)))
        return 0
    machine = common.machine_info()
    log(f"Machine: {common.machine_line(machine)}")
    results: dict[str, list[dict[str, Any]]] = {}
    for backend in args.backends.split(","):
        for during in args.during.split(","):
            key = backend if during == "checkpoint" else f"{backend} {during}"
            with common.database(backend) as url:
                results[key] = run_once(url, args.tasks, args.repeats, during)
    common.write_json(
        Path(args.output),
        {"machine": machine, "pythonpath": os.environ.get("PYTHONPATH", ""), "args": vars(args), "runs": results},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
