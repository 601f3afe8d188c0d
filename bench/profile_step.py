"""Where a step's time goes inside the server: py-spy samples a `bots-server
serve` child process while a client runs select+report cycles, and the
samples are grouped by the innermost frame that belongs to a known layer.

    .venv/bin/pip install py-spy      # a sampling profiler; not a dependency of the server
    .venv/bin/python -m bench.profile_step --backend sqlite --pool 10000 --seconds 20

Samples of threads waiting (the event loop in epoll, idle workers on their
queue) are counted apart: the shares are of the samples where a thread was
doing something, which includes waiting for the database inside a driver
call (a commit's fsync on SQLite, a round trip on PostgreSQL).

Writes bench/results/profile-<backend>-<pool>.json (the grouped shares and
the top innermost frames) and the raw collapsed stacks next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # `python bench/profile_step.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.perf import _cycle, experiment_config, log, make_tasks, random_outcomes

# Innermost matching frame wins; the first pattern that matches names the layer.
LAYERS = [
    ("engine (numpy selection and update)", re.compile(r"bots_server/engine/")),
    (
        "database driver (execute, commit: fsync or network)",
        re.compile(r"do_commit|do_execute|do_executemany|psycopg|sqlite3"),
    ),
    ("SQLAlchemy (statements, results, pool)", re.compile(r"sqlalchemy/")),
    ("store (the service's SQL code)", re.compile(r"bots_server/store/")),
    ("gRPC, protobuf, conversion", re.compile(r"grpc|protobuf|bots_server/service/")),
    ("core (runtime, batches, validation)", re.compile(r"bots_server/core/")),
    ("asyncio, threads, executor hand-offs", re.compile(r"asyncio|concurrent/futures|threading")),
]
# Innermost frames of a thread that waits for work.
IDLE = re.compile(
    r"EpollSelector\.select|_PollLikeSelector\.select|_worker \(concurrent/futures/thread\.py:81\)|^Thread\.run "
)


def group(raw: str) -> dict[str, Any]:
    layers: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    idle = busy = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        if IDLE.search(frames[-1]):
            idle += count
            continue
        busy += count
        leaves[frames[-1]] += count
        layer = next((name for f in reversed(frames) for name, rx in LAYERS if rx.search(f)), "other")
        layers[layer] += count
    return {
        "busy_samples": busy,
        "idle_samples": idle,
        "layers": {k: v / busy for k, v in layers.most_common()},
        "top_frames": {k: v / busy for k, v in leaves.most_common(15)},
    }


async def _concurrent_cycles(
    address: str, names: list[str], batch: int, sampler: subprocess.Popen[bytes], combined: bool
) -> int:
    """Select + report loops (`combined`: ReportAndSelect loops) on every
    experiment at once until the sampler ends; the steps done."""
    import bots_client

    steps = 0
    async with bots_client.AsyncClient(address, timeout=600) as client:

        async def loop(name: str, seed: int) -> None:
            nonlocal steps
            rng = np.random.default_rng(seed)
            chosen = await client.select_batch(name, batch)
            while sampler.poll() is None:
                outcomes = random_outcomes(chosen.keys, rng)
                if combined:
                    _, chosen = await client.report_and_select(name, chosen.batch_id, outcomes, batch)
                else:
                    await client.report_outcomes(name, chosen.batch_id, outcomes)
                    chosen = await client.select_batch(name, batch)
                steps += 1

        await asyncio.gather(*(loop(name, i) for i, name in enumerate(names)))
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sqlite")
    parser.add_argument("--pool", type=int, default=10_000)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument(
        "--experiments", type=int, default=1, help="experiments stepped concurrently (one async loop each)"
    )
    parser.add_argument(
        "--gil", action="store_true", help="sample only the thread holding the GIL: where the Python CPU goes"
    )
    parser.add_argument(
        "--combined", action="store_true", help="step by ReportAndSelect instead of SelectBatch + ReportOutcomes"
    )
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    import bots_client

    machine = common.machine_info()
    stem = common.RESULTS / (
        f"profile-{args.backend}-{args.pool}"
        + (f"-{args.experiments}x" if args.experiments > 1 else "")
        + ("-gil" if args.gil else "")
        + ("-combined" if args.combined else "")
    )
    raw_path = stem.with_suffix(".txt")
    with common.database(args.backend) as url:
        server = common.server_process(url).start()
        try:
            names = [f"profile-{i}" for i in range(args.experiments)]
            tasks = make_tasks(args.pool)
            with bots_client.Client(server.address, timeout=600) as client:
                for name in names:
                    client.create_experiment(name, experiment_config())
                    client.add_tasks(name, tasks)
                rng = np.random.default_rng(0)
                for i in range(3):
                    _cycle(client, names[0], f"warm-{i}", rng, args.batch)
                cmd = [spy, "record", "--pid", str(server.proc.pid), "--duration", str(args.seconds)]
                cmd += ["--rate", "200", "--nonblocking", "--format", "raw", "-o", str(raw_path)]
                cmd += ["--gil"] if args.gil else []
                sampler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                steps, started = 0, time.perf_counter()
                if args.experiments > 1:
                    steps = asyncio.run(_concurrent_cycles(server.address, names, args.batch, sampler, args.combined))
                elif args.combined:
                    batch = client.select_batch(names[0], args.batch, "first")
                    while sampler.poll() is None:
                        outcomes = random_outcomes(batch.keys, rng)
                        _, batch = client.report_and_select(names[0], batch.batch_id, outcomes, args.batch, f"step-{steps}")
                        steps += 1
                else:
                    while sampler.poll() is None:
                        _cycle(client, names[0], f"step-{steps}", rng, args.batch)
                        steps += 1
                elapsed = time.perf_counter() - started
        finally:
            server.stop()
    result = {
        "machine": machine,
        "backend": args.backend,
        "pool": args.pool,
        "steps": steps,
        "ms_per_step": elapsed / steps * 1e3,
        **group(raw_path.read_text()),
    }
    common.write_json(stem.with_suffix(".json"), result)
    log(f"Machine: {common.machine_line(machine)}")
    log(
        f"{args.backend}, {args.pool:,} tasks: {steps} steps in {elapsed:.1f} s ({result['ms_per_step']:.1f} ms per step)"
    )
    log(f"busy samples {result['busy_samples']}, idle {result['idle_samples']}; by layer (share of busy samples):")
    for name, share in result["layers"].items():
        log(f"    {100 * share:5.1f}%  {name}")
    log("innermost frames:")
    for name, share in list(result["top_frames"].items())[:8]:
        log(f"    {100 * share:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
