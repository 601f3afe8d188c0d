"""The floor under a select+report cycle in this stack: what one Python
gRPC (asyncio) server process does per second when a cycle does nothing but
its two calls, and when each call also commits one small PostgreSQL write
transaction through SQLAlchemy on a worker thread, as the service's calls do.

    .venv/bin/python -m bench.floor                      # 3 repeats x 10 s, 64 experiments' worth of callers
    .venv/bin/python -m bench.floor --with-bots          # and the real server (64 x 10k tasks), interleaved
    .venv/bin/python -m bench.floor --with-bots --callers 1 --output bench/results/floor-1   # one caller: latency
    .venv/bin/python -m bench.floor --backend sqlite ...  # the same on SQLite (no arrays, no COPY)
    .venv/bin/python -m bench.floor --with-bots --one-call   # and each with a cycle as one call (ReportAndSelect)

The driver is bench/perf.py's throughput loop: 64 concurrent callers in one
asyncio process, each a select then a report, batch 64. The modes, one
server process each, started afresh per repeat and interleaved:

- `grpc`: a generic unary handler that answers at once with as many bytes as
  a SelectBatch of 64 keys; no interceptors, no work. The ceiling of a
  Python asyncio gRPC server on this machine.
- `grpc+interceptors`: the same with the service's default interceptors
  (request ids, Prometheus RPC metrics).
- `grpc+sql`: the same as `grpc`, and each call runs one write transaction on a
  worker (8 threads, as --workers): lock the experiment's row, insert a
  batch row and its 64 task rows (select) or 64 outcome rows (report),
  advance the step, commit; the rows through executemany. Two transactions a cycle, as the service.
- `grpc+sql-arrays`: the same rows, but a step's 64 task or outcome rows
  bound as one array and inserted by one statement (unnest).
- `grpc+sql-copy`: the same rows through COPY, as the service's PostgreSQL
  store writes them.
- `bots` (--with-bots): `bots-server serve` itself, 64 experiments x 10k tasks.

With --one-call, the modes that can run again right after themselves with
a cycle as one call carrying both, written in one transaction (report
rows, then select rows): the floor of a ReportAndSelect step; `bots (one
call)` is the server stepped by ReportAndSelect.

Prints and writes cycles/s, cycle latency p50/p99 and server CPU ms per
cycle per mode, median (min-max) over the repeats (bench/results/floor.json|md).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/floor.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.perf import PerfConfig, _cpu_seconds, _self_cpu_seconds, _throughput_level, log

SERVICE = "floor.Floor"
BATCH = 64
# A SelectBatch answer for 64 keys of ~12 characters, and a report of as many outcomes.
ANSWER = b"x" * 1200
EXPERIMENTS = 64
MODES = ["grpc", "grpc+interceptors", "grpc+sql", "grpc+sql-arrays", "grpc+sql-copy"]
# What a call carries (its second byte): a select, a report, or both in one transaction.
_PARTS = {0: ("report",), 1: ("select",), 2: ("report", "select")}
# With --one-call, these modes run again with a cycle as one call ("bots": ReportAndSelect).
ONE_CALL = "(one call)"
ONE_CALL_MODES = {"grpc", "grpc+interceptors", "grpc+sql-copy", "bots"}
# On SQLite the rows go through the driver's executemany, as the store's do.
SQLITE_MODES = ["grpc", "grpc+interceptors", "grpc+sql"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS exp (id INTEGER PRIMARY KEY, step INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batch (id BIGSERIAL PRIMARY KEY, exp_id INTEGER NOT NULL, step INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batch_task (batch_id BIGINT NOT NULL, task_idx INTEGER NOT NULL,
                                       PRIMARY KEY (batch_id, task_idx));
CREATE TABLE IF NOT EXISTS outcome (exp_id INTEGER NOT NULL, step INTEGER NOT NULL, task_idx INTEGER NOT NULL,
                                    successes REAL NOT NULL, trials INTEGER NOT NULL,
                                    PRIMARY KEY (exp_id, step, task_idx));
"""


# -- the server side (a child process) -----------------------------------------------------------


def _locked_step(conn: Any, exp_id: int) -> int:
    """The experiment's row locked until the transaction ends, as the service's selects and reports lock it."""
    import sqlalchemy as sa

    return int(conn.execute(sa.text("SELECT step FROM exp WHERE id = :id FOR UPDATE"), {"id": exp_id}).scalar_one())


def _insert_batch_row(conn: Any, exp_id: int, step: int) -> int:
    import sqlalchemy as sa

    query = sa.text("INSERT INTO batch (exp_id, step) VALUES (:e, :s) RETURNING id")
    return int(conn.execute(query, {"e": exp_id, "s": step}).scalar_one())


def _transaction(engine: Any, exp_id: int, select: bool, rows: str) -> None:
    import sqlalchemy as sa

    if rows == "arrays":
        _transaction_with_arrays(engine, exp_id, select)
        return
    with engine.begin() as conn:
        step = _locked_step(conn, exp_id)
        if select:
            batch_id = _insert_batch_row(conn, exp_id, step)
            conn.execute(
                sa.text("INSERT INTO batch_task (batch_id, task_idx) VALUES (:b, :t)"),
                [{"b": batch_id, "t": t} for t in range(BATCH)],
            )
        else:
            conn.execute(
                sa.text("INSERT INTO outcome VALUES (:e, :s, :t, 1.0, 1)"),
                [{"e": exp_id, "s": step, "t": t} for t in range(BATCH)],
            )
            conn.execute(sa.text("UPDATE exp SET step = step + 1 WHERE id = :id"), {"id": exp_id})


_SQLITE_WRITER = threading.Lock()


def _sqlite_transaction(engine: Any, exp_id: int, parts: tuple[str, ...]) -> None:
    """The same rows on SQLite as the store writes them: one writer at a
    time in the process, BEGIN IMMEDIATE, WAL with synchronous=FULL (set at
    connect), the driver's executemany. `parts`: "report", "select" or both,
    in that order, in the one transaction."""
    with _SQLITE_WRITER, engine.connect() as conn:
        raw = conn.connection.driver_connection
        raw.execute("BEGIN IMMEDIATE")
        try:
            (step,) = raw.execute("SELECT step FROM exp WHERE id = ?", (exp_id,)).fetchone()
            if "report" in parts:
                raw.executemany(
                    "INSERT INTO outcome VALUES (?, ?, ?, 1.0, 1)", [(exp_id, step, t) for t in range(BATCH)]
                )
                raw.execute("UPDATE exp SET step = step + 1 WHERE id = ?", (exp_id,))
            if "select" in parts:
                (batch_id,) = raw.execute(
                    "INSERT INTO batch (exp_id, step) VALUES (?, ?) RETURNING id", (exp_id, step)
                ).fetchone()
                raw.executemany("INSERT INTO batch_task VALUES (?, ?)", [(batch_id, t) for t in range(BATCH)])
            raw.execute("COMMIT")
        except BaseException:
            raw.execute("ROLLBACK")
            raise


def _sqlite_engine(db: str) -> Any:
    import sqlalchemy as sa

    engine = sa.create_engine(db, connect_args={"check_same_thread": False, "timeout": 30})

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # transactions begun explicitly
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
        dbapi_connection.execute("PRAGMA synchronous=FULL")

    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        raw.executescript(_SCHEMA.replace("BIGSERIAL", "INTEGER"))
        for table in ("exp", "batch", "batch_task", "outcome"):
            raw.execute(f"DELETE FROM {table}")
        raw.executemany("INSERT INTO exp VALUES (?, 0)", [(i,) for i in range(EXPERIMENTS)])
    return engine


def _transaction_with_arrays(engine: Any, exp_id: int, select: bool) -> None:
    """The same rows, each step's 64 bound as one array (unnest): one
    statement per table instead of one row per task through executemany."""
    import sqlalchemy as sa

    tasks = list(range(BATCH))
    with engine.begin() as conn:
        step = _locked_step(conn, exp_id)
        if select:
            conn.execute(
                sa.text(
                    "WITH b AS (INSERT INTO batch (exp_id, step) VALUES (:e, :s) RETURNING id) "
                    "INSERT INTO batch_task SELECT b.id, unnest(CAST(:t AS integer[])) FROM b"
                ),
                {"e": exp_id, "s": step, "t": tasks},
            )
        else:
            conn.execute(
                sa.text(
                    "WITH o AS (INSERT INTO outcome SELECT :e, :s, unnest(CAST(:t AS integer[])), 1.0, 1) "
                    "UPDATE exp SET step = step + 1 WHERE id = :e"
                ),
                {"e": exp_id, "s": step, "t": tasks},
            )


def _transaction_with_copy(engine: Any, exp_id: int, parts: tuple[str, ...]) -> None:
    """The same rows through COPY, as the service's PostgreSQL store writes
    them. `parts`: "report", "select" or both, in that order, in the one
    transaction."""
    import sqlalchemy as sa

    with engine.begin() as conn:
        step = _locked_step(conn, exp_id)
        copies = []
        if "report" in parts:
            conn.execute(sa.text("UPDATE exp SET step = step + 1 WHERE id = :id"), {"id": exp_id})
            rows = [(exp_id, step, t, 1.0, 1) for t in range(BATCH)]
            copies.append(("COPY outcome (exp_id, step, task_idx, successes, trials) FROM STDIN", rows))
        if "select" in parts:
            batch_id = _insert_batch_row(conn, exp_id, step)
            copies.append(("COPY batch_task (batch_id, task_idx) FROM STDIN", [(batch_id, t) for t in range(BATCH)]))
        for sql, rows in copies:
            with conn.connection.driver_connection.cursor() as cursor, cursor.copy(sql) as copy:
                for row in rows:
                    copy.write_row(row)


async def _serve(mode: str, db: str) -> None:
    import grpc
    import sqlalchemy as sa

    engine = None
    pool = concurrent.futures.ThreadPoolExecutor(8)
    sqlite = db.startswith("sqlite")
    if mode.startswith("grpc+sql") and sqlite:
        engine = _sqlite_engine(db)
    elif mode.startswith("grpc+sql"):
        engine = sa.create_engine(db, pool_size=8, max_overflow=0)
        with engine.begin() as conn:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(sa.text(statement))
            conn.execute(sa.text("TRUNCATE exp, batch, batch_task, outcome"))
            conn.execute(sa.text("INSERT INTO exp VALUES (:id, 0)"), [{"id": i} for i in range(EXPERIMENTS)])

    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if engine is not None:
            exp_id, parts = request[0] % EXPERIMENTS, _PARTS[request[1]]
            loop = asyncio.get_running_loop()
            rows = mode.removeprefix("grpc+sql").removeprefix("-")  # "", "arrays" or "copy"
            if sqlite:
                await loop.run_in_executor(pool, _sqlite_transaction, engine, exp_id, parts)
            elif rows == "copy":
                await loop.run_in_executor(pool, _transaction_with_copy, engine, exp_id, parts)
            else:
                if len(parts) > 1:
                    raise ValueError(f"mode {mode} makes one call per part")
                await loop.run_in_executor(pool, _transaction, engine, exp_id, parts == ("select",), rows)
        return ANSWER

    handler = grpc.method_handlers_generic_handler(SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(call)})
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if mode == "grpc+interceptors":  # the service's default pair: request ids, Prometheus metrics
        from bots_server.metrics import Metrics
        from bots_server.service.interceptors import MetricsInterceptor, RequestIdInterceptor

        interceptors = [RequestIdInterceptor(), MetricsInterceptor(Metrics(version="floor").rpc)]
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


# -- the driver -----------------------------------------------------------------------------------


@dataclasses.dataclass
class FloorServer:
    proc: subprocess.Popen[str]
    port: int

    @classmethod
    def start(cls, mode: str, db: str) -> FloorServer:
        cmd = [sys.executable, "-m", "bench.floor", "--serve", mode, "--db", db]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=common.REPO)
        assert proc.stdout is not None
        return cls(proc, int(proc.stdout.readline()))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def _drive(port: int, pid: int, seconds: float, callers: int, one_call: bool) -> dict[str, Any]:
    """bench/perf.py's loop with raw calls: per caller, a 'select' then a
    'report', each one unary call; `one_call`: one call carrying both (as
    ReportAndSelect), which the server writes in one transaction."""
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(f"/{SERVICE}/Call")
    cycles: list[float] = []
    measuring = stop = False

    async def caller(i: int) -> None:
        report = bytes([i, 0]) + b"r" * 1500
        select = bytes([i, 1]) + b"s" * 40
        both = bytes([i, 2]) + b"r" * 1500 + b"s" * 40
        while not stop:
            started = time.perf_counter()
            if one_call:
                await call(both)
            else:
                await call(select)
                await call(report)
            if measuring:
                cycles.append(time.perf_counter() - started)

    running = [asyncio.create_task(caller(i)) for i in range(callers)]
    await asyncio.sleep(2.0)  # warm-up
    cpu0, self0 = _cpu_seconds(pid), _self_cpu_seconds()
    measuring, started = True, time.perf_counter()
    await asyncio.sleep(seconds)
    measuring, elapsed = False, time.perf_counter() - started
    cpu1, self1 = _cpu_seconds(pid), _self_cpu_seconds()
    stop = True
    await asyncio.gather(*running)
    await channel.close()
    return _result(len(cycles), elapsed, cycles, cpu1 - cpu0, self1 - self0)


def _result(count: int, elapsed: float, cycles: list[float], server_cpu: float, client_cpu: float) -> dict[str, Any]:
    p = common.percentiles(cycles)
    return {
        "cycles_per_s": count / elapsed,
        "cycle_p50_ms": p["p50"],
        "cycle_p99_ms": p["p99"],
        "server_cpu_ms_per_cycle": 1e3 * server_cpu / max(count, 1),
        "server_cpu_share": server_cpu / elapsed,
        "client_cpu_share": client_cpu / elapsed,
    }


def _run_bots(url: str, seconds: float, callers: int, one_call: bool) -> dict[str, Any]:
    import bots_client
    from bench.perf import experiment_config, make_tasks

    names = [f"floor-{i}" for i in range(EXPERIMENTS)]
    server = common.server_process(url).start()
    try:
        with bots_client.Client(server.address, timeout=600) as client:
            if not client.list_experiments():
                tasks = make_tasks(10_000)
                for name in names:
                    client.create_experiment(name, experiment_config())
                    client.add_tasks(name, tasks)
        cfg = PerfConfig(throughput_seconds=seconds, throughput_batch=BATCH)
        assert server.proc is not None
        kind = "combined" if one_call else "separate"
        level = asyncio.run(_throughput_level([server.address], names[:callers], cfg, [server.proc.pid], kind))
    finally:
        server.stop()
    steps, elapsed = level["steps"], level["steps"] / level["steps_per_s"]
    return {
        "cycles_per_s": level["steps_per_s"],
        "cycle_p50_ms": level["cycle"]["p50"],
        "cycle_p99_ms": level["cycle"]["p99"],
        "server_cpu_ms_per_cycle": 1e3 * level["server_cpu_share"] * elapsed / max(steps, 1),
        "server_cpu_share": level["server_cpu_share"],
        "client_cpu_share": level["client_cpu_share"],
        "errors": level["errors"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--db", default="", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=["postgresql", "sqlite"], default="postgresql")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--callers", type=int, default=EXPERIMENTS, help=f"concurrent callers (experiments), at most {EXPERIMENTS}"
    )
    parser.add_argument("--with-bots", action="store_true", help="also the real server, 64 experiments x 10k tasks")
    parser.add_argument(
        "--one-call",
        action="store_true",
        help="also each mode with a cycle as one call and one transaction (bots: ReportAndSelect)",
    )
    parser.add_argument("--output", default=str(common.RESULTS / "floor"))
    args = parser.parse_args(argv)
    if not 1 <= args.callers <= EXPERIMENTS:
        parser.error(f"--callers = {args.callers}: expected 1 to {EXPERIMENTS}")
    if args.serve:
        asyncio.run(_serve(args.serve, args.db))
        return 0

    info = common.machine_info()
    log(common.machine_line(info))
    modes = [*(SQLITE_MODES if args.backend == "sqlite" else MODES), *(["bots"] if args.with_bots else [])]
    if args.one_call:  # each mode that can, again with a cycle as one call, right after it
        # (SQLite's grpc+sql writes as the store does, so it can take both in one transaction.)
        capable = ONE_CALL_MODES | ({"grpc+sql"} if args.backend == "sqlite" else set())
        modes = [m for mode in modes for m in (mode, f"{mode} {ONE_CALL}" if mode in capable else None) if m]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with common.database(args.backend) as url, common.database(args.backend) as bots_url:
        for repeat in range(args.repeats):
            for mode in modes:
                one_call = mode.endswith(ONE_CALL)
                serve = mode.removesuffix(f" {ONE_CALL}")
                if serve == "bots":
                    result = _run_bots(bots_url, args.seconds, args.callers, one_call)
                else:
                    server = FloorServer.start(serve, url)
                    try:
                        result = asyncio.run(
                            _drive(server.port, server.proc.pid, args.seconds, args.callers, one_call)
                        )
                    finally:
                        server.stop()
                runs[mode].append(result)
                log(
                    f"  repeat {repeat + 1}, {mode}: {result['cycles_per_s']:.0f} cycles/s, "
                    f"p50 {result['cycle_p50_ms']:.1f} ms, p99 {result['cycle_p99_ms']:.1f} ms, "
                    f"server CPU {result['server_cpu_ms_per_cycle']:.2f} ms/cycle "
                    f"({result['server_cpu_share']:.2f} cores), client {result['client_cpu_share']:.2f} cores, "
                    f"load {os.getloadavg()[0]:.1f}"
                )
    lines = [
        f"Machine: {common.machine_line(info)}; {args.repeats} repeats x {args.seconds:g} s, interleaved; "
        f"{args.backend}; {args.callers} concurrent callers, batch {BATCH}; median (min-max).",
        "",
        "| mode | cycles/s | cycle p50, ms | cycle p99, ms | server CPU, ms/cycle | server cores | client cores |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, results in runs.items():
        cells = [
            common.median_range([r[k] for r in results], digits)
            for k, digits in [
                ("cycles_per_s", 0),
                ("cycle_p50_ms", 1),
                ("cycle_p99_ms", 1),
                ("server_cpu_ms_per_cycle", 2),
                ("server_cpu_share", 2),
                ("client_cpu_share", 2),
            ]
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    output = Path(args.output)
    common.write_json(output.with_suffix(".json"), {"machine": info, "args": vars(args), "runs": runs})
    output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
