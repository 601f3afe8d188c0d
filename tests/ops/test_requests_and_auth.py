"""Request ids, log volume and bearer-token auth, against real server processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import bots_client
from bots_client import ExperimentConfig, Task
from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from tests.ops.support import MetricsServer, eventually, value


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def log_entries(server: MetricsServer, message: str, **fields: object) -> list[dict[str, object]]:
    return [
        e for e in list(server.log_lines)
        if e.get("message") == message and all(e.get(k) == v for k, v in fields.items())
    ]  # fmt: skip


def create(stub: pb_grpc.TaskSelectorStub, name: str, metadata: tuple[tuple[str, str], ...] = ()) -> str | None:
    """CreateExperiment; returns the request id the server sent back."""
    _, call = stub.CreateExperiment.with_call(
        pb.CreateExperimentRequest(name=name, config=pb.ExperimentConfig(seed=1)), metadata=metadata, timeout=10
    )
    return dict(call.trailing_metadata()).get("x-request-id")


def test_request_id_is_echoed_and_on_the_state_change_log_line(metrics_server: MetricsServer) -> None:
    with grpc.insecure_channel(metrics_server.address) as channel:
        stub = pb_grpc.TaskSelectorStub(channel)

        def created_line(name: str) -> dict[str, object]:
            return eventually(lambda: log_entries(metrics_server, "experiment created", experiment=name), bool)[0]

        given, name = "trainer-7/step-42", unique("rid")
        assert create(stub, name, (("x-request-id", given),)) == given
        assert created_line(name)["request_id"] == given

        # Without one (or with one unfit for a log line) the server makes one.
        for metadata in ((), (("x-request-id", "x" * 500),)):
            name = unique("rid")
            generated = create(stub, name, metadata)
            assert generated is not None and re.fullmatch(r"[0-9a-f]{32}", generated), generated
            assert created_line(name)["request_id"] == generated

        # Errors carry it too: it is what a user quotes in a bug report.
        with pytest.raises(grpc.RpcError) as failed:
            stub.GetExperiment(pb.GetExperimentRequest(name=unique("nope")), metadata=(("x-request-id", "r-err"),))
        assert failed.value.code() == grpc.StatusCode.NOT_FOUND
        assert dict(failed.value.trailing_metadata())["x-request-id"] == "r-err"


def test_no_log_line_per_call_at_the_default_level(metrics_server: MetricsServer) -> None:
    name = unique("quiet")
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=2))
        client.add_tasks(name, [Task(f"t{i}") for i in range(10)])
        batch = client.select_batch(name, 2, request_key="s")
        # The log is read in order: once a marker's line is read, so is
        # everything logged before it (no sleep that a busy machine outruns).
        before = log_marker(client, metrics_server)
        for _ in range(20):  # calls that change nothing
            client.get_experiment(name)
            assert client.select_batch(name, 2, request_key="s").batch_id == batch.batch_id
        client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))  # a step
        after = log_marker(client, metrics_server)
    new = [e for e in metrics_server.log_lines[before + 1 : after] if not str(e.get("experiment", "")).startswith("mark")]
    assert len(new) <= 1, new  # at most the checkpoint the step may trigger


def log_marker(client: bots_client.Client, server: MetricsServer) -> int:
    """Logs a line of its own ("tasks added" for a new experiment) and
    returns its index once the log reader has read it."""
    name = unique("mark")
    client.create_experiment(name)
    client.add_tasks(name, [Task("m")])
    eventually(lambda: log_entries(server, "tasks added", experiment=name), bool)
    lines = list(server.log_lines)
    return next(i for i, e in enumerate(lines) if e.get("message") == "tasks added" and e.get("experiment") == name)


def test_debug_level_logs_one_access_line_per_call(tmp_path: Path) -> None:
    server = MetricsServer(f"sqlite:///{tmp_path / 'debug.db'}", extra_args=["--log-level", "DEBUG"]).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TaskSelectorStub(channel)
            create(stub, "dbg", (("x-request-id", "dbg-1"),))
            with pytest.raises(grpc.RpcError):
                stub.GetExperiment(pb.GetExperimentRequest(name="missing"), metadata=(("x-request-id", "dbg-2"),))
        rpc = eventually(
            lambda: [e for e in list(server.log_lines) if e.get("message") == "rpc"], lambda x: len(x) >= 2
        )
        by_id = {e.get("request_id"): e for e in rpc}
        assert by_id["dbg-1"]["method"] == "/bots.v1.TaskSelector/CreateExperiment"
        assert by_id["dbg-1"]["code"] == "OK"
        assert by_id["dbg-2"]["code"] == "NOT_FOUND"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsServer]:
    tmp = tmp_path_factory.mktemp("auth")
    tokens_file = tmp / "tokens"
    tokens_file.write_text("# one token per line\ngamma-token\n")
    server = MetricsServer(
        f"sqlite:///{tmp / 'auth.db'}",
        extra_args=["--auth-tokens-file", str(tokens_file)],
        env={"BOTS_AUTH_TOKENS": "alpha-token, beta-token"},
    ).start()
    yield server
    server.stop()


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_calls_need_a_valid_bearer_token(auth_server: MetricsServer) -> None:
    for metadata in ((), bearer("wrong-token"), (("authorization", "Basic alpha-token"),)):
        with bots_client.Client(auth_server.address, metadata=metadata) as client:
            with pytest.raises(bots_client.UnauthenticatedError):
                client.create_experiment(unique("denied"))
            # Streaming calls too, both directions.
            with pytest.raises(bots_client.UnauthenticatedError):
                client.add_tasks("any", [Task("t")])
            with pytest.raises(bots_client.UnauthenticatedError):
                client.snapshot("any")
    # Tokens from the environment and from the file are both accepted.
    for token in ("beta-token", "gamma-token"):
        name = unique("allowed")
        with bots_client.Client(auth_server.address, metadata=bearer(token)) as client:
            client.create_experiment(name, ExperimentConfig(seed=1))
            client.add_tasks(name, [Task("a"), Task("b")])
            assert client.snapshot(name).keys == ["a", "b"]
    # Without a credentials file a plain token is the server's admin: it may
    # name experiments of any tenant (beside a file it may not:
    # tests/service/test_tenants.py).
    other = f"team-x/{unique('run')}"
    with bots_client.Client(auth_server.address, metadata=bearer("alpha-token")) as client:
        client.create_experiment(other)
        assert client.get_experiment(other).name == other
        assert other in {e.name for e in client.list_experiments()}


def test_the_cli_says_to_set_bots_token(auth_server: MetricsServer) -> None:
    def listing(token: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "BOTS_TOKEN"} | ({"BOTS_TOKEN": token} if token else {})
        return subprocess.run(
            [sys.executable, "-m", "bots_server.cli", "experiments", "list", "--server", auth_server.address],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip

    # Not the server's hint for programs ("send metadata 'authorization: ...'").
    for token, why in ((None, "missing bearer token"), ("wrong-token", "invalid bearer token")):
        denied = listing(token)
        assert denied.returncode == 1
        assert denied.stderr.startswith("error: UNAUTHENTICATED: /bots.v1.TaskSelector/ListExperiments: ")
        assert denied.stderr.endswith(f"{why}; set BOTS_TOKEN to a token {auth_server.address} accepts\n")
        assert denied.stderr.count("\n") == 1 and "metadata" not in denied.stderr
    assert listing("alpha-token").returncode == 0


def test_health_and_reflection_need_no_token(auth_server: MetricsServer) -> None:
    with grpc.insecure_channel(auth_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "bots.v1.TaskSelector"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(reflection.ServerReflectionInfo(iter([request]), timeout=5))
    assert "bots.v1.TaskSelector" in {s.name for s in response.list_services_response.service}


def test_rejections_are_counted_and_tokens_never_logged(auth_server: MetricsServer) -> None:
    with bots_client.Client(auth_server.address) as client, pytest.raises(bots_client.UnauthenticatedError):
        client.get_experiment("x")
    # The counter is updated after the answer is sent: poll, do not read once.
    rejected = eventually(
        lambda: value(
            auth_server.samples(), "grpc_server_handled_total", grpc_method="GetExperiment", grpc_code="Unauthenticated"
        ),
        lambda v: v is not None and v >= 1,
        what="the rejection counted",
    )
    assert rejected is not None and rejected >= 1
    serving = next(e for e in auth_server.log_lines if e.get("message") == "serving")
    assert serving["auth"] is True
    logged = repr(list(auth_server.log_lines))
    for token in ("alpha-token", "beta-token", "gamma-token"):
        assert token not in logged
