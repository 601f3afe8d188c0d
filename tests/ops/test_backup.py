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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import bots_client
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


def pg_dump_and_restore(original: str, made: list[str]) -> Backup:
    def backup(folder: Path) -> str:
        dump = folder / "bots.dump"
        subprocess.run(["pg_dump", "--format=custom", f"--file={dump}", pg_conninfo(original)], check=True, timeout=120)
        restored = create_pg_database("bots_restored")
        made.append(restored)
        subprocess.run(
            ["pg_restore", "--no-owner", "--exit-on-error", f"--dbname={pg_conninfo(restored)}", str(dump)],
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
        original_url = create_pg_database("bots_backup")
        made.append(original_url)
        backup = pg_dump_and_restore(original_url, made)
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
