"""Database bytes per step: how the event log and the batch records grow.

    .venv/bin/python -m bench.storage [--steps 300] [--pool 4096] [--batch 256]
    .venv/bin/python -m bench.storage --steps 1200 --retention-steps 200   # with compaction

A trainer loop (select, report) against a real server on each backend; the
size of every table is read before and after, and divided by the steps:
SQLite's dbstat (pages in use per table and index), PostgreSQL's
pg_total_relation_size (table, indexes and TOAST). Without compaction
(the default here, --retention-steps 0) this is what the event log costs
per step; with it, the second half's growth per step ("steady") shows
whether the database stopped growing (on PostgreSQL the run VACUUMs the
two tables between compactions, standing in for autovacuum). Writes
bench/results/storage.json
and .md (storage-compacted.* with --retention-steps).
"""

from __future__ import annotations

import argparse
import hashlib
import sqlite3
import sys
import time

import numpy as np
import psycopg

from bench.common import (
    RESULTS,
    database,
    machine_info,
    machine_line,
    postgres_available,
    server_process,
    write_json,
)

# The tables that grow with steps (a step's outcomes and a batch's tasks are
# one value each since revision 0009); the rest (experiments, tasks,
# checkpoints) are sized by the pool, not by the run's length.
GROWING = ("steps", "step_outcomes", "batches", "batch_task_lists")


def table_bytes(url: str) -> dict[str, int]:
    """Bytes of each table with its indexes."""
    if url.startswith("sqlite"):
        path = url.split(":///", 1)[1]
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            indexes = dict(conn.execute("SELECT name, tbl_name FROM sqlite_schema WHERE type = 'index'").fetchall())
            sizes: dict[str, int] = {}
            for name, size in conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"):
                table = indexes.get(name, name)
                sizes[table] = sizes.get(table, 0) + int(size)
            return sizes
    from bots_server.testing.postgres import pg_conninfo

    with psycopg.connect(pg_conninfo(url)) as conn:
        rows = conn.execute(
            "SELECT relname, pg_total_relation_size(oid) FROM pg_class WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace"
        ).fetchall()
        return {name: int(size) for name, size in rows}


def vacuum(url: str) -> None:
    """PostgreSQL: make the space of deleted rows reusable, as autovacuum
    does in a long run (by default once a fifth of a table's rows are dead);
    a run of minutes would otherwise end before autovacuum's first pass."""
    if url.startswith("sqlite"):
        return  # SQLite reuses freed pages at once
    from bots_server.testing.postgres import pg_conninfo

    with psycopg.connect(pg_conninfo(url), autocommit=True) as conn:
        conn.execute("VACUUM step_outcomes, batch_task_lists")


def outcome(key: str, step: int) -> tuple[float, int]:
    h = int.from_bytes(hashlib.sha256(f"{key}/{step}".encode()).digest()[:8], "little")
    return float(h % 9), 8


def run(
    backend: str, steps: int, pool: int, batch: int, retention: int = 0, checkpoint_every: int = 100
) -> dict[str, object]:
    import bots_client
    from bots_client import ExperimentConfig, Task

    args = ["--event-retention-steps", str(retention), "--checkpoint-every-steps", str(checkpoint_every)]
    with database(backend) as url:
        server = server_process(url, args).start()
        try:
            with bots_client.Client(server.address) as client:
                client.create_experiment("run", ExperimentConfig(seed=1, weak_feature="w", strong_feature="s"))
                weak = np.random.default_rng(0).uniform(0, 0.8, pool)
                client.add_tasks("run", [Task(f"task-{i:06d}", {"w": float(w), "s": float(min(1.0, w + 0.2))}) for i, w in enumerate(weak)])
                before = table_bytes(url)
                started = time.perf_counter()
                for step in range(steps):
                    if retention and step % checkpoint_every == checkpoint_every // 2:
                        vacuum(url)  # between compactions, as autovacuum would
                    if step == steps // 2:
                        middle = table_bytes(url)
                    chosen = client.select_batch("run", batch, request_key=f"step-{step}")
                    client.report_outcomes("run", chosen.batch_id, {k: outcome(k, step) for k in chosen.keys})
                seconds = time.perf_counter() - started
                after = table_bytes(url)
        finally:
            server.stop()
    per_step = {t: (after.get(t, 0) - before.get(t, 0)) / steps for t in GROWING}
    second_half = steps - steps // 2
    steady = sum(after.get(t, 0) - middle.get(t, 0) for t in GROWING) / second_half
    return {
        "backend": backend,
        "steps": steps,
        "pool": pool,
        "batch": batch,
        "retention_steps": retention,
        "checkpoint_every_steps": checkpoint_every,
        "steady_bytes_per_step": round(steady),
        "growing_tables_bytes": sum(after.get(t, 0) for t in GROWING),
        "bytes_per_step": {t: round(v) for t, v in per_step.items()},
        "bytes_per_step_total": round(sum(per_step.values())),
        "tables_after": after,
        "seconds": round(seconds, 1),
    }


def markdown(info: dict[str, object], results: list[dict[str, object]]) -> str:
    lines = [
        "# Database bytes per step",
        "",
        f"`python -m bench.storage` on {machine_line(info)}.",
        "",
        "| backend | steps | pool | batch | retention | steps table | step_outcomes | batches | batch_task_lists "
        "| total per step | second half, per step | growing tables at the end | 100k steps at the total rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        b = r["bytes_per_step"]
        assert isinstance(b, dict)
        total = int(r["bytes_per_step_total"])  # type: ignore[call-overload]
        lines.append(
            f"| {r['backend']} | {r['steps']} | {r['pool']} | {r['batch']} | {r['retention_steps'] or 'all'} | "
            f"{b['steps']} | {b['step_outcomes']} | {b['batches']} | {b['batch_task_lists']} | {total / 1024:.1f} KiB | "
            f"{int(r['steady_bytes_per_step']) / 1024:.1f} KiB | {int(r['growing_tables_bytes']) / 2**20:.1f} MiB | "  # type: ignore[call-overload]
            f"{total * 100_000 / 2**30:.1f} GiB |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pool", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--retention-steps", type=int, default=0, help="compaction's retention; 0: keep every event")
    parser.add_argument("--checkpoint-every-steps", type=int, default=100)
    args = parser.parse_args()
    info = machine_info()
    backends = ["sqlite"] + (["postgresql"] if postgres_available() else [])
    results = [
        run(b, args.steps, args.pool, args.batch, args.retention_steps, args.checkpoint_every_steps) for b in backends
    ]
    name = "storage-compacted" if args.retention_steps else "storage"
    write_json(RESULTS / f"{name}.json", {"machine": info, "results": results})
    text = markdown(info, results)
    (RESULTS / f"{name}.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
