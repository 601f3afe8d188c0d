"""Does one tenant's flood slow another tenant's trainer? Team B's trainer
loop, measured with the load generator, alone and while team A floods the
same server, on SQLite and PostgreSQL.

    .venv/bin/python -m bench.fairness                      # both backends, uploads and snapshots, 3 rounds
    .venv/bin/python -m bench.fairness --flood all          # ... and restores
    .venv/bin/python -m bench.fairness --backend sqlite --flood uploads --rounds 1 --seconds 10
    .venv/bin/python -m bench.fairness --flood selects --control           # the select flood, and its control
    .venv/bin/python -m bench.fairness --flood selects --backend postgresql --processes 2

Each round runs `bench.loadgen` as team B (its own bearer token; a
tenant-admin, so that it deletes its scratch experiment afterwards:
one worker, SelectBatch -> ReportOutcomes, batch 64 of 10k tasks) for
`--seconds` alone, then for `--seconds` while team A floods, so the two
phases alternate and share the machine's state. The floods:

- uploads:   4 of A's threads, each uploading 250k new tasks at a time, again and again;
- snapshots: 4 of A's threads, each streaming Snapshot(include_features) of a 250k-task experiment, again and again;
- restores:  4 of A's threads, each restoring a 250k-task snapshot as a new experiment (deleted after), again and again;
- selects:   4 of A's threads, each calling SelectBatch (batch 256, never reported; leases of 10 s) on an
             experiment of its own of `--select-tasks` tasks (default 1M), again and again.

With `--control`, each round has a third phase: A floods a second server,
with a database of its own, on the same machine. B's p99 then shows what
sharing the machine (its cores, and on PostgreSQL the database server)
costs B, apart from sharing the service.

Prints, per backend and flood, B's p50 and p99 (milliseconds) alone and
under the flood, per round, and the ratios of the p50s and of the p99s
(median and range over rounds), with B's errors, how many calls of A were
served and refused, and the 1-minute load average after each phase (the
machine may be shared). The goal is a p99 under the flood within 2x of B's
p99 alone, and a p50 within 1.5x.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/fairness.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common

FLOODERS = 4
FLOOD_TASKS = 250_000
FLOODS = ("uploads", "snapshots", "restores", "selects")
SELECT_BATCH = 256
SELECT_LEASE_S = 10.0
TOKENS = {"a-writer": "team-a-writer-token-0123456789", "b-writer": "team-b-writer-token-0123456789"}


def credentials(path: Path, role: str) -> Path:
    from bots_server.service.credentials import hash_token

    path.write_text(
        "\n".join(
            f'[[principals]]\nname = "{who}"\ntenant = "team-{who[0]}"\nrole = "{role}"\n'
            f'token_sha256 = "{hash_token(token)}"\n'
            for who, token in TOKENS.items()
        )
    )
    return path


class Flood:
    """FLOODERS threads of team A calling the server as fast as it answers.
    Requests are serialized once and responses left undecoded, so that the
    flood spends the machine's CPU in the server, not in this client."""

    def __init__(self, address: str, kind: str, select_tasks: int = 1_000_000) -> None:
        import grpc

        from bots_client.proto import bots_pb2 as pb

        self.kind = kind
        self.channel = grpc.insecure_channel(address)
        self.metadata = (("authorization", f"Bearer {TOKENS['a-writer']}"),)
        self.stop = threading.Event()
        self.served = 0
        self.refused: dict[str, int] = {}
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        service = "/bots.v1.TaskSelector/"
        def serialize(message: Any) -> bytes:
            return bytes(message.SerializeToString())

        self.create = self.channel.unary_unary(service + "CreateExperiment", serialize, None)
        self.delete = self.channel.unary_unary(service + "DeleteExperiment", serialize, None)
        self.add = self.channel.stream_unary(service + "AddTasks", None, None)  # bytes in, bytes out
        self.snapshot = self.channel.unary_stream(service + "Snapshot", serialize, None)
        self.restore = self.channel.stream_unary(service + "RestoreExperiment", None, None)
        self.select = self.channel.unary_unary(service + "SelectBatch", serialize, None)
        features = {"weak": 0.5, "strong": 0.5}
        if kind == "restores":
            n = 10_000
            self.chunks = [
                pb.RestoreExperimentRequest(
                    keys=[f"t-{i:07d}" for i in range(s, s + n)], alpha=[1.0] * n, beta=[1.0] * n,
                    features=[pb.Features(values=features)] * n,
                ).SerializeToString()
                for s in range(0, FLOOD_TASKS, n)
            ]  # fmt: skip
        else:
            self.chunks = [
                pb.AddTasksRequest(tasks=[pb.Task(key=f"t-{i:07d}", features=features) for i in range(s, s + 10_000)])
                .SerializeToString()
                for s in range(0, FLOOD_TASKS, 10_000)
            ]
        if kind == "snapshots":
            self.create(pb.CreateExperimentRequest(name="flood-snapshots"), metadata=self.metadata)
            self.upload("flood-snapshots")
        self.pools = [f"flood-selects-{i}" for i in range(FLOODERS)] if kind == "selects" else []
        for name in self.pools:
            config = pb.ExperimentConfig(lease_ttl_seconds=SELECT_LEASE_S)
            self.create(pb.CreateExperimentRequest(name=name, config=config), metadata=self.metadata, timeout=60)
            self.upload(name, select_tasks)

    def upload(self, name: str, tasks: int = FLOOD_TASKS) -> None:
        from bots_client.proto import bots_pb2 as pb

        head = pb.AddTasksRequest(experiment=name, total_tasks=tasks).SerializeToString()
        if tasks == FLOOD_TASKS:
            chunks = iter(self.chunks)
        else:
            chunks = (
                pb.AddTasksRequest(tasks=[pb.Task(key=f"t-{i:07d}") for i in range(s, min(s + 10_000, tasks))])
                .SerializeToString()
                for s in range(0, tasks, 10_000)
            )
        self.add(itertools.chain([head], chunks), metadata=self.metadata, timeout=1800)

    def start(self) -> None:
        self.stop.clear()
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(FLOODERS)]
        for t in self.threads:
            t.start()

    def loop(self, i: int) -> None:
        import grpc

        from bots_client.proto import bots_pb2 as pb

        while not self.stop.is_set():
            try:
                if self.kind == "uploads":
                    name = f"flood-{i}-{uuid.uuid4().hex[:8]}"
                    self.create(pb.CreateExperimentRequest(name=name), metadata=self.metadata, timeout=60)
                    try:
                        self.upload(name)
                    finally:
                        self.delete(pb.DeleteExperimentRequest(name=name), metadata=self.metadata, timeout=600)
                elif self.kind == "restores":
                    name = f"flood-{i}-{uuid.uuid4().hex[:8]}"
                    head = pb.RestoreExperimentRequest(name=name, total_tasks=FLOOD_TASKS).SerializeToString()
                    try:
                        self.restore(iter([head, *self.chunks]), metadata=self.metadata, timeout=600)
                    finally:
                        with contextlib.suppress(grpc.RpcError):  # NOT_FOUND if the restore failed
                            self.delete(pb.DeleteExperimentRequest(name=name), metadata=self.metadata, timeout=600)
                elif self.kind == "selects":
                    select = pb.SelectBatchRequest(experiment=self.pools[i], batch_size=SELECT_BATCH)
                    self.select(select, metadata=self.metadata, timeout=60)
                else:
                    request = pb.SnapshotRequest(experiment="flood-snapshots", include_features=True)
                    for _ in self.snapshot(request, metadata=self.metadata, timeout=600):
                        pass
                with self.lock:
                    self.served += 1
            except grpc.RpcError as e:
                with self.lock:
                    code = e.code().name
                    self.refused[code] = self.refused.get(code, 0) + 1
                time.sleep(0.2)

    def halt(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.threads = []


def trainer_b(address: str, seconds: float, out: Path, flood: Flood | None = None) -> dict[str, Any]:
    """bench.loadgen as team B for `seconds` (its setup, creating and
    filling its experiment, included); its JSON result. `flood` starts once
    B's setup is done, so that B's calls, not its upload, meet the flood."""
    env = {**os.environ, "BOTS_TOKEN": TOKENS["b-writer"]}
    cmd = [sys.executable, "-m", "bench.loadgen", "--target", address, "--duration", str(seconds),
           "--requests", "0", "--concurrency", "1", "--pool", "10000", "--batch-size", "64",
           "--rollouts", "8", "--timeout", "10", "--json", str(out)]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=root) as b:
        assert b.stderr is not None
        for line in b.stderr:  # loadgen's progress lines; "setup: ..." once its experiment is ready
            if line.startswith("setup:") and flood is not None:
                flood.start()
    if flood is not None:
        flood.halt()
    return json.loads(out.read_text())


def summary(result: dict[str, Any]) -> dict[str, float]:
    """B's calls: the slower method's p50 and p99 (ms), calls and errors."""
    methods = [result["latency_ms"][m] for m in ("SelectBatch", "ReportOutcomes") if m in result["latency_ms"]]
    worst = {q: max((m[q] for m in methods), default=float("nan")) for q in ("p50", "p99", "max")}
    return {"calls": result["requests_ok"], "p50_ms": worst["p50"], "p99_ms": worst["p99"], "max_ms": worst["max"],
            "errors": result["errors_total"], "setup_s": result["setup_seconds"], "load1": os.getloadavg()[0]}  # fmt: skip


def run_backend(args: argparse.Namespace, backend: str, floods: list[str]) -> list[dict[str, Any]]:
    rows = []
    rounds, seconds = args.rounds, args.seconds
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        serve = ["--credentials-file", str(credentials(Path(tmp) / "credentials.toml", args.role)), *args.server_arg]
        servers = []
        for _ in range(2 if args.control else 1):  # B's server, then the control's: a database of its own
            url = stack.enter_context(common.database(backend))
            servers.append(common.server_process(url, serve, processes=args.processes).start(timeout=120))
            stack.callback(servers[-1].stop)
        b_server = servers[0].address

        def b_during(flood: Flood) -> dict[str, Any]:
            return summary(trainer_b(b_server, seconds, Path(tmp) / "b.json", flood))

        for kind in floods:
            flood = Flood(b_server, kind, args.select_tasks)
            control = Flood(servers[1].address, kind, args.select_tasks) if args.control else None
            for r in range(rounds):
                alone = summary(trainer_b(b_server, seconds, Path(tmp) / "b.json"))
                if kind == "selects":  # A alone on the server: its throughput, to compare with and without B
                    flood.start()
                    time.sleep(seconds / 2)
                    flood.halt()
                    alone["a_per_s"] = flood.served / (seconds / 2)
                    flood.served = 0
                loaded = b_during(flood)
                row = {"backend": backend, "flood": kind, "round": r, "alone": alone, "flooded": loaded,
                       "ratio_p50": loaded["p50_ms"] / alone["p50_ms"], "ratio_p99": loaded["p99_ms"] / alone["p99_ms"],
                       "a_served": flood.served, "a_refused": dict(flood.refused)}  # fmt: skip
                flood.served, flood.refused = 0, {}
                line = (
                    f"{backend:10s} {kind:9s} round {r}: B alone p50 {alone['p50_ms']:.1f} p99 {alone['p99_ms']:.1f} "
                    f"({alone['calls']} calls, {alone['errors']} errors); flooded p50 {loaded['p50_ms']:.1f} "
                    f"p99 {loaded['p99_ms']:.1f} max {loaded['max_ms']:.0f} ({loaded['calls']} calls, {loaded['errors']} errors); "
                    f"ratios p50 {row['ratio_p50']:.2f} p99 {row['ratio_p99']:.2f}; A served {row['a_served']} "
                    f"refused {row['a_refused']}; load {alone['load1']:.1f}/{loaded['load1']:.1f}"
                )
                if "a_per_s" in alone:
                    line += f"; A alone {alone['a_per_s']:.1f} selects/s"
                if control is not None:
                    beside = b_during(control)
                    row |= {"control": beside, "ratio_p50_control": beside["p50_ms"] / alone["p50_ms"],
                            "ratio_p99_control": beside["p99_ms"] / alone["p99_ms"], "a_served_control": control.served}  # fmt: skip
                    line += (
                        f"; A on the other server: B p50 {beside['p50_ms']:.1f} p99 {beside['p99_ms']:.1f}, ratios "
                        f"{row['ratio_p50_control']:.2f} {row['ratio_p99_control']:.2f}, A served {control.served}, "
                        f"load {beside['load1']:.1f}"
                    )
                    control.served, control.refused = 0, {}
                rows.append(row)
                print(line, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--flood", choices=[*FLOODS, "both", "all"], default="both", help="both: uploads and snapshots")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase (default 20)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra argument to bots-server serve")
    parser.add_argument(
        "--role", default="tenant-admin", help="both teams' role (admin: a server from before tenant-admin existed)"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="a third phase each round: A floods a second server (its own database) on the same machine, "
        "so that B's p99 then shows what sharing the machine's cores costs, apart from sharing the server",
    )
    parser.add_argument(
        "--select-tasks", type=int, default=1_000_000, help="tasks of each of A's pools in the selects flood"
    )
    parser.add_argument("--processes", type=int, default=1, help="server processes (PostgreSQL only above 1)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    floods = {"all": list(FLOODS), "both": ["uploads", "snapshots"]}.get(args.flood, [args.flood])
    info = common.machine_info()
    print(common.machine_line(info), flush=True)
    rows = [row for b in backends for row in run_backend(args, b, floods)]
    for backend in backends:
        for kind in floods:
            mine = [r for r in rows if r["backend"] == backend and r["flood"] == kind]
            for q in ("p50", "p99"):
                ratios = [r[f"ratio_{q}"] for r in mine]
                print(f"{backend:10s} {kind:9s} {q} flooded / alone: {common.median_range(ratios, 2)}")
                if args.control:
                    beside = [r[f"ratio_{q}_control"] for r in mine]
                    print(f"{backend:10s} {kind:9s} {q} with A on the other server / alone: {common.median_range(beside, 2)}")
    if args.json:
        common.write_json(Path(args.json), {"machine": info, "args": vars(args), "rounds": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
