"""asyncio client: the same surface as Client, with async methods."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import grpc

from bots_client import _calls, _convert
from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_client.errors import from_rpc_error
from bots_client.types import Batch, Experiment, ExperimentConfig, ReportResult, Snapshot, Task

T = TypeVar("T")


class AsyncClient:
    """See Client: same deadlines, retries and errors."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 30.0,
        bulk_timeout: float = 600.0,
        retry_timeout: float = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.bulk_timeout = bulk_timeout
        self.retry_timeout = retry_timeout
        self._metadata = tuple(metadata)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=_calls.CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=_calls.CHANNEL_OPTIONS)
        self._stub = pb_grpc.TaskSelectorStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn: Callable[[float, _calls.Metadata], Awaitable[T]], timeout: float | None = None) -> T:
        request_id, metadata = _calls.with_request_id(self._metadata)
        deadline = time.monotonic() + self.retry_timeout
        for delay in _calls.backoff():
            try:
                return await fn(self.timeout if timeout is None else timeout, metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    raise from_rpc_error(e, request_id) from None
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def create_experiment(self, name: str, config: ExperimentConfig | None = None) -> Experiment:
        request = pb.CreateExperimentRequest(name=name, config=_convert.config_to_proto(config or ExperimentConfig()))
        response = await self._call(lambda t, md: self._stub.CreateExperiment(request, timeout=t, metadata=md))
        return _convert.experiment_from_proto(response)

    async def get_experiment(self, name: str) -> Experiment:
        request = pb.GetExperimentRequest(name=name)
        response = await self._call(lambda t, md: self._stub.GetExperiment(request, timeout=t, metadata=md))
        return _convert.experiment_from_proto(response)

    async def list_experiments(self, page_size: int = 0) -> list[Experiment]:
        experiments: list[Experiment] = []
        token = ""
        while True:
            request = pb.ListExperimentsRequest(page_size=page_size, page_token=token)
            response = await self._call(
                lambda t, md: self._stub.ListExperiments(request, timeout=t, metadata=md)
            )
            experiments.extend(_convert.experiment_from_proto(e) for e in response.experiments)
            token = response.next_page_token
            if not token:
                return experiments

    async def delete_experiment(self, name: str) -> None:
        request = pb.DeleteExperimentRequest(name=name)
        await self._call(lambda t, md: self._stub.DeleteExperiment(request, timeout=t, metadata=md))

    async def fork_experiment(self, source: str, name: str, config: ExperimentConfig | None = None) -> Experiment:
        """A new experiment with the source's tasks, posterior and step, and
        its config unless `config` is given (e.g. to branch an ablation)."""
        request = pb.ForkExperimentRequest(source=source, name=name)
        if config is not None:
            request.config.CopyFrom(_convert.config_to_proto(config))
        response = await self._call(lambda t, md: self._stub.ForkExperiment(request, timeout=t, metadata=md))
        return _convert.experiment_from_proto(response)

    async def restore_experiment(
        self, name: str, snapshot: Snapshot, config: ExperimentConfig | None = None, source: str = ""
    ) -> Experiment:
        """A new experiment from a snapshot (taken with include_features=True,
        possibly from another server): same tasks, posterior and step."""
        chunks = _calls.restore_chunks(name, snapshot, config, source)
        response = await self._call(
            lambda t, md: self._stub.RestoreExperiment(iter(chunks), timeout=t, metadata=md), self.bulk_timeout
        )
        return _convert.experiment_from_proto(response)

    async def add_tasks(self, experiment: str, tasks: Iterable[Task]) -> int:
        chunks = _calls.task_chunks(experiment, tasks)
        response = await self._call(
            lambda t, md: self._stub.AddTasks(iter(chunks), timeout=t, metadata=md), self.bulk_timeout
        )
        return int(response.num_tasks)

    async def select_batch(self, experiment: str, batch_size: int, request_key: str | None = None) -> Batch:
        request = pb.SelectBatchRequest(
            experiment=experiment, batch_size=batch_size, request_key=_calls.request_key(request_key)
        )
        response = await self._call(lambda t, md: self._stub.SelectBatch(request, timeout=t, metadata=md))
        return _convert.batch_from_proto(response)

    async def report_outcomes(
        self, experiment: str, batch_id: str, outcomes: Mapping[str, _calls.OutcomeValue]
    ) -> ReportResult:
        request = _calls.report_request(experiment, batch_id, outcomes)
        response = await self._call(lambda t, md: self._stub.ReportOutcomes(request, timeout=t, metadata=md))
        return _convert.report_from_proto(response)

    async def snapshot(self, experiment: str, include_features: bool = False) -> Snapshot:
        request = pb.SnapshotRequest(experiment=experiment, include_features=include_features)

        async def fetch(t: float, md: tuple[tuple[str, str], ...]) -> Snapshot:
            chunks = [c async for c in self._stub.Snapshot(request, timeout=t, metadata=md)]
            return _calls.snapshot_from_chunks(chunks, include_features)

        return await self._call(fetch, self.bulk_timeout)
