"""How much memory a flood of uploads takes from a server, with and without
the in-flight budgets (--inflight-budget-mb, --tenant-inflight-budget-mb).

    .venv/bin/python -m bench.admission                 # budgets 0 (off) and 80 MB, 3 repeats interleaved

Each run starts a server on a fresh SQLite file with two tenants, then 16
threads upload 40k tasks each at once (half per tenant), slowly (0.3 s
between messages), and samples the server's resident memory every 20 ms.
Prints, per budget, the growth of resident memory over the run and how
many uploads were accepted and refused. The per-tenant budget is half the
server's. About a minute per run on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.common import machine_info, machine_line
from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_server.testing.processes import ServerProcess, rss_bytes
from bots_server.testing.tenants import bearer, credentials_file, upload

UPLOADS = 16
TASKS, CHUNK = 40_000, 4_000  # an upload: charged about 29 MB
PRINCIPALS = {"a-writer": ("team-a", "writer"), "b-writer": ("team-b", "writer")}


def flood(budget_mb: int) -> tuple[float, list[str]]:
    """(resident growth in MiB, each upload's status) for one run."""
    with tempfile.TemporaryDirectory() as tmp:
        creds = credentials_file(Path(tmp) / "credentials.toml", PRINCIPALS)
        args = ["--credentials-file", str(creds), "--inflight-budget-mb", str(budget_mb),
                "--tenant-inflight-budget-mb", str(budget_mb // 2), "--tenant-bulk-calls", "0"]  # fmt: skip
        server = ServerProcess(f"sqlite:///{Path(tmp) / 'flood.db'}", extra_args=args).start()
        try:
            assert server.proc is not None
            pid = server.proc.pid
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.TaskSelectorStub(channel)
                for who in PRINCIPALS:
                    stub.CreateExperiment(pb.CreateExperimentRequest(name="flood"), metadata=bearer(who), timeout=20)
                before = rss_bytes(pid)[0]
                peak = [before]
                done = threading.Event()

                def watch() -> None:
                    while not done.is_set():
                        peak[0] = max(peak[0], rss_bytes(pid)[0])
                        time.sleep(0.02)

                def send(i: int) -> str:
                    who = "a-writer" if i % 2 else "b-writer"
                    try:
                        tag = f"f{i}-{uuid.uuid4().hex[:6]}"
                        stub.AddTasks(upload("flood", tag, TASKS, CHUNK, pause=0.3), metadata=bearer(who), timeout=300)
                    except grpc.RpcError as e:
                        return e.code().name
                    return "OK"

                watcher = threading.Thread(target=watch)
                watcher.start()
                try:
                    with ThreadPoolExecutor(UPLOADS) as pool:
                        codes = list(pool.map(send, range(UPLOADS)))
                finally:
                    done.set()
                    watcher.join()
        finally:
            server.stop()
    return (peak[0] - before) / 2**20, codes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="0,80", help="comma-separated --inflight-budget-mb values (0: off)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    print(machine_line(machine_info()))
    for repeat in range(args.repeats):
        for budget in budgets:  # interleaved
            growth, codes = flood(budget)
            print(f"repeat {repeat} budget {budget:>4} MB: resident growth {growth:6.1f} MiB, "
                  f"{codes.count('OK')} accepted, {codes.count('RESOURCE_EXHAUSTED')} refused")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
