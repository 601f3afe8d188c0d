"""Measure a server's memory per task and per experiment (for docs/operations.md).

Not a test (it takes minutes): run it by hand on the machine you size for,

    .venv/bin/python -m tests.ops.measure_memory --db sqlite:////tmp/bots-mem.db
    .venv/bin/python -m tests.ops.measure_memory --db postgresql+psycopg://postgres@127.0.0.1/bots_mem

It starts `bots-server serve` as a child process and reads its resident set
(VmRSS) and peak (VmHWM) from /proc after each phase: idle, 1000 small
experiments, a 100k-task pool, a 1M-task pool, and a restart that rebuilds
the 1M pool from the database. Task keys are 12 characters; every task has
the two reference features of the interpolation plug-in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterator

import bots_client
from bots_client import ExperimentConfig, Task
from tests.support.servers import ServerProcess


def memory(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def tasks(prefix: str, n: int) -> Iterator[Task]:
    for i in range(n):
        weak = (i % 97) / 97
        yield Task(f"{prefix}{i:010d}", {"weak": weak, "strong": min(1.0, weak + 0.3)})


def step_seconds(client: bots_client.Client, name: str, steps: int) -> float:
    """Median wall time of select(256) + report, as a trainer sees it."""
    times = []
    for s in range(steps):
        started = time.perf_counter()
        batch = client.select_batch(name, 256, request_key=f"m{s}")
        client.report_outcomes(name, batch.batch_id, {k: (i % 17, 16) for i, k in enumerate(batch.keys)})
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--large", type=int, default=1_000_000)
    args = parser.parse_args()
    config = ExperimentConfig(seed=1, weak_feature="weak", strong_feature="strong")
    results: dict[str, object] = {"db": args.db.split("://")[0], "cpus": os.cpu_count()}

    server = ServerProcess(args.db, extra_args=["--metrics-listen", ""]).start()
    assert server.proc is not None
    pid = server.proc.pid
    client = bots_client.Client(server.address, bulk_timeout=7200)
    try:
        time.sleep(1)
        results["idle"] = memory(pid)

        for i in range(1000):
            client.create_experiment(f"small{i}", config)
            client.add_tasks(f"small{i}", list(tasks("s", 10)))
            client.select_batch(f"small{i}", 1, request_key="load")  # brings it into memory
        results["after_1000_experiments_of_10_tasks"] = memory(pid)

        client.create_experiment("k100", config)
        started = time.perf_counter()
        client.add_tasks("k100", tasks("k", 100_000))
        results["add_100k_seconds"] = round(time.perf_counter() - started, 1)
        results["step_100k_seconds"] = round(step_seconds(client, "k100", 20), 4)
        results["after_100k_tasks"] = memory(pid)

        client.create_experiment("m1", config)
        started = time.perf_counter()
        client.add_tasks("m1", tasks("m", args.large))
        results["add_1m_seconds"] = round(time.perf_counter() - started, 1)
        results["step_1m_seconds"] = round(step_seconds(client, "m1", 10), 4)
        results["after_1m_tasks"] = memory(pid)
    finally:
        client.close()
        stopping = time.perf_counter()
        server.stop(timeout=600)
        results["shutdown_seconds"] = round(time.perf_counter() - stopping, 1)
    # The final checkpoints, written on SIGTERM: what the grace period must cover.
    results["checkpoint_seconds"] = {
        str(e["experiment"]): e["seconds"]
        for e in server.log_lines
        if e.get("message") == "checkpoint written" and str(e.get("experiment")) in ("k100", "m1")
    }

    # A fresh process that only rebuilds the 1M pool from the store: what a
    # restarted replica holds for it, without add_tasks' transient buffers.
    server = ServerProcess(args.db, extra_args=["--metrics-listen", ""]).start()
    assert server.proc is not None
    pid = server.proc.pid
    client = bots_client.Client(server.address, bulk_timeout=7200)
    try:
        time.sleep(1)
        results["restart_idle"] = memory(pid)
        started = time.perf_counter()
        client.get_experiment("m1")
        client.select_batch("m1", 256, request_key="after-restart")
        results["restart_load_1m_seconds"] = round(time.perf_counter() - started, 1)
        results["restart_after_loading_1m"] = memory(pid)
    finally:
        client.close()
        server.stop(timeout=600)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
