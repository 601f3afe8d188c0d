"""What the bound on batches never reported costs a select.

    .venv/bin/python -m bench.unreported [--rounds 5] [--ops 200]

Every select counts the experiment's batches never reported (in the same
statement as its other checks), and past `Store.max_unreported_batches`
deletes the oldest expired one. This times the store's `insert_batch` (the
select's write transaction) on two experiments of one database, alternately:
"clean", whose batches are all reported (a trainer that reports), and
"at the bound", which holds the bound's number of expired batches never
reported (a trainer that never reports, at its worst): each insert counts
them, the first deletes a tenth of them, and the count is back at the bound
after as many inserts. Both backends, PostgreSQL also after a VACUUM of the
table (as autovacuum leaves it: the count then reads the index alone);
rounds interleaved. Writes bench/results/unreported.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
import uuid

import numpy as np

from bench.common import RESULTS, database, machine_info, machine_line, median_range, postgres_available, write_json
from bots_server.store import BatchRow, StepEvent, open_store
from bots_server.store.base import Store

POOL = 64
BATCH = 8


def _batch(now: dt.datetime, step: int, ttl_s: float, rng: np.random.Generator) -> BatchRow:
    tasks = rng.choice(POOL, BATCH, replace=False).tolist()
    key = uuid.uuid4().hex
    return BatchRow(key, key, step, tasks, now, now + dt.timedelta(seconds=ttl_s), None)


def _vacuum(url: str) -> None:
    """What autovacuum does to a table after this many inserts: the
    visibility map lets the count read the index alone."""
    import psycopg

    from bots_server.testing.postgres import pg_conninfo

    with psycopg.connect(pg_conninfo(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE batches")


def measure(backend: str, rounds: int, ops: int, vacuum: bool) -> dict[str, object]:
    bound = Store.max_unreported_batches
    rng = np.random.default_rng(0)
    with database(backend) as url:
        store = open_store(url)
        store.migrate()
        try:
            now = dt.datetime.now(dt.UTC)
            ids = {}
            for name in ("clean", "at the bound"):
                ids[name] = store.create_experiment(name, {}, now).id
                store.add_tasks(ids[name], 0, [f"k{i}" for i in range(POOL)], [{}] * POOL)
            for _ in range(bound):  # expired at once; none reported
                store.insert_batch(ids["at the bound"], _batch(now, 0, 0.0, rng), now)
            if vacuum and backend == "postgresql":
                _vacuum(url)
            step = 0
            times: dict[str, list[list[float]]] = {"clean": [], "at the bound": []}
            for _ in range(rounds):
                round_times: dict[str, list[float]] = {"clean": [], "at the bound": []}
                for _ in range(ops):
                    for name in ("clean", "at the bound"):
                        now = dt.datetime.now(dt.UTC)
                        row = _batch(now, step if name == "clean" else 0, 0.0, rng)
                        started = time.perf_counter()
                        store.insert_batch(ids[name], row, now)
                        round_times[name].append(time.perf_counter() - started)
                        if name == "clean":
                            n = len(row.task_idx)
                            event = StepEvent(
                                step + 1, row.batch_id, POOL, sorted(row.task_idx), [1.0] * n, [2] * n, 0.5, 0.25
                            )
                            store.commit_report(ids[name], step, event, now)
                            step += 1
                for name in times:
                    times[name].append(round_times[name])
            return {
                "backend": backend + (", after VACUUM" if vacuum and backend == "postgresql" else ""),
                "bound": bound,
                "rounds": rounds,
                "ops_per_round": ops,
                "p50_ms": {name: [float(np.median(r)) * 1e3 for r in runs] for name, runs in times.items()},
                "p99_ms": {name: [float(np.percentile(r, 99)) * 1e3 for r in runs] for name, runs in times.items()},
            }
        finally:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=200, help="inserts per experiment per round")
    args = parser.parse_args()
    info = machine_info()
    runs = [("sqlite", False)] + ([("postgresql", False), ("postgresql", True)] if postgres_available() else [])
    results = [measure(backend, args.rounds, args.ops, vacuum) for backend, vacuum in runs]
    write_json(RESULTS / "unreported.json", {"machine": info, "results": results})
    lines = [
        "# What the bound on batches never reported costs a select",
        "",
        f"`python -m bench.unreported --rounds {args.rounds} --ops {args.ops}`; {machine_line(info)}.",
        "",
        "The store's insert_batch (a select's write transaction), per round the median and p99 over "
        f"{args.ops} inserts; the table gives the median (min-max) over {args.rounds} interleaved rounds.",
        "",
        "| backend | experiment | p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for r in results:
        for name in ("clean", "at the bound"):
            label = name if name == "clean" else f"{r['bound'] * 9 // 10}-{r['bound']} expired, never reported"
            p50 = r["p50_ms"][name]  # type: ignore[index]
            p99 = r["p99_ms"][name]  # type: ignore[index]
            lines.append(f"| {r['backend']} | {label} | {median_range(p50, 2)} | {median_range(p99, 2)} |")
    (RESULTS / "unreported.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
