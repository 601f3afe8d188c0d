"""PostgreSQL stopped and started under a running server: calls fail fast
with UNAVAILABLE, readiness turns NOT_SERVING, the server recovers by itself,
and the client's default retries ride through a short outage."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import bots_client
from bots_client import Task
from tests.support.pgcluster import PgCluster
from tests.support.servers import ServerProcess


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
        client.report_outcomes("e", first.batch_id, {k: (1, 2) for k in first.keys})
        pending = client.select_batch("e", 4, request_key="s1")

        cluster.stop()
        # No retries, a long deadline: the answer is UNAVAILABLE, not a hang
        # until DEADLINE_EXCEEDED.
        impatient = bots_client.Client(server.address, retry_timeout=0, timeout=60)
        for call in (
            lambda: impatient.select_batch("e", 2, request_key="during"),
            lambda: impatient.report_outcomes("e", pending.batch_id, {k: (1, 2) for k in pending.keys}),
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
                client.report_outcomes("e", pending.batch_id, {k: (1, 2) for k in pending.keys})
            )
        )
        patient.start()
        time.sleep(2)
        cluster.start()
        patient.join(90)
        assert result and result[0].step == 2
        assert wait_for(lambda: readiness(server.address) == health_pb2.HealthCheckResponse.SERVING)
        assert client.report_outcomes("e", pending.batch_id, {k: (1, 2) for k in pending.keys}).duplicate
        assert client.get_experiment("e").step == 2
    finally:
        server.stop()
