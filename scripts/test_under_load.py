"""Run a command (by default the test suite) beside a CPU hog, as on a busy
CI machine: `make test-under-load` (RUNS=3 runs it three times in a row).

The hog is HOGS busy-looping processes at normal priority (default: three per
core, which keeps the load average at 6 or more on 2 cores with the suite's own
work on top). The load average is sampled every 10 s and its range printed at
the end, so a green run states the load it was green under. The hogs end with
this script, however it ends (they poll their parent), and never outlive
--max-minutes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time


def _spin(parent: int, until: float) -> None:
    x = 0
    while time.monotonic() < until:
        for _ in range(200_000):
            x += 1
        if os.getppid() != parent:  # the runner died: stop with it
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/test_under_load.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=3 * (os.cpu_count() or 1), help="busy processes (default 3/core)")
    parser.add_argument("--runs", type=int, default=1, help="run the command this many times in a row, stop at a failure")
    parser.add_argument("--max-minutes", type=float, default=240.0, help="the hogs stop after this long regardless")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command (default: make test)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    command = command or ["make", "test"]

    until = time.monotonic() + 60 * args.max_minutes
    hogs = [mp.Process(target=_spin, args=(os.getpid(), until), daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(10):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = 0
    try:
        for run in range(1, args.runs + 1):
            started = time.monotonic()
            print(f"== run {run}/{args.runs} beside {args.hogs} busy processes: {' '.join(command)}", flush=True)
            code = subprocess.call(command)
            minutes = (time.monotonic() - started) / 60
            print(f"== run {run}: exit {code} after {minutes:.1f} min", flush=True)
            if code != 0:
                break
    finally:
        done.set()
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join(10)
    if loads:
        print(f"== load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}, "
              f"median {sorted(loads)[len(loads) // 2]:.1f} on {os.cpu_count()} cores", flush=True)  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
