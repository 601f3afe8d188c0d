"""A stop always ends. A final checkpoint that cannot be written (here: its
row locked by another connection, as a stuck transaction would) must not keep
the process alive: past --shutdown-seconds it logs where every thread is
waiting and exits with code 3, and no acknowledged outcome is lost."""

from __future__ import annotations

import time

import psycopg
import pytest

import bots_client
from bots_client import Task
from bots_server.service.server import EXIT_SHUTDOWN_TIMEOUT
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, pg_conninfo, require_postgres

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
        assert SHUTDOWN_SECONDS <= took < SHUTDOWN_SECONDS + 10
        messages = server.messages()
        assert "shutdown did not finish; exiting" in messages
        assert any("write_checkpoint" in m for m in messages)  # the stack shows where it waited

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
