"""A stop always ends. A final checkpoint that cannot be written (here: its
row locked by another connection, as a stuck transaction would) must not keep
the process alive: past --shutdown-seconds it logs where every thread is
waiting and exits with code 3, and no acknowledged outcome is lost."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

import bots_client
from bots_client import Task
from bots_server.service.server import EXIT_SHUTDOWN_TIMEOUT
from bots_server.store.postgresql import MIGRATION_LOCK_KEY
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, pg_conninfo, require_postgres
from tests.support.timing import slack

SHUTDOWN_SECONDS = 4.0
# No checkpoint while serving: the only one left is the final one, at stop.
ARGS = ("--grace-seconds", "1", "--shutdown-seconds", str(SHUTDOWN_SECONDS), "--checkpoint-every-steps", "1000")


def test_a_stop_stuck_on_a_lock_ends_with_every_stack_logged() -> None:
    require_postgres()
    url = create_pg_database("bots_stuck_stop")
    server = ServerProcess(url, extra_args=ARGS).start()
    try:
        with bots_client.Client(server.address) as client:
            client.create_experiment("stuck")
            client.add_tasks("stuck", [Task(key=f"task-{i}") for i in range(20)])
            batch = client.select_batch("stuck", 4, request_key="step-0")
            client.report_outcomes("stuck", batch.batch_id, dict.fromkeys(batch.keys, (1.0, 1)))
            acknowledged = client.snapshot("stuck")
        with psycopg.connect(pg_conninfo(url)) as holder:
            holder.execute("SELECT * FROM checkpoints FOR UPDATE")  # held until this transaction ends
            started = time.monotonic()
            with pytest.warns(UserWarning, match="shutdown did not finish"):
                code = server.stop()
            took = time.monotonic() - started
            holder.rollback()
        assert code == EXIT_SHUTDOWN_TIMEOUT
        assert SHUTDOWN_SECONDS <= took < SHUTDOWN_SECONDS + slack(10)
        messages = server.messages()
        assert "shutdown did not finish; exiting" in messages
        assert any("write_checkpoint" in m for m in messages)  # the stack shows where it waited
        # and the log line, at which step of the stop (the stacks alone show
        # an idle event loop when an await hangs rather than a thread)
        gave_up = [e for e in server.log_lines if e.get("message") == "shutdown did not finish; exiting"]
        assert [e["stage"] for e in gave_up] == ["final checkpoints"]

        again = ServerProcess(url, extra_args=ARGS).start()
        try:
            with bots_client.Client(again.address) as client:
                rebuilt = client.snapshot("stuck")
            assert rebuilt.step == acknowledged.step == 1
            assert rebuilt.alpha.tobytes() == acknowledged.alpha.tobytes()
            assert rebuilt.beta.tobytes() == acknowledged.beta.tobytes()
        finally:
            assert again.stop() == 0
    finally:
        server.kill()
        drop_pg_database(url)


def test_a_stop_while_the_start_waits_for_the_migration_lock_keeps_its_deadline(tmp_path: Path) -> None:
    # Another migration holds the schema lock; the deadline of a SIGTERM
    # that arrives meanwhile (a pod deleted at once) runs from the signal.
    # Before, it ran only once the start was done: 26.5 s after a SIGTERM
    # with --shutdown-seconds 5 while the lock was held 30 s.
    require_postgres()
    url = create_pg_database("bots_stop_in_start")
    stderr = tmp_path / "stderr"
    proc = None
    try:
        with psycopg.connect(pg_conninfo(url)) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
            with stderr.open("w") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "bots_server.cli", "serve", "--db", url, "--listen", "127.0.0.1:0",
                     "--metrics-listen", "", "--log-format", "json", "--processes", "1", *ARGS],
                    stderr=err, stdout=subprocess.DEVNULL,
                )  # fmt: skip
            deadline = time.monotonic() + 60
            # Advisory locks are per database, and the other test workers'
            # servers take the same key in theirs: count only this database's.
            waiting = (
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            while holder.execute(waiting).fetchone() != (1,):  # the migration waits for the lock
                assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()
                time.sleep(0.1)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(SHUTDOWN_SECONDS + 20)
            took = time.monotonic() - started
        assert code == EXIT_SHUTDOWN_TIMEOUT
        assert SHUTDOWN_SECONDS <= took < SHUTDOWN_SECONDS + slack(5)
        assert '"stage": "starting"' in stderr.read_text()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        drop_pg_database(url)
