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
