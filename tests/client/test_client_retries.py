"""Which failures the client retries: UNAVAILABLE always, DEADLINE_EXCEEDED
only for calls that repeating cannot change (reads, selects, reports), and a
refusal with the server's retry pushback; and what a create, fork, restore
or delete does when its retry meets its own lost effect. Real gRPC servers
with scripted handlers, or a proxy in front of a real server, stand in for a
hung, busy or failing server."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

import bots_client
from bots_client.proto import bots_pb2 as pb
from tests.support.servers import ServerProcess
from tests.support.timing import slack

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


@contextlib.contextmanager
def serving(handlers: dict[str, grpc.RpcMethodHandler] | grpc.GenericRpcHandler) -> Iterator[str]:
    """A real gRPC server answering `handlers` of the service; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    if isinstance(handlers, dict):
        handlers = grpc.method_handlers_generic_handler("bots.v1.TaskSelector", handlers)
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


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
    with serving(handlers) as address:
        yield stalls, address


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
            assert 2.0 <= time.monotonic() - started < 2.0 + slack(1.5)


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
    with serving({"CreateExperiment": handler}) as address:
        yield refuser, address


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
    assert 1.0 <= time.monotonic() - started < 1.0 + slack(1.5) and 3 <= len(refuser.calls) <= 5


class LosingAnswers:
    """A server that acts on a create or delete and loses the answer
    (UNAVAILABLE) the first time; the retry then meets what it did
    (ALREADY_EXISTS, NOT_FOUND). `existing`: the experiment already there
    before the client's first attempt, if any."""

    def __init__(self, existing: pb.Experiment | None = None) -> None:
        self.experiment = existing
        self.calls: list[str] = []
        # Made by another client between the first attempt and its retry.
        self.made_by_someone_else: pb.Experiment | None = None

    def create(self, request: pb.CreateExperimentRequest, context: grpc.ServicerContext) -> pb.Experiment:
        self.calls.append("CreateExperiment")
        if self.experiment is not None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"experiment {request.name!r} already exists")
        self.experiment = self.made_by_someone_else or pb.Experiment(name=request.name, config=request.config)
        context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        raise AssertionError

    def get(self, request: pb.GetExperimentRequest, context: grpc.ServicerContext) -> pb.Experiment:
        self.calls.append("GetExperiment")
        if self.experiment is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such experiment")
        return self.experiment

    def delete(self, request: pb.DeleteExperimentRequest, context: grpc.ServicerContext) -> pb.DeleteExperimentResponse:
        self.calls.append("DeleteExperiment")
        if self.experiment is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"experiment {request.name!r} not found")
        self.experiment = None
        context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        raise AssertionError


@pytest.fixture
def losing(request: pytest.FixtureRequest) -> Iterator[tuple[LosingAnswers, str]]:
    server_side = LosingAnswers(getattr(request, "param", None))
    serialize = {"response_serializer": lambda m: m.SerializeToString()}
    handlers = {
        "CreateExperiment": grpc.unary_unary_rpc_method_handler(
            server_side.create, request_deserializer=pb.CreateExperimentRequest.FromString, **serialize
        ),
        "GetExperiment": grpc.unary_unary_rpc_method_handler(
            server_side.get, request_deserializer=pb.GetExperimentRequest.FromString, **serialize
        ),
        "DeleteExperiment": grpc.unary_unary_rpc_method_handler(
            server_side.delete, request_deserializer=pb.DeleteExperimentRequest.FromString, **serialize
        ),
    }
    with serving(handlers) as address:
        yield server_side, address


def test_a_create_whose_answer_was_lost_returns_the_experiment_it_made(losing: tuple[LosingAnswers, str]) -> None:
    server_side, address = losing
    config = bots_client.ExperimentConfig(target_success=0.4)
    with bots_client.Client(address, retry_timeout=10) as client:
        made = client.create_experiment("e", config)
        assert made.name == "e" and made.config == config
        assert server_side.calls == ["CreateExperiment", "CreateExperiment", "GetExperiment"]
        # The experiment is there: a second create is refused as before.
        with pytest.raises(bots_client.AlreadyExistsError):
            client.create_experiment("e", config)


def test_a_delete_whose_answer_was_lost_succeeds(losing: tuple[LosingAnswers, str]) -> None:
    server_side, address = losing
    server_side.experiment = pb.Experiment(name="e", config=pb.ExperimentConfig())
    with bots_client.Client(address, retry_timeout=10) as client:
        client.delete_experiment("e")
        assert server_side.calls == ["DeleteExperiment", "DeleteExperiment"]
        with pytest.raises(bots_client.NotFoundError):
            client.delete_experiment("e")


async def test_the_async_client_settles_lost_answers_alike(losing: tuple[LosingAnswers, str]) -> None:
    server_side, address = losing
    async with bots_client.AsyncClient(address, retry_timeout=10) as client:
        assert (await client.create_experiment("e")).name == "e"
        server_side.calls.clear()
        # The first delete attempt deletes and loses its answer.
        server_side.experiment = pb.Experiment(name="e", config=pb.ExperimentConfig())
        await client.delete_experiment("e")
        assert server_side.calls == ["DeleteExperiment", "DeleteExperiment"]


@pytest.mark.parametrize(
    "losing", [pb.Experiment(name="e", config=pb.ExperimentConfig(target_success=0.7))], indirect=True
)
def test_an_experiment_someone_else_made_is_still_refused(losing: tuple[LosingAnswers, str]) -> None:
    server_side, address = losing
    with bots_client.Client(address, retry_timeout=10) as client:
        # ALREADY_EXISTS with no lost answer before it.
        with pytest.raises(bots_client.AlreadyExistsError):
            client.create_experiment("e", bots_client.ExperimentConfig(target_success=0.4))
        assert server_side.calls == ["CreateExperiment"]
        # After a lost answer, but not as this create would have left it:
        # another config, or tasks already added.
        for other in (pb.Experiment(name="e", config=pb.ExperimentConfig(target_success=0.7)),
                      pb.Experiment(name="e", config=pb.ExperimentConfig(target_success=0.4), num_tasks=3)):  # fmt: skip
            server_side.experiment = None
            server_side.made_by_someone_else = other
            with pytest.raises(bots_client.AlreadyExistsError):
                client.create_experiment("e", bots_client.ExperimentConfig(target_success=0.4))


class LosingProxy(grpc.GenericRpcHandler):
    """Forwards every call to a real server, except that the first call of
    `method` is forwarded, then its answer is lost (UNAVAILABLE), after
    `meanwhile` has run (another client acting between the attempts)."""

    def __init__(self, target: str, method: str, meanwhile: Callable[[], object] = lambda: None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.method = f"/bots.v1.TaskSelector/{method}"
        self.meanwhile = meanwhile
        self.calls: list[str] = []

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        path = details.method  # type: ignore[attr-defined]
        if path.endswith(("/RestoreExperiment", "/AddTasks")):
            forward = self.channel.stream_unary(path)
            return grpc.stream_unary_rpc_method_handler(lambda requests, context: self._answer(path, forward, requests, context))
        forward_unary = self.channel.unary_unary(path)
        return grpc.unary_unary_rpc_method_handler(lambda request, context: self._answer(path, forward_unary, request, context))

    def _answer(self, path: str, forward: Callable[[object], bytes], request: object, context: grpc.ServicerContext) -> bytes:
        self.calls.append(path.rsplit("/", 1)[1])
        try:
            answer = forward(request)
        except grpc.RpcError as e:  # the server's refusal, passed on as it is
            context.abort(e.code(), e.details())  # type: ignore[attr-defined]
        if path == self.method and self.calls.count(path.rsplit("/", 1)[1]) == 1:
            self.meanwhile()
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        return answer


@contextlib.contextmanager
def losing_proxy(proxy: LosingProxy) -> Iterator[str]:
    """The proxy served on an address of its own, which it yields."""
    with proxy.channel, serving(proxy) as address:
        yield address


def _source(client: bots_client.Client, name: str) -> None:
    """An experiment a step in, with a batch still open: what a fork copies."""
    client.create_experiment(name, bots_client.ExperimentConfig(target_success=0.4))
    client.add_tasks(name, [bots_client.Task(f"t{i}") for i in range(6)])
    batch = client.select_batch(name, 2)
    client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))
    client.select_batch(name, 2)


def test_a_fork_or_restore_whose_answer_was_lost_returns_the_copy_it_made(sqlite_server: ServerProcess) -> None:
    with bots_client.Client(sqlite_server.address) as direct:
        _source(direct, "lost-fork-source")
        snapshot = direct.snapshot("lost-fork-source", include_features=True)
        for method, copy in (
            ("ForkExperiment", lambda c: c.fork_experiment("lost-fork-source", "lost-fork")),
            ("RestoreExperiment", lambda c: c.restore_experiment("lost-restore", snapshot)),
        ):
            proxy = LosingProxy(sqlite_server.address, method)
            with losing_proxy(proxy) as address, bots_client.Client(address, retry_timeout=10) as client:
                made = copy(client)
                assert (made.forked_from, made.step, made.num_tasks) == ("lost-fork-source", 1, 6)
                assert made.config.target_success == 0.4
                assert proxy.calls.count(method) == 2
                # It is there: a second attempt is refused as before.
                with pytest.raises(bots_client.AlreadyExistsError):
                    copy(client)


def test_a_copy_changed_between_the_attempts_is_still_refused(sqlite_server: ServerProcess) -> None:
    with bots_client.Client(sqlite_server.address) as direct:
        _source(direct, "changed-copy-source")
        snapshot = direct.snapshot("changed-copy-source", include_features=True)
        for method, name, copy in (
            ("ForkExperiment", "changed-fork", lambda c: c.fork_experiment("changed-copy-source", "changed-fork")),
            ("RestoreExperiment", "changed-restore", lambda c: c.restore_experiment("changed-restore", snapshot)),
        ):
            # Another client draws a batch from the copy before the retry:
            # the copy is no longer as the call left it, so the call fails.
            proxy = LosingProxy(sqlite_server.address, method, lambda name=name: direct.select_batch(name, 2))
            with losing_proxy(proxy) as address, bots_client.Client(address, retry_timeout=10) as client:
                with pytest.raises(bots_client.AlreadyExistsError):
                    copy(client)
        # A fork into a name that another fork of another source holds.
        direct.create_experiment("changed-copy-other")
        direct.fork_experiment("changed-copy-other", "changed-other-fork")
        proxy = LosingProxy(sqlite_server.address, "ForkExperiment")
        with losing_proxy(proxy) as address, bots_client.Client(address, retry_timeout=10) as client:
            with pytest.raises(bots_client.AlreadyExistsError):
                client.fork_experiment("changed-copy-source", "changed-other-fork")
