"""Memory benchmark: what a server holds per task and per experiment, however
the tasks arrived, on SQLite and PostgreSQL.

    .venv/bin/python -m bench.memory                                  # 1M tasks, both backends, 3 repeats
    .venv/bin/python -m bench.memory --pool 100000 --backends sqlite --repeats 1
    .venv/bin/python -m bench.memory --baseline /path/to/other/checkout   # interleave that code's server
    .venv/bin/python -m bench.memory --pool 100000 --embedding-dim 256    # tasks with 256-value embeddings

Per backend and repeat, on a fresh database and a `bots-server serve` child
process, resident memory (VmRSS) and peak (VmHWM) read from /proc:

- `small`: --small experiments of 10 tasks, each created, filled and
  selected from (so held in memory): bytes per experiment;
- `added`: one experiment of --pool tasks (12-character keys, the two
  reference features each, and with --embedding-dim an embedding of that
  many values) sent through AddTasks, then 5 select+report cycles: bytes
  per task resident after, and the peak during the call;
- `rebuilt`: after a graceful stop (which checkpoints), a new process whose
  first select rebuilds the pool from the database: bytes per task.

Beside each, the server's own estimate (`bots_loaded_experiments_bytes`,
what --memory-budget-mb bounds) from its metrics endpoint, to check that
the estimate follows the resident memory it stands for.

With --baseline, every repeat runs the server of that checkout too (its
`server/` first on PYTHONPATH), alternating which goes first, so both see
the same load. Writes bench/results/memory.json (or --output).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/memory.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.perf import log

CYCLES = 5
BATCH = 256


def tasks(prefix: str, n: int, embedding_dim: int = 0) -> Iterator[Any]:
    import numpy as np

    from bots_client import Task

    rng = np.random.default_rng(0)
    vectors = None
    for i in range(n):
        weak = (i % 97) / 97
        if embedding_dim and i % 1000 == 0:
            vectors = rng.standard_normal((1000, embedding_dim), dtype=np.float32)
        embedding = None if vectors is None else vectors[i % 1000]
        yield Task(f"{prefix}{i:010d}", {"weak": weak, "strong": min(1.0, weak + 0.3)}, embedding=embedding)


def estimate(server: Any) -> int | None:
    """The server's bots_loaded_experiments_bytes, from its metrics endpoint."""
    port = next((e.get("metrics_port") for e in server.log_lines if e.get("message") == "serving"), None)
    if not port:
        return None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("bots_loaded_experiments_bytes "):
                return int(float(line.split()[1]))
    return None


def start(url: str, code: str | None) -> Any:
    """A server on `url`, running the checkout `code` (None: this one)."""
    from bots_server.testing.processes import ServerProcess

    env = {}
    if code:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(code) / "server"), os.environ.get("PYTHONPATH", "")])
    return ServerProcess(url, extra_args=["--memory-budget-mb", "0"], env=env).start()


def cycles(client: Any, name: str, label: str) -> None:
    for i in range(CYCLES):
        batch = client.select_batch(name, BATCH, request_key=f"{label}-{i}")
        client.report_outcomes(name, batch.batch_id, {k: (j % 17, 16) for j, k in enumerate(batch.keys)})


def run_once(backend: str, url: str, args: argparse.Namespace, code: str | None) -> dict[str, Any]:
    import bots_client
    from bots_client import ExperimentConfig

    config = ExperimentConfig(seed=1, weak_feature="weak", strong_feature="strong")
    n = args.pool
    out: dict[str, Any] = {"backend": backend, "pool": n, "code": code or "this checkout", "small": args.small}
    out["embedding_dim"] = args.embedding_dim
    server = start(url, code)
    try:
        pid = server.proc.pid
        with bots_client.Client(server.address, timeout=600, bulk_timeout=7200) as client:
            time.sleep(1)
            idle = common.rss_bytes(pid)[0]
            for i in range(args.small):
                client.create_experiment(f"small{i}", config)
                client.add_tasks(f"small{i}", list(tasks("s", 10)))
                client.select_batch(f"small{i}", 1, request_key="load")
            small = common.rss_bytes(pid)[0]
            out["bytes_per_small_experiment"] = (small - idle) / max(1, args.small)
            out["estimate_per_small_experiment"] = (estimate(server) or 0) / max(1, args.small)
            small_estimate = estimate(server) or 0
            client.create_experiment("big", dataclasses.replace(config, embedding_dim=args.embedding_dim))
            started = time.perf_counter()
            client.add_tasks("big", tasks("m", n, args.embedding_dim))
            out["add_tasks_s"] = time.perf_counter() - started
            rss, hwm = common.rss_bytes(pid)
            cycles(client, "big", "added")
            after_cycles = common.rss_bytes(pid)[0]
            big_estimate = (estimate(server) or 0) - small_estimate
        out["added"] = {
            "bytes_per_task": (rss - small) / n,
            "bytes_per_task_after_cycles": (after_cycles - small) / n,
            "peak_bytes_per_task": (hwm - small) / n,
            "estimate_bytes_per_task": big_estimate / n,
        }
        server.stop(timeout=600)
    finally:
        server.kill()

    server = start(url, code)
    try:
        pid = server.proc.pid
        with bots_client.Client(server.address, timeout=600) as client:
            time.sleep(1)
            idle = common.rss_bytes(pid)[0]
            started = time.perf_counter()
            cycles(client, "big", "rebuilt")
            out["rebuild_and_cycles_s"] = time.perf_counter() - started
            rss, hwm = common.rss_bytes(pid)
            out["rebuilt"] = {
                "bytes_per_task": (rss - idle) / n,
                "peak_bytes_per_task": (hwm - idle) / n,
                "estimate_bytes_per_task": (estimate(server) or 0) / n,
            }
        server.stop(timeout=600)
    finally:
        server.kill()
    a, r = out["added"], out["rebuilt"]
    log(
        f"    {backend} {out['code']}: per task after AddTasks {a['bytes_per_task']:.0f} B "
        f"(after {CYCLES} cycles {a['bytes_per_task_after_cycles']:.0f}, peak {a['peak_bytes_per_task']:.0f}, "
        f"estimate {a['estimate_bytes_per_task']:.0f}); after a rebuild {r['bytes_per_task']:.0f} B "
        f"(peak {r['peak_bytes_per_task']:.0f}, estimate {r['estimate_bytes_per_task']:.0f}); "
        f"per experiment of 10 tasks {out['bytes_per_small_experiment'] / 1024:.1f} KiB "
        f"(estimate {out['estimate_per_small_experiment'] / 1024:.1f})"
    )
    return out


# (label, how to read one run's value)
MEASURES: list[tuple[str, Any]] = [
    ("after AddTasks, B/task", lambda r: r["added"]["bytes_per_task"]),
    (f"after AddTasks and {CYCLES} cycles, B/task", lambda r: r["added"]["bytes_per_task_after_cycles"]),
    ("peak during AddTasks, B/task", lambda r: r["added"]["peak_bytes_per_task"]),
    ("estimate after AddTasks, B/task", lambda r: r["added"]["estimate_bytes_per_task"]),
    ("after a rebuild, B/task", lambda r: r["rebuilt"]["bytes_per_task"]),
    ("peak during the rebuild, B/task", lambda r: r["rebuilt"]["peak_bytes_per_task"]),
    ("estimate after a rebuild, B/task", lambda r: r["rebuilt"]["estimate_bytes_per_task"]),
    ("per experiment of 10 tasks, KiB", lambda r: r["bytes_per_small_experiment"] / 1024),
    ("estimate per experiment of 10 tasks, KiB", lambda r: r["estimate_per_small_experiment"] / 1024),
    ("AddTasks, s", lambda r: r["add_tasks_s"]),
    ("rebuild + 5 cycles, s", lambda r: r["rebuild_and_cycles_s"]),
]


def summary(runs: list[dict[str, Any]]) -> list[str]:
    """Median (range) over the repeats, per backend and code."""
    codes = list(dict.fromkeys(r["code"] for r in runs))
    lines = ["| backend | measure | " + " | ".join(codes) + " |", "|---|---|" + "---|" * len(codes)]
    for backend in dict.fromkeys(r["backend"] for r in runs):
        for label, read in MEASURES:
            cells = []
            for code in codes:
                values = [float(read(r)) for r in runs if r["backend"] == backend and r["code"] == code]
                cells.append(f"{common.median_range(values, 0)}, n={len(values)}" if values else "-")
            lines.append(f"| {backend} | {label} | " + " | ".join(cells) + " |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--pool", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=300, help="experiments of 10 tasks before the pool")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--embedding-dim", type=int, default=0, help="each pool task's embedding length (0: none)")
    parser.add_argument("--baseline", default=None, help="a checkout whose server runs interleaved with this one")
    parser.add_argument("--output", default=str(common.RESULTS / "memory.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    machine = common.machine_info()
    log(f"Machine: {common.machine_line(machine)}")
    backends = args.backends.split(",")
    if "postgresql" in backends and not common.postgres_available():
        log("PostgreSQL is not reachable (BOTS_TEST_PG_DSN): skipping it")
        backends.remove("postgresql")
    codes: list[str | None] = [None] if args.baseline is None else [args.baseline, None]
    runs = []
    for repeat in range(args.repeats):
        order = codes if repeat % 2 == 0 else codes[::-1]
        for backend in backends:
            for code in order:
                with common.database(backend) as url:
                    runs.append(run_once(backend, url, args, code))
    out = Path(args.output)
    common.write_json(
        out,
        {
            "machine": machine,
            "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "load_at_end": os.getloadavg(),
            "args": vars(args),
            "runs": runs,
        },
    )
    text = "\n".join(
        [f"Machine: {common.machine_line(machine)}; load at the end {os.getloadavg()}.", "", *summary(runs)]
    )
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
