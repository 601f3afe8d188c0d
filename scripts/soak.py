"""Crash soak: many random SIGKILLs against a training loop, bounded in time.

    .venv/bin/python scripts/soak.py --kills 1000 --minutes 60 [--db sqlite|postgresql|both]

Each round trains the same experiment twice, once while the server is killed
and restarted at random moments, and checks that every acknowledged report
was applied exactly once (lost / doubled) and that the final posterior and
every selected batch are identical to the uninterrupted run. Rounds alternate
between the backends with --db both. Stops after --kills kills or --minutes;
exits 1 on the first divergence, 2 if the time ran out before --kills.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.crash import crash_run
from tests.support.servers import create_pg_database, drop_pg_database


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=1000, help="stop after this many kills")
    parser.add_argument("--minutes", type=float, default=60.0, help="and at the latest after this long")
    parser.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--kills-per-round", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.minutes * 60
    backends = ("sqlite", "postgresql") if args.db == "both" else (args.db,)
    kills: dict[str, int] = dict.fromkeys(backends, 0)
    lost = doubled = rounds = 0
    phases: dict[str, int] = {}
    for backend in itertools.cycle(backends):
        total = sum(kills.values())
        if total >= args.kills or time.monotonic() >= deadline:
            break
        with tempfile.TemporaryDirectory() as tmp:
            if backend == "sqlite":
                urls = (f"sqlite:///{tmp}/crash.db", f"sqlite:///{tmp}/reference.db")
            else:
                urls = (create_pg_database("bots_soak"), create_pg_database("bots_soak"))
            try:
                report = crash_run(
                    *urls, kills=min(args.kills_per_round, args.kills - total), steps=args.steps, seed=rounds,
                    deadline=deadline,
                )  # fmt: skip
            finally:
                if backend == "postgresql":
                    for url in urls:
                        drop_pg_database(url)
        rounds += 1
        kills[backend] += report.kills
        lost += report.lost
        doubled += report.doubled
        for phase, n in report.phases.items():
            phases[phase] = phases.get(phase, 0) + n
        print(
            f"round {rounds} ({backend}): {report.kills} kills, phases {report.phases}, lost {report.lost}, "
            f"doubled {report.doubled}, identical={report.identical}",
            flush=True,
        )
        if not report.identical or report.lost or report.doubled:
            print("DIVERGED: the crashed run differs from the uninterrupted one", file=sys.stderr)
            return 1
    minutes = (time.monotonic() - started) / 60
    print(
        f"{rounds} rounds, {sum(kills.values())} kills ({kills}) in {minutes:.1f} min; trainer waiting on: {phases}; "
        f"lost {lost}, doubled {doubled}; every run identical"
    )
    return 0 if sum(kills.values()) >= args.kills else 2


if __name__ == "__main__":
    sys.exit(main())
