"""One server per port and per SQLite file: a second server refuses to start
with a clear error, whatever path reaches the file (the same path, a hard
link, a symlink, a relative path), and the first keeps working on an intact
file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import bots_client
from bots_client import Task
from tests.support.servers import ServerProcess


def second_path(kind: str, file: Path) -> tuple[str, Path]:
    """Another way to name `file`: (database URL, working directory)."""
    other = file.parent / "other"
    other.mkdir(exist_ok=True)
    if kind == "hard link":
        os.link(file, other / "linked.db")
        return f"sqlite:///{other / 'linked.db'}", other
    if kind == "symlink":
        (other / "symlinked.db").symlink_to(file)
        return f"sqlite:///{other / 'symlinked.db'}", other
    if kind == "relative path":
        return f"sqlite:///../{file.name}", other
    return f"sqlite:///{file}", other


@pytest.mark.parametrize("kind", ["same path", "hard link", "symlink", "relative path"])
def test_second_server_on_the_same_file_fails_clearly(tmp_path: Path, kind: str) -> None:
    file = tmp_path / "one.db"
    db = f"sqlite:///{file}"
    first = ServerProcess(db).start()
    try:
        with bots_client.Client(first.address) as client:
            client.create_experiment("e")
            client.add_tasks("e", [Task("a"), Task("b")])
        url, cwd = second_path(kind, file)
        second = subprocess.run(
            [sys.executable, "-m", "bots_server.cli", "serve", "--db", url, "--listen", "127.0.0.1:0",
             "--metrics-listen", ""],
            capture_output=True, text=True, timeout=60, cwd=cwd,
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


def test_second_server_on_a_port_in_use_fails_clearly(tmp_path: Path) -> None:
    first = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}").start()
    try:
        second = subprocess.run(
            [sys.executable, "-m", "bots_server.cli", "serve", "--db", f"sqlite:///{tmp_path / 'b.db'}",
             "--listen", first.address, "--metrics-listen", ""],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode != 0
        assert f"cannot listen on {first.address}" in second.stderr
        with bots_client.Client(first.address) as client:
            client.create_experiment("still-served")
            assert client.get_experiment("still-served").name == "still-served"
    finally:
        first.stop()
