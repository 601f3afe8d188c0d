"""PostgreSQL stopped and started under a running server: calls fail fast
with UNAVAILABLE, readiness turns NOT_SERVING, the server recovers by itself,
and the client's default retries ride through a short outage."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import bots_client
from bots_client import Task
from bots_server.testing.postgres import PG_ADMIN_DSN
from tests.support.pgcluster import PgCluster
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres
from tests.support.timing import slack


@pytest.fixture
def cluster() -> Iterator[PgCluster]:
    pg = PgCluster()
    pg.start()
    yield pg
    pg.destroy()


def readiness(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service="bots.v1.TaskSelector")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def wait_for(predicate, limit: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_server_rides_through_a_database_outage(cluster: PgCluster) -> None:
    server = ServerProcess(cluster.create_database("outage")).start()
    try:
        client = bots_client.Client(server.address)
        client.create_experiment("e")
        client.add_tasks("e", [Task(f"t{i}") for i in range(20)])
        first = client.select_batch("e", 4, request_key="s0")
        client.report_outcomes("e", first.batch_id, dict.fromkeys(first.keys, (1, 2)))
        pending = client.select_batch("e", 4, request_key="s1")

        cluster.stop()
        # No retries, a long deadline: the answer is UNAVAILABLE, not a hang
        # until DEADLINE_EXCEEDED.
        impatient = bots_client.Client(server.address, retry_timeout=0, timeout=60)
        for call in (
            lambda: impatient.select_batch("e", 2, request_key="during"),
            lambda: impatient.report_outcomes("e", pending.batch_id, dict.fromkeys(pending.keys, (1, 2))),
            lambda: impatient.get_experiment("e"),
        ):
            with pytest.raises(bots_client.UnavailableError, match="database"):
                call()
        assert wait_for(lambda: readiness(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert server.proc.poll() is None  # still running

        # A report sent during the outage with the default retries succeeds
        # once the database is back, and is applied once.
        result: list[bots_client.ReportResult] = []
        patient = threading.Thread(
            target=lambda: result.append(
                client.report_outcomes("e", pending.batch_id, dict.fromkeys(pending.keys, (1, 2)))
            )
        )
        patient.start()
        time.sleep(2)
        cluster.start()
        patient.join(90)
        assert result and result[0].step == 2
        assert wait_for(lambda: readiness(server.address) == health_pb2.HealthCheckResponse.SERVING)
        assert client.report_outcomes("e", pending.batch_id, dict.fromkeys(pending.keys, (1, 2))).duplicate
        assert client.get_experiment("e").step == 2
    finally:
        server.stop()


def cluster_pids(cluster: PgCluster) -> list[int]:
    """The postmaster and every process it started."""
    postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            pids.append(int(stat.parent.name))
    return pids


def train(client: bots_client.Client, steps: int, done: list[int]) -> None:
    for step in range(steps):
        batch = client.select_batch("e", 4, request_key=f"step-{step}")
        client.report_outcomes("e", batch.batch_id, dict.fromkeys(batch.keys, (step % 3, 2)))
        done.append(step)
        time.sleep(0.2)


def final_state(client: bots_client.Client) -> tuple[object, ...]:
    snap = client.snapshot("e")
    return snap.step, tuple(snap.keys), snap.alpha.tobytes(), snap.beta.tobytes()


def test_a_trainer_rides_through_a_hung_database(cluster: PgCluster) -> None:
    """PostgreSQL frozen with SIGSTOP (it accepts nothing and refuses
    nothing): readiness turns NOT_SERVING within the documented bound, calls
    answer UNAVAILABLE instead of hanging to the caller's deadline, and a
    trainer loop with the default client finishes exactly like one that
    never saw the hang."""
    timeout_s = 2.0
    args = ("--database-timeout-seconds", str(timeout_s))
    reference = ServerProcess(cluster.create_database("reference"), extra_args=args).start()
    server = ServerProcess(cluster.create_database("hung"), extra_args=args).start()
    try:
        for s in (reference, server):
            with bots_client.Client(s.address) as setup:
                setup.create_experiment("e")
                setup.add_tasks("e", [Task(f"t{i}") for i in range(40)])
        with bots_client.Client(reference.address) as client:
            train(client, 12, [])
            expected = final_state(client)

        client = bots_client.Client(server.address)  # the defaults: 30 s deadline, 60 s of retries
        done: list[int] = []
        trainer = threading.Thread(target=train, args=(client, 12, done))
        trainer.start()
        assert wait_for(lambda: len(done) >= 3)
        pids = cluster_pids(cluster)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            assert wait_for(lambda: readiness(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
            noticed = time.monotonic() - frozen
            assert noticed <= 1.0 + timeout_s + slack(1.0)  # check interval + ping timeout + slack
            impatient = bots_client.Client(server.address, retry_timeout=0, timeout=60)
            asked = time.monotonic()
            with pytest.raises(bots_client.UnavailableError, match="database"):
                impatient.get_experiment("e")
            assert time.monotonic() - asked < slack(5)
            impatient.close()
            time.sleep(3)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        trainer.join(120)
        assert not trainer.is_alive() and done == list(range(12))
        assert wait_for(lambda: readiness(server.address) == health_pb2.HealthCheckResponse.SERVING)
        assert final_state(client) == expected
        client.close()
    finally:
        server.stop()
        reference.stop()


def test_a_read_only_database_is_down_and_calls_are_retryable() -> None:
    # A failover that leaves the address on a standby: reads work, every
    # write fails. The server was SERVING and answered writes with INTERNAL,
    # which clients do not retry; now readiness turns NOT_SERVING and calls
    # answer UNAVAILABLE until the database takes writes again.
    require_postgres()
    url = create_pg_database("bots_read_only")
    name = url.rsplit("/", 1)[1]
    server = ServerProcess(url).start()

    def switch(read_only: bool) -> None:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            setting = "SET default_transaction_read_only = on" if read_only else "RESET default_transaction_read_only"
            admin.execute(f'ALTER DATABASE "{name}" {setting}')
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))

    try:
        client = bots_client.Client(server.address)
        client.create_experiment("e")
        client.add_tasks("e", [Task(f"t{i}") for i in range(20)])
        first = client.select_batch("e", 4, request_key="s0")
        switch(read_only=True)
        assert wait_for(lambda: readiness(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 20)
        impatient = bots_client.Client(server.address, retry_timeout=0)
        with pytest.raises(bots_client.UnavailableError):
            impatient.report_outcomes("e", first.batch_id, dict.fromkeys(first.keys, (1, 2)))
        time.sleep(3)  # reconnected by now: a ping that reads (SELECT 1) would say SERVING again
        assert readiness(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        switch(read_only=False)
        assert wait_for(lambda: readiness(server.address) == health_pb2.HealthCheckResponse.SERVING, 20)
        assert client.report_outcomes("e", first.batch_id, dict.fromkeys(first.keys, (1, 2))).step == 1
    finally:
        server.stop()
        drop_pg_database(url)
