"""Backups, as docs/operations.md tells operators to take them: pg_dump of a
PostgreSQL database and SQLite's online backup API, each taken while
trainers report. Each copy is restored into a fresh database, a new server
serves it, and the trainers' loops, resumed from the step the copy holds,
get the original's batches for the same request keys and end on the
original's posterior, bit for bit."""

from __future__ import annotations

import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

import bots_client
from bots_server.testing.postgres import PG_ADMIN_DSN
from tests.support.crash import Run, final_state, outcome, setup, train
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, pg_conninfo, require_postgres

NAMES = ("math", "code")
STEPS = 50
BATCH = 16
# Checkpoints every 7 steps: a copy holds a checkpoint and events after it.
SERVER_ARGS = ("--checkpoint-every-steps", "7", "--checkpoint-every-seconds", "3600")

Backup = Callable[[Path], str]  # takes a copy into a folder, returns the URL of a restored database


@pytest.fixture
def pg_databases() -> Iterator[list[str]]:
    require_postgres()
    made: list[str] = []
    yield made
    for url in made:
        drop_pg_database(url)


@pytest.fixture
def server_role() -> Iterator[str]:
    """A login role that is not a superuser, as the docs' `bots`: the server
    runs as it, and the restored tables must be its own."""
    require_postgres()
    role = f"bots_backup_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
    yield role
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        owned = admin.execute(
            "SELECT datname FROM pg_database d JOIN pg_roles r ON d.datdba = r.oid WHERE r.rolname = %s", (role,)
        ).fetchall()
        for (name,) in owned:  # its databases go first (pg_databases drops them after this)
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def as_role(url: str, role: str) -> str:
    return url.replace("://postgres@", f"://{role}@", 1)


def owned_database(role: str, made: list[str], prefix: str) -> str:
    """createdb --owner=ROLE: a database of the server's role, its URL as that role."""
    url = create_pg_database(prefix)
    made.append(url)
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{url.rsplit("/", 1)[1]}" OWNER TO "{role}"')
    return as_role(url, role)


def pg_dump_and_restore(original: str, role: str, made: list[str]) -> Backup:
    """docs/operations/upgrade-and-backup.md: pg_dump as the server's role;
    then, as the superuser, a database owned by that role and pg_restore
    --no-owner --role=ROLE, so that the restored tables are the role's."""

    def backup(folder: Path) -> str:
        dump = folder / "bots.dump"
        dump_as_role = psycopg.conninfo.make_conninfo(pg_conninfo(original), user=role)
        subprocess.run(["pg_dump", "--format=custom", f"--file={dump}", dump_as_role], check=True, timeout=120)
        restored = owned_database(role, made, "bots_restored")
        subprocess.run(
            ["pg_restore", "--no-owner", f"--role={role}", "--exit-on-error",
             f"--dbname={pg_conninfo(restored)}", str(dump)],
            check=True, timeout=120,
        )  # fmt: skip
        return restored

    return backup


def sqlite_online_backup(original: Path) -> Backup:
    def backup(folder: Path) -> str:
        # The sqlite3 module's backup(), SQLite's online backup API (what the
        # sqlite3 shell's .backup runs), on a connection of its own while the
        # server writes through its own.
        copy = folder / "bots-backup.db"
        source, target = sqlite3.connect(original), sqlite3.connect(copy)
        try:
            source.backup(target)
        finally:
            source.close()
            target.close()
        return f"sqlite:///{copy}"

    return backup


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_a_backup_taken_while_trainers_report_restores_and_continues_bit_identical(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if backend == "postgresql":
        made: list[str] = request.getfixturevalue("pg_databases")
        role: str = request.getfixturevalue("server_role")
        original_url = owned_database(role, made, "bots_backup")
        backup = pg_dump_and_restore(original_url, role, made)
    else:
        original_db = tmp_path / "bots.db"
        original_url = f"sqlite:///{original_db}"
        backup = sqlite_online_backup(original_db)

    original = ServerProcess(original_url, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(original.address) as client:
            for name in NAMES:
                setup(client, name, pool=300)
        runs = {name: Run() for name in NAMES}
        trainers = [threading.Thread(target=train_alone, args=(original.address, n, runs[n])) for n in NAMES]
        for t in trainers:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(r.picks) for r in runs.values()) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        # The copy is taken mid-run, while the trainers report (pg_dump's
        # snapshot is its start; SQLite's backup copies what is committed).
        assert not any(r.done.is_set() for r in runs.values()), "the trainers finished before the backup began"
        restored_url = backup(tmp_path)
        for t in trainers:
            t.join(timeout=300)
        assert all(r.done.is_set() for r in runs.values())
        with bots_client.Client(original.address) as client:
            expected = {name: final_state(client, name) for name in NAMES}
    finally:
        original.stop()

    restored = ServerProcess(restored_url, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(restored.address) as client:
            for name in NAMES:
                resumed_at = client.get_experiment(name).step
                assert 5 <= resumed_at < STEPS, (name, resumed_at)
                # The trainer resumes its loop at the restored step; a batch
                # the copy holds open comes back for its request key.
                for step in range(resumed_at, STEPS):
                    batch = client.select_batch(name, BATCH, request_key=f"step-{step}")
                    assert batch.keys == runs[name].picks[step], (name, step)
                    client.report_outcomes(name, batch.batch_id, {k: outcome(k, step) for k in batch.keys})
                assert final_state(client, name) == expected[name], name
    finally:
        restored.stop()


def train_alone(address: str, name: str, run: Run) -> None:
    with bots_client.Client(address) as client:
        train(client, name, STEPS, BATCH, run)
