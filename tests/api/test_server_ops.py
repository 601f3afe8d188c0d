"""Health, reflection, graceful shutdown and the ops CLI, against a real server."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import uuid

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import bots_client
from bots_client import ExperimentConfig, Task
from tests.support.servers import ServerProcess


def test_health_reports_liveness_and_readiness(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "bots.v1.TaskSelector"):
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in response.list_services_response.service}
    assert {"bots.v1.TaskSelector", "grpc.health.v1.Health"} <= names


def cli(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bots_server.cli", *args, "--server", server.address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_cli_lists_shows_and_exports(server: ServerProcess) -> None:
    name = f"cli-{uuid.uuid4().hex[:8]}"
    with bots_client.Client(server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=4))
        client.add_tasks(name, [Task("a,b"), Task('quote"d'), Task("plain")])
        batch = client.select_batch(name, 3, request_key="s0")
        client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (4, 16)))
        snap = client.snapshot(name)

    listing = cli(server, "experiments", "list")
    assert listing.returncode == 0, listing.stderr
    line = next(line for line in listing.stdout.splitlines() if line.startswith(name))
    assert line.split()[1:4] == ["bots", "1", "3"]

    shown = cli(server, "experiments", "show", name)
    assert json.loads(shown.stdout)["config"]["seed"] == 4

    exported = cli(server, "export", name, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert [r["key"] for r in rows] == snap.keys
    assert [float(r["alpha"]) for r in rows] == snap.alpha.tolist()  # repr round-trips exactly

    jsonl = cli(server, "export", name, "--format", "jsonl")
    records = [json.loads(line) for line in jsonl.stdout.splitlines()]
    assert [r["beta"] for r in records] == snap.beta.tolist()

    embedded = f"cli-emb-{uuid.uuid4().hex[:8]}"
    with bots_client.Client(server.address) as client:
        client.create_experiment(embedded, ExperimentConfig(embedding_dim=3))
        client.add_tasks(embedded, [Task("a", embedding=[0.1, -2.0, 1e-3]), Task("b", embedding=[1.0, 2.0, 3.0])])
    jsonl = cli(server, "export", embedded, "--format", "jsonl")
    records = [json.loads(line) for line in jsonl.stdout.splitlines()]
    assert np.array([r["embedding"] for r in records], dtype=np.float32).tobytes() == np.array(
        [[0.1, -2.0, 1e-3], [1.0, 2.0, 3.0]], dtype=np.float32
    ).tobytes()

    missing = cli(server, "experiments", "show", "nope")
    assert missing.returncode == 1
    assert "NOT_FOUND" in missing.stderr and "'nope'" in missing.stderr


def test_sigterm_finishes_and_checkpoints(tmp_path) -> None:
    server = ServerProcess(f"sqlite:///{tmp_path / 'term.db'}").start()
    try:
        with bots_client.Client(server.address) as client:
            client.create_experiment("e")
            client.add_tasks("e", [Task(f"t{i}") for i in range(5)])
            batch = client.select_batch("e", 2, request_key="s")
            client.report_outcomes("e", batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))
        assert server.stop() == 0
        messages = server.messages()
        assert messages.index("shutting down") < messages.index("checkpoint written") < messages.index("stopped")
    finally:
        server.kill()


def test_client_request_ids_reach_the_server_logs(tmp_path) -> None:
    """A failed call's request id names the server's log line of that call,
    so a trainer's error can be found in the server's logs."""
    server = ServerProcess(f"sqlite:///{tmp_path / 'ids.db'}", extra_args=["--log-level", "DEBUG"]).start()
    try:
        with bots_client.Client(server.address) as client:
            try:
                client.get_experiment("missing")
            except bots_client.NotFoundError as e:
                error = e
            else:
                raise AssertionError("expected NOT_FOUND")
        assert len(error.request_id) == 32
        server.stop()
        lines = [e for e in server.log_lines if e.get("request_id") == error.request_id]
        assert any(e.get("message") == "rpc" and e.get("code") == "NOT_FOUND" for e in lines), lines
    finally:
        server.kill()
