"""The load generator (bench/loadgen.py) against a real server: it stops at
its count and time bounds, cleans up, and reports errors."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

import bots_client
from bench import loadgen
from tests.support.servers import ServerProcess
from tests.support.timing import slack

SMALL = ["--pool", "300", "--batch-size", "16", "--quiet"]


@pytest.fixture
def server(sqlite_server: ServerProcess) -> ServerProcess:
    """The run's shared SQLite server: the load generator's experiments are
    named by their prefix, and it deletes them."""
    return sqlite_server


def run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    code = loadgen.main([*args, "--json", str(out)])
    return code, json.loads(out.read_text())


def experiment_names(address: str) -> list[str]:
    with bots_client.Client(address) as client:
        return [e.name for e in client.list_experiments()]


def test_stops_at_the_request_count(server: ServerProcess, tmp_path: Path) -> None:
    code, result = run(
        tmp_path,
        "--target",
        server.address,
        "--requests",
        "30",
        "--duration",
        "120",
        "--concurrency",
        "3",
        "--experiments",
        "2",
        *SMALL,
    )
    assert code == 0
    assert result["requests_issued"] == 30
    assert result["requests_ok"] == 30
    assert result["errors_total"] == 0
    lat = result["latency_ms"]
    assert lat["SelectBatch"]["n"] + lat["ReportOutcomes"]["n"] == 30
    assert 0 < lat["SelectBatch"]["p50"] <= lat["SelectBatch"]["p99"] <= lat["SelectBatch"]["max"]
    assert result["load_seconds"] < 60
    assert not [n for n in experiment_names(server.address) if n.startswith("loadgen-")]  # scratch experiments deleted


def test_stops_at_the_time_bound(server: ServerProcess, tmp_path: Path) -> None:
    started = time.monotonic()
    code, result = run(
        tmp_path, "--target", server.address, "--requests", "0", "--duration", "2", "--grace", "2", *SMALL
    )
    elapsed = time.monotonic() - started
    assert code == 0
    assert result["requests_ok"] > 0
    assert result["elapsed_seconds"] < 2 + 2 + slack(1)
    assert elapsed < slack(10)


def test_keep_leaves_the_experiments(server: ServerProcess, tmp_path: Path) -> None:
    code, _ = run(tmp_path, "--target", server.address, "--requests", "4", "--prefix", "kept", "--keep", *SMALL)
    assert code == 0
    assert "kept-0" in experiment_names(server.address)
    with bots_client.Client(server.address) as client:
        client.delete_experiment("kept-0")


def test_reports_server_errors(server: ServerProcess, tmp_path: Path) -> None:
    with bots_client.Client(server.address) as client:
        client.create_experiment("taken-0")
    try:
        code, result = run(tmp_path, "--target", server.address, "--prefix", "taken", "--duration", "5", *SMALL)
    finally:
        with bots_client.Client(server.address) as client:
            client.delete_experiment("taken-0")
    assert code == 2
    assert result["errors"] == {"CreateExperiment": {"ALREADY_EXISTS": 1}}


def test_reports_errors_for_a_bad_address(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    code, result = run(tmp_path, "--target", f"127.0.0.1:{port}", "--duration", "3", *SMALL)
    assert time.monotonic() - started < slack(10)
    assert code == 2
    assert result["errors_total"] >= 1
    assert "UNAVAILABLE" in result["errors"]["CreateExperiment"]
    assert result["requests_ok"] == 0


def test_loopback_mode_starts_and_stops_its_own_server(tmp_path: Path) -> None:
    code, result = run(tmp_path, "--requests", "6", "--duration", "60", *SMALL)
    assert code == 0
    assert result["requests_ok"] == 6
    assert result["target"].startswith("127.0.0.1:")


def test_a_writers_token_leaves_its_experiments_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trainer's token may not delete (that needs tenant-admin): the run
    is no failure, and it names what it left behind."""
    from bots_server.service.credentials import hash_token

    creds = tmp_path / "credentials.toml"
    creds.write_text(f'[[principals]]\nname = "w"\ntenant = "team-w"\nrole = "writer"\ntoken_sha256 = "{hash_token("w-token")}"\n')
    server = ServerProcess(f"sqlite:///{tmp_path / 'w.db'}", extra_args=["--credentials-file", str(creds)]).start()
    try:
        monkeypatch.setenv("BOTS_TOKEN", "w-token")
        # Bounded by the request count; the generous duration and retry keep a
        # slow first connection on a busy machine from counting as an error.
        code, result = run(
            tmp_path, "--target", server.address, "--requests", "4", "--duration", "120", "--retry", "60",
            "--prefix", "w", *SMALL[:-1],
        )  # fmt: skip
        assert code == 0 and result["errors_total"] == 0 and result["left_behind"] == ["w-0"]
        assert "left 1 scratch experiments (w-0): deleting needs a tenant-admin token" in capsys.readouterr().err
    finally:
        server.stop()
