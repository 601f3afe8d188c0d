"""Quotas, stream bounds and credential reloads against real server
processes: each limit answers RESOURCE_EXHAUSTED naming it and writes
nothing, on SQLite and PostgreSQL; the credentials file is re-read without a
restart, and a broken file keeps the previous credentials."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import bots_client
from bots_client import Task
from bots_server.service.credentials import hash_token
from tests.support.servers import ServerProcess


def entry(name: str, tenant: str, role: str = "writer") -> str:
    return f'[[principals]]\nname = "{name}"\ntenant = "{tenant}"\nrole = "{role}"\ntoken_sha256 = "{hash_token(name + "-token")}"\n'


def client(server: ServerProcess, principal: str) -> bots_client.Client:
    return bots_client.Client(server.address, metadata=bots_client.bearer(principal + "-token"), retry_timeout=0)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def quota_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("quotas")
    url = f"sqlite:///{tmp / 'quotas.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    creds = tmp / "credentials.toml"
    # Flags give every tenant 3 experiments, 10 tasks each, 15 in all;
    # team-big's own entry overrides them.
    creds.write_text(
        "[tenants.team-big]\nmax_experiments = 0\nmax_tasks_per_experiment = 100\nmax_tasks = 0\n\n"
        + entry("small", "team-small", "tenant-admin")  # it deletes, to make room
        + entry("big", "team-big")
    )
    args = [
        "--credentials-file", str(creds), "--max-experiments-per-tenant", "3", "--max-tasks-per-experiment", "10",
        "--max-tasks-per-tenant", "15", "--max-stream-tasks", "12", "--max-stream-mb", "0.001",
    ]  # fmt: skip
    server = ServerProcess(url, extra_args=args).start()
    yield server
    server.stop()


def tasks(n: int, prefix: str = "t") -> list[Task]:
    return [Task(key=f"{prefix}{i}") for i in range(n)]


def test_experiment_and_task_quotas(quota_server: ServerProcess) -> None:
    with client(quota_server, "small") as c:
        for name in ("e1", "e2", "e3"):
            c.create_experiment(name)
        with pytest.raises(bots_client.ResourceExhaustedError, match="max_experiments = 3"):
            c.create_experiment("e4")
        with pytest.raises(bots_client.ResourceExhaustedError, match="max_experiments = 3"):
            c.fork_experiment("e1", "e1-fork")
        assert {e.name for e in c.list_experiments()} == {"e1", "e2", "e3"}

        c.add_tasks("e1", tasks(8))
        with pytest.raises(bots_client.ResourceExhaustedError, match="max_tasks_per_experiment = 10"):
            c.add_tasks("e1", tasks(3, "more"))
        assert c.get_experiment("e1").num_tasks == 8
        c.add_tasks("e1", tasks(2, "more"))  # exactly at the quota
        c.add_tasks("e2", tasks(5))
        with pytest.raises(bots_client.ResourceExhaustedError, match="max_tasks = 15"):
            c.add_tasks("e3", tasks(1))
        assert c.get_experiment("e3").num_tasks == 0
        c.delete_experiment("e2")
        c.create_experiment("e4")  # room again
        c.add_tasks("e4", tasks(5))

    with client(quota_server, "big") as c:
        for i in range(5):  # no experiment limit for team-big
            c.create_experiment(f"big{i}")
        c.add_tasks("big0", tasks(12))  # above the flags' 10, within its own 100


def test_stream_bounds(quota_server: ServerProcess) -> None:
    with client(quota_server, "big") as c:
        c.create_experiment("streams")
        with pytest.raises(bots_client.ResourceExhaustedError, match="more than 12 tasks"):
            c.add_tasks("streams", tasks(13))
        # 0.001 MB = 1048 bytes: 10 tasks with 200-character keys are more.
        with pytest.raises(bots_client.ResourceExhaustedError, match="more than 1048 bytes"):
            c.add_tasks("streams", [Task(key=f"{i}" + "k" * 200) for i in range(10)])
        assert c.get_experiment("streams").num_tasks == 0
        c.add_tasks("streams", tasks(12))
        assert c.get_experiment("streams").num_tasks == 12


def wait_until(condition: object, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def can_list(server: ServerProcess, principal: str) -> bool:
    # Retries UNAVAILABLE: on a busy machine a new connection's handshake can
    # time out; UNAUTHENTICATED is never retried.
    try:
        with bots_client.Client(server.address, metadata=bots_client.bearer(principal + "-token"), retry_timeout=60) as c:
            c.list_experiments()
        return True
    except bots_client.UnauthenticatedError:
        return False


def test_credentials_reload_without_restart(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.toml"
    creds.write_text(entry("alice", "team-a"))
    server = ServerProcess(f"sqlite:///{tmp_path / 'reload.db'}", extra_args=["--credentials-file", str(creds)]).start()
    try:
        assert can_list(server, "alice") and not can_list(server, "bob")
        # Replaced the way Kubernetes updates a mounted Secret: a new file renamed over.
        new = tmp_path / "new.toml"
        new.write_text(entry("bob", "team-a"))
        os.replace(new, creds)
        assert wait_until(lambda: can_list(server, "bob") and not can_list(server, "alice"))

        # A broken file is logged and the credentials in force stay.
        creds.write_text("[[principals]\nname = ")
        assert wait_until(lambda: any(e.get("message", "").startswith("credentials file not reloaded") for e in list(server.log_lines)))
        assert can_list(server, "bob")

        # SIGHUP reloads at once, even when the file's stamp did not change.
        creds.write_text(entry("carol", "team-a"))
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGHUP)
        assert wait_until(lambda: can_list(server, "carol"), seconds=60)
        assert not can_list(server, "bob")
    finally:
        server.stop()


def test_a_bad_credentials_file_stops_the_start(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.toml"
    creds.write_text('[[principals]]\nname = "x"\ntenant = "Team A"\nrole = "writer"\ntoken_sha256 = "00"\n')
    server = ServerProcess(f"sqlite:///{tmp_path / 'bad.db'}", extra_args=["--credentials-file", str(creds)])
    with pytest.raises(RuntimeError, match="did not start"):
        server.start(timeout=60)
    assert any("credentials-file" in line and "Team A" in line for line in server.messages()), server.messages()


def test_the_token_command_makes_a_working_entry(tmp_path: Path) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "token", "--name", "dana", "--tenant", "team-d", "--role", "reader"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = [line for line in made.stdout.splitlines() if not line.startswith("#")]
    token, entry = lines[0], "\n".join(lines[1:]) + "\n"
    assert token not in entry  # only its hash goes into the file
    creds = tmp_path / "credentials.toml"
    creds.write_text(entry)
    server = ServerProcess(f"sqlite:///{tmp_path / 't.db'}", extra_args=["--credentials-file", str(creds)]).start()
    try:
        with bots_client.Client(server.address, metadata=bots_client.bearer(token), retry_timeout=0) as dana:
            assert dana.list_experiments() == []
            with pytest.raises(bots_client.PermissionDeniedError, match="role reader"):
                dana.create_experiment("not-for-readers")
    finally:
        server.stop()
    bad = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "token", "--name", "x", "--role", "owner"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 1 and "reader, writer, tenant-admin, admin" in bad.stderr


def _token_entry(name: str, tenant: str, role: str) -> tuple[str, str]:
    made = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "token", "--name", name, "--tenant", tenant, "--role", role],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = [line for line in made.stdout.splitlines() if not line.startswith("#")]
    return lines[0], "\n".join(lines[1:]) + "\n"


def test_a_tenant_admin_administers_its_own_tenant_and_nothing_else(tmp_path: Path) -> None:
    owner_token, owner = _token_entry("owner-a", "team-a", "tenant-admin")
    trainer_token, trainer = _token_entry("trainer-a", "team-a", "writer")
    other_token, other = _token_entry("trainer-b", "team-b", "writer")
    assert 'role = "tenant-admin"' in owner
    creds = tmp_path / "credentials.toml"
    creds.write_text(owner + "\n" + trainer + "\n" + other)
    server = ServerProcess(f"sqlite:///{tmp_path / 't.db'}", extra_args=["--credentials-file", str(creds)]).start()
    try:
        with (
            bots_client.Client(server.address, metadata=bots_client.bearer(owner_token), retry_timeout=0) as a_admin,
            bots_client.Client(server.address, metadata=bots_client.bearer(trainer_token), retry_timeout=0) as a_writer,
            bots_client.Client(server.address, metadata=bots_client.bearer(other_token), retry_timeout=0) as b_writer,
        ):
            a_writer.create_experiment("run")
            b_writer.create_experiment("run")
            # A trainer's token cannot erase its run; the team's administrator can.
            with pytest.raises(bots_client.PermissionDeniedError, match="needs tenant-admin or above"):
                a_writer.delete_experiment("run")
            assert [e.name for e in a_admin.list_experiments()] == ["run"]  # its own tenant's only
            a_admin.delete_experiment("run")
            assert a_writer.list_experiments() == []
            # Nothing of another tenant: not by its qualified name, not by a plain one.
            with pytest.raises(bots_client.PermissionDeniedError, match="may not use experiments of tenant 'team-b'"):
                a_admin.delete_experiment("team-b/run")
            with pytest.raises(bots_client.NotFoundError):
                a_admin.get_experiment("run")
            assert [e.name for e in b_writer.list_experiments()] == ["run"]
    finally:
        server.stop()
