"""The phases of a ReportAndSelect step inside the service, timed one by one:
the update, the choice of the next batch, the store's commit (its statements
counted), and the whole call. The service runs in this process
(testing/inprocess.py: every message serialized and parsed, no socket), so
the phases can be wrapped with timers and the commit's statements counted; bench/perf.py times the same call
over a socket.

    .venv/bin/python -m bench.step_phases --backend postgresql --pool 10000

Prints medians over the measured steps and writes them, with the
statements of a step's commit, to
bench/results/step-phases-<backend>-<pool>.json.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

if __package__ in (None, ""):  # `python bench/step_phases.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.perf import experiment_config, make_tasks, random_outcomes

# core/batches.py's functions of a combined step, each run on a worker.
PHASES = {"_apply": "update", "_choose": "choose the next batch"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sqlite")
    parser.add_argument("--pool", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/step-phases-BACKEND-POOL.json)")
    args = parser.parse_args(argv)
    import bots_client
    from bots_server.core import batches
    from bots_server.testing.inprocess import InProcessService

    seconds: dict[str, list[float]] = collections.defaultdict(list)
    statements: collections.Counter[str] = collections.Counter()

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name].append(time.perf_counter() - started)

        return run

    machine = common.machine_info()
    originals = {name: getattr(batches, name) for name in PHASES}
    for name in PHASES:
        setattr(batches, name, timed(PHASES[name], originals[name]))
    try:
        with common.database(args.backend) as url, InProcessService(url) as service:
            store = service.store
            commit = timed("store: commit the report and the batch", store.commit_report_and_insert_batch)
            in_commit = threading.local()

            def counted_commit(*a: Any, **k: Any) -> Any:
                in_commit.active = True
                try:
                    return commit(*a, **k)
                finally:
                    in_commit.active = False

            def count(*a: Any) -> None:  # the step's own statements, not a checkpoint's meanwhile
                if getattr(in_commit, "active", False):
                    statements.update([a[2].split()[0]])

            store.commit_report_and_insert_batch = counted_commit  # type: ignore[method-assign]
            sa.event.listen(store.engine, "before_cursor_execute", count)  # type: ignore[attr-defined]
            client = bots_client.Client(None, channel=service.channel())
            client.create_experiment("phases", experiment_config())
            client.add_tasks("phases", make_tasks(args.pool))
            rng = np.random.default_rng(0)
            batch = client.select_batch("phases", args.batch, "phases-0")
            for i in range(args.warmup + args.steps):
                if i == args.warmup:
                    seconds.clear()
                    statements.clear()
                started = time.perf_counter()
                _, batch = client.report_and_select(
                    "phases", batch.batch_id, random_outcomes(batch.keys, rng), args.batch, f"phases-{i + 1}"
                )
                seconds["the whole call (client included)"].append(time.perf_counter() - started)
    finally:
        for name, fn in originals.items():
            setattr(batches, name, fn)
    medians = {name: statistics.median(values) * 1e3 for name, values in seconds.items()}
    per_step = {word: count / args.steps for word, count in sorted(statements.items())}
    print(common.machine_line(machine))
    print(f"{args.backend}, {args.pool:,} tasks, batch {args.batch}, {args.steps} steps: median ms")
    for name, ms in medians.items():
        print(f"  {ms:7.3f}  {name}")
    print(f"  statements per step: {per_step}")
    common.write_json(
        Path(args.out or common.RESULTS / f"step-phases-{args.backend}-{args.pool}.json"),
        {"machine": machine, "args": vars(args), "median_ms": medians, "statements_per_step": per_step},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
