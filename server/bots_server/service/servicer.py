"""The TaskSelector servicer: converts messages and delegates to the core.
No SQL, no numpy.

Converting includes names: the caller's experiment names resolve to stored
names in its tenant (core/tenancy.py), and stored names go back out as the
caller names them. Request streams are cut off at their bounds as they
arrive, before the server holds more than the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_server.core import tenancy
from bots_server.core.domain import Experiment, NewTasks, RestoreData, Snapshot
from bots_server.core.limits import shown
from bots_server.core.priority import BLOCK, Pacer
from bots_server.core.quotas import DEFAULT_STREAM_BOUNDS, StreamBounds
from bots_server.core.selector import SelectorService
from bots_server.errors import InvalidArgument, ResourceExhausted
from bots_server.service import convert
from bots_server.service.admission import Admission, Budgets, Charge, snapshot_cost, stream_cost
from bots_server.service.status import server_streaming, unary

# Snapshot chunks stay well under gRPC's default 4 MB message limit.
SNAPSHOT_CHUNK_BYTES = 1 << 20
Message = TypeVar("Message")
_PER_TASK_OVERHEAD = 26  # two doubles, a retired flag and framing
_PER_FEATURE_OVERHEAD = 16  # a double and map-entry framing


def _name(reference: str, what: str = "experiment name") -> str:
    """The stored name of the experiment the caller means."""
    return tenancy.resolve(tenancy.current.get(), reference, what)


def _shown(experiment: Experiment) -> pb.Experiment:
    principal = tenancy.current.get()
    message = convert.experiment_to_proto(experiment)
    message.name = tenancy.shown_to(principal, experiment.name)
    message.forked_from = tenancy.lineage_shown_to(principal, experiment.forked_from)
    if not message.forked_from:
        message.forked_at_step = 0
    return message


class _StreamBudget:
    """Counts a request stream's tasks and bytes against its bounds, and
    charges the memory it holds to the call's admission `charge`."""

    def __init__(self, method: str, bounds: StreamBounds, charge: Charge) -> None:
        self.method, self.bounds, self.charge = method, bounds, charge
        self.tasks = self.bytes = 0
        self.embedding_bytes = 0  # of each task's embedding: set once the experiment's embedding_dim is known

    def _too_many(self) -> ResourceExhausted:
        return ResourceExhausted(
            f"{self.method}: the stream carries more than {self.bounds.max_tasks} tasks (--max-stream-tasks); "
            "send them in several calls; nothing was written"
        )

    async def take(self, message: pb.AddTasksRequest | pb.RestoreExperimentRequest, tasks: int) -> None:
        first = self.tasks == 0 and self.bytes == 0
        self.tasks += tasks
        self.bytes += message.ByteSize()
        if self.tasks > self.bounds.max_tasks:
            raise self._too_many()
        if self.bytes > self.bounds.max_bytes:
            raise ResourceExhausted(
                f"{self.method}: the stream carries more than {self.bounds.max_bytes} bytes (--max-stream-mb); "
                "send them in several calls; nothing was written"
            )
        if first and message.HasField("total_tasks"):
            # Reserve the announced stream's memory at once: two large streams
            # admitted piece by piece could each wait for the other's share.
            if message.total_tasks > self.bounds.max_tasks:
                raise self._too_many()
            per_task = self.bytes / max(tasks, 1)
            announced = stream_cost(message.total_tasks, int(per_task * message.total_tasks), self.embedding_bytes)
            await self.charge.at_least(announced)
        await self.charge.at_least(stream_cost(self.tasks, self.bytes, self.embedding_bytes))


async def _until_idle(
    stream: AsyncIterator[Message], method: str, idle_seconds: float, tasks_in: Callable[[Message], int]
) -> AsyncIterator[Message]:
    """The request stream's messages; one that sends no task (`tasks_in` of
    a message counts them) for `idle_seconds` ends the call
    (RESOURCE_EXHAUSTED), which lets go of the memory admitted for it: a
    stalled stream must not hold other callers' share of the server,
    whichever tenant they are. Messages without tasks do not count: a
    trickle of empty ones is a stall too."""
    messages = stream.__aiter__()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + idle_seconds
    while True:
        try:
            message = await asyncio.wait_for(messages.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise ResourceExhausted(
                f"{method}: the stream sent no task for {idle_seconds:g} s (--stream-idle-seconds) while the "
                "server held memory for it; nothing was written"
            ) from None
        if tasks_in(message):
            deadline = loop.time() + idle_seconds
        yield message


def _caller_tenant() -> str:
    """Whose budget a call's memory counts against: the caller's tenant."""
    return tenancy.current.get().tenant


class TaskSelectorServicer(pb_grpc.TaskSelectorServicer):
    def __init__(
        self,
        core: SelectorService,
        stream_bounds: StreamBounds = DEFAULT_STREAM_BOUNDS,
        admission: Admission | None = None,
    ) -> None:
        self.core = core
        self.stream_bounds = stream_bounds
        self.admission = admission if admission is not None else Admission(Budgets())

    @unary
    async def CreateExperiment(
        self, request: pb.CreateExperimentRequest, context: grpc.aio.ServicerContext
    ) -> pb.Experiment:
        config = convert.config_from_proto(request.config)
        return _shown(await self.core.experiments.create(_name(request.name), config))

    @unary
    async def ForkExperiment(self, request: pb.ForkExperimentRequest, context: grpc.aio.ServicerContext) -> pb.Experiment:
        config = convert.config_from_proto(request.config) if request.HasField("config") else None
        source = _name(request.source, "source experiment name")
        return _shown(await self.core.experiments.fork(source, _name(request.name), config))

    @unary
    async def RestoreExperiment(
        self, request_iterator: AsyncIterator[pb.RestoreExperimentRequest], context: grpc.aio.ServicerContext
    ) -> pb.Experiment:
        first: pb.RestoreExperimentRequest | None = None
        keys: list[str] = []
        alpha: list[float] = []
        beta: list[float] = []
        features: list[dict[str, float]] = []
        name = source = ""
        retired: list[bool] = []
        groups: list[str] = []
        vectors: list[bytes] = []
        async with self.admission.holding(_caller_tenant(), "RestoreExperiment") as charge:
            budget = _StreamBudget("RestoreExperiment", self.stream_bounds, charge)
            pacer = self.core.runtime.priority.pacer()
            idle = self.stream_bounds.idle_seconds
            async for chunk in _until_idle(request_iterator, "RestoreExperiment", idle, lambda m: len(m.keys)):
                if first is None:
                    first = chunk
                    if not chunk.name:
                        raise InvalidArgument("RestoreExperiment: the first message must name the new experiment")
                    name = _name(chunk.name)
                    # The snapshot's provenance is the caller's word: it must name
                    # an experiment (of any server) in a tenant the caller may use.
                    source = _name(chunk.source, "restore source") if chunk.source else ""
                    await self.core.experiments.refuse_taken(name)
                    budget.embedding_bytes = 4 * chunk.config.embedding_dim
                await budget.take(chunk, len(chunk.keys))

                def take(chunk: pb.RestoreExperimentRequest = chunk) -> None:
                    keys.extend(chunk.keys)
                    alpha.extend(chunk.alpha)
                    beta.extend(chunk.beta)
                    features.extend(dict(f.values) for f in pacer.paced(chunk.features))
                    retired.extend(chunk.retired)
                    groups.extend(chunk.groups)
                    vectors.extend(chunk.embeddings)

                await asyncio.to_thread(take)  # off the event loop, as AddTasks' conversion
            if first is None:
                raise InvalidArgument("RestoreExperiment: empty stream")
            _check_complete("RestoreExperiment", first, len(keys))
            data = RestoreData(
                name=name,
                config=convert.config_from_proto(first.config),
                step=first.step,
                capability=first.capability if first.HasField("capability") else None,
                source=source,
                keys=keys,
                alpha=alpha,
                beta=beta,
                features=features,
                retired=retired,
                groups=groups,
                shares=convert.shares_from_proto(first.shares, "RestoreExperiment"),
                rho_halvings=first.rho_halvings,
                embeddings=vectors,
            )
            return _shown(await self.core.experiments.restore(data, pacer))

    @unary
    async def GetExperiment(self, request: pb.GetExperimentRequest, context: grpc.aio.ServicerContext) -> pb.Experiment:
        return _shown(await self.core.experiments.get(_name(request.name)))

    @unary
    async def ListExperiments(
        self, request: pb.ListExperimentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListExperimentsResponse:
        principal = tenancy.current.get()
        # An admin sees every tenant's experiments, everyone else its own.
        tenant = None if principal.role >= tenancy.Role.ADMIN else principal.tenant
        experiments, token = await self.core.experiments.list(request.page_size, request.page_token, tenant)
        return pb.ListExperimentsResponse(experiments=[_shown(e) for e in experiments], next_page_token=token)

    @unary
    async def DeleteExperiment(
        self, request: pb.DeleteExperimentRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteExperimentResponse:
        await self.core.experiments.delete(_name(request.name))
        return pb.DeleteExperimentResponse()

    @unary
    async def AddTasks(
        self, request_iterator: AsyncIterator[pb.AddTasksRequest], context: grpc.aio.ServicerContext
    ) -> pb.AddTasksResponse:
        first: pb.AddTasksRequest | None = None
        tasks = NewTasks()
        name = ""
        async with self.admission.holding(_caller_tenant(), "AddTasks") as charge:
            budget = _StreamBudget("AddTasks", self.stream_bounds, charge)
            pacer = self.core.runtime.priority.pacer()
            idle = self.stream_bounds.idle_seconds
            async for chunk in _until_idle(request_iterator, "AddTasks", idle, lambda m: len(m.tasks)):
                if first is None:
                    first = chunk
                    if not chunk.experiment:
                        raise InvalidArgument("AddTasks: the first message must name the experiment")
                    name = _name(chunk.experiment)
                    # NOT_FOUND now, not after buffering a stream of a million tasks.
                    budget.embedding_bytes = 4 * (await self.core.experiments.shape(name))[1]
                elif chunk.experiment and chunk.experiment != first.experiment:
                    raise InvalidArgument(
                        f"AddTasks: message names experiment {shown(chunk.experiment)} after {shown(first.experiment)}"
                    )
                await budget.take(chunk, len(chunk.tasks))
                # Off the event loop: converting a large message is CPU that
                # would hold every other caller's responses back.
                await asyncio.to_thread(convert.add_tasks_from_proto, tasks, chunk.tasks, pacer)
            if first is None:
                raise InvalidArgument("AddTasks: empty stream")
            _check_complete("AddTasks", first, len(tasks))
            added, total = await self.core.pool.add_tasks(name, tasks)
            return pb.AddTasksResponse(added=added, num_tasks=total)

    @unary
    async def SelectBatch(self, request: pb.SelectBatchRequest, context: grpc.aio.ServicerContext) -> pb.Batch:
        batch = await self.core.batches.select(_name(request.experiment), request.batch_size, request.request_key)
        return convert.batch_to_proto(batch)

    @unary
    async def ReportOutcomes(
        self, request: pb.ReportOutcomesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportOutcomesResponse:
        outcomes = convert.outcomes_from_proto(request.outcomes)
        result = await self.core.batches.report(_name(request.experiment), request.batch_id, outcomes)
        return convert.report_to_proto(result)

    @unary
    async def ReportAndSelect(
        self, request: pb.ReportAndSelectRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportAndSelectResponse:
        outcomes = convert.outcomes_from_proto(request.outcomes)
        result, batch = await self.core.batches.report_and_select(
            _name(request.experiment), request.batch_id, outcomes, request.batch_size, request.request_key
        )
        return pb.ReportAndSelectResponse(report=convert.report_to_proto(result), batch=convert.batch_to_proto(batch))

    @unary
    async def RetireTasks(
        self, request: pb.RetireTasksRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetireTasksResponse:
        result = await self.core.pool.set_retired(_name(request.experiment), list(request.keys), retired=True)
        return convert.retire_to_proto(result)

    @unary
    async def ReactivateTasks(
        self, request: pb.RetireTasksRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetireTasksResponse:
        result = await self.core.pool.set_retired(_name(request.experiment), list(request.keys), retired=False)
        return convert.retire_to_proto(result)

    @unary
    async def SetGroupShares(
        self, request: pb.SetGroupSharesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListGroupsResponse:
        shares = convert.shares_from_proto(request.shares)
        return convert.groups_to_proto(await self.core.pool.set_group_shares(_name(request.experiment), shares))

    @unary
    async def ListGroups(self, request: pb.ListGroupsRequest, context: grpc.aio.ServicerContext) -> pb.ListGroupsResponse:
        return convert.groups_to_proto(await self.core.pool.groups(_name(request.experiment)))

    @server_streaming
    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SnapshotChunk]:
        name = _name(request.experiment)
        num_tasks, embedding_dim = await self.core.experiments.shape(name)
        async with self.admission.holding(_caller_tenant(), "Snapshot") as charge:
            await charge.at_least(snapshot_cost(num_tasks, request.include_features, 4 * embedding_dim))
            pacer = self.core.runtime.priority.pacer()
            snap = await self.core.experiments.snapshot(name, request.include_features, pacer)
            # Chunks are sized and built on a worker thread, in blocks that
            # give way to trainer calls: a large experiment's copy takes
            # seconds of CPU that would otherwise stall every other caller.
            bounds = await asyncio.to_thread(_chunk_bounds, snap, pacer)
            for start, stop in bounds:
                chunk = pb.SnapshotChunk(experiment=_shown(snap.experiment)) if start == 0 else pb.SnapshotChunk()
                if start == 0:
                    chunk.shares.extend(convert.shares_to_proto(snap.shares))
                    chunk.rho_halvings = snap.rho_halvings
                yield await asyncio.to_thread(_fill, chunk, snap, start, stop, pacer)


def _check_complete(method: str, first: pb.AddTasksRequest | pb.RestoreExperimentRequest, received: int) -> None:
    """A stream that announced its length must have delivered all of it: a
    cancelled or broken stream ends like a complete one on the server's side."""
    if first.HasField("total_tasks") and first.total_tasks != received:
        raise InvalidArgument(
            f"{method}: the stream carried {received} tasks but its first message announced {first.total_tasks}; "
            "nothing was written"
        )


def _chunk_bounds(snap: Snapshot, pacer: Pacer) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of about SNAPSHOT_CHUNK_BYTES; one chunk
    at least, so that an empty experiment still answers with its summary."""
    bounds, start, size = [], 0, 0
    for i, key in pacer.paced(enumerate(snap.keys)):
        size += len(key.encode()) + _PER_TASK_OVERHEAD
        if snap.features is not None:
            size += sum(len(name.encode()) + _PER_FEATURE_OVERHEAD for name in snap.features[i])
        if snap.groups is not None:
            size += len(snap.groups[i].encode()) + 2
        if snap.embeddings is not None:
            size += len(snap.embeddings[i]) + 3
        if size >= SNAPSHOT_CHUNK_BYTES:
            bounds.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(snap.keys) or not bounds:
        bounds.append((start, len(snap.keys)))
    return bounds


def _fill(chunk: pb.SnapshotChunk, snap: Snapshot, start: int, stop: int, pacer: Pacer) -> pb.SnapshotChunk:
    for lo in pacer.paced(range(start, stop, BLOCK), size=1):
        hi = min(lo + BLOCK, stop)
        chunk.keys.extend(snap.keys[lo:hi])
        chunk.alpha.extend(snap.alpha[lo:hi])
        chunk.beta.extend(snap.beta[lo:hi])
        if snap.features is not None:
            chunk.features.extend(pb.Features(values=f) for f in snap.features[lo:hi])
        if snap.retired is not None:
            chunk.retired.extend(snap.retired[lo:hi])
        if snap.groups is not None:
            chunk.groups.extend(snap.groups[lo:hi])
        if snap.embeddings is not None:
            chunk.embeddings.extend(snap.embeddings[lo:hi])
    return chunk
