"""Crash soak: many random SIGKILLs against a training loop, bounded in time.

    .venv/bin/python scripts/soak.py --minutes 10 [--db sqlite|postgresql] [--kills-per-round 20]

Each round trains the same experiment twice, once while the server is killed
and restarted at random moments, and checks the final posterior is identical.
Exits 1 on the first divergence.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.crash import crash_run  # noqa: E402
from tests.support.servers import create_pg_database, drop_pg_database  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--kills-per-round", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    deadline = time.monotonic() + args.minutes * 60
    total_kills, rounds = 0, 0
    phases: dict[str, int] = {}
    while time.monotonic() < deadline:
        with tempfile.TemporaryDirectory() as tmp:
            if args.db == "sqlite":
                urls = (f"sqlite:///{tmp}/crash.db", f"sqlite:///{tmp}/reference.db")
            else:
                urls = (create_pg_database("bots_soak"), create_pg_database("bots_soak"))
            try:
                report = crash_run(*urls, kills=args.kills_per_round, steps=args.steps, seed=rounds, deadline=deadline)
            finally:
                if args.db == "postgresql":
                    for url in urls:
                        drop_pg_database(url)
        rounds += 1
        total_kills += report.kills
        for phase, n in report.phases.items():
            phases[phase] = phases.get(phase, 0) + n
        print(f"round {rounds}: {report.kills} kills, phases {report.phases}, identical={report.identical}", flush=True)
        if not report.identical:
            print("DIVERGED: the crashed run's posterior differs from the uninterrupted one", file=sys.stderr)
            return 1
    print(f"{rounds} rounds, {total_kills} kills (trainer waiting on: {phases}), every run identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
