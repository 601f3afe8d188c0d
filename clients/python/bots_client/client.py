"""Synchronous client."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Self, TypeVar

import grpc

from bots_client import _calls, _driver
from bots_client.connection import Connection
from bots_client.errors import BotsError, from_rpc_error
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_client.types import Batch, Experiment, ExperimentConfig, GroupInfo, ReportResult, RetireResult, Snapshot, Task

T = TypeVar("T")


class Client:
    """A connection to a BOTS server.

    Every call has a deadline (`timeout` seconds; `bulk_timeout` for
    add_tasks, restore_experiment and snapshot) and is retried on UNAVAILABLE
    with exponential backoff for up to `retry_timeout` seconds, so a server
    restart or a short database outage is ridden through. Reads, selects and
    reports are also retried on DEADLINE_EXCEEDED (a hung server or network):
    selects carry a request key and a batch is applied once, so a retry after
    a lost answer returns the same result. Errors raise BotsError subclasses.

    `channel`: an open grpc.Channel to use as is instead of one to `target`
    (which then only names the server and may be ""), e.g. an in-process
    channel of a test harness; `credentials` must not be given with it.
    close() closes it.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 30.0,
        bulk_timeout: float = 600.0,
        retry_timeout: float = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        channel: grpc.Channel | None = None,
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
            self._channel = grpc.insecure_channel(target, options=_driver.CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=_driver.CHANNEL_OPTIONS)
        self._stub = pb_grpc.TaskSelectorStub(self._channel)
        self._reachability = _driver.Reachability(target)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: _calls.Call[T]) -> T:
        """The driver: sends each RPC the call yields and sends the response
        back into it, or throws the failure in as a BotsError."""
        request_id, metadata = _driver.with_request_id(self._metadata)
        try:
            rpc = next(call)
            while True:
                try:
                    response = self._send(rpc, request_id, metadata)
                except BotsError as error:
                    rpc = call.throw(error)
                else:
                    rpc = call.send(response)
        except StopIteration as done:
            return done.value

    def _send(self, rpc: _calls.Rpc, request_id: str, metadata: _driver.Metadata) -> Any:
        """One RPC with its deadline, retried as _driver.Retries says."""
        timeout = self.bulk_timeout if rpc.bulk else self.timeout
        retries = _driver.Retries(self.retry_timeout, rpc.idempotent)
        while True:
            try:
                response = getattr(self._stub, rpc.method)(rpc.stub_argument(), timeout=timeout, metadata=metadata)
                # A stream's failure surfaces while it is read: read it inside the retry.
                answer = list(response) if rpc.streams_response else response
            except grpc.RpcError as e:
                delay = retries.delay_after(e)
                if delay is None:
                    raise from_rpc_error(e, request_id, retries.after_unanswered_attempt) from None
                self._reachability.retrying(e, self.retry_timeout)
            else:
                self._reachability.answered()
                return answer
            time.sleep(delay)

    def create_experiment(self, name: str, config: ExperimentConfig | None = None) -> Experiment:
        """A new experiment; fields of `config` left unset take the defaults.
        A name already taken raises AlreadyExistsError, unless an attempt of
        this very call made it and lost its answer (the experiment is then
        empty, with this config, and is returned)."""
        return self._run(_calls.create_experiment(name, config))

    def get_or_create_experiment(self, name: str, config: ExperimentConfig | None = None) -> Experiment:
        """The experiment `name`, created if it does not exist yet: what a
        trainer calls on start, so that it resumes after a crash or restart.
        If it exists and `config` is given, its config must equal `config`,
        else ConfigMismatchError names every field that differs."""
        return self._run(_calls.get_or_create_experiment(name, config))

    def get_experiment(self, name: str) -> Experiment:
        """The experiment's config, step, task count and open batches."""
        return self._run(_calls.get_experiment(name))

    def list_experiments(self, page_size: int = 0) -> list[Experiment]:
        """All experiments, fetched page by page."""
        return self._run(_calls.list_experiments(page_size))

    def delete_experiment(self, name: str) -> None:
        """Delete the experiment with its tasks, batches and history. An
        unknown name raises NotFoundError, except on a retry after an attempt
        whose answer was lost: that attempt may have deleted it."""
        return self._run(_calls.delete_experiment(name))

    def fork_experiment(self, source: str, name: str, config: ExperimentConfig | None = None) -> Experiment:
        """A new experiment with the source's tasks, posterior and step, and
        its config unless `config` is given (e.g. to branch an ablation)."""
        return self._run(_calls.fork_experiment(source, name, config))

    def restore_experiment(
        self, name: str, snapshot: Snapshot, config: ExperimentConfig | None = None, source: str = ""
    ) -> Experiment:
        """A new experiment from a snapshot (taken with include_features=True,
        possibly from another server): same tasks, posterior and step."""
        return self._run(_calls.restore_experiment(name, snapshot, config, source))

    def add_tasks(self, experiment: str, tasks: Iterable[Task]) -> int:
        """Add tasks (streamed in chunks of about 1 MB; all or nothing).
        Returns the number of tasks in the experiment afterwards."""
        return self._run(_calls.add_tasks(experiment, tasks))

    def select_batch(self, experiment: str, batch_size: int, request_key: str | None = None) -> Batch:
        """The next batch. Calls with the same request_key (e.g. "step-12" on
        every data-parallel rank) get the same batch."""
        return self._run(_calls.select_batch(experiment, batch_size, request_key))

    def report_outcomes(
        self, experiment: str, batch_id: str, outcomes: Mapping[str, _calls.OutcomeValue]
    ) -> ReportResult:
        """Report key -> (successes, trials) for tasks of a batch; applied once."""
        return self._run(_calls.report_outcomes(experiment, batch_id, outcomes))

    def report_and_select(
        self,
        experiment: str,
        batch_id: str,
        outcomes: Mapping[str, _calls.OutcomeValue],
        batch_size: int,
        request_key: str | None = None,
    ) -> tuple[ReportResult, Batch]:
        """One training step in one call: report_outcomes, then
        select_batch, applied together or not at all (one transaction on
        the server). The batch is the one select_batch would return right
        after the report; a retry gets the same answer."""
        return self._run(_calls.report_and_select(experiment, batch_id, outcomes, batch_size, request_key))

    def retire_tasks(self, experiment: str, keys: Iterable[str]) -> RetireResult:
        """Retire tasks: never selected again until re-activated; their
        posterior is kept (and shown in snapshots). All or nothing: an
        unknown key raises InvalidArgumentError and changes nothing."""
        return self._run(_calls.retire_tasks(experiment, keys, retired=True))

    def reactivate_tasks(self, experiment: str, keys: Iterable[str]) -> RetireResult:
        """Make retired tasks selectable again, from their current posterior."""
        return self._run(_calls.retire_tasks(experiment, keys, retired=False))

    def set_group_shares(
        self, experiment: str, shares: Mapping[str, _calls.ShareValue]
    ) -> list[GroupInfo]:
        """Each group's share of every batch from the next select on: a
        fixed share or (min, max); groups not named are free; {} clears
        them. Unknown groups or shares no batch could meet raise
        InvalidArgumentError and change nothing. Returns the groups."""
        return self._run(_calls.set_group_shares(experiment, shares))

    def list_groups(self, experiment: str) -> list[GroupInfo]:
        """The experiment's groups: sizes, shares, posterior signals."""
        return self._run(_calls.list_groups(experiment))

    def snapshot(self, experiment: str, include_features: bool = False) -> Snapshot:
        """Every task's posterior: keys, alpha and beta (float64), step and config;
        with include_features, the tasks' features too (needed to restore)."""
        return self._run(_calls.snapshot(experiment, include_features))
