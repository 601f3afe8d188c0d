"""The TaskSelector servicer: converts messages and delegates to the core.
No SQL, no numpy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_server.core.domain import RestoreData, Snapshot
from bots_server.core.limits import shown
from bots_server.core.selector import SelectorService
from bots_server.errors import InvalidArgument
from bots_server.service import convert
from bots_server.service.status import server_streaming, unary

# Snapshot chunks stay well under gRPC's default 4 MB message limit.
SNAPSHOT_CHUNK_BYTES = 1 << 20
_PER_TASK_OVERHEAD = 26  # two doubles, a retired flag and framing
_PER_FEATURE_OVERHEAD = 16  # a double and map-entry framing


class TaskSelectorServicer(pb_grpc.TaskSelectorServicer):
    def __init__(self, core: SelectorService) -> None:
        self.core = core

    @unary
    async def CreateExperiment(
        self, request: pb.CreateExperimentRequest, context: grpc.aio.ServicerContext
    ) -> pb.Experiment:
        config = convert.config_from_proto(request.config)
        return convert.experiment_to_proto(await self.core.experiments.create(request.name, config))

    @unary
    async def ForkExperiment(self, request: pb.ForkExperimentRequest, context: grpc.aio.ServicerContext) -> pb.Experiment:
        config = convert.config_from_proto(request.config) if request.HasField("config") else None
        return convert.experiment_to_proto(await self.core.experiments.fork(request.source, request.name, config))

    @unary
    async def RestoreExperiment(
        self, request_iterator: AsyncIterator[pb.RestoreExperimentRequest], context: grpc.aio.ServicerContext
    ) -> pb.Experiment:
        first: pb.RestoreExperimentRequest | None = None
        keys: list[str] = []
        alpha: list[float] = []
        beta: list[float] = []
        features: list[dict[str, float]] = []
        retired: list[bool] = []
        groups: list[str] = []
        async for chunk in request_iterator:
            if first is None:
                first = chunk
                if not chunk.name:
                    raise InvalidArgument("RestoreExperiment: the first message must name the new experiment")
            keys.extend(chunk.keys)
            alpha.extend(chunk.alpha)
            beta.extend(chunk.beta)
            features.extend(dict(f.values) for f in chunk.features)
            retired.extend(chunk.retired)
            groups.extend(chunk.groups)
        if first is None:
            raise InvalidArgument("RestoreExperiment: empty stream")
        _check_complete("RestoreExperiment", first, len(keys))
        data = RestoreData(
            name=first.name,
            config=convert.config_from_proto(first.config),
            step=first.step,
            capability=first.capability if first.HasField("capability") else None,
            source=first.source,
            keys=keys,
            alpha=alpha,
            beta=beta,
            features=features,
            retired=retired,
            groups=groups,
        )
        return convert.experiment_to_proto(await self.core.experiments.restore(data))

    @unary
    async def GetExperiment(self, request: pb.GetExperimentRequest, context: grpc.aio.ServicerContext) -> pb.Experiment:
        return convert.experiment_to_proto(await self.core.experiments.get(request.name))

    @unary
    async def ListExperiments(
        self, request: pb.ListExperimentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListExperimentsResponse:
        experiments, token = await self.core.experiments.list(request.page_size, request.page_token)
        return pb.ListExperimentsResponse(
            experiments=[convert.experiment_to_proto(e) for e in experiments], next_page_token=token
        )

    @unary
    async def DeleteExperiment(
        self, request: pb.DeleteExperimentRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteExperimentResponse:
        await self.core.experiments.delete(request.name)
        return pb.DeleteExperimentResponse()

    @unary
    async def AddTasks(
        self, request_iterator: AsyncIterator[pb.AddTasksRequest], context: grpc.aio.ServicerContext
    ) -> pb.AddTasksResponse:
        first: pb.AddTasksRequest | None = None
        tasks = []
        async for chunk in request_iterator:
            if first is None:
                first = chunk
                if not chunk.experiment:
                    raise InvalidArgument("AddTasks: the first message must name the experiment")
            elif chunk.experiment and chunk.experiment != first.experiment:
                raise InvalidArgument(
                    f"AddTasks: message names experiment {shown(chunk.experiment)} after {shown(first.experiment)}"
                )
            tasks.extend(convert.tasks_from_proto(chunk.tasks))
        if first is None:
            raise InvalidArgument("AddTasks: empty stream")
        _check_complete("AddTasks", first, len(tasks))
        name = first.experiment
        added, total = await self.core.pool.add_tasks(name, tasks)
        return pb.AddTasksResponse(added=added, num_tasks=total)

    @unary
    async def SelectBatch(self, request: pb.SelectBatchRequest, context: grpc.aio.ServicerContext) -> pb.Batch:
        batch = await self.core.batches.select(request.experiment, request.batch_size, request.request_key)
        return convert.batch_to_proto(batch)

    @unary
    async def ReportOutcomes(
        self, request: pb.ReportOutcomesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportOutcomesResponse:
        outcomes = convert.outcomes_from_proto(request.outcomes)
        result = await self.core.batches.report(request.experiment, request.batch_id, outcomes)
        return convert.report_to_proto(result)

    @unary
    async def RetireTasks(
        self, request: pb.RetireTasksRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetireTasksResponse:
        result = await self.core.pool.set_retired(request.experiment, list(request.keys), retired=True)
        return convert.retire_to_proto(result)

    @unary
    async def ReactivateTasks(
        self, request: pb.RetireTasksRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetireTasksResponse:
        result = await self.core.pool.set_retired(request.experiment, list(request.keys), retired=False)
        return convert.retire_to_proto(result)

    @unary
    async def SetGroupShares(
        self, request: pb.SetGroupSharesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListGroupsResponse:
        shares = convert.shares_from_proto(request.shares)
        return convert.groups_to_proto(await self.core.pool.set_group_shares(request.experiment, shares))

    @unary
    async def ListGroups(self, request: pb.ListGroupsRequest, context: grpc.aio.ServicerContext) -> pb.ListGroupsResponse:
        return convert.groups_to_proto(await self.core.pool.groups(request.experiment))

    @server_streaming
    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SnapshotChunk]:
        snap = await self.core.experiments.snapshot(request.experiment, request.include_features)
        chunk = pb.SnapshotChunk(experiment=convert.experiment_to_proto(snap.experiment))
        start, size = 0, 0
        for i, key in enumerate(snap.keys):
            size += len(key.encode()) + _PER_TASK_OVERHEAD
            if snap.features is not None:
                size += sum(len(name.encode()) + _PER_FEATURE_OVERHEAD for name in snap.features[i])
            if snap.groups is not None:
                size += len(snap.groups[i].encode()) + 2
            if size >= SNAPSHOT_CHUNK_BYTES:
                yield _fill(chunk, snap, start, i + 1)
                chunk, start, size = pb.SnapshotChunk(), i + 1, 0
        yield _fill(chunk, snap, start, len(snap.keys))


def _check_complete(method: str, first: pb.AddTasksRequest | pb.RestoreExperimentRequest, received: int) -> None:
    """A stream that announced its length must have delivered all of it: a
    cancelled or broken stream ends like a complete one on the server's side."""
    if first.HasField("total_tasks") and first.total_tasks != received:
        raise InvalidArgument(
            f"{method}: the stream carried {received} tasks but its first message announced {first.total_tasks}; "
            "nothing was written"
        )


def _fill(chunk: pb.SnapshotChunk, snap: Snapshot, start: int, stop: int) -> pb.SnapshotChunk:
    chunk.keys.extend(snap.keys[start:stop])
    chunk.alpha.extend(snap.alpha[start:stop])
    chunk.beta.extend(snap.beta[start:stop])
    if snap.features is not None:
        chunk.features.extend(pb.Features(values=f) for f in snap.features[start:stop])
    if snap.retired is not None:
        chunk.retired.extend(snap.retired[start:stop])
    if snap.groups is not None:
        chunk.groups.extend(snap.groups[start:stop])
    return chunk
