"""`bots-server migrate`: the separate schema command the container image and
the Kubernetes init container run."""

from __future__ import annotations

import multiprocessing
import sqlite3
import subprocess
import sys
from pathlib import Path
from threading import Barrier as BarrierType

import bots_client
from bots_server.store import revisions
from tests.ops.support import MetricsServer


def migrate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "migrate", *args], capture_output=True, text=True, timeout=timeout
    )


def test_check_then_migrate_then_serve_without_migrating(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    check = migrate("--db", url, "--check")
    assert check.returncode == 3, check.stdout + check.stderr
    assert "empty database" in check.stdout

    done = migrate("--db", url)
    assert done.returncode == 0, done.stderr
    again = migrate("--db", url, "--check")
    assert again.returncode == 0, again.stdout + again.stderr

    # What the image and the pods do: serve with migrations off.
    server = MetricsServer(url, extra_args=["--migrate", "false"]).start()
    try:
        with bots_client.Client(server.address) as client:
            client.create_experiment("after-migrate")
    finally:
        server.stop()


def test_check_creates_no_database_file(tmp_path: Path) -> None:
    # --check changes nothing: connecting to SQLite would create the file.
    missing = tmp_path / "new.db"
    check = migrate("--db", f"sqlite:///{missing}", "--check")
    assert check.returncode == 3, check.stdout + check.stderr  # 3: not at the latest revision (see --help)
    assert check.stdout.startswith("schema is at nothing (empty database, or none yet); the code needs ")
    assert check.stderr == ""
    assert list(tmp_path.iterdir()) == []


def _migrate_at_barrier(url: str, barrier: BarrierType) -> str:
    """In a child process: connect, wait for the others, then migrate."""
    from bots_server.store import open_store

    store = open_store(url)
    try:
        store.ping()
        barrier.wait(timeout=60)
        store.migrate()
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        store.close()


def test_replicas_migrating_at_once_all_succeed(fresh_pg_url: str) -> None:
    # Several pods' init containers start together on a rollout. Without the
    # advisory lock their DDL transactions block each other (until the
    # statement timeout) or fail on "already exists"; with it they take turns.
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(4)
        with context.Pool(4) as pool:
            results = pool.starmap(_migrate_at_barrier, [(fresh_pg_url, barrier)] * 4)
    assert results == ["ok"] * 4
    assert migrate("--db", fresh_pg_url, "--check").returncode == 0


def test_unreachable_database_waits_then_fails(tmp_path: Path) -> None:
    # Port 1 on loopback: nothing listens, the connection is refused at once.
    result = migrate("--db", "postgresql+psycopg://postgres@127.0.0.1:1/none", "--wait-seconds", "1.5")
    assert result.returncode == 1
    assert "waiting for the database" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("error: database unavailable")


ALEMBIC_INTERNALS = ("setup plugin", "Context impl", "Will assume")


def test_a_first_start_logs_no_alembic_internals(tmp_path: Path) -> None:
    # Alembic's "setup plugin", "Context impl SQLiteImpl." and "Will assume
    # non-transactional DDL." INFO lines (up to 13 a start) are noise; the
    # "Running upgrade" lines say what changed and stay.
    done = migrate("--db", f"sqlite:///{tmp_path / 'first.db'}")
    assert done.returncode == 0, done.stderr
    assert "Running upgrade" in done.stderr
    assert not [line for line in done.stderr.splitlines() if any(s in line for s in ALEMBIC_INTERNALS)], done.stderr
    served = f"sqlite:///{tmp_path / 'served.db'}"
    for first in (True, False):  # a first start migrates; the second finds the schema current
        server = MetricsServer(served).start()
        server.stop()
        assert "serving" in server.messages()
        assert not [m for m in server.messages() if any(s in m for s in ALEMBIC_INTERNALS)], server.messages()
        assert any(m.startswith("Running upgrade") for m in server.messages()) == first


def test_a_rollback_onto_a_newer_schema_migrates_nothing_and_serves(tmp_path: Path) -> None:
    # The previous release's image on a database a newer release migrated
    # (docs: fine if that migration was additive). Before, `migrate` failed
    # with "Can't locate revision" (and so did every pod's init container),
    # as did a server migrating at its start.
    url = f"sqlite:///{tmp_path / 'm.db'}"
    assert migrate("--db", url).returncode == 0
    newer = f"{int(max(revisions.heads())) + 1:04d}"
    with sqlite3.connect(tmp_path / "m.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (newer,))
    done = migrate("--db", url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"schema is at ['{newer}'], newer than this code's migrations: left as it is")
    server = MetricsServer(url).start()  # migrating at its start, the default
    try:
        with bots_client.Client(server.address) as client:
            client.create_experiment("after-rollback")
        assert "database schema is newer than this code's migrations" in "\n".join(server.messages())
    finally:
        server.stop()
    with sqlite3.connect(tmp_path / "m.db") as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(newer,)]
    # A revision this code does not know and that is not newer is no rollback: it fails as before.
    with sqlite3.connect(tmp_path / "m.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'abc'")
    assert migrate("--db", url).returncode != 0
