"""`serve --processes N` on PostgreSQL: N server processes behind one address.

Clients that land on any of them get the results of a single server; a
process killed mid-step is started again and nothing is lost; /metrics is one
endpoint with every process's series; SQLite refuses more than one process."""

from __future__ import annotations

import datetime as dt
import json
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
from bots_server.service.supervisor import SUPERVISOR_SERIES
from tests.support.crash import outcome, setup
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres
from tests.support.timing import slack

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
        assert "bots_server_processes 2.0" in text and "bots_server_processes_up 2.0" in text
        assert all(f"\n{name} " in text for name in SUPERVISOR_SERIES)  # what the alerts may read
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


def test_a_second_supervised_server_cannot_take_the_address(databases: tuple[str, str]) -> None:
    # Without the probe both supervisors started, four processes shared the
    # port, and 8 of 20 fresh connections to the first server's address
    # reached the second server's database.
    first, second = databases
    server = ServerProcess(first, processes=2).start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "bots_server.cli", "serve", "--db", second, "--listen", server.address,
             "--metrics-listen", "127.0.0.1:0", "--processes", "2"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode != 0
        assert f"cannot listen on {server.address}" in result.stderr
        assert len(children(server.proc.pid)) == 2  # type: ignore[union-attr]
    finally:
        assert server.stop() == 0


def test_a_stalled_process_is_killed_with_its_stacks_and_replaced(databases: tuple[str, str]) -> None:
    server = ServerProcess(databases[0], processes=2, extra_args=["--process-stall-seconds", "3"]).start()
    try:
        victim = children(server.proc.pid)[0]  # type: ignore[union-attr]
        os.kill(victim, signal.SIGSTOP)  # its event loop stops; the kernel still deals it connections
        deadline = time.monotonic() + 30
        while victim in children(server.proc.pid):  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the stalled process was never killed"
            time.sleep(0.2)
        while len(children(server.proc.pid)) < 2:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the stalled process was not replaced"
            time.sleep(0.2)
        stalled = [e for e in server.log_lines if str(e.get("message", "")).startswith("server process stopped:")]
        assert stalled and stalled[0]["pid"] == victim
        with connect(server.address) as client:
            setup(client, "after", pool=20)
            assert len(client.select_batch("after", BATCH, request_key="k").keys) == BATCH
        assert "bots_server_process_restarts_total 1.0" in metrics(server.metrics_port)
    finally:
        assert server.stop() == 0


def test_a_pause_of_the_whole_server_is_not_a_stall(databases: tuple[str, str]) -> None:
    # SIGSTOP of the process group (Ctrl-Z, a frozen container or VM): the
    # supervisor did not run either, so no process missed a heartbeat.
    server = ServerProcess(databases[0], processes=2, extra_args=["--process-stall-seconds", "3"]).start()
    try:
        pids = children(server.proc.pid)  # type: ignore[union-attr]
        everyone = [server.proc.pid, *pids]  # type: ignore[union-attr]
        for pid in everyone:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(5)
        for pid in everyone:
            os.kill(pid, signal.SIGCONT)
        time.sleep(3)  # the watchdog has looked several times since
        assert children(server.proc.pid) == pids  # type: ignore[union-attr]
        assert not any(str(e.get("message", "")).startswith("server process stopped:") for e in server.log_lines)
    finally:
        code = server.stop()
        assert code == 0, server.log_lines[-30:]


def test_processes_that_cannot_start_are_retried_slower_and_reported_down(
    databases: tuple[str, str], tmp_path: Path
) -> None:
    log = tmp_path / "stderr"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bots_server.cli", "serve", "--db", databases[0], "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--processes", "2", "--log-format", "json",
             "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "missing.key")],
            stderr=err, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip

    def exits_by_process() -> dict[int, list[dict[str, object]]]:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        exits: dict[int, list[dict[str, object]]] = {}
        for e in lines:
            if e.get("message") == "server process exited; starting it again":
                exits.setdefault(int(e["process_index"]), []).append(e)
        return exits

    try:
        # Wait on the log, not the clock: on a busy machine one failed start
        # (imports, then the missing certificate) can take seconds.
        deadline = time.monotonic() + 180
        while not any(len(e) >= 3 for e in exits_by_process().values()):
            assert proc.poll() is None  # the supervisor goes on retrying
            assert time.monotonic() < deadline, exits_by_process()
            time.sleep(0.2)
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        port = next(int(e["metrics_port"]) for e in lines if e.get("message") == "supervising")
        text = metrics(port)
        assert "bots_server_processes_up 0.0" in text and "bots_server_processes 2.0" in text
        for exits in exits_by_process().values():
            # Each quick exit doubles the delay before the next start (1, 2,
            # 4 s), and the next exit comes no sooner than that delay.
            delays = [float(e["restart_in_seconds"]) for e in exits]  # type: ignore[arg-type]
            assert delays == [min(2.0**i, 30.0) for i in range(len(delays))], delays
            times = [dt.datetime.fromisoformat(str(e["time"])) for e in exits]
            for delay, before, after in zip(delays, times, times[1:], strict=False):
                assert (after - before).total_seconds() >= delay
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_a_sighup_while_processes_start_does_not_kill_them(databases: tuple[str, str]) -> None:
    server = ServerProcess(databases[0], processes=2)
    server.start()
    pids = children(server.proc.pid)  # type: ignore[union-attr]
    try:
        for _ in range(3):  # reloads the credentials: a no-op without a file, and never fatal
            server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            time.sleep(0.3)
        assert children(server.proc.pid) == pids  # type: ignore[union-attr]
        assert "bots_server_process_restarts_total 0.0" in metrics(server.metrics_port)
    finally:
        assert server.stop() == 0


def test_a_process_killed_at_the_shutdown_deadline_fails_the_exit_code(databases: tuple[str, str]) -> None:
    server = ServerProcess(
        databases[0], processes=2,
        extra_args=["--shutdown-seconds", "2", "--grace-seconds", "1", "--process-stall-seconds", "0"],
    ).start()  # fmt: skip
    victim = children(server.proc.pid)[0]  # type: ignore[union-attr]
    os.kill(victim, signal.SIGSTOP)  # it cannot stop by itself
    started = time.monotonic()
    assert "bots_server_processes_up 1.0" in metrics(server.metrics_port)  # the other one answers
    assert time.monotonic() - started < 2 + slack(2)  # within one process's timeout (2 s), not waiting on it first
    assert server.stop() == 128 + signal.SIGKILL
    killed = [e for e in server.log_lines if e.get("message") == "server process did not stop in time; killing it"]
    assert [e["pid"] for e in killed] == [victim]


def test_a_stop_while_a_process_waits_to_start_again_exits_cleanly(databases: tuple[str, str]) -> None:
    # The process's exit was logged when it happened; the stop itself went
    # well. Before, the exit status depended on whether the stop came within
    # the restart's delay (137) or after it (0).
    server = ServerProcess(databases[0], processes=2).start()
    victim = children(server.proc.pid)[0]  # type: ignore[union-attr]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "server process exited; starting it again" not in server.messages():  # seen exited, restart due in 1 s
        assert time.monotonic() < deadline, server.messages()
        time.sleep(0.05)
    assert server.stop() == 0
