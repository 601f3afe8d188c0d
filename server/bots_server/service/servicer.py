"""The TaskSelector servicer: converts messages and delegates to the core.
No SQL, no numpy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from bots_client import _convert
from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_client.types import ExperimentConfig, Outcome
from bots_server.core.selector import RestoreData, SelectorService, SnapshotData
from bots_server.errors import InvalidArgument
from bots_server.service.status import server_streaming, unary

# Snapshot chunks stay well under gRPC's default 4 MB message limit.
SNAPSHOT_CHUNK_BYTES = 1 << 20
_PER_TASK_OVERHEAD = 24  # two doubles and framing
_PER_FEATURE_OVERHEAD = 16  # a double and map-entry framing


class TaskSelectorServicer(pb_grpc.TaskSelectorServicer):
    def __init__(self, selector: SelectorService) -> None:
        self.selector = selector

    @unary
    async def CreateExperiment(
        self, request: pb.CreateExperimentRequest, context: grpc.aio.ServicerContext
    ) -> pb.Experiment:
        config = _config(request.config)
        return _convert.experiment_to_proto(await self.selector.create_experiment(request.name, config))

    @unary
    async def ForkExperiment(self, request: pb.ForkExperimentRequest, context: grpc.aio.ServicerContext) -> pb.Experiment:
        config = _config(request.config) if request.HasField("config") else None
        return _convert.experiment_to_proto(await self.selector.fork_experiment(request.source, request.name, config))

    @unary
    async def RestoreExperiment(
        self, request_iterator: AsyncIterator[pb.RestoreExperimentRequest], context: grpc.aio.ServicerContext
    ) -> pb.Experiment:
        first: pb.RestoreExperimentRequest | None = None
        keys: list[str] = []
        alpha: list[float] = []
        beta: list[float] = []
        features: list[dict[str, float]] = []
        async for chunk in request_iterator:
            if first is None:
                first = chunk
                if not chunk.name:
                    raise InvalidArgument("RestoreExperiment: the first message must name the new experiment")
            keys.extend(chunk.keys)
            alpha.extend(chunk.alpha)
            beta.extend(chunk.beta)
            features.extend(dict(f.values) for f in chunk.features)
        if first is None:
            raise InvalidArgument("RestoreExperiment: empty stream")
        data = RestoreData(
            name=first.name,
            config=_config(first.config),
            step=first.step,
            capability=first.capability if first.HasField("capability") else None,
            source=first.source,
            keys=keys,
            alpha=alpha,
            beta=beta,
            features=features,
        )
        return _convert.experiment_to_proto(await self.selector.restore_experiment(data))

    @unary
    async def GetExperiment(self, request: pb.GetExperimentRequest, context: grpc.aio.ServicerContext) -> pb.Experiment:
        return _convert.experiment_to_proto(await self.selector.get_experiment(request.name))

    @unary
    async def ListExperiments(
        self, request: pb.ListExperimentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListExperimentsResponse:
        experiments, token = await self.selector.list_experiments(request.page_size, request.page_token)
        return pb.ListExperimentsResponse(
            experiments=[_convert.experiment_to_proto(e) for e in experiments], next_page_token=token
        )

    @unary
    async def DeleteExperiment(
        self, request: pb.DeleteExperimentRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteExperimentResponse:
        await self.selector.delete_experiment(request.name)
        return pb.DeleteExperimentResponse()

    @unary
    async def AddTasks(
        self, request_iterator: AsyncIterator[pb.AddTasksRequest], context: grpc.aio.ServicerContext
    ) -> pb.AddTasksResponse:
        name = ""
        tasks = []
        async for chunk in request_iterator:
            if not name:
                name = chunk.experiment
                if not name:
                    raise InvalidArgument("AddTasks: the first message must name the experiment")
            elif chunk.experiment and chunk.experiment != name:
                raise InvalidArgument(f"AddTasks: message names experiment {chunk.experiment!r} after {name!r}")
            tasks.extend(_convert.tasks_from_proto(chunk.tasks))
        if not name:
            raise InvalidArgument("AddTasks: empty stream")
        added, total = await self.selector.add_tasks(name, tasks)
        return pb.AddTasksResponse(added=added, num_tasks=total)

    @unary
    async def SelectBatch(self, request: pb.SelectBatchRequest, context: grpc.aio.ServicerContext) -> pb.Batch:
        batch = await self.selector.select_batch(request.experiment, request.batch_size, request.request_key)
        return _convert.batch_to_proto(batch)

    @unary
    async def ReportOutcomes(
        self, request: pb.ReportOutcomesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportOutcomesResponse:
        outcomes = [Outcome(o.key, o.successes, o.trials) for o in request.outcomes]
        result = await self.selector.report_outcomes(request.experiment, request.batch_id, outcomes)
        return _convert.report_to_proto(result)

    @server_streaming
    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SnapshotChunk]:
        snap = await self.selector.snapshot(request.experiment, request.include_features)
        chunk = pb.SnapshotChunk(experiment=_convert.experiment_to_proto(snap.experiment))
        start, size = 0, 0
        for i, key in enumerate(snap.keys):
            size += len(key) + _PER_TASK_OVERHEAD
            if snap.features is not None:
                size += sum(len(name) + _PER_FEATURE_OVERHEAD for name in snap.features[i])
            if size >= SNAPSHOT_CHUNK_BYTES:
                yield _fill(chunk, snap, start, i + 1)
                chunk, start, size = pb.SnapshotChunk(), i + 1, 0
        yield _fill(chunk, snap, start, len(snap.keys))


def _config(message: pb.ExperimentConfig) -> ExperimentConfig:
    try:
        return _convert.config_from_proto(message)
    except ValueError as e:
        raise InvalidArgument(str(e)) from e


def _fill(chunk: pb.SnapshotChunk, snap: SnapshotData, start: int, stop: int) -> pb.SnapshotChunk:
    chunk.keys.extend(snap.keys[start:stop])
    chunk.alpha.extend(snap.alpha[start:stop])
    chunk.beta.extend(snap.beta[start:stop])
    if snap.features is not None:
        chunk.features.extend(pb.Features(values=f) for f in snap.features[start:stop])
    return chunk
