"""How long does the database driver hold Python's GIL while it fetches
many rows? The largest gap of a thread that wakes every 0.5 ms, while the
main thread reads 250k tasks' features (one JSON text a row, as the tasks
table holds them) in one fetch and in fetches of 250 rows.

    .venv/bin/python -m bench.fetch_hold                    # both backends, 3 repeats each
    .venv/bin/python -m bench.fetch_hold --backend sqlite --rows 100000

A gap near the whole fetch's time means every other thread of the process
(in the server: the event loop, every trainer's call) waited for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/fetch_hold.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bots_server.store.sql_base import ROWS_PER_PACE as PART_ROWS  # the store's fetch size


def largest_gap(read: Any) -> tuple[float, float]:
    """(seconds `read()` took, the ticker thread's largest gap in seconds)."""
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    started = time.perf_counter()
    read()
    took = time.perf_counter() - started
    stop.set()
    ticker.join()
    return took, max(gaps)


def run_backend(backend: str, rows: int, repeats: int) -> list[dict[str, Any]]:
    import sqlalchemy as sa

    with common.database(backend) as url:
        engine = sa.create_engine(url)
        meta = sa.MetaData()
        table = sa.Table("rows", meta, sa.Column("i", sa.Integer, primary_key=True), sa.Column("features", sa.Text))
        meta.create_all(engine)
        encoded = json.dumps({"weak": 0.5, "strong": 0.5})
        with engine.begin() as conn:
            conn.execute(table.insert(), [{"i": i, "features": encoded} for i in range(rows)])
        query = sa.select(table.c.features).order_by(table.c.i)

        def at_once() -> None:
            with engine.connect() as conn:
                assert len(conn.execute(query).scalars().all()) == rows

        def in_parts() -> None:
            with engine.connect() as conn:
                parts = conn.execution_options(yield_per=PART_ROWS).execute(query).scalars().partitions()
                assert sum(len(part) for part in parts) == rows

        results = []
        for repeat in range(repeats):  # the two ways interleaved
            for how, read in (("one fetch", at_once), (f"fetches of {PART_ROWS}", in_parts)):
                took, gap = largest_gap(read)
                results.append(
                    {"backend": backend, "how": how, "repeat": repeat, "read_ms": took * 1e3, "gap_ms": gap * 1e3}
                )
                print(f"{backend:10s} {how:15s} read {took * 1e3:5.0f} ms, largest gap {gap * 1e3:5.0f} ms", flush=True)
        engine.dispose()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    info = common.machine_info()
    print(common.machine_line(info), flush=True)
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    results = [r for b in backends for r in run_backend(b, args.rows, args.repeats)]
    for backend in backends:
        for how in ("one fetch", f"fetches of {PART_ROWS}"):
            mine = [r for r in results if r["backend"] == backend and r["how"] == how]
            print(
                f"{backend:10s} {how:15s} read ms {common.median_range([r['read_ms'] for r in mine], 0)}, "
                f"largest gap ms {common.median_range([r['gap_ms'] for r in mine], 0)}"
            )
    if args.json:
        common.write_json(Path(args.json), {"machine": info, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
