"""Performance benchmark: what the service costs a trainer, on SQLite and PostgreSQL.

    .venv/bin/python -m bench.perf            # pools of 10k, 100k, 1M tasks, both backends (~15 min)
    .venv/bin/python -m bench.perf --quick    # 10k and 100k, fewer steps, short throughput windows (~3 min)
    .venv/bin/python -m bench.perf --backends sqlite --pools 100000

For every backend and pool size (batch 256, BOTS defaults with the
interpolation plug-in, a `bots-server serve` child process on loopback):

- SelectBatch and ReportOutcomes latency over the socket (p50, p90, p99,
  max), beside the in-process engine step (select + update) on the same pool;
- rows inserted per report and per select (table row counts), bytes written
  per call (SQLite: the server's write() bytes; PostgreSQL: WAL bytes, the
  median of per-call deltas since the cluster is shared) and bytes stored per
  step;
- time to rebuild the experiment after a graceful restart (checkpoint only)
  and after a crash (checkpoint + replay), and the server's memory per task.

Then, per backend: throughput with 1, 8 and 64 concurrent experiments, and an
in-process breakdown of one select and one report (each store call, the
engine, SQL statements and rows), which locates the overhead over the engine.
Finally a history probe times the lease query with 0, 1000 and 5000 reported
batches in the table.

Prints tables and writes bench/results/perf.json (perf-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime as dt
import functools
import json
import re
import resource
import sqlite3
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # `python bench/perf.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.common import median_range as span

BATCH = 256
ROLLOUTS = 16
TABLES = ("experiments", "tasks", "checkpoints", "steps", "step_outcomes", "batches", "batch_task_lists")


@dataclass(frozen=True)
class PerfConfig:
    backends: tuple[str, ...] = ("sqlite", "postgresql")
    pools: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    batch_size: int = BATCH
    steps: tuple[tuple[int, int], ...] = ((10_000, 150), (100_000, 150), (1_000_000, 150))  # pool -> measured steps
    engine_steps: int = 30
    crash_steps: int = 20  # steps after the last checkpoint before the simulated crash
    throughput_levels: tuple[int, ...] = (1, 8, 64)
    throughput_pool: int = 10_000
    throughput_seconds: float = 10.0
    throughput_batch: int = 64  # the 64 experiments x 10k tasks, batch 64
    throughput_replicas: tuple[int, ...] = (1, 2, 3)  # servers on one database (PostgreSQL only)
    # `serve --processes P` (PostgreSQL only), one address, each loop on a connection of its own.
    throughput_processes: tuple[int, ...] = ()
    # How a loop steps: "separate" SelectBatch + ReportOutcomes, "combined" ReportAndSelect; each level runs each, in turn.
    throughput_steps: tuple[str, ...] = ("separate", "combined")
    throughput_clients: int = 1  # processes of the bench's own client loops
    breakdown_pool: int = 100_000
    breakdown_steps: int = 60
    history_batches: tuple[int, ...] = (0, 1000, 5000)
    contention_seconds: float = 8.0
    repeats: int = 3  # interleaved runs per backend and pool
    interleaved_server_args: tuple[str, ...] = ()  # extra flags of the interleaved run's server

    def steps_for(self, pool: int) -> int:
        table = dict(self.steps)
        return table.get(pool, min(table.values()) if pool > max(table) else max(table.values()))


QUICK = PerfConfig(
    pools=(10_000, 100_000),
    steps=((10_000, 60), (100_000, 60)),
    engine_steps=15,
    crash_steps=10,
    throughput_seconds=3.0,
    throughput_replicas=(1,),
    breakdown_steps=30,
    history_batches=(0, 1000),
    contention_seconds=3.0,
    repeats=2,
)


def experiment_config() -> Any:
    import bots_client

    return bots_client.ExperimentConfig(
        weak_feature="weak", strong_feature="strong", rollouts_per_task=ROLLOUTS, seed=7
    )


def server_config() -> Any:
    """experiment_config() as the server's own type, for the in-process service."""
    import dataclasses

    from bots_server.core.domain import ExperimentConfig

    return ExperimentConfig(**dataclasses.asdict(experiment_config()))


def server_tasks(n: int) -> Any:
    """make_tasks(n) as the server's own type, for the in-process service."""
    from bots_server.core.domain import NewTasks

    tasks = make_tasks(n)
    return NewTasks([t.key for t in tasks], [dict(t.features) for t in tasks], [""] * n)


def reference_rates(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    weak = rng.beta(0.7, 1.3, size=n)
    strong = np.minimum(1.0, weak + rng.beta(1.5, 3.0, size=n))
    return weak, strong


def make_tasks(n: int, seed: int = 0) -> list[Any]:
    import bots_client

    weak, strong = reference_rates(n, seed)
    return [
        bots_client.Task(f"task-{i:07d}", {"weak": w, "strong": s})
        for i, (w, s) in enumerate(zip(weak.tolist(), strong.tolist(), strict=True))
    ]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the in-process engine baseline ----------------------------------------------------------


def engine_baseline(n: int, batch: int, steps: int) -> dict[str, Any]:
    """select(B) + apply_outcomes on n tasks, as the server runs them, in this process."""
    from bots_server.engine import EngineParams, PosteriorState, apply_outcomes, select, step_rng

    params = EngineParams.of(experiment_config())
    weak, strong = reference_rates(n)
    state = PosteriorState.from_prior(params, weak, strong)
    rng = np.random.default_rng(1)
    t_select, t_update, t_step = [], [], []
    for i in range(steps + 2):
        started = time.perf_counter()
        available = np.ones(n, dtype=bool)
        chosen = select(params, state.alpha, state.beta, available, batch, step_rng(7, i, f"bench-{i}"))
        mid = time.perf_counter()
        idx = np.sort(chosen)
        result = apply_outcomes(
            params, state, idx, rng.integers(0, ROLLOUTS + 1, batch).astype(np.float64), np.full(batch, float(ROLLOUTS))
        )
        state = result.state
        end = time.perf_counter()
        if i >= 2:  # warm-up
            t_select.append(mid - started)
            t_update.append(end - mid)
            t_step.append(end - started)
    return {
        "select": common.percentiles(t_select),
        "update": common.percentiles(t_update),
        "step": common.percentiles(t_step),
    }


class EngineStep:
    """The in-process reference step on its own copy of a pool, one step per
    call, so that it can be timed interleaved with the socket calls on the
    same pool: select B + update in plain numpy, the code a trainer would
    run instead of the service (bench/reference_engine.py: the engine before
    its fast paths, the same batches and posteriors bit for bit)."""

    def __init__(self, n: int, batch: int) -> None:
        from bots_server.engine import EngineParams, PosteriorState

        # Stream 1: the reference code's draw, one call over the pool.
        self.params = dataclasses.replace(EngineParams.of(experiment_config()), random_stream=1)
        weak, strong = reference_rates(n)
        self.state = PosteriorState.from_prior(self.params, weak, strong)
        self.available = np.ones(n, dtype=bool)
        self.batch = batch
        self.rng = np.random.default_rng(1)
        self.i = 0

    def step(self) -> float:
        """One step; its seconds."""
        from bench.reference_engine import ref_apply_outcomes as apply_outcomes
        from bench.reference_engine import ref_select as select
        from bots_server.engine import step_rng

        outcomes = self.rng.integers(0, ROLLOUTS + 1, self.batch).astype(np.float64)
        started = time.perf_counter()
        rng = step_rng(7, self.i, f"e-{self.i}")
        chosen = select(self.params, self.state.alpha, self.state.beta, self.available, self.batch, rng)
        idx = np.sort(chosen)
        self.state = apply_outcomes(self.params, self.state, idx, outcomes, np.full(self.batch, float(ROLLOUTS))).state
        self.i += 1
        return time.perf_counter() - started


def interleaved_run(backend: str, url: str, n: int, cfg: PerfConfig) -> dict[str, Any]:
    """The round trip against the reference step, honestly: each step of the
    reference alternates with one socket step of each kind on the same pool
    in this process, in an order that rotates, so load that comes and goes
    hits all alike. The two kinds step twin experiments on one server:
    `separate` a SelectBatch then a ReportOutcomes, `combined` one
    ReportAndSelect (reporting the batch the previous call returned). Also
    the server's CPU seconds per step of each kind."""
    import bots_client

    server = common.server_process(url, cfg.interleaved_server_args).start()
    engine = EngineStep(n, cfg.batch_size)
    rng = np.random.default_rng(2)
    separate, combined = f"inter-{n}", f"inter-combined-{n}"
    try:
        with bots_client.Client(server.address, timeout=600) as client:
            for name in (separate, combined):
                client.create_experiment(name, experiment_config())
                client.add_tasks(name, make_tasks(n))
            open_batch = client.select_batch(combined, cfg.batch_size, "warm-open")
            for i in range(3):  # warm-up, every side
                _cycle(client, separate, f"warm-{i}", rng, cfg.batch_size)
                _, open_batch = client.report_and_select(
                    combined, open_batch.batch_id, random_outcomes(open_batch.keys, rng), cfg.batch_size, f"warm-{i}"
                )
                engine.step()
            steps = cfg.steps_for(n)
            trips, selects, reports, combined_trips, reference = [], [], [], [], []
            cpu = {"separate": 0.0, "combined": 0.0}

            def step_separate(i: int) -> None:
                t0 = time.perf_counter()
                batch = client.select_batch(separate, cfg.batch_size, f"inter-{i}")
                t1 = time.perf_counter()
                outcomes = random_outcomes(batch.keys, rng)
                t2 = time.perf_counter()
                client.report_outcomes(separate, batch.batch_id, outcomes)
                t3 = time.perf_counter()
                selects.append(t1 - t0)
                reports.append(t3 - t2)
                trips.append((t1 - t0) + (t3 - t2))

            def step_combined(i: int) -> None:
                nonlocal open_batch
                outcomes = random_outcomes(open_batch.keys, rng)
                t0 = time.perf_counter()
                _, open_batch = client.report_and_select(
                    combined, open_batch.batch_id, outcomes, cfg.batch_size, f"inter-{i}"
                )
                combined_trips.append(time.perf_counter() - t0)

            def timed_cpu(kind: str, fn: Callable[[int], None], i: int) -> None:
                # CPU ticks are coarse, but a tick lands in a step with the
                # step's share of the time: the sums over all steps are fair.
                before = _cpu_seconds(server.proc.pid)
                fn(i)
                cpu[kind] += _cpu_seconds(server.proc.pid) - before

            sides = [
                lambda i: reference.append(engine.step()),
                lambda i: timed_cpu("separate", step_separate, i),
                lambda i: timed_cpu("combined", step_combined, i),
            ]
            for i in range(steps):
                for k in range(3):
                    sides[(i + k) % 3](i)
    finally:
        server.stop()
    trip, ref, both = common.percentiles(trips), common.percentiles(reference), common.percentiles(combined_trips)
    out = {
        "backend": backend,
        "pool": n,
        "steps": steps,
        "round_trip": trip,
        "select": common.percentiles(selects),
        "report": common.percentiles(reports),
        "combined_round_trip": both,
        "reference_step": ref,
        "ratio_p50": trip["p50"] / ref["p50"],
        "combined_ratio_p50": both["p50"] / ref["p50"],
        "p99_over_p50": trip["p99"] / trip["p50"],
        "combined_p99_over_p50": both["p99"] / both["p50"],
        # Include the background checkpoints the run triggers (every 100 steps by default).
        "server_cpu_ms_per_step": cpu["separate"] / steps * 1e3,
        "combined_server_cpu_ms_per_step": cpu["combined"] / steps * 1e3,
    }
    log(
        f"    {backend} {n:>9,}: reference step p50 {ref['p50']:.1f} ms; separate calls p50 {trip['p50']:.1f} ms "
        f"(p99 {trip['p99']:.1f}) {out['ratio_p50']:.2f}x, server CPU {out['server_cpu_ms_per_step']:.1f} ms/step; "
        f"ReportAndSelect p50 {both['p50']:.1f} ms (p99 {both['p99']:.1f}) {out['combined_ratio_p50']:.2f}x, "
        f"server CPU {out['combined_server_cpu_ms_per_step']:.1f} ms/step"
    )
    return out


def _interleaved_table(runs: list[dict[str, Any]]) -> list[str]:
    """Medians and ranges over the repeated runs, per backend, pool and kind of step."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["backend"], r["pool"]), []).append(r)

    lines = [
        (
            "Round trip over the socket against the in-process reference step (select + update), timed in "
            "turn in the same process on the same pool; `separate`: SelectBatch + ReportOutcomes, `combined`: "
            "ReportAndSelect; median over the runs (min-max):"
        ),
        "",
        "| backend | pool | step | runs x steps | round trip p50 ms | reference step p50 ms | ratio | round trip p99 / p50 | server CPU ms per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (backend, pool), rs in groups.items():
        for kind, prefix in (("separate", ""), ("combined", "combined_")):
            if prefix + "round_trip" not in rs[0]:
                continue
            lines.append(
                f"| {backend} | {pool:,} | {kind} | {len(rs)} x {rs[0]['steps']} "
                f"| {span([r[prefix + 'round_trip']['p50'] for r in rs])} "
                f"| {span([r['reference_step']['p50'] for r in rs])} | {span([r[prefix + 'ratio_p50'] for r in rs], 2)}x "
                f"| {span([r[prefix + 'p99_over_p50'] for r in rs], 2)} "
                f"| {span([r[prefix + 'server_cpu_ms_per_step'] for r in rs])} |"
            )
    return lines + [""]


# -- database probes ---------------------------------------------------------------------------


class DbProbe:
    """Reads the benchmark's own database from outside the server: row counts,
    stored bytes, and (PostgreSQL) the WAL position and table statistics."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            self.path = url.removeprefix("sqlite:///")
            self._pg = None
        else:
            import psycopg

            params = url.removeprefix("postgresql+psycopg://")
            user_host, dbname = params.rsplit("/", 1)
            user, hostport = user_host.split("@")
            host, port = hostport.split(":")
            self._pg = psycopg.connect(host=host, port=int(port), user=user, dbname=dbname, autocommit=True)

    def close(self) -> None:
        if self._pg is not None:
            self._pg.close()

    def counts(self) -> dict[str, int]:
        if self.is_sqlite:
            with sqlite3.connect(self.path, timeout=30) as conn:
                return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}
        assert self._pg is not None
        return {t: self._pg.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}

    def stored_bytes(self) -> int:
        """SQLite: database file size after moving the WAL into it; PostgreSQL:
        heap + index + TOAST size of the service's tables."""
        if self.is_sqlite:
            with sqlite3.connect(self.path, timeout=30) as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                pages = conn.execute("PRAGMA page_count").fetchone()[0]
                size = conn.execute("PRAGMA page_size").fetchone()[0]
                return int(pages * size)
        assert self._pg is not None
        return int(
            self._pg.execute(
                "SELECT sum(pg_total_relation_size(quote_ident(t))) FROM unnest(%s::text[]) AS t", [list(TABLES)]
            ).fetchone()[0]
        )

    def wal_lsn(self) -> int | None:
        if self._pg is None:
            return None
        return int(self._pg.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()[0])


# -- over the socket: one pool size ----------------------------------------------------------------


def socket_run(backend: str, url: str, n: int, cfg: PerfConfig) -> dict[str, Any]:
    """Latency, writes, restart and memory for one pool on one backend."""
    import bots_client

    out: dict[str, Any] = {"backend": backend, "pool": n, "batch": cfg.batch_size}
    probe = DbProbe(url)
    server = common.server_process(url).start()
    try:
        out["rss_empty_server"] = common.rss_bytes(server.proc.pid)[0]
        name = f"perf-{n}"
        with bots_client.Client(server.address, timeout=600) as client:
            client.create_experiment(name, experiment_config())
            tasks = make_tasks(n)
            started = time.perf_counter()
            client.add_tasks(name, tasks)
            out["add_tasks_s"] = time.perf_counter() - started
            del tasks
            log(f"    {backend} {n:>9,} tasks: added in {out['add_tasks_s']:.1f} s")
            rng = np.random.default_rng(2)
            for i in range(3):  # warm-up
                _cycle(client, name, f"warm-{i}", rng, cfg.batch_size)
            steps = cfg.steps_for(n)
            counts0, stored0 = probe.counts(), probe.stored_bytes()
            sel, rep, sel_io, rep_io, sel_wal, rep_wal = [], [], [], [], [], []
            pid = server.proc.pid
            for i in range(steps):
                io0, wal0 = common.io_counters(pid), probe.wal_lsn()
                t0 = time.perf_counter()
                batch = client.select_batch(name, cfg.batch_size, f"bench-{i}")
                t1 = time.perf_counter()
                io1, wal1 = common.io_counters(pid), probe.wal_lsn()
                outcomes = random_outcomes(batch.keys, rng)
                t2 = time.perf_counter()
                client.report_outcomes(name, batch.batch_id, outcomes)
                t3 = time.perf_counter()
                io2, wal2 = common.io_counters(pid), probe.wal_lsn()
                sel.append(t1 - t0)
                rep.append(t3 - t2)
                sel_io.append((io1["wchar"] - io0["wchar"], io1["write_bytes"] - io0["write_bytes"]))
                rep_io.append((io2["wchar"] - io1["wchar"], io2["write_bytes"] - io1["write_bytes"]))
                if wal0 is not None and wal1 is not None and wal2 is not None:
                    sel_wal.append(wal1 - wal0)
                    rep_wal.append(wal2 - wal1)
            counts1, stored1 = probe.counts(), probe.stored_bytes()
            out["steps"] = steps
            out["select"] = common.percentiles(sel)
            out["report"] = common.percentiles(rep)
            out["round_trip_p50_ms"] = out["select"]["p50"] + out["report"]["p50"]
            fifth = max(1, steps // 5)  # growth with the experiment's history (same pool, more batches)
            out["select_p50_first_fifth"] = float(np.median(sel[:fifth])) * 1e3
            out["select_p50_last_fifth"] = float(np.median(sel[-fifth:])) * 1e3
            out["report_p50_first_fifth"] = float(np.median(rep[:fifth])) * 1e3
            out["report_p50_last_fifth"] = float(np.median(rep[-fifth:])) * 1e3
            out["select_ms_all"] = [round(x * 1e3, 3) for x in sel]
            out["report_ms_all"] = [round(x * 1e3, 3) for x in rep]
            inserted = {t: counts1[t] - counts0[t] for t in TABLES}
            out["rows_inserted"] = inserted
            out["rows_inserted_per_step"] = {t: v / steps for t, v in inserted.items() if v}
            out["stored_bytes_per_step"] = (stored1 - stored0) / steps
            out["server_wchar_per_select"] = float(np.median([x[0] for x in sel_io]))
            out["server_wchar_per_report"] = float(np.median([x[0] for x in rep_io]))
            out["server_write_bytes_per_report"] = float(np.median([x[1] for x in rep_io]))
            if rep_wal:
                out["wal_bytes_per_select"] = float(np.median(sel_wal))
                out["wal_bytes_per_report"] = float(np.median(rep_wal))
            checkpoints = [e for e in server.log_lines if e.get("message") == "checkpoint written"]
            out["checkpoints_during_run"] = [{"step": e.get("step"), "seconds": e.get("seconds")} for e in checkpoints]
            log(
                f"    {backend} {n:>9,} tasks: select p50 {out['select']['p50']:.1f} ms p99 {out['select']['p99']:.1f}, "
                f"report p50 {out['report']['p50']:.1f} ms p99 {out['report']['p99']:.1f} ({steps} steps, "
                f"{len(checkpoints)} checkpoints); select p50 first fifth {out['select_p50_first_fifth']:.1f} ms, "
                f"last fifth {out['select_p50_last_fifth']:.1f} ms"
            )
        # Graceful restart: the server checkpoints at shutdown; the new one loads the checkpoint.
        started = time.perf_counter()
        server.stop()
        out["graceful_stop_s"] = time.perf_counter() - started
        out["restart"] = _restart(url, name, n, cfg, rng, crash=False)
        out["crash_restart"] = _restart(url, name, n, cfg, rng, crash=True)
        log(
            f"    {backend} {n:>9,} tasks: rebuild after restart {out['restart']['rebuild_s']:.2f} s, after crash "
            f"{out['crash_restart']['rebuild_s']:.2f} s ({out['crash_restart'].get('replayed_steps')} steps replayed), "
            f"memory {out['restart']['bytes_per_task']:.0f} B/task"
        )
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()
        probe.close()
    return out


def random_outcomes(keys: Sequence[str], rng: np.random.Generator) -> dict[str, tuple[float, int]]:
    """Uniformly random successes out of ROLLOUTS trials for each key."""
    successes = rng.integers(0, ROLLOUTS + 1, len(keys)).tolist()
    return {k: (float(s), ROLLOUTS) for k, s in zip(keys, successes, strict=True)}


def _cycle(client: Any, name: str, key: str, rng: np.random.Generator, batch_size: int) -> None:
    batch = client.select_batch(name, batch_size, key)
    client.report_outcomes(name, batch.batch_id, random_outcomes(batch.keys, rng))


def _restart(url: str, name: str, n: int, cfg: PerfConfig, rng: np.random.Generator, crash: bool) -> dict[str, Any]:
    """Start a server on the database and time the first call, which rebuilds
    the experiment. crash=True: first run crash_steps steps past the last
    checkpoint on a server, SIGKILL it, and time the rebuild with replay."""
    import bots_client

    if crash:
        server = common.server_process(url).start()
        with bots_client.Client(server.address, timeout=600) as client:
            for _i in range(cfg.crash_steps):
                _cycle(client, name, f"crash-{uuid.uuid4().hex}", rng, cfg.batch_size)
        server.kill()
    server = common.server_process(url).start()
    try:
        rss_empty = common.rss_bytes(server.proc.pid)[0]
        with bots_client.Client(server.address, timeout=600) as client:
            started = time.perf_counter()
            batch = client.select_batch(name, cfg.batch_size, f"restart-{uuid.uuid4().hex}")
            first_call = time.perf_counter() - started
            client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1.0, ROLLOUTS)))
        rss, hwm = common.rss_bytes(server.proc.pid)
        loaded = server.entries("experiment loaded")
        result: dict[str, Any] = {
            "rebuild_s": first_call,  # the first SelectBatch, rebuild included
            "server_load_s": loaded[-1].get("seconds") if loaded else None,
            "replayed_steps": loaded[-1].get("replayed_steps") if loaded else None,
            "rss_empty": rss_empty,
            "rss_loaded": rss,
            "rss_peak": hwm,
            "bytes_per_task": (rss - rss_empty) / n,
            "peak_bytes_per_task": (hwm - rss_empty) / n,
        }
        server.stop()
        return result
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill()


# -- throughput ------------------------------------------------------------------------------------


def throughput_run(backend: str, url: str, cfg: PerfConfig) -> dict[str, Any]:
    """Steps per second with 1..N experiments stepped at once, each by its
    own loop; on PostgreSQL also with 2 and 3 server replicas on the one
    database, the experiments spread evenly over them (a trainer talks to one)."""
    import bots_client

    most = max(cfg.throughput_levels)
    results: dict[str, Any] = {
        "backend": backend,
        "pool": cfg.throughput_pool,
        "batch": cfg.throughput_batch,
        "seconds": cfg.throughput_seconds,
        "levels": [],
    }
    names = [f"tp-{i}" for i in range(most)]
    replica_counts = cfg.throughput_replicas if backend == "postgresql" else (1,)
    # (replicas, processes of each): the replicas, then one server of P processes.
    deployments = [(r, 1) for r in replica_counts]
    if backend == "postgresql":
        deployments += [(1, p) for p in cfg.throughput_processes]
    for replicas, processes in deployments:
        servers = [common.server_process(url, processes=processes).start() for _ in range(replicas)]
        try:
            if not results["levels"]:
                tasks = make_tasks(cfg.throughput_pool)
                started = time.perf_counter()
                with bots_client.Client(servers[0].address, timeout=600) as client:
                    for name in names:
                        client.create_experiment(name, experiment_config())
                        client.add_tasks(name, tasks)
                log(
                    f"    {backend}: {most} experiments x {cfg.throughput_pool:,} tasks set up in "
                    f"{time.perf_counter() - started:.0f} s"
                )
            addresses = [server.address for server in servers]
            pids = [pid for server in servers for pid in _server_pids(server.proc.pid)]
            for level in cfg.throughput_levels:
                for kind in cfg.throughput_steps:
                    level_result = asyncio.run(
                        _throughput_level(addresses, names[:level], cfg, pids, kind, own_connections=processes > 1)
                    )
                    level_result["replicas"] = replicas
                    level_result["processes"] = processes
                    results["levels"].append(level_result)
                    log(
                        f"    {backend}: {replicas} replica(s) x {processes} process(es), {level:>3} concurrent "
                        f"experiments, {kind}: "
                        f"{level_result['steps_per_s']:.1f} steps/s, step p50 {level_result['cycle']['p50']:.1f} ms "
                        f"(p99 {level_result['cycle']['p99']:.1f}), server CPU {level_result['server_cpu_share']:.2f} "
                        f"cores (event loop threads {level_result['loop_thread_cpu_share']:.2f}), "
                        f"client CPU {level_result['client_cpu_share']:.2f} ({level_result['client_processes']} processes)"
                        + (f"; by process {level_result['server_cpu_share_by_process']}" if processes > 1 else "")
                    )
        finally:
            for server in servers:
                server.stop()
    return results


def _server_pids(pid: int) -> list[int]:
    """A server's process and, for a supervisor, the processes it runs."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(int(c) for c in children)]


async def _throughput_level(
    addresses: Sequence[str],
    names: Sequence[str],
    cfg: PerfConfig,
    pids: Sequence[int],
    kind: str = "separate",
    own_connections: bool = False,
) -> dict[str, Any]:
    """One level: a loop per experiment, stepping it by `kind` (see
    PerfConfig.throughput_steps) as fast as the server answers, for a window
    of `cfg.throughput_seconds` after a warm-up. With `cfg.throughput_clients`
    > 1 the loops run in that many client processes (so that the bench's own
    Python is not what limits a server of many processes); their figures are
    summed."""
    clients = max(1, min(cfg.throughput_clients, len(names)))
    # Spawned clients import numpy and grpc before their loops start.
    start_up = 0.0 if clients == 1 else 5.0
    measure_from = time.time() + start_up + min(2.0, cfg.throughput_seconds / 3)
    measure_until = measure_from + cfg.throughput_seconds
    shares = [(list(addresses), list(names[i::clients]), list(range(i, len(names), clients))) for i in range(clients)]
    jobs = [(a, n, s, cfg, kind, own_connections, measure_from, measure_until) for a, n, s in shares]
    if clients == 1:
        only, server = await asyncio.gather(
            _client_loops(*jobs[0]), _server_cpu_window(pids, measure_from, measure_until)
        )
        parts = [only]
    else:
        import multiprocessing

        # Spawned, not forked: the parent has used gRPC, which does not survive a fork.
        with multiprocessing.get_context("spawn").Pool(clients) as pool:
            pending = pool.starmap_async(_client_process, jobs)
            server = await _server_cpu_window(pids, measure_from, measure_until)
            parts = pending.get(timeout=start_up + cfg.throughput_seconds + 300)
    elapsed = measure_until - measure_from
    cycles = [c for part in parts for c in part["cycles"]]
    sel = [c for part in parts for c in part["select"]]
    rep = [c for part in parts for c in part["report"]]
    errors: collections.Counter[str] = collections.Counter()
    for part in parts:
        errors.update(part["errors"])
    steps = sum(part["steps"] for part in parts)
    return {
        "experiments": len(names),
        "step_kind": kind,
        "client_processes": clients,
        "steps": steps,
        "steps_per_s": steps / elapsed,
        "cycle": common.percentiles(cycles),
        "select": common.percentiles(sel) if sel else None,
        "report": common.percentiles(rep) if rep else None,
        "errors": dict(errors),
        "server_cpu_share": server["cpu"] / elapsed,
        # Per process (a supervisor first, then its processes): an uneven
        # spread of the connections shows as some near one core, others idle.
        "server_cpu_share_by_process": [round(c / elapsed, 3) for c in server["by_process"]],
        # Summed over the replicas: divide by their number for one loop's share of a core.
        "loop_thread_cpu_share": server["loop"] / elapsed,
        "client_cpu_share": sum(part["cpu"] for part in parts) / elapsed,
    }


async def _server_cpu_window(pids: Sequence[int], measure_from: float, measure_until: float) -> dict[str, Any]:
    """The servers' CPU seconds, each process's and their event loop
    threads', between two wall-clock times."""
    await asyncio.sleep(max(0.0, measure_from - time.time()))
    cpu0, loop0 = [_cpu_seconds(p) for p in pids], sum(map(_loop_thread_cpu_seconds, pids))
    await asyncio.sleep(max(0.0, measure_until - time.time()))
    cpu1, loop1 = [_cpu_seconds(p) for p in pids], sum(map(_loop_thread_cpu_seconds, pids))
    by_process = [after - before for before, after in zip(cpu0, cpu1, strict=True)]
    return {"cpu": sum(by_process), "by_process": by_process, "loop": loop1 - loop0}


def _client_process(*job: Any) -> dict[str, Any]:
    """One client process's loops (see _throughput_level)."""
    return asyncio.run(_client_loops(*job))


async def _client_loops(
    addresses: Sequence[str],
    names: Sequence[str],
    seeds: Sequence[int],
    cfg: PerfConfig,
    kind: str,
    own_connections: bool,
    measure_from: float,
    measure_until: float,
) -> dict[str, Any]:
    """A loop per experiment until `measure_until`; the steps that end
    after `measure_from` count. With `own_connections`, each loop has a
    connection of its own (as trainers in their own processes have), so a
    server of several processes gets them spread by the kernel; else the
    loops of one address share one."""
    import grpc

    import bots_client

    if own_connections:
        options = [("grpc.use_local_subchannel_pool", 1)]
        clients = [
            bots_client.AsyncClient(address, timeout=120, channel=grpc.aio.insecure_channel(address, options=options))
            for address in addresses
            for _ in names
        ]
    else:
        clients = [bots_client.AsyncClient(address, timeout=120) for address in addresses]
    sel: list[float] = []
    rep: list[float] = []
    cycles: list[float] = []
    steps = 0
    errors: collections.Counter[str] = collections.Counter()

    def measuring() -> bool:
        return measure_from <= time.time() < measure_until

    async def separate(client: bots_client.AsyncClient, name: str, rng: np.random.Generator) -> None:
        t0 = time.perf_counter()
        batch = await client.select_batch(name, cfg.throughput_batch)
        t1 = time.perf_counter()
        outcomes = random_outcomes(batch.keys, rng)
        t2 = time.perf_counter()
        await client.report_outcomes(name, batch.batch_id, outcomes)
        t3 = time.perf_counter()
        if measuring():
            sel.append(t1 - t0)
            rep.append(t3 - t2)
            cycles.append((t1 - t0) + (t3 - t2))

    async def worker(name: str, seed: int, client: bots_client.AsyncClient) -> None:
        nonlocal steps
        rng = np.random.default_rng(seed)
        batch = None
        while time.time() < measure_until:
            try:
                if kind == "separate":
                    await separate(client, name, rng)
                elif batch is None:  # the first batch of a combined loop
                    batch = await client.select_batch(name, cfg.throughput_batch)
                    continue
                else:
                    outcomes = random_outcomes(batch.keys, rng)
                    t0 = time.perf_counter()
                    _, batch = await client.report_and_select(name, batch.batch_id, outcomes, cfg.throughput_batch)
                    if measuring():
                        cycles.append(time.perf_counter() - t0)
            except bots_client.BotsError as e:
                errors[type(e).__name__] += 1
                continue
            if measuring():
                steps += 1

    async def own_cpu() -> float:
        await asyncio.sleep(max(0.0, measure_from - time.time()))
        before = _self_cpu_seconds()
        await asyncio.sleep(max(0.0, measure_until - time.time()))
        return _self_cpu_seconds() - before

    workers = [
        worker(name, seed, clients[i % len(clients)]) for i, (name, seed) in enumerate(zip(names, seeds, strict=True))
    ]
    cpu, *_ = await asyncio.gather(own_cpu(), *workers, return_exceptions=True)
    for client in clients:
        await client.close()
    if isinstance(cpu, BaseException):
        raise cpu
    return {"steps": steps, "cycles": cycles, "select": sel, "report": rep, "errors": dict(errors), "cpu": cpu}


def _cpu_seconds(pid: int) -> float:
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def _loop_thread_cpu_seconds(pid: int) -> float:
    """CPU of the server's main thread, which runs its event loop: every
    call's gRPC handling, conversion and bookkeeping, the serial part."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat"))


def _stat_cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- in-process breakdown ----------------------------------------------------------------------------


class Recorder:
    """Times named calls and counts SQL statements, per phase (select / report)."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        self.statements: dict[tuple[str, str], int] = collections.Counter()
        self.rows: dict[tuple[str, str], int] = collections.Counter()
        self.checkouts: dict[str, int] = collections.Counter()
        self.commits: dict[str, int] = collections.Counter()

    def wrap(self, owner: Any, attr: str, label: str | None = None, static: bool = False) -> None:
        fn = getattr(owner, attr)
        name = label or attr

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            phase = self.phase
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[(phase, name)].append(time.perf_counter() - started)

        setattr(owner, attr, staticmethod(timed) if static else timed)

    def listen(self, engine: Any) -> None:
        from sqlalchemy import event

        pattern = re.compile(
            r"^\s*(INSERT INTO|UPDATE|DELETE FROM|SELECT)\b(?:.*?\bFROM)?\s+\"?(\w+)", re.IGNORECASE | re.DOTALL
        )

        @event.listens_for(engine, "after_cursor_execute")
        def after(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
            m = pattern.match(statement)
            verb = m.group(1).split()[0].upper() if m else statement.split()[0].upper()
            if not m:
                self.statements[(self.phase, verb)] += 1
                return
            table = m.group(2) if m else "?"
            key = (self.phase, f"{verb} {table}" + (" (executemany)" if executemany else ""))
            self.statements[key] += 1
            if verb in ("INSERT", "UPDATE", "DELETE") and cursor.rowcount is not None and cursor.rowcount >= 0:
                self.rows[key] += cursor.rowcount

        @event.listens_for(engine, "checkout")
        def checkout(*_: Any) -> None:
            self.checkouts[self.phase] += 1

        @event.listens_for(engine, "commit")
        def commit(*_: Any) -> None:
            self.commits[self.phase] += 1


def breakdown_run(backend: str, url: str, cfg: PerfConfig) -> dict[str, Any]:
    """The service in this process (no gRPC): where one select and one report spend their time."""
    return asyncio.run(_breakdown(backend, url, cfg))


async def _breakdown(backend: str, url: str, cfg: PerfConfig) -> dict[str, Any]:
    import bots_server.core.batches as batches_module
    from bots_server.core.domain import Outcomes
    from bots_server.core.selector import SelectorService
    from bots_server.store import open_store

    n, steps = cfg.breakdown_pool, cfg.breakdown_steps
    store = open_store(url)
    store.migrate()
    rec = Recorder()
    rec.listen(store.engine)
    for attr in ("insert_batch", "commit_report", "load", "find_experiment"):
        rec.wrap(store, attr)
    original_choose = batches_module._choose
    rec.wrap(batches_module, "_choose", "engine select (_choose)")
    original_apply = batches_module.apply_outcomes
    rec.wrap(batches_module, "apply_outcomes", "engine update (apply_outcomes)")
    service = SelectorService(store)
    try:
        await service.experiments.create("breakdown", server_config())
        await service.pool.add_tasks("breakdown", server_tasks(n))
        rng = np.random.default_rng(3)
        totals: dict[str, list[float]] = {"select": [], "report": []}
        for i in range(steps + 3):
            rec.phase = "select" if i >= 3 else "warm-up"
            t0 = time.perf_counter()
            batch = await service.batches.select("breakdown", cfg.batch_size, f"bd-{i}")
            t1 = time.perf_counter()
            outcomes = Outcomes.of(
                (k, float(s), ROLLOUTS, None)
                for k, s in zip(batch.keys, rng.integers(0, ROLLOUTS + 1, len(batch.keys)).tolist(), strict=True)
            )
            rec.phase = "report" if i >= 3 else "warm-up"
            t2 = time.perf_counter()
            await service.batches.report("breakdown", batch.batch_id, outcomes)
            t3 = time.perf_counter()
            if i >= 3:
                totals["select"].append(t1 - t0)
                totals["report"].append(t3 - t2)
        rec.phase = "done"
    finally:
        batches_module.apply_outcomes = original_apply
        batches_module._choose = original_choose
        await service.close()
        store.close()
    result: dict[str, Any] = {"backend": backend, "pool": n, "steps": steps}
    for phase in ("select", "report"):
        parts = {name: float(np.median(v)) * 1e3 for (p, name), v in rec.times.items() if p == phase}
        total = float(np.median(totals[phase])) * 1e3
        result[phase] = {
            "total_ms": total,
            "parts_ms": parts,
            "unaccounted_ms": total - sum(parts.values()),  # executor hops, conversions, validation, locks
            "statements_per_call": {k: v / steps for (p, k), v in rec.statements.items() if p == phase},
            "rows_per_call": {k: v / steps for (p, k), v in rec.rows.items() if p == phase},
            "connection_checkouts_per_call": rec.checkouts[phase] / steps,
            "commits_per_call": rec.commits[phase] / steps,
        }
    return result


# -- history probe: the lease query as the batch history grows ---------------------------------------


def history_probe(backend: str, url: str, cfg: PerfConfig) -> dict[str, Any]:
    """Time the store's reads of the leased tasks and of one batch (Store.load
    with a Lookup, as a select and a report make them) with 0..K reported
    batches of B tasks in the tables."""
    from bots_server.store import BatchRow, Lookup, open_store, pieces
    from bots_server.store import schema as t

    store = open_store(url)
    store.migrate()
    now = dt.datetime.now(dt.UTC)
    # SQLite rows written by hand take SQLAlchemy's text format for DateTime.
    stamp = now.strftime("%Y-%m-%d %H:%M:%S.%f") if backend == "sqlite" else now
    later = (
        (now + dt.timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S.%f")
        if backend == "sqlite"
        else now + dt.timedelta(hours=1)
    )
    row = store.create_experiment("history", server_config().to_dict(), now)
    store.add_tasks(row.id, 0, [f"k{i}" for i in range(1000)], [{} for _ in range(1000)])
    b = cfg.batch_size
    out: dict[str, Any] = {"backend": backend, "batch": b, "points": []}
    have = 0
    try:
        for target in cfg.history_batches:
            if target > have:
                batches = ((row.id, f"h{j:08d}", f"hk{j}", j, b, stamp, later, j + 1) for j in range(have, target))
                tasks = ((row.id, f"h{j:08d}", pieces.pack_tasks(range(j, j + b))) for j in range(have, target))
                with store._write() as conn:  # the store's own bulk path (COPY / executemany)
                    store._bulk_insert(
                        conn,
                        t.batches,
                        (
                            "experiment_id",
                            "batch_id",
                            "request_key",
                            "step",
                            "batch_size",
                            "create_time",
                            "lease_expire_time",
                            "reported_step",
                        ),
                        batches,
                    )
                    store._bulk_insert(conn, t.batch_task_lists, ("experiment_id", "batch_id", "tasks"), tasks)
                if backend != "sqlite":
                    with store.engine.connect() as conn:
                        conn.exec_driver_sql("ANALYZE batches")
                        conn.exec_driver_sql("ANALYZE batch_task_lists")
                        conn.commit()
                have = target
            # one open batch, as during training
            open_id = uuid.uuid4().hex
            current = store.find_experiment("history")
            open_row = BatchRow(
                open_id, f"open-{open_id}", current.step, list(range(b)), now, now + dt.timedelta(hours=1), None
            )
            store.insert_batch(row.id, open_row, now)
            # The catch-up read of a replica that is up to date, with each lookup.
            read = functools.partial(store.load, row.id, after_step=current.step, first_task=current.num_tasks)
            leased, found = [], []
            for _ in range(15):
                t0 = time.perf_counter()
                assert sorted(read(lookup=Lookup(leases_at=now)).leased) == list(range(b))
                t1 = time.perf_counter()
                assert read(lookup=Lookup(batch_id=open_id)).batch.batch_id == open_id
                t2 = time.perf_counter()
                leased.append(t1 - t0)
                found.append(t2 - t1)
            with store._write() as conn:  # close it again
                conn.execute(t.batches.update().where(t.batches.c.batch_id == open_id).values(reported_step=0))
            point = {
                "reported_batches": have,
                "load_leases_ms": float(np.median(leased)) * 1e3,
                "load_batch_ms": float(np.median(found)) * 1e3,
            }
            out["points"].append(point)
            log(
                f"    {backend}: {have:>6} reported batches: load with leases "
                f"{point['load_leases_ms']:.2f} ms, load with a batch {point['load_batch_ms']:.2f} ms"
            )
    finally:
        store.close()
    return out


def contention_probe(url: str, cfg: PerfConfig, seconds: float) -> dict[str, Any]:
    """SQLite, in-process service: how long write transactions wait for the
    database's single write lock when several experiments are served at
    once, as the server runs them (worker threads, SQLite's busy handler),
    and the same with a process-wide lock around write transactions (a
    what-if for a fix; the server is not modified)."""
    import threading

    from bots_server.store.sql import SqlStore

    results: dict[str, Any] = {"backend": "sqlite", "pool": cfg.throughput_pool, "seconds": seconds, "runs": []}
    original = SqlStore._write
    for variant in ("as is", "process-wide lock (what-if)"):
        for k in (1, 8):
            waits: list[float] = []
            lock = threading.Lock()

            @contextmanager
            def write(
                self: Any, _variant: str = variant, _lock: Any = lock, _waits: list[float] = waits
            ) -> Iterator[Any]:
                started = time.perf_counter()
                with _lock if _variant != "as is" else _nullcontext(), original(self) as conn:
                    _waits.append(time.perf_counter() - started)
                    yield conn

            SqlStore._write = write
            try:
                with common.database("sqlite") as scratch:
                    cycles = asyncio.run(_contention_run(scratch, k, cfg, seconds, waits))
            finally:
                SqlStore._write = original
            run = {
                "variant": variant,
                "experiments": k,
                "steps_per_s": len(cycles) / seconds,
                "cycle": common.percentiles(cycles),
                "write_lock_wait": common.percentiles(waits),
            }
            results["runs"].append(run)
            log(
                f"    sqlite, {variant}, {k} experiments: {run['steps_per_s']:.1f} steps/s, select+report p50 "
                f"{run['cycle']['p50']:.0f} ms p99 {run['cycle']['p99']:.0f}; write-lock wait p50 "
                f"{run['write_lock_wait']['p50']:.2f} ms p99 {run['write_lock_wait']['p99']:.0f} max {run['write_lock_wait']['max']:.0f}"
            )
    return results


@contextmanager
def _nullcontext() -> Iterator[None]:
    yield None


async def _contention_run(url: str, k: int, cfg: PerfConfig, seconds: float, waits: list[float]) -> list[float]:
    from bots_server.core.domain import Outcomes
    from bots_server.core.selector import SelectorService
    from bots_server.store import open_store

    store = open_store(url)
    store.migrate()
    service = SelectorService(store)
    tasks = server_tasks(cfg.throughput_pool)
    for i in range(k):
        await service.experiments.create(f"c{i}", server_config())
        await service.pool.add_tasks(f"c{i}", tasks)
    cycles: list[float] = []
    measuring = False
    stop = False

    async def worker(i: int) -> None:
        rng = np.random.default_rng(i)
        while not stop:
            started = time.perf_counter()
            batch = await service.batches.select(f"c{i}", cfg.batch_size, "")
            outcomes = Outcomes.of(
                (key, float(s), ROLLOUTS, None)
                for key, s in zip(batch.keys, rng.integers(0, ROLLOUTS + 1, len(batch.keys)).tolist(), strict=True)
            )
            await service.batches.report(f"c{i}", batch.batch_id, outcomes)
            if measuring:
                cycles.append(time.perf_counter() - started)

    workers = [asyncio.create_task(worker(i)) for i in range(k)]
    await asyncio.sleep(1.0)
    waits.clear()
    measuring = True
    await asyncio.sleep(seconds)
    measuring = False
    stop = True
    await asyncio.gather(*workers)
    await service.close()
    store.close()
    return cycles


def rebuild_probe(url: str, n: int) -> dict[str, Any]:
    """In-process on SQLite: where the rebuild of an n-task experiment spends
    its time (Store.load, of which decoding the features JSON, and
    LiveExperiment.rebuild) and its memory (live objects vs the peak while
    loading, traced by tracemalloc)."""
    import gc
    import tracemalloc

    from bots_server.core.experiment import LiveExperiment
    from bots_server.store import open_store

    store = open_store(url)
    store.migrate()
    now = dt.datetime.now(dt.UTC)
    config = server_config()
    row = store.create_experiment("rebuild", config.to_dict(), now)
    weak, strong = reference_rates(n)
    store.add_tasks(
        row.id,
        0,
        [f"task-{i:07d}" for i in range(n)],
        [{"weak": w, "strong": s} for w, s in zip(weak.tolist(), strong.tolist(), strict=True)],
    )
    from bots_server.core.checkpoint_state import encode_state
    from bots_server.engine import PosteriorState

    store.write_checkpoint(row.id, 1, n, encode_state(PosteriorState.from_prior(config, weak, strong)), now)
    gc.collect()
    try:
        t0 = time.perf_counter()
        rows = store.load(row.id, reference_features=config.reference_features)
        t1 = time.perf_counter()
        live = LiveExperiment.rebuild(rows, config)
        t2 = time.perf_counter()
        assert live.num_tasks == n
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            raw = [
                r[0]
                for r in conn.execute("SELECT features FROM tasks WHERE experiment_id = ? ORDER BY task_idx", (row.id,))
            ]
        t3 = time.perf_counter()
        for text in raw:
            json.loads(text)
        t4 = time.perf_counter()
        del raw, live, rows
        gc.collect()
        tracemalloc.start()
        rows = store.load(row.id, reference_features=config.reference_features)
        live = LiveExperiment.rebuild(rows, config)
        with_rows, peak = tracemalloc.get_traced_memory()
        del rows
        gc.collect()
        live_only, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del live
    finally:
        store.close()
    out = {
        "backend": "sqlite",
        "pool": n,
        "load_s": t1 - t0,
        "rebuild_s": t2 - t1,
        "features_json_decode_s": t4 - t3,
        "live_bytes_per_task": live_only / n,
        "loaded_rows_bytes_per_task": (with_rows - live_only) / n,
        "peak_bytes_per_task": peak / n,
    }
    log(
        f"    sqlite, {n:,} tasks: Store.load {out['load_s']:.2f} s (json.loads of the features alone "
        f"{out['features_json_decode_s']:.2f} s), LiveExperiment.rebuild {out['rebuild_s']:.2f} s; traced memory: "
        f"live {out['live_bytes_per_task']:.0f} B/task, peak while loading {out['peak_bytes_per_task']:.0f} B/task"
    )
    return out


# -- reporting ---------------------------------------------------------------------------------------------


def _ms(p: dict[str, float]) -> str:
    return f"{p['p50']:.1f} / {p['p99']:.1f}"


def tables(result: dict[str, Any]) -> str:
    lines = [f"Machine: {common.machine_line(result['machine'])}.", ""]
    if result.get("interleaved"):
        lines += _interleaved_table(result["interleaved"])
    if result["socket"]:
        lines += _socket_tables(result)
    return "\n".join(lines + _other_tables(result)) + "\n"


def _socket_tables(result: dict[str, Any]) -> list[str]:
    lines = [
        (
            "Latency over the socket, batch 256, BOTS defaults with the plug-in (ms, p50 / p99), beside the in-process engine "
            "step measured right before on the same pool (ratio = round trip p50 / engine step p50):"
        ),
        "",
        (
            "| backend | pool | steps | SelectBatch | select p50, first -> last fifth of the steps | ReportOutcomes | round trip p50 | "
            "engine select | engine update | engine step p50 | ratio |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    engine = {(e.get("backend"), e["pool"]): e for e in result["engine"]}
    for r in result["socket"]:
        e = engine.get((r["backend"], r["pool"])) or engine.get((None, r["pool"]))
        ratio = r["round_trip_p50_ms"] / e["step"]["p50"] if e else float("nan")
        trend = (
            f"{r['select_p50_first_fifth']:.1f} -> {r['select_p50_last_fifth']:.1f}"
            if "select_p50_first_fifth" in r
            else ""
        )
        lines.append(
            f"| {r['backend']} | {r['pool']:,} | {r['steps']} | {_ms(r['select'])} | {trend} | {_ms(r['report'])} | "
            f"{r['round_trip_p50_ms']:.1f} | "
            + (
                f"{_ms(e['select'])} | {_ms(e['update'])} | {e['step']['p50']:.1f} | {ratio:.1f}x |"
                if e
                else " | | | |"
            )
        )
    lines += [
        "",
        "Writes per step (measured on the database):",
        "",
        (
            "| backend | pool | rows inserted per report (steps + step_outcomes) | rows inserted per select (batches + batch_task_lists) | "
            "bytes written per report | bytes written per select | bytes stored per step | checkpoints in the run |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["socket"]:
        per = r["rows_inserted_per_step"]
        report_rows = per.get("steps", 0) + per.get("step_outcomes", 0)
        select_rows = per.get("batches", 0) + per.get("batch_task_lists", 0)
        if "wal_bytes_per_report" in r:
            written_r, written_s = (
                f"{r['wal_bytes_per_report'] / 1024:.1f} KiB WAL",
                f"{r['wal_bytes_per_select'] / 1024:.1f} KiB WAL",
            )
        else:
            written_r = f"{r['server_wchar_per_report'] / 1024:.1f} KiB"
            written_s = f"{r['server_wchar_per_select'] / 1024:.1f} KiB"
        ckpt = (
            ", ".join(f"{c['seconds']:.2f} s" for c in r["checkpoints_during_run"] if c.get("seconds") is not None)
            or "none"
        )
        lines.append(
            f"| {r['backend']} | {r['pool']:,} | {report_rows:.0f} | {select_rows:.0f} | {written_r} | {written_s} | "
            f"{r['stored_bytes_per_step'] / 1024:.1f} KiB | {ckpt} |"
        )
    lines += [
        "",
        "Restart and memory:",
        "",
        (
            "| backend | pool | add tasks | rebuild after graceful restart | after crash (replayed steps) | graceful stop | "
            "server memory per task | peak during rebuild |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["socket"]:
        g, c = r["restart"], r["crash_restart"]
        lines.append(
            f"| {r['backend']} | {r['pool']:,} | {r['add_tasks_s']:.1f} s | {g['rebuild_s']:.2f} s | {c['rebuild_s']:.2f} s "
            f"({c['replayed_steps']}) | {r['graceful_stop_s']:.1f} s | {g['bytes_per_task']:.0f} B | {g['peak_bytes_per_task']:.0f} B |"
        )
    return lines


def _other_tables(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if result.get("throughput"):
        lines += [
            "",
            f"Throughput: concurrent experiments of {result['throughput'][0]['pool']:,} tasks each, batch "
            f"{result['throughput'][0].get('batch', BATCH)}, one loop per experiment stepping it by SelectBatch + "
            "ReportOutcomes (separate) or ReportAndSelect (combined); server CPU summed over the replicas:",
            "",
            "| backend | replicas x processes | experiments | step | steps/s | step p50 / p99 ms | server CPU (cores) | of it event loop threads | bench client CPU | errors |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in result["throughput"]:
            for lv in t["levels"]:
                lines.append(
                    f"| {t['backend']} | {lv.get('replicas', 1)} x {lv.get('processes', 1)} | {lv['experiments']} "
                    f"| {lv.get('step_kind', 'separate')} "
                    f"| {lv['steps_per_s']:.1f} | {_ms(lv['cycle'])} | "
                    f"{lv['server_cpu_share']:.2f} | {lv.get('loop_thread_cpu_share', float('nan')):.2f} "
                    f"| {lv['client_cpu_share']:.2f} | {sum(lv['errors'].values())} |"
                )
    if result.get("breakdown"):
        lines += ["", "In-process breakdown (no gRPC), median ms per call:", ""]
        for b in result["breakdown"]:
            for phase in ("select", "report"):
                p = b[phase]
                parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(p["parts_ms"].items(), key=lambda kv: -kv[1]))
                stmts = ", ".join(f"{k} x{v:g}" for k, v in sorted(p["statements_per_call"].items()))
                lines.append(
                    f"- {b['backend']}, {b['pool']:,} tasks, {phase}: total {p['total_ms']:.2f} = {parts}, other "
                    f"{p['unaccounted_ms']:.2f}; statements: {stmts}; connection checkouts {p['connection_checkouts_per_call']:g}, "
                    f"commits {p['commits_per_call']:g}"
                )
    if result.get("history"):
        lines += [
            "",
            "Lease query as the batch history grows (median ms; the store runs it twice per select: in the read, and again under the row lock):",
            "",
            "| backend | reported batches | Store.load with leases | Store.load with a batch |",
            "|---|---|---|---|",
        ]
        for h in result["history"]:
            for p in h["points"]:
                lines.append(
                    f"| {h['backend']} | {p['reported_batches']:,} | {p['load_leases_ms']:.2f} | {p['load_batch_ms']:.2f} |"
                )
    if result.get("contention"):
        c = result["contention"]
        lines += [
            "",
            f"SQLite write-lock contention, in-process service, experiments of {c['pool']:,} tasks (ms):",
            "",
            "| variant | experiments | steps/s | select+report p50 / p99 | write-lock wait p50 / p99 / max |",
            "|---|---|---|---|---|",
        ]
        for r in c["runs"]:
            w = r["write_lock_wait"]
            lines.append(
                f"| {r['variant']} | {r['experiments']} | {r['steps_per_s']:.1f} | {_ms(r['cycle'])} | "
                f"{w['p50']:.2f} / {w['p99']:.1f} / {w['max']:.1f} |"
            )
    if result.get("rebuild"):
        r = result["rebuild"]
        lines += [
            "",
            (
                f"Rebuild of {r['pool']:,} tasks in-process (SQLite): Store.load {r['load_s']:.2f} s, of which decoding every task's "
                f"features JSON {r['features_json_decode_s']:.2f} s; LiveExperiment.rebuild {r['rebuild_s']:.2f} s. Traced Python "
                f"memory: the loaded experiment {r['live_bytes_per_task']:.0f} B/task, the LoadedRows on top "
                f"{r['loaded_rows_bytes_per_task']:.0f} B/task, peak while loading {r['peak_bytes_per_task']:.0f} B/task."
            ),
        ]
    return lines


# -- command line -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.perf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="pools 10k and 100k, fewer steps, 3 s throughput windows")
    parser.add_argument(
        "--backends",
        default=None,
        help="comma-separated: sqlite,postgresql (default both; PostgreSQL skipped if unreachable)",
    )
    parser.add_argument("--pools", default=None, help="comma-separated pool sizes (default 10000,100000,1000000)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per pool (default depends on the pool)")
    parser.add_argument("--throughput-seconds", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs per backend and pool (default 3)")
    parser.add_argument(
        "--interleaved-server-args",
        default=None,
        help='flags of the interleaved run\'s server, e.g. "--checkpoint-every-steps 100000" (no checkpoint in the run)',
    )
    parser.add_argument(
        "--throughput-levels", default=None, help="comma-separated concurrent experiments (default 1,8,64)"
    )
    parser.add_argument(
        "--throughput-replicas", default=None, help="comma-separated PostgreSQL server replicas (default 1,2,3)"
    )
    parser.add_argument(
        "--throughput-processes",
        default=None,
        help="comma-separated process counts of one `serve --processes P` on PostgreSQL, e.g. 1,2,4,8 (default none)",
    )
    parser.add_argument(
        "--throughput-steps",
        default=None,
        help="comma-separated: separate (SelectBatch + ReportOutcomes), combined (ReportAndSelect); default both, in turn",
    )
    parser.add_argument(
        "--throughput-clients",
        type=int,
        default=None,
        help="client processes that run the throughput loops between them (default 1; more for servers of many cores)",
    )
    parser.add_argument(
        "--throughput-summary", default=None, help="comma-separated --out files of earlier runs: print their medians"
    )
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated parts to skip: interleaved,socket,engine,throughput,breakdown,history,contention,rebuild",
    )
    parser.add_argument(
        "--out", default=None, help="JSON output (default bench/results/perf.json, perf-quick.json with --quick)"
    )
    return parser


def throughput_summary(paths: Sequence[str]) -> list[str]:
    """Medians (min-max) of repeated throughput runs (their --out files),
    per backend, replica count and number of experiments."""
    cells: dict[tuple[str, int, int, str], list[dict[str, Any]]] = {}
    for path in paths:
        for t in json.loads(Path(path).read_text())["throughput"]:
            for lv in t["levels"]:
                deployment = f"{lv.get('replicas', 1)} x {lv.get('processes', 1)}"
                key = (t["backend"], deployment, lv["experiments"], lv.get("step_kind", "separate"))
                cells.setdefault(key, []).append(lv)

    lines = [
        f"Median (min-max) over {len(paths)} runs:",
        "",
        "| backend | replicas x processes | experiments | step | steps/s | step p50 ms | step p99 ms | server CPU (cores) | of it event loop threads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (backend, replicas, experiments, kind), lvs in cells.items():
        lines.append(
            f"| {backend} | {replicas} | {experiments} | {kind} | {span([lv['steps_per_s'] for lv in lvs])} "
            f"| {span([lv['cycle']['p50'] for lv in lvs], 0)} | {span([lv['cycle']['p99'] for lv in lvs], 0)} "
            f"| {span([lv['server_cpu_share'] for lv in lvs], 2)} "
            f"| {span([lv.get('loop_thread_cpu_share', float('nan')) for lv in lvs], 2)} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.throughput_summary:
        print("\n".join(throughput_summary(args.throughput_summary.split(","))))
        return 0
    cfg = QUICK if args.quick else PerfConfig()
    if args.backends:
        cfg = dataclasses.replace(cfg, backends=tuple(args.backends.split(",")))
    if args.pools:
        cfg = dataclasses.replace(cfg, pools=tuple(int(p) for p in args.pools.split(",")))
    if args.steps:
        cfg = dataclasses.replace(cfg, steps=tuple((p, args.steps) for p in cfg.pools))
    if args.throughput_seconds:
        cfg = dataclasses.replace(cfg, throughput_seconds=args.throughput_seconds)
    if args.repeats:
        cfg = dataclasses.replace(cfg, repeats=args.repeats)
    if args.interleaved_server_args:
        cfg = dataclasses.replace(cfg, interleaved_server_args=tuple(args.interleaved_server_args.split()))
    if args.throughput_levels:
        cfg = dataclasses.replace(cfg, throughput_levels=tuple(int(x) for x in args.throughput_levels.split(",")))
    if args.throughput_replicas:
        cfg = dataclasses.replace(cfg, throughput_replicas=tuple(int(x) for x in args.throughput_replicas.split(",")))
    if args.throughput_processes:
        processes = tuple(int(x) for x in args.throughput_processes.split(","))
        cfg = dataclasses.replace(cfg, throughput_processes=processes)
    if args.throughput_clients:
        cfg = dataclasses.replace(cfg, throughput_clients=args.throughput_clients)
    if args.throughput_steps:
        cfg = dataclasses.replace(cfg, throughput_steps=tuple(args.throughput_steps.split(",")))
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {"interleaved", "socket", "engine", "throughput", "breakdown", "history", "contention", "rebuild"}
    if unknown:
        raise SystemExit(f"--skip: unknown parts {sorted(unknown)}")
    backends = list(cfg.backends)
    if "postgresql" in backends and not common.postgres_available():
        log("PostgreSQL is not reachable (BOTS_TEST_PG_DSN): skipping it")
        backends.remove("postgresql")
    out_path = Path(args.out) if args.out else common.RESULTS / ("perf-quick.json" if args.quick else "perf.json")
    result: dict[str, Any] = {
        "machine": common.machine_info(),
        "config": dataclasses.asdict(cfg),
        "engine": [],
        "interleaved": [],
        "socket": [],
        "throughput": [],
        "breakdown": [],
        "history": [],
    }
    started = time.perf_counter()
    if "engine" not in skip and ("socket" in skip or not backends):
        log("in-process engine step (select 256 + update):")
        for n in cfg.pools:
            e = {"backend": None, "pool": n, **engine_baseline(n, cfg.batch_size, cfg.engine_steps)}
            result["engine"].append(e)
            log(
                f"    {n:>9,} tasks: select {e['select']['p50']:.2f} ms, update {e['update']['p50']:.2f} ms, step {e['step']['p50']:.2f} ms"
            )
    if "interleaved" not in skip:
        log("round trip against the reference step, interleaved:")
        for _ in range(cfg.repeats):
            for backend in backends:
                for n in cfg.pools:
                    with common.database(backend) as url:
                        result["interleaved"].append(interleaved_run(backend, url, n, cfg))
    for backend in backends:
        if "socket" not in skip:
            log(f"{backend}: latency, writes, restart, memory over the socket:")
            for n in cfg.pools:
                if "engine" not in skip:  # the baseline right before, under the same load
                    e = {"backend": backend, "pool": n, **engine_baseline(n, cfg.batch_size, cfg.engine_steps)}
                    result["engine"].append(e)
                    log(f"    {n:>9,} tasks in-process engine: step {e['step']['p50']:.2f} ms")
                with common.database(backend) as url:
                    result["socket"].append(socket_run(backend, url, n, cfg))
        if "throughput" not in skip:
            log(f"{backend}: throughput:")
            with common.database(backend) as url:
                result["throughput"].append(throughput_run(backend, url, cfg))
        if "breakdown" not in skip:
            log(f"{backend}: in-process breakdown at {cfg.breakdown_pool:,} tasks:")
            with common.database(backend) as url:
                b = breakdown_run(backend, url, cfg)
                result["breakdown"].append(b)
                log(f"    select {b['select']['total_ms']:.1f} ms, report {b['report']['total_ms']:.1f} ms")
        if "history" not in skip:
            log(f"{backend}: lease query vs history:")
            with common.database(backend) as url:
                result["history"].append(history_probe(backend, url, cfg))
        if "rebuild" not in skip and backend == "sqlite":
            log(f"sqlite: rebuild of {max(cfg.pools):,} tasks, in-process:")
            with common.database("sqlite") as url:
                result["rebuild"] = rebuild_probe(url, max(cfg.pools))
        if "contention" not in skip and backend == "sqlite":
            log("sqlite: write-lock contention between experiments (in-process):")
            result["contention"] = contention_probe("", cfg, cfg.contention_seconds)
    result["seconds"] = time.perf_counter() - started
    text = tables(result)
    print(text)
    common.write_json(out_path, result)
    out_path.with_suffix(".md").write_text(text)
    log(f"wrote {out_path} and {out_path.with_suffix('.md')} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
