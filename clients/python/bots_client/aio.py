"""asyncio client: the same surface as Client, with async methods."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Self, TypeVar

import grpc

from bots_client import _calls, _driver
from bots_client.connection import Connection
from bots_client.errors import BotsError, from_rpc_error
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_client.types import Batch, Experiment, ExperimentConfig, GroupInfo, ReportResult, RetireResult, Snapshot, Task

T = TypeVar("T")


class AsyncClient:
    """See Client: the same calls as coroutines, with the same deadlines,
    retries, errors and `channel` (here a grpc.aio.Channel)."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 30.0,
        bulk_timeout: float = 600.0,
        retry_timeout: float = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        channel: grpc.aio.Channel | None = None,
        connection: Connection | None = None,
    ) -> None:
        """`connection`: how this client was made (Connection.client), so
        that copies of an adapter holding it can reconnect alike."""
        self.target = target
        self.connection = connection
        self.timeout = timeout
        self.bulk_timeout = bulk_timeout
        self.retry_timeout = retry_timeout
        self._metadata = tuple(metadata)
        if channel is not None:
            if credentials is not None:
                raise ValueError("credentials apply to a channel the client opens, not to a given channel")
            self._channel = channel
        elif credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=_driver.CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=_driver.CHANNEL_OPTIONS)
        self._stub = pb_grpc.TaskSelectorStub(self._channel)
        self._reachability = _driver.Reachability(target)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, call: _calls.Call[T]) -> T:
        """The driver: sends each RPC the call yields and sends the response
        back into it, or throws the failure in as a BotsError."""
        request_id, metadata = _driver.with_request_id(self._metadata)
        try:
            rpc = next(call)
            while True:
                try:
                    response = await self._send(rpc, request_id, metadata)
                except BotsError as error:
                    rpc = call.throw(error)
                else:
                    rpc = call.send(response)
        except StopIteration as done:
            return done.value

    async def _send(self, rpc: _calls.Rpc, request_id: str, metadata: _driver.Metadata) -> Any:
        """One RPC with its deadline, retried as _driver.Retries says."""
        timeout = self.bulk_timeout if rpc.bulk else self.timeout
        retries = _driver.Retries(self.retry_timeout, rpc.idempotent)
        while True:
            try:
                response = getattr(self._stub, rpc.method)(rpc.stub_argument(), timeout=timeout, metadata=metadata)
                # A stream's failure surfaces while it is read: read it inside the retry.
                answer = [m async for m in response] if rpc.streams_response else await response
            except grpc.RpcError as e:
                delay = retries.delay_after(e)
                if delay is None:
                    raise from_rpc_error(e, request_id, retries.after_unanswered_attempt) from None
                self._reachability.retrying(e, self.retry_timeout)
            else:
                self._reachability.answered()
                return answer
            await asyncio.sleep(delay)

    async def create_experiment(self, name: str, config: ExperimentConfig | None = None) -> Experiment:
        """See Client.create_experiment."""
        return await self._run(_calls.create_experiment(name, config))

    async def get_or_create_experiment(self, name: str, config: ExperimentConfig | None = None) -> Experiment:
        """See Client.get_or_create_experiment."""
        return await self._run(_calls.get_or_create_experiment(name, config))

    async def get_experiment(self, name: str) -> Experiment:
        """See Client.get_experiment."""
        return await self._run(_calls.get_experiment(name))

    async def list_experiments(self, page_size: int = 0) -> list[Experiment]:
        """See Client.list_experiments."""
        return await self._run(_calls.list_experiments(page_size))

    async def delete_experiment(self, name: str) -> None:
        """See Client.delete_experiment."""
        return await self._run(_calls.delete_experiment(name))

    async def fork_experiment(self, source: str, name: str, config: ExperimentConfig | None = None) -> Experiment:
        """See Client.fork_experiment."""
        return await self._run(_calls.fork_experiment(source, name, config))

    async def restore_experiment(
        self, name: str, snapshot: Snapshot, config: ExperimentConfig | None = None, source: str = ""
    ) -> Experiment:
        """See Client.restore_experiment."""
        return await self._run(_calls.restore_experiment(name, snapshot, config, source))

    async def add_tasks(self, experiment: str, tasks: Iterable[Task]) -> int:
        """See Client.add_tasks."""
        return await self._run(_calls.add_tasks(experiment, tasks))

    async def select_batch(self, experiment: str, batch_size: int, request_key: str | None = None) -> Batch:
        """See Client.select_batch."""
        return await self._run(_calls.select_batch(experiment, batch_size, request_key))

    async def report_outcomes(
        self, experiment: str, batch_id: str, outcomes: Mapping[str, _calls.OutcomeValue]
    ) -> ReportResult:
        """See Client.report_outcomes."""
        return await self._run(_calls.report_outcomes(experiment, batch_id, outcomes))

    async def report_and_select(
        self,
        experiment: str,
        batch_id: str,
        outcomes: Mapping[str, _calls.OutcomeValue],
        batch_size: int,
        request_key: str | None = None,
    ) -> tuple[ReportResult, Batch]:
        """See Client.report_and_select."""
        return await self._run(_calls.report_and_select(experiment, batch_id, outcomes, batch_size, request_key))

    async def retire_tasks(self, experiment: str, keys: Iterable[str]) -> RetireResult:
        """See Client.retire_tasks."""
        return await self._run(_calls.retire_tasks(experiment, keys, retired=True))

    async def reactivate_tasks(self, experiment: str, keys: Iterable[str]) -> RetireResult:
        """See Client.reactivate_tasks."""
        return await self._run(_calls.retire_tasks(experiment, keys, retired=False))

    async def set_group_shares(
        self, experiment: str, shares: Mapping[str, _calls.ShareValue]
    ) -> list[GroupInfo]:
        """See Client.set_group_shares."""
        return await self._run(_calls.set_group_shares(experiment, shares))

    async def list_groups(self, experiment: str) -> list[GroupInfo]:
        """See Client.list_groups."""
        return await self._run(_calls.list_groups(experiment))

    async def snapshot(self, experiment: str, include_features: bool = False) -> Snapshot:
        """See Client.snapshot."""
        return await self._run(_calls.snapshot(experiment, include_features))
