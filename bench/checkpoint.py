"""Checkpoint, stop and rebuild benchmark: what a large pool costs a server
when it checkpoints, stops and comes back, on SQLite and PostgreSQL.

    .venv/bin/python -m bench.checkpoint                       # 1M tasks, both backends, 2 repeats
    .venv/bin/python -m bench.checkpoint --pools 100000 --backends sqlite --repeats 1

Per backend, pool and repeat (fresh database each time; the tasks are seeded
through the store, then a `bots-server serve` child process does the rest):

- `checkpoint_s`: each background checkpoint's duration, as the server logs
  it ("checkpoint written"), while a client runs select+report cycles;
- the cycles' SelectBatch and ReportOutcomes latencies meanwhile (p50, max):
  a checkpoint that blocks calls shows as a max far above the p50;
- `graceful_stop_s`: SIGTERM to exit (the server checkpoints every
  experiment first);
- `restart_s`: the first SelectBatch on a new server, which rebuilds the
  experiment from its checkpoint (and `loaded_s`, the rebuild as logged);
- `crash_restart_s`: the same after `--crash-steps` cycles past the last
  checkpoint and a SIGKILL (rebuild plus replay);
- resident memory per task after the restart.

To compare two versions of the server, run this file with
PYTHONPATH=<other checkout>/server: the server processes and the seeding
then use that checkout's code (the store calls used here exist in both).

Writes bench/results/checkpoint.json (or --output).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # `python bench/checkpoint.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.perf import _cpu_seconds as cpu_seconds
from bench.perf import log, random_outcomes, reference_rates, server_config


def seed(url: str, name: str, n: int) -> None:
    """An experiment with n tasks (two reference features each), at step 0."""
    from bots_server.store import open_store

    store = open_store(url)
    try:
        store.migrate()
        row = store.create_experiment(name, server_config().to_dict(), dt.datetime.now(dt.UTC))
        weak, strong = reference_rates(n)
        features = [{"weak": w, "strong": s} for w, s in zip(weak.tolist(), strong.tolist(), strict=True)]
        store.add_tasks(row.id, 0, [f"task-{i:07d}" for i in range(n)], features)
    finally:
        store.close()


def cycle(
    client: Any, name: str, rng: np.random.Generator, batch: int, calls: list[tuple[float, float]] | None = None
) -> tuple[float, float]:
    """One select+report; `calls` gets each call's (start, end) wall-clock time."""
    t0 = time.perf_counter()
    w0 = time.time()
    selected = client.select_batch(name, batch, f"c-{uuid.uuid4().hex}")
    t1 = time.perf_counter()
    if calls is not None:
        calls.append((w0, time.time()))
    outcomes = random_outcomes(selected.keys, rng)
    t2 = time.perf_counter()
    w2 = time.time()
    client.report_outcomes(name, selected.batch_id, outcomes)
    if calls is not None:
        calls.append((w2, time.time()))
    return t1 - t0, time.perf_counter() - t2


def first_call(url: str, name: str, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    """A new server; the first select+report, which rebuilds the experiment."""
    import bots_client

    server = common.server_process(url, server_args(args)).start()
    try:
        rss_empty = common.rss_bytes(server.proc.pid)[0]
        with bots_client.Client(server.address, timeout=600) as client:
            started, cpu0 = time.perf_counter(), cpu_seconds(server.proc.pid)
            cycle(client, name, rng, args.batch)
            seconds, cpu = time.perf_counter() - started, cpu_seconds(server.proc.pid) - cpu0
        rss = common.rss_bytes(server.proc.pid)[0]
        loaded = server.entries("experiment loaded")
        return {
            "first_cycle_s": seconds,
            # On a shared machine the wall time above waits for the CPU; the
            # server's own CPU seconds for the call are what load changes least.
            "first_cycle_cpu_s": cpu,
            "loaded_s": loaded[-1].get("seconds") if loaded else None,
            "replayed_steps": loaded[-1].get("replayed_steps") if loaded else None,
            "rss_bytes_per_task": (rss - rss_empty) / args.pool_now,
            "server": server,
        }
    except BaseException:
        server.kill()
        raise


def server_args(args: argparse.Namespace) -> list[str]:
    return ["--checkpoint-every-steps", str(args.every), "--checkpoint-every-seconds", "3600"]


def run_once(backend: str, url: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    import bots_client

    name = "ckpt"
    args.pool_now = n
    started = time.perf_counter()
    seed(url, name, n)
    out: dict[str, Any] = {"backend": backend, "pool": n, "seed_s": time.perf_counter() - started}
    rng = np.random.default_rng(1)

    first = first_call(url, name, args, rng)
    server = first.pop("server")
    try:
        selects: list[float] = []
        reports: list[float] = []
        calls: list[tuple[float, float]] = []
        with bots_client.Client(server.address, timeout=600) as client:
            for _ in range(args.steps):
                s, r = cycle(client, name, rng, args.batch, calls)
                selects.append(s)
                reports.append(r)
            # Let the last background checkpoint finish before stopping, so
            # the stop below times the shutdown checkpoint alone.
            deadline = time.monotonic() + 120
            want = args.steps // args.every
            while time.monotonic() < deadline and len(_checkpoints(server)) < want:
                time.sleep(0.1)
        out["checkpoint_s"] = _checkpoints(server)
        out.update(_overlap(server, calls))
        out["select"] = common.percentiles(selects)
        out["report"] = common.percentiles(reports)
        # The server's CPU seconds while stopping: its whole life's (from the
        # children's rusage once reaped) minus what it had used before.
        lived = cpu_seconds(server.proc.pid)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        server.stop()
        out["graceful_stop_s"] = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        whole = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
        out["graceful_stop_cpu_s"] = whole - lived
    finally:
        server.kill()

    restart = first_call(url, name, args, rng)
    server = restart.pop("server")
    try:
        with bots_client.Client(server.address, timeout=600) as client:
            for _ in range(args.crash_steps):
                cycle(client, name, rng, args.batch)
    finally:
        server.kill()  # SIGKILL: no shutdown checkpoint
    out["restart"] = restart
    crash = first_call(url, name, args, rng)
    crash.pop("server").kill()
    out["crash_restart"] = crash
    log(
        f"    {backend} {n:>9,}: checkpoints {[round(s, 2) for s in out['checkpoint_s']]} s; select p50/max "
        f"{out['select']['p50']:.0f}/{out['select']['max']:.0f} ms, report p50/max {out['report']['p50']:.0f}/"
        f"{out['report']['max']:.0f} ms; calls during checkpoints p50 {out['calls_during_checkpoint']['p50']:.0f} ms "
        f"(n={out['calls_during_checkpoint']['n']}), otherwise {out['calls_otherwise']['p50']:.0f} ms; graceful stop "
        f"{out['graceful_stop_s']:.2f} s (server CPU {out['graceful_stop_cpu_s']:.2f} s); restart "
        f"{restart['first_cycle_s']:.2f} s (server CPU {restart['first_cycle_cpu_s']:.2f} s); after SIGKILL "
        f"{crash['first_cycle_s']:.2f} s (CPU {crash['first_cycle_cpu_s']:.2f} s) "
        f"({crash['replayed_steps']} steps replayed); {restart['rss_bytes_per_task']:.0f} B/task"
    )
    return out


def _overlap(server: Any, calls: list[tuple[float, float]]) -> dict[str, Any]:
    """Call latencies (select and report alike) of the calls that overlapped a
    background checkpoint (its window: the log line's time minus its
    seconds) against those that did not: what a checkpoint costs the calls
    running meanwhile, under whatever load the machine has."""
    windows = []
    for e in server.log_lines:
        if e.get("message") == "checkpoint written":
            end = dt.datetime.fromisoformat(str(e["time"]).replace("Z", "+00:00")).timestamp()
            windows.append((end - float(e["seconds"]), end))
    during, other = [], []
    for start, end in calls:
        overlapped = any(start < w_end and end > w_start for w_start, w_end in windows)
        (during if overlapped else other).append(end - start)
    return {"calls_during_checkpoint": common.percentiles(during), "calls_otherwise": common.percentiles(other)}


def _checkpoints(server: Any) -> list[float]:
    return [float(e["seconds"]) for e in server.log_lines if e.get("message") == "checkpoint written"]


def summary(runs: list[dict[str, Any]]) -> list[str]:
    """Medians and ranges over the repeats, per backend and pool."""
    lines = [
        "| backend | pool | runs | checkpoint s (median, range) | select p50 / max ms | report p50 / max ms "
        "| calls during a checkpoint p50 / max ms | other calls p50 / max ms "
        "| graceful stop s | its server CPU s | restart (rebuild) s | its server CPU s | after SIGKILL s | its server CPU s | B/task |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["backend"], r["pool"]), []).append(r)

    def fmt(values: list[float], digits: int = 2) -> str:
        return common.median_range(values, digits) if values else "-"

    for (backend, pool), rs in groups.items():
        lines.append(
            f"| {backend} | {pool:,} | {len(rs)} | {fmt([c for r in rs for c in r['checkpoint_s']])} "
            f"| {fmt([r['select']['p50'] for r in rs], 0)} / {fmt([r['select']['max'] for r in rs], 0)} "
            f"| {fmt([r['report']['p50'] for r in rs], 0)} / {fmt([r['report']['max'] for r in rs], 0)} "
            f"| {fmt([r['calls_during_checkpoint']['p50'] for r in rs], 0)} / "
            f"{fmt([r['calls_during_checkpoint']['max'] for r in rs], 0)} "
            f"| {fmt([r['calls_otherwise']['p50'] for r in rs], 0)} / {fmt([r['calls_otherwise']['max'] for r in rs], 0)} "
            f"| {fmt([r['graceful_stop_s'] for r in rs])} | {fmt([r.get('graceful_stop_cpu_s', math.nan) for r in rs])} "
            f"| {fmt([r['restart']['first_cycle_s'] for r in rs])} "
            f"| {fmt([r['restart'].get('first_cycle_cpu_s', math.nan) for r in rs])} "
            f"| {fmt([r['crash_restart']['first_cycle_s'] for r in rs])} "
            f"| {fmt([r['crash_restart'].get('first_cycle_cpu_s', math.nan) for r in rs])} "
            f"| {fmt([r['restart']['rss_bytes_per_task'] for r in rs], 0)} |"
        )
    return lines


# (label, how to read one run's values) for the before/after comparison.
METRICS: list[tuple[str, Any]] = [
    ("background checkpoint, s", lambda r: r["checkpoint_s"]),
    (
        "calls overlapping a checkpoint, p50 ms",
        lambda r: [r["calls_during_checkpoint"]["p50"]] if "calls_during_checkpoint" in r else [],
    ),
    (
        "calls overlapping a checkpoint, max ms",
        lambda r: [r["calls_during_checkpoint"]["max"]] if "calls_during_checkpoint" in r else [],
    ),
    ("other calls, p50 ms", lambda r: [r["calls_otherwise"]["p50"]] if "calls_otherwise" in r else []),
    ("graceful stop, s", lambda r: [r["graceful_stop_s"]]),
    ("graceful stop, server CPU s", lambda r: [r["graceful_stop_cpu_s"]] if "graceful_stop_cpu_s" in r else []),
    ("first call after restart (rebuild), s", lambda r: [r["restart"]["first_cycle_s"]]),
    ("its server CPU, s", lambda r: [r["restart"]["first_cycle_cpu_s"]] if "first_cycle_cpu_s" in r["restart"] else []),
    ("first call after SIGKILL (rebuild + replay), s", lambda r: [r["crash_restart"]["first_cycle_s"]]),
    (
        "its server CPU, s ",
        lambda r: [r["crash_restart"]["first_cycle_cpu_s"]] if "first_cycle_cpu_s" in r["crash_restart"] else [],
    ),
    ("server memory after restart, B/task", lambda r: [r["restart"]["rss_bytes_per_task"]]),
]


def compare(before: list[Path], after: list[Path]) -> list[str]:
    """Before/after per backend: the median over every run's values (range)."""

    def by_backend(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in (r for p in paths for r in json.loads(p.read_text())["runs"]):
            runs.setdefault(r["backend"], []).append(r)
        return runs

    return common.before_after(METRICS, by_backend(before), by_backend(after))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--pools", default="1000000")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="cycles while checkpointing")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--crash-steps", type=int, default=5, help="cycles past the checkpoint before SIGKILL")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--output", default=str(common.RESULTS / "checkpoint.json"))
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="print the before/after table of two comma-separated lists of result files, and exit",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        before, after = ([Path(p) for p in group.split(",")] for group in args.compare)
        print("\n".join(compare(before, after)))
        return 0
    machine = common.machine_info()
    log(f"Machine: {common.machine_line(machine)}")
    runs = []
    for _ in range(args.repeats):
        for backend in args.backends.split(","):
            for pool in (int(p) for p in args.pools.split(",")):
                with common.database(backend) as url:
                    runs.append(run_once(backend, url, pool, args))
    result = {
        "machine": machine,
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "args": {k: v for k, v in vars(args).items() if k != "pool_now"},
        "runs": runs,
    }
    common.write_json(Path(args.output), result)
    print("\n".join([f"Machine: {common.machine_line(machine)}.", "", *summary(runs)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
