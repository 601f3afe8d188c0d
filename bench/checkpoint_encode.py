"""How long encoding a checkpoint holds the GIL, in-process: the state of
`--tasks` tasks is encoded and cut into the chunks the store writes, as a
background checkpoint does, while another thread wakes every 0.5 ms and
records how late it wakes. A late wake is time a step on the event loop or a
worker could not run Python: the step waited for the checkpoint.

    .venv/bin/python -m bench.checkpoint_encode                  # 1M tasks, 20 repeats

Reported: the encode's duration and the longest wait of the other thread
during it, median and range over the repeats, and the same wait with
nothing encoding (the floor: the sleep's own lateness). To compare two
versions, run it with PYTHONPATH=<other checkout>/server, alternating.
Writes bench/results/checkpoint-encode.json (or --output).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # `python bench/checkpoint_encode.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.perf import log

TICK_S = 0.0005


class LateWakes:
    """A thread sleeping TICK_S at a time; `longest` is its longest gap
    between wakes since `start`."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(TICK_S)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self) -> LateWakes:
        self._thread.start()
        time.sleep(0.02)  # running before the measured work starts
        self.longest = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=str(common.RESULTS / "checkpoint-encode.json"))
    args = parser.parse_args(argv)
    from bots_server.core.checkpoint_state import encode_state
    from bots_server.engine import PosteriorState
    from bots_server.store import pieces

    rng = np.random.default_rng(0)
    n = args.tasks
    state = PosteriorState(rng.random(n) + 1, rng.random(n) + 1, rng.random(n), rng.random(n), 0.5, 0)
    machine = common.machine_info()
    encode_ms, wait_ms, floor_ms = [], [], []
    for _ in range(args.repeats):
        with LateWakes() as idle:
            time.sleep(0.03)
        floor_ms.append(idle.longest * 1e3)
        with LateWakes() as wakes:
            started = time.perf_counter()
            blob = encode_state(state)
            chunks = list(pieces.chunks(blob, pieces.chunk_bytes(blob)))
            encode_ms.append((time.perf_counter() - started) * 1e3)
        wait_ms.append(wakes.longest * 1e3)
        del blob, chunks
    result = {
        "machine": machine,
        "tasks": n,
        "repeats": args.repeats,
        "encode_ms": encode_ms,
        "longest_wait_ms": wait_ms,
        "idle_longest_wait_ms": floor_ms,
    }
    common.write_json(Path(args.output), result)
    log(f"Machine: {common.machine_line(machine)}")
    for label, values in (
        ("encode and chunks, ms", encode_ms),
        ("another thread's longest wait meanwhile, ms", wait_ms),
        ("the same wait with nothing encoding, ms", floor_ms),
    ):
        log(f"  {label}: median {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}), n={len(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
