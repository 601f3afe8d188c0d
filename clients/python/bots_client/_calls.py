"""Every call of the client, described once and free of I/O.

A call is a generator: it yields an Rpc (which stub method, with which
request), is sent the response, and returns the call's result. A call may make
several RPCs (list_experiments pages, get_or_create_experiment falls back to a
get). Client and AsyncClient each run these descriptions with a driver of their
own, which sends the RPC with its deadline, retries it on UNAVAILABLE and throws
a failure into the generator as a BotsError.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import numpy as np
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import Message

from bots_client import _convert
from bots_client.errors import AlreadyExistsError, ConfigMismatchError, NotFoundError
from bots_client.proto import bots_pb2 as pb
from bots_client.types import (
    Batch,
    Experiment,
    ExperimentConfig,
    GroupInfo,
    ReportResult,
    RetireResult,
    Snapshot,
    Task,
)

T = TypeVar("T")

# Each AddTasks message stays far below gRPC's 4 MB default limit.
ADD_TASKS_CHUNK_BYTES = 1 << 20

# (successes, trials), or (successes, trials, sum of squared rewards) for
# rewards in [0, 1] that are not all 0 or 1 (the group's variance counts).
OutcomeValue = tuple[float, int] | tuple[float, int, float]


def outcome_value(value: Sequence[Any], key: str | None = None) -> OutcomeValue:
    """An outcome as the service takes it: (successes, trials[, sum_squares])
    as float, int[, float]. Another number of values, or trials that are not
    a whole number, raise ValueError (`key` names the task in the message)."""
    trials = _whole_trials(value, key)
    if len(value) == 3:
        return float(value[0]), trials, float(value[2])
    return float(value[0]), trials


def _whole_trials(value: Sequence[Any], key: str | None) -> int:
    """value[1] as an int, after checking the outcome's shape: int() alone
    would turn 1.9 trials into 1 and drop a fourth value without a word."""
    of = "an outcome" if key is None else f"the outcome of task {key!r}"
    if len(value) not in (2, 3):
        raise ValueError(
            f"{of} has {len(value)} values {tuple(value)!r}; expected (successes, trials) or "
            "(successes, trials, sum of squared rewards)"
        )
    trials = value[1]
    try:
        whole = int(trials)
    except (TypeError, ValueError, OverflowError):  # None, NaN, inf, "a"
        whole = None
    if whole is None or whole != trials:
        raise ValueError(f"{of} has trials = {trials!r}; trials count rollouts, a whole number")
    return whole


@dataclass(frozen=True)
class Rpc:
    """One RPC of a call. The driver answers with the response message, or
    with the list of them for a server-streaming method."""

    method: str  # the TaskSelectorStub attribute, e.g. "GetExperiment"
    request: Message | Sequence[Message]  # a sequence: the stream of a client-streaming method
    streams_response: bool = False
    bulk: bool = False  # moves a whole experiment: bulk_timeout applies instead of timeout
    # Repeating it cannot change the outcome (a read, a select with a request
    # key, a report): retried after DEADLINE_EXCEEDED too, whose answer may
    # have been lost after the server acted.
    idempotent: bool = False

    def stub_argument(self) -> Message | Iterator[Message]:
        """The stub method's argument, fresh for every attempt: a retried
        client stream starts again from its first message."""
        return self.request if isinstance(self.request, Message) else iter(self.request)


# Yields the RPCs, is sent their responses, returns the result.
Call: TypeAlias = Generator[Rpc, Any, T]


def create_experiment(name: str, config: ExperimentConfig | None) -> Call[Experiment]:
    wanted = config or ExperimentConfig()
    request = pb.CreateExperimentRequest(name=name, config=_convert.config_to_proto(wanted))
    try:
        return _convert.experiment_from_proto((yield Rpc("CreateExperiment", request)))
    except AlreadyExistsError as e:
        if not e.after_unanswered_attempt:
            raise
        # An earlier attempt may have created it and lost the answer: it did
        # if the experiment is as a create leaves it, with this config.
        existing = yield from get_experiment(name)
        if existing.step or existing.num_tasks or config_differences(wanted, existing.config):
            raise
        return existing


def get_experiment(name: str) -> Call[Experiment]:
    return _convert.experiment_from_proto((yield Rpc("GetExperiment", pb.GetExperimentRequest(name=name), idempotent=True)))


def get_or_create_experiment(name: str, config: ExperimentConfig | None) -> Call[Experiment]:
    try:
        return (yield from create_experiment(name, config))
    except AlreadyExistsError:
        pass  # a resumed run (or a retry of our own create whose answer was lost)
    experiment = yield from get_experiment(name)
    if config is not None and (differences := config_differences(config, experiment.config)):
        raise ConfigMismatchError(f"experiment {name!r} exists with another config: {'; '.join(differences)}")
    return experiment


def config_differences(requested: ExperimentConfig, existing: ExperimentConfig) -> list[str]:
    """Each field the configs differ in, as "field: requested X, existing Y"."""
    return [
        f"{field.name}: requested {getattr(requested, field.name)!r}, existing {getattr(existing, field.name)!r}"
        for field in dataclasses.fields(ExperimentConfig)
        if getattr(requested, field.name) != getattr(existing, field.name)
    ]


def list_experiments(page_size: int) -> Call[list[Experiment]]:
    experiments: list[Experiment] = []
    token = ""
    while True:
        page = yield Rpc(
            "ListExperiments", pb.ListExperimentsRequest(page_size=page_size, page_token=token), idempotent=True
        )
        experiments.extend(_convert.experiment_from_proto(e) for e in page.experiments)
        token = page.next_page_token
        if not token:
            return experiments


def delete_experiment(name: str) -> Call[None]:
    try:
        yield Rpc("DeleteExperiment", pb.DeleteExperimentRequest(name=name))
    except NotFoundError as e:
        # An earlier attempt may have deleted it and lost the answer; either
        # way the experiment is gone, as asked.
        if not e.after_unanswered_attempt:
            raise


def fork_experiment(source: str, name: str, config: ExperimentConfig | None) -> Call[Experiment]:
    request = pb.ForkExperimentRequest(source=source, name=name)
    if config is not None:
        request.config.CopyFrom(_convert.config_to_proto(config))
    try:
        return _convert.experiment_from_proto((yield Rpc("ForkExperiment", request)))
    except AlreadyExistsError as e:
        if not e.after_unanswered_attempt:
            raise
        # An earlier attempt may have forked it and lost the answer: it did
        # if the experiment is an untouched copy of `source` with this config.
        existing = yield from get_experiment(name)
        wanted = config if config is not None else (yield from get_experiment(source)).config
        if not _untouched_copy(existing, source, wanted, existing.forked_at_step):
            raise
        return existing


def restore_experiment(name: str, snapshot: Snapshot, config: ExperimentConfig | None, source: str) -> Call[Experiment]:
    requests = restore_chunks(name, snapshot, config, source)
    try:
        return _convert.experiment_from_proto((yield Rpc("RestoreExperiment", requests, bulk=True)))
    except AlreadyExistsError as e:
        if not e.after_unanswered_attempt:
            raise
        # As a fork: an earlier attempt may have restored it and lost the answer.
        existing = yield from get_experiment(name)
        wanted = config or snapshot.experiment.config
        if (
            not _untouched_copy(existing, requests[0].source, wanted, snapshot.step)
            or existing.num_tasks != len(snapshot.keys)
        ):
            raise
        return existing


def _untouched_copy(existing: Experiment, source: str, config: ExperimentConfig, step: int | None) -> bool:
    """Whether `existing` is a copy of `source` made at `step`, with this
    config, that nothing has changed since (no report, no batch open)."""
    return (
        existing.forked_from == source
        and existing.forked_at_step == step == existing.step
        and not existing.open_batches
        and not config_differences(config, existing.config)
    )


def add_tasks(experiment: str, tasks: Iterable[Task]) -> Call[int]:
    response = yield Rpc("AddTasks", task_chunks(experiment, tasks), bulk=True)
    return int(response.num_tasks)


def select_batch(experiment: str, batch_size: int, request_key: str | None) -> Call[Batch]:
    # Every select carries a key, so a retried call cannot select twice.
    key = request_key or f"auto-{uuid.uuid4().hex}"
    request = pb.SelectBatchRequest(experiment=experiment, batch_size=batch_size, request_key=key)
    return _convert.batch_from_proto((yield Rpc("SelectBatch", request, idempotent=True)))


def report_outcomes(experiment: str, batch_id: str, outcomes: Mapping[str, OutcomeValue]) -> Call[ReportResult]:
    request = pb.ReportOutcomesRequest(experiment=experiment, batch_id=batch_id)
    _add_outcomes(request.outcomes, outcomes)
    return _convert.report_from_proto((yield Rpc("ReportOutcomes", request, idempotent=True)))


def report_and_select(
    experiment: str,
    batch_id: str,
    outcomes: Mapping[str, OutcomeValue],
    batch_size: int,
    request_key: str | None,
) -> Call[tuple[ReportResult, Batch]]:
    # As select_batch: every call carries a key, so a retry cannot select twice.
    key = request_key or f"auto-{uuid.uuid4().hex}"
    request = pb.ReportAndSelectRequest(
        experiment=experiment,
        batch_id=batch_id,
        batch_size=batch_size,
        request_key=key,
    )
    _add_outcomes(request.outcomes, outcomes)
    response = yield Rpc("ReportAndSelect", request, idempotent=True)
    return _convert.report_from_proto(response.report), _convert.batch_from_proto(response.batch)


def _add_outcomes(field: RepeatedCompositeFieldContainer[pb.Outcome], outcomes: Mapping[str, OutcomeValue]) -> None:
    # add() builds each message in place; messages built apart and then
    # extended in are copied again (twice the time for a batch of 256).
    add = field.add
    for k, value in outcomes.items():
        trials = _whole_trials(value, k)
        if len(value) == 3:
            add(key=k, successes=float(value[0]), trials=trials, sum_squares=float(value[2]))
        else:
            add(key=k, successes=float(value[0]), trials=trials)


def retire_tasks(experiment: str, keys: Iterable[str], retired: bool) -> Call[RetireResult]:
    # Idempotent: a repeat sets the same state (it then reports changed=0).
    request = pb.RetireTasksRequest(experiment=experiment, keys=list(keys))
    response = yield Rpc("RetireTasks" if retired else "ReactivateTasks", request, idempotent=True)
    return RetireResult(
        changed=int(response.changed), num_retired=int(response.num_retired), num_tasks=int(response.num_tasks)
    )


ShareValue = float | tuple[float, float]


def set_group_shares(experiment: str, shares: Mapping[str, ShareValue]) -> Call[list[GroupInfo]]:
    """`shares`: group -> a fixed share, or (min, max)."""
    request = pb.SetGroupSharesRequest(experiment=experiment)
    for group, share in shares.items():
        low, high = (share, share) if isinstance(share, (int, float)) else share
        request.shares.add(group=group, min_share=float(low), max_share=float(high))
    # Idempotent: setting the same shares again leaves the same shares.
    return groups_from_proto((yield Rpc("SetGroupShares", request, idempotent=True)))


def list_groups(experiment: str) -> Call[list[GroupInfo]]:
    return groups_from_proto((yield Rpc("ListGroups", pb.ListGroupsRequest(experiment=experiment), idempotent=True)))


def groups_from_proto(response: pb.ListGroupsResponse) -> list[GroupInfo]:
    return [
        GroupInfo(
            name=g.name,
            num_tasks=g.num_tasks,
            num_retired=g.num_retired,
            min_share=g.min_share if g.HasField("min_share") else None,
            max_share=g.max_share if g.HasField("max_share") else None,
            mean_success=g.mean_success,
            near_target=g.near_target,
            informative=g.informative,
            adaptive_share=g.adaptive_share if g.HasField("adaptive_share") else None,
        )
        for g in response.groups
    ]


def snapshot(experiment: str, include_features: bool) -> Call[Snapshot]:
    request = pb.SnapshotRequest(experiment=experiment, include_features=include_features)
    chunks = yield Rpc("Snapshot", request, streams_response=True, bulk=True, idempotent=True)
    return snapshot_from_chunks(chunks, include_features)


def task_chunks(
    experiment: str, tasks: Iterable[Task], chunk_bytes: int = ADD_TASKS_CHUNK_BYTES
) -> list[pb.AddTasksRequest]:
    chunks: list[pb.AddTasksRequest] = []
    current = pb.AddTasksRequest(experiment=experiment)
    size = 0
    for task in tasks:
        message = _convert.task_to_proto(task)
        task_size = message.ByteSize() + 4
        if size and size + task_size > chunk_bytes:
            chunks.append(current)
            current, size = pb.AddTasksRequest(experiment=experiment), 0
        current.tasks.append(message)
        size += task_size
    chunks.append(current)
    # The server rejects a stream that ends before this many tasks arrived:
    # a cancelled upload can never be taken for a complete one.
    chunks[0].total_tasks = sum(len(c.tasks) for c in chunks)
    return chunks


def snapshot_from_chunks(chunks: Iterable[pb.SnapshotChunk], include_features: bool) -> Snapshot:
    keys: list[str] = []
    alpha: list[float] = []
    beta: list[float] = []
    features: list[dict[str, float]] = []
    retired: list[bool] = []
    groups: list[str] = []
    vectors: list[bytes] = []
    shares: dict[str, tuple[float, float]] = {}
    halvings = 0
    experiment = None
    for chunk in chunks:
        if chunk.HasField("experiment"):
            experiment = _convert.experiment_from_proto(chunk.experiment)
            halvings = chunk.rho_halvings
        shares.update((s.group, (s.min_share, s.max_share)) for s in chunk.shares)
        keys.extend(chunk.keys)
        alpha.extend(chunk.alpha)
        beta.extend(chunk.beta)
        features.extend(dict(f.values) for f in chunk.features)
        retired.extend(chunk.retired)
        groups.extend(chunk.groups)
        vectors.extend(chunk.embeddings)
    if experiment is None:
        raise RuntimeError("snapshot stream ended without the experiment header")
    return Snapshot(
        experiment,
        keys,
        np.asarray(alpha, dtype=np.float64),
        np.asarray(beta, dtype=np.float64),
        features if include_features else None,
        # A server from before retirements sends none: nothing is retired.
        np.asarray(retired, dtype=bool) if retired else np.zeros(len(keys), dtype=bool),
        groups if groups else None,
        shares,
        halvings,
        _convert.embedding_matrix(vectors, experiment.config.embedding_dim),
    )


def restore_chunks(
    name: str,
    snapshot: Snapshot,
    config: ExperimentConfig | None,
    source: str,
    chunk_bytes: int = ADD_TASKS_CHUNK_BYTES,
) -> list[pb.RestoreExperimentRequest]:
    """The RestoreExperiment stream for a snapshot taken with include_features=True."""
    if snapshot.features is None:
        raise ValueError("restoring needs the tasks' features: take the snapshot with include_features=True")
    experiment = snapshot.experiment
    first = pb.RestoreExperimentRequest(
        name=name,
        config=_convert.config_to_proto(config or experiment.config),
        step=experiment.step,
        source=source or experiment.name,
        total_tasks=len(snapshot.keys),
    )
    if experiment.capability is not None:
        first.capability = experiment.capability
    for group, (low, high) in sorted((snapshot.shares or {}).items()):
        first.shares.add(group=group, min_share=low, max_share=high)
    first.rho_halvings = snapshot.rho_halvings
    chunks, current, size = [first], first, 0
    retired = snapshot.retired if snapshot.retired is not None and snapshot.retired.any() else None
    embeddings = snapshot.embeddings
    embedding_size = 0 if embeddings is None else embeddings.shape[1] * 4 + 3
    for i, (key, a, b, f) in enumerate(
        zip(snapshot.keys, snapshot.alpha.tolist(), snapshot.beta.tolist(), snapshot.features)
    ):
        task_size = _utf8_size(key) + 24 + sum(_utf8_size(n) + 16 for n in f) + embedding_size
        if size and size + task_size > chunk_bytes:
            current, size = pb.RestoreExperimentRequest(), 0
            chunks.append(current)
        current.keys.append(key)
        current.alpha.append(a)
        current.beta.append(b)
        current.features.append(pb.Features(values=f))
        if retired is not None:
            current.retired.append(bool(retired[i]))
        if snapshot.groups is not None:
            current.groups.append(snapshot.groups[i])
            task_size += _utf8_size(snapshot.groups[i]) + 2
        if embeddings is not None:
            current.embeddings.append(_convert.embedding_bytes(embeddings[i], key))
        size += task_size + 1
    return chunks


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8"))
