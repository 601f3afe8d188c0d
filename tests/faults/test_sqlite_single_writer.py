"""SQLite is one server per file: a second server refuses to start with a
clear error, and the first keeps working on an intact file."""

from __future__ import annotations

import subprocess
import sys

import bots_client
from bots_client import Task
from tests.support.servers import ServerProcess


def test_second_server_on_the_same_file_fails_clearly(tmp_path) -> None:
    db = f"sqlite:///{tmp_path / 'one.db'}"
    first = ServerProcess(db).start()
    try:
        with bots_client.Client(first.address) as client:
            client.create_experiment("e")
            client.add_tasks("e", [Task("a"), Task("b")])
        second = subprocess.run(
            [sys.executable, "-m", "bots_server.cli", "serve", "--db", db, "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode != 0
        assert "is in use by another bots-server" in second.stderr
        assert f"pid {first.proc.pid}" in second.stderr
        with bots_client.Client(first.address) as client:
            batch = client.select_batch("e", 2, request_key="s")
            assert client.report_outcomes("e", batch.batch_id, {"a": (1, 2)}).step == 1
    finally:
        first.stop()
    # Once the first is gone, the file opens again with its state.
    again = ServerProcess(db).start()
    try:
        with bots_client.Client(again.address) as client:
            assert client.get_experiment("e").step == 1
    finally:
        again.stop()


def test_migrate_refuses_a_file_a_server_holds(tmp_path) -> None:
    db = f"sqlite:///{tmp_path / 'held.db'}"
    server = ServerProcess(db).start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "bots_server.cli", "migrate", "--db", db], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 1
        assert "is in use by another bots-server" in result.stderr
    finally:
        server.stop()
