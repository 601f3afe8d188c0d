"""Load generator for operators: drive a BOTS server like trainers do, bounded
in requests and in time, and report latency percentiles and errors.

    # a loopback server on a scratch SQLite file, 20 s or 2000 requests:
    .venv/bin/python -m bench.loadgen
    # a running server (its own scratch experiments, deleted afterwards):
    .venv/bin/python -m bench.loadgen --target bots.internal:50051 --concurrency 16 --duration 60 --pool 100000
    BOTS_TOKEN=... .venv/bin/python -m bench.loadgen --target host:443 --tls

Each worker loops SelectBatch -> simulated rollouts -> ReportOutcomes on one
of `--experiments` scratch experiments named `<prefix>-<i>` (created with
`--pool` tasks, deleted at the end unless --keep, or left with a message
when the token's role may not delete: that needs tenant-admin). Nothing
else on the server is touched. The run stops at `--requests` RPCs or `--duration`
seconds, whichever comes first; calls still in flight then get at most
`--grace` seconds. Errors are counted by gRPC status, never retried unless
`--retry` allows it. Exit status: 0 no errors, 1 some errors, 2 setup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # `python bench/loadgen.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    errors: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    error_samples: dict[str, str] = field(default_factory=dict)  # status -> one message
    issued: int = 0
    cancelled_at_deadline: int = 0

    def ok(self, method: str, seconds: float) -> None:
        self.latencies[method].append(seconds)

    def error(self, method: str, error: BaseException) -> None:
        status = getattr(getattr(error, "code", None), "name", None) or type(error).__name__
        self.errors[method][status] += 1
        self.error_samples.setdefault(status, str(error)[:300])

    @property
    def error_count(self) -> int:
        return sum(sum(c.values()) for c in self.errors.values())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="HOST:PORT of a running server (default: start one on loopback)")
    parser.add_argument(
        "--db", default=None, help="database URL of the loopback server (default: a scratch SQLite file)"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=2000,
        help="stop after this many RPCs (select and report each count); 0: no bound",
    )
    parser.add_argument("--duration", type=float, default=20.0, help="stop after this many seconds (default 20)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds calls in flight at the bound may still take")
    parser.add_argument("--concurrency", type=int, default=4, help="workers, each a closed select -> report loop")
    parser.add_argument("--experiments", type=int, default=1, help="scratch experiments the workers share round-robin")
    parser.add_argument("--pool", type=int, default=10_000, help="tasks per scratch experiment")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rollouts", type=int, default=16, help="trials per task in the reports")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each call, seconds")
    parser.add_argument(
        "--retry", type=float, default=0.0, help="seconds the client may retry UNAVAILABLE (default 0: count it)"
    )
    parser.add_argument(
        "--prefix", default=None, help="name prefix of the scratch experiments (default loadgen-<random>)"
    )
    parser.add_argument("--keep", action="store_true", help="do not delete the scratch experiments")
    parser.add_argument("--tls", action="store_true", help="TLS with the system roots (or --ca-file)")
    parser.add_argument("--ca-file", default=None)
    parser.add_argument(
        "--token-env", default="BOTS_TOKEN", help="environment variable holding a bearer token (default BOTS_TOKEN)"
    )
    parser.add_argument("--json", default=None, help="also write the result as JSON to this file")
    parser.add_argument("--quiet", action="store_true", help="print only the result table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 0 or args.duration <= 0 or args.concurrency < 1 or args.experiments < 1:
        raise SystemExit("--requests >= 0, --duration > 0, --concurrency >= 1 and --experiments >= 1")
    if args.batch_size > args.pool:
        raise SystemExit(f"--batch-size {args.batch_size} is larger than --pool {args.pool}")
    server = None
    scratch = None
    try:
        target = args.target
        if target is None:
            scratch = common.scratch_dir()
            server = common.server_process(args.db or f"sqlite:///{scratch}/loadgen.db").start()
            target = server.address
            _say(args, f"loopback server on {target}")
        result = asyncio.run(run(args, target))
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    print(report(result))
    if args.json:
        common.write_json(Path(args.json), result)
    if result["setup_failed"]:
        return 2
    return 1 if result["errors_total"] else 0


def _say(args: argparse.Namespace, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def _client(args: argparse.Namespace, target: str, timeout: float) -> Any:
    import grpc

    import bots_client

    credentials = None
    if args.tls:
        root = Path(args.ca_file).read_bytes() if args.ca_file else None
        credentials = grpc.ssl_channel_credentials(root_certificates=root)
    token = os.environ.get(args.token_env, "")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return bots_client.AsyncClient(
        target,
        timeout=timeout,
        bulk_timeout=max(timeout, 600.0),
        retry_timeout=args.retry,
        credentials=credentials,
        metadata=metadata,
    )


async def run(args: argparse.Namespace, target: str) -> dict[str, Any]:
    import bots_client

    stats = Stats()
    prefix = args.prefix or f"loadgen-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-{i}" for i in range(args.experiments)]
    started = time.monotonic()
    deadline = started + args.duration
    client = _client(args, target, min(args.timeout, args.duration + args.grace))
    created: list[str] = []
    setup_failed = False
    setup_s = load_s = 0.0
    result: dict[str, Any] = {"target": target, "experiments": names, "args": vars(args)}
    try:
        # -- setup, inside the time bound
        rng = np.random.default_rng(0)
        weak = rng.beta(0.7, 1.3, size=args.pool)
        strong = np.minimum(1.0, weak + rng.beta(1.5, 3.0, size=args.pool))
        tasks = [
            bots_client.Task(f"task-{i:07d}", {"weak": w, "strong": s})
            for i, (w, s) in enumerate(zip(weak.tolist(), strong.tolist(), strict=True))
        ]
        config = bots_client.ExperimentConfig(
            weak_feature="weak", strong_feature="strong", rollouts_per_task=args.rollouts
        )
        for name in names:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(client.create_experiment(name, config), remaining + args.grace)
                created.append(name)
                stats.ok("CreateExperiment", time.perf_counter() - t0)
                t1 = time.perf_counter()
                await asyncio.wait_for(
                    client.add_tasks(name, tasks), max(0.001, deadline - time.monotonic()) + args.grace
                )
                stats.ok("AddTasks", time.perf_counter() - t1)
            except (TimeoutError, bots_client.BotsError) as e:
                stats.error("CreateExperiment" if name not in created else "AddTasks", e)
                setup_failed = True
                break
        setup_s = time.monotonic() - started
        _say(args, f"setup: {len(created)}/{len(names)} experiments of {args.pool:,} tasks in {setup_s:.1f} s")
        # -- load
        load_started = time.monotonic()
        if created and not setup_failed and time.monotonic() < deadline:
            await _load(args, client, created, stats, deadline)
        load_s = time.monotonic() - load_started
    finally:
        left: list[str] = []
        if created and not args.keep:
            for name in created:
                try:
                    await asyncio.wait_for(client.delete_experiment(name), args.timeout)
                except bots_client.PermissionDeniedError:
                    left.append(name)  # a writer's token: deleting needs tenant-admin
                except (TimeoutError, bots_client.BotsError) as e:
                    stats.error("DeleteExperiment", e)
        if left:
            _say(args, f"left {len(left)} scratch experiments ({', '.join(left)}): deleting needs a tenant-admin token")
        result["left_behind"] = left
        await client.close()
    elapsed = time.monotonic() - started
    calls = sum(len(v) for m, v in stats.latencies.items() if m in ("SelectBatch", "ReportOutcomes"))
    result.update(
        {
            "setup_failed": setup_failed,
            "setup_seconds": setup_s,
            "load_seconds": load_s,
            "elapsed_seconds": elapsed,
            "requests_issued": stats.issued,
            "requests_ok": calls,
            "cancelled_at_deadline": stats.cancelled_at_deadline,
            "requests_per_s": calls / load_s if load_s > 0 else 0.0,
            "steps_per_s": len(stats.latencies.get("ReportOutcomes", [])) / load_s if load_s > 0 else 0.0,
            "latency_ms": {m: common.percentiles(v) for m, v in stats.latencies.items()},
            "errors": {m: dict(c) for m, c in stats.errors.items()},
            "error_samples": stats.error_samples,
            "errors_total": stats.error_count,
        }
    )
    return result


async def _load(args: argparse.Namespace, client: Any, names: list[str], stats: Stats, deadline: float) -> None:
    import bots_client

    budget = args.requests if args.requests > 0 else None

    def take() -> bool:
        """Claim one request of the count bound, unless the run is over."""
        if time.monotonic() >= deadline or (budget is not None and stats.issued >= budget):
            return False
        stats.issued += 1
        return True

    async def worker(w: int) -> None:
        name = names[w % len(names)]
        rng = np.random.default_rng(w + 1)
        while take():
            t0 = time.perf_counter()
            try:
                batch = await client.select_batch(name, args.batch_size)
            except bots_client.BotsError as e:
                stats.error("SelectBatch", e)
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))  # do not spin on a dead server
                continue
            stats.ok("SelectBatch", time.perf_counter() - t0)
            if not take():
                return  # the batch stays leased until its TTL; scratch experiments are deleted anyway
            successes = rng.binomial(args.rollouts, rng.random(len(batch.keys)))
            outcomes = {k: (float(s), args.rollouts) for k, s in zip(batch.keys, successes.tolist(), strict=True)}
            t1 = time.perf_counter()
            try:
                await client.report_outcomes(name, batch.batch_id, outcomes)
            except bots_client.BotsError as e:
                stats.error("ReportOutcomes", e)
                continue
            stats.ok("ReportOutcomes", time.perf_counter() - t1)

    workers = [asyncio.create_task(worker(w)) for w in range(args.concurrency)]
    done, pending = await asyncio.wait(workers, timeout=max(0.0, deadline - time.monotonic()) + args.grace)
    for task in pending:
        task.cancel()
        stats.cancelled_at_deadline += 1
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        if task.exception() is not None:  # an unexpected failure in a worker
            stats.error("worker", task.exception())  # type: ignore[arg-type]


def report(result: dict[str, Any]) -> str:
    lines = [
        (
            f"target {result['target']}: {result['requests_ok']} requests ok in {result['load_seconds']:.1f} s "
            f"({result['requests_per_s']:.1f} req/s, {result['steps_per_s']:.1f} select+report steps/s), "
            f"{result['errors_total']} errors, {result['cancelled_at_deadline']} workers cancelled at the deadline "
            f"(setup {result['setup_seconds']:.1f} s)"
        ),
        "",
        f"{'method':<18} {'ok':>7} {'errors':>7} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'max ms':>9}",
    ]
    methods = sorted(set(result["latency_ms"]) | set(result["errors"]))
    for m in methods:
        p = result["latency_ms"].get(m, common.percentiles([]))
        errors = sum(result["errors"].get(m, {}).values())
        lines.append(
            f"{m:<18} {p['n']:>7} {errors:>7} {p['p50']:>9.2f} {p['p90']:>9.2f} {p['p99']:>9.2f} {p['max']:>9.2f}"
        )
    if result["errors_total"]:
        lines.append("")
        lines.append("errors by status: " + json.dumps(result["errors"]))
        for status, message in result["error_samples"].items():
            lines.append(f"  {status}: {message}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
