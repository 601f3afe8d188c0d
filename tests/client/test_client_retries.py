"""Which failures the client retries: UNAVAILABLE always, DEADLINE_EXCEEDED
only for calls that repeating cannot change (reads, selects, reports). A real
gRPC server whose handlers stall on their first call stands in for a hung
server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import bots_client
from bots_client.proto import bots_pb2 as pb

STALL_SECONDS = 1.5


class Stalling:
    """Answers every call, except that the first call of each method stalls."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def handler(self, method: str, response: object) -> grpc.RpcMethodHandler:
        def behavior(request: object, context: grpc.ServicerContext) -> object:
            self.calls[method] = self.calls.get(method, 0) + 1
            if self.calls[method] == 1:
                time.sleep(STALL_SECONDS)
            return response

        return grpc.unary_unary_rpc_method_handler(behavior, response_serializer=lambda m: m.SerializeToString())


@pytest.fixture
def stalling() -> Iterator[tuple[Stalling, str]]:
    stalls = Stalling()
    experiment = pb.Experiment(name="e", config=pb.ExperimentConfig())
    handlers = {
        "GetExperiment": stalls.handler("GetExperiment", experiment),
        "CreateExperiment": stalls.handler("CreateExperiment", experiment),
        "SelectBatch": stalls.handler("SelectBatch", pb.Batch(batch_id="b", keys=["t"])),
        "ReportOutcomes": stalls.handler("ReportOutcomes", pb.ReportOutcomesResponse(step=1)),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bots.v1.TaskSelector", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield stalls, f"127.0.0.1:{port}"
    server.stop(0)


def test_reads_selects_and_reports_are_retried_after_a_deadline(stalling: tuple[Stalling, str]) -> None:
    stalls, address = stalling
    with bots_client.Client(address, timeout=0.5, retry_timeout=10) as client:
        assert client.get_experiment("e").name == "e"
        assert client.select_batch("e", 1, request_key="k").keys == ["t"]
        assert client.report_outcomes("e", "b", {"t": (1, 2)}).step == 1
    assert stalls.calls == {"GetExperiment": 2, "SelectBatch": 2, "ReportOutcomes": 2}


def test_a_create_is_not_retried_after_a_deadline(stalling: tuple[Stalling, str]) -> None:
    stalls, address = stalling
    with bots_client.Client(address, timeout=0.5, retry_timeout=10) as client:
        with pytest.raises(bots_client.DeadlineExceededError):
            client.create_experiment("e")
    assert stalls.calls == {"CreateExperiment": 1}


async def test_the_async_client_retries_the_same_way(stalling: tuple[Stalling, str]) -> None:
    stalls, address = stalling
    async with bots_client.AsyncClient(address, timeout=0.5, retry_timeout=10) as client:
        assert (await client.get_experiment("e")).name == "e"
        with pytest.raises(bots_client.DeadlineExceededError):
            await client.create_experiment("e")
    assert stalls.calls == {"GetExperiment": 2, "CreateExperiment": 1}


def test_unavailable_is_retried_until_retry_timeout_has_passed() -> None:
    # A jittered wait that would overshoot the deadline used to end the
    # retries there: 1.6-2.8 s into a retry_timeout of 3 s.
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens here once closed
    for _ in range(3):
        with bots_client.Client(address, timeout=0.5, retry_timeout=2) as client:
            started = time.monotonic()
            with pytest.raises(bots_client.UnavailableError):
                client.get_experiment("e")
            assert 2.0 <= time.monotonic() - started < 3.5


class Refusing:
    """Refuses the first `refusals` calls with RESOURCE_EXHAUSTED, carrying
    `pushback` as gRPC's retry pushback (None: none), then answers."""

    def __init__(self, refusals: int, pushback: str | None) -> None:
        self.refusals, self.pushback = refusals, pushback
        self.calls: list[float] = []

    def behavior(self, request: object, context: grpc.ServicerContext) -> pb.Experiment:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.refusals:
            if self.pushback is not None:
                context.set_trailing_metadata((("grpc-retry-pushback-ms", self.pushback),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        return pb.Experiment(name="e", config=pb.ExperimentConfig())


@pytest.fixture
def refusing(request: pytest.FixtureRequest) -> Iterator[tuple[Refusing, str]]:
    refusals, pushback = request.param
    refuser = Refusing(refusals, pushback)
    handler = grpc.unary_unary_rpc_method_handler(refuser.behavior, response_serializer=lambda m: m.SerializeToString())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generic = grpc.method_handlers_generic_handler("bots.v1.TaskSelector", {"CreateExperiment": handler})
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield refuser, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("refusing", [(2, "300")], indirect=True)
def test_a_refusal_with_a_retry_pushback_is_retried_after_it(refusing: tuple[Refusing, str]) -> None:
    # Even a create: the server says it wrote nothing and to come back later.
    refuser, address = refusing
    with bots_client.Client(address, retry_timeout=10) as client:
        assert client.create_experiment("e").name == "e"
    assert len(refuser.calls) == 3
    assert all(later - earlier >= 0.29 for earlier, later in zip(refuser.calls, refuser.calls[1:]))


@pytest.mark.parametrize("refusing", [(1, "300")], indirect=True)
async def test_the_async_client_follows_the_pushback_too(refusing: tuple[Refusing, str]) -> None:
    refuser, address = refusing
    async with bots_client.AsyncClient(address, retry_timeout=10) as client:
        assert (await client.create_experiment("e")).name == "e"
    assert len(refuser.calls) == 2 and refuser.calls[1] - refuser.calls[0] >= 0.29


@pytest.mark.parametrize("refusing", [(1, None), (1, "-1"), (1, "soon")], indirect=True)
def test_a_refusal_without_a_valid_pushback_is_final(refusing: tuple[Refusing, str]) -> None:
    refuser, address = refusing
    with bots_client.Client(address, retry_timeout=10) as client:
        with pytest.raises(bots_client.ResourceExhaustedError, match="busy"):
            client.create_experiment("e")
    assert len(refuser.calls) == 1


@pytest.mark.parametrize("refusing", [(100, "300")], indirect=True)
def test_pushback_retries_end_at_retry_timeout(refusing: tuple[Refusing, str]) -> None:
    refuser, address = refusing
    started = time.monotonic()
    with bots_client.Client(address, retry_timeout=1.0) as client:
        with pytest.raises(bots_client.ResourceExhaustedError):
            client.create_experiment("e")
    assert 1.0 <= time.monotonic() - started < 2.5 and 3 <= len(refuser.calls) <= 5
