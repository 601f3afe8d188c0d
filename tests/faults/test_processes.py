"""`serve --processes N` on PostgreSQL: N server processes behind one address.

Clients that land on any of them get the results of a single server; a
process killed mid-step is started again and nothing is lost; /metrics is one
endpoint with every process's series; SQLite refuses more than one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import bots_client
from tests.support.crash import outcome, setup
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres

STEPS, BATCH = 12, 8


@pytest.fixture
def databases() -> Iterator[tuple[str, str]]:
    require_postgres()
    urls = create_pg_database("bots_processes"), create_pg_database("bots_processes")
    yield urls
    for url in urls:
        drop_pg_database(url)


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def connect(address: str) -> bots_client.Client:
    """A client on a connection of its own: gRPC shares one connection among
    a process's channels to the same address by default, which would keep
    every call on one server process."""
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    return bots_client.Client(address, channel=channel, retry_timeout=60)


def train(address: str, name: str, steps: range, *, kill: int | None = None) -> list[list[str]]:
    """A trainer that opens a new connection for every call, so the kernel
    deals its calls to any process; `kill` (a pid) is SIGKILLed right after
    the first report (the supervisor's processes, mid-run)."""
    picks = []
    for step in steps:
        with connect(address) as client:
            batch = client.select_batch(name, BATCH, request_key=f"step-{step}")
        with connect(address) as client:
            client.report_outcomes(name, batch.batch_id, {k: outcome(k, step) for k in batch.keys})
        if kill is not None:
            os.kill(kill, signal.SIGKILL)
            kill = None
        picks.append(list(batch.keys))
    return picks


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def rpc_calls_by_process(text: str) -> dict[str, float]:
    calls: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("bots_rpc_requests_total{") or line.startswith("grpc_server_handled_total{"):
            process = line.split('process="')[1].split('"')[0]
            calls[process] = calls.get(process, 0.0) + float(line.rsplit(" ", 1)[1])
    return calls


def test_processes_behind_one_address_match_a_single_server(databases: tuple[str, str]) -> None:
    shared_db, single_db = databases
    server = ServerProcess(shared_db, processes=2).start()
    single = ServerProcess(single_db).start()
    try:
        assert len(children(server.proc.pid)) == 2  # type: ignore[union-attr]
        with bots_client.Client(server.address) as c, bots_client.Client(single.address) as ref:
            setup(c, "run", pool=60)
            setup(ref, "run", pool=60)
            got = train(server.address, "run", range(STEPS))
            expected = train(single.address, "run", range(STEPS))
            assert got == expected
            mine, theirs = c.snapshot("run"), ref.snapshot("run")
            assert (mine.step, mine.alpha.tobytes(), mine.beta.tobytes()) == (
                theirs.step, theirs.alpha.tobytes(), theirs.beta.tobytes()
            )  # fmt: skip
            # A retried select on any process: the same batch.
            again = [c2.select_batch("run", BATCH, request_key="step-3").keys
                     for c2 in (connect(server.address) for _ in range(4))]  # fmt: skip
            assert all(keys == got[3] for keys in again)
        # One /metrics endpoint: both processes' series, and both answered calls.
        text = metrics(server.metrics_port)
        calls = rpc_calls_by_process(text)
        assert set(calls) == {"0", "1"} and all(n > 0 for n in calls.values()), calls
        assert "bots_server_processes 2.0" in text
    finally:
        single.stop()
        code = server.stop()
    assert code == 0


def test_a_process_killed_mid_run_is_replaced_and_loses_nothing(databases: tuple[str, str]) -> None:
    shared_db, single_db = databases
    server = ServerProcess(shared_db, processes=2).start()
    single = ServerProcess(single_db).start()
    try:
        victim = children(server.proc.pid)[0]  # type: ignore[union-attr]
        with bots_client.Client(server.address) as c, bots_client.Client(single.address) as ref:
            setup(c, "run", pool=60)
            setup(ref, "run", pool=60)
            got = train(server.address, "run", range(STEPS), kill=victim)
            expected = train(single.address, "run", range(STEPS))
            assert got == expected
            mine, theirs = c.snapshot("run"), ref.snapshot("run")
            assert mine.alpha.tobytes() == theirs.alpha.tobytes() and mine.beta.tobytes() == theirs.beta.tobytes()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = children(server.proc.pid)  # type: ignore[union-attr]
            if len(now) == 2 and victim not in now and "bots_server_process_restarts_total 1.0" in metrics(
                server.metrics_port
            ):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the killed process was not replaced: {children(server.proc.pid)}")  # type: ignore[union-attr]
        assert any(e.get("message") == "server process exited; starting it again" for e in server.log_lines)
    finally:
        single.stop()
        code = server.stop()
    assert code == 0


def test_killing_the_supervisor_stops_every_process(databases: tuple[str, str]) -> None:
    server = ServerProcess(databases[0], processes=2).start()
    workers = children(server.proc.pid)  # type: ignore[union-attr]
    server.kill()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
              for pid in workers):  # fmt: skip
        assert time.monotonic() < deadline, "a server process outlived its supervisor"
        time.sleep(0.1)


def test_sqlite_refuses_more_than_one_process(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "serve", "--db", f"sqlite:///{tmp_path / 'b.db'}",
         "--listen", "127.0.0.1:0", "--processes", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--processes 2 needs PostgreSQL" in result.stderr
