"""Conversions between the data types and the generated protobuf messages.

Shared by the client and the server, so defaults and enum names live in one place.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence

import numpy as np
from google.protobuf import timestamp_pb2

from bots_client.proto import bots_pb2 as pb
from bots_client.types import (
    SELECTION_MODE_NUMBERS,
    STRATEGY_NUMBERS,
    Batch,
    Experiment,
    ExperimentConfig,
    ReportResult,
    Task,
)

_DEFAULTS = ExperimentConfig()
# The `optional` fields of the proto config: unset, they take the dataclass default.
_OPTIONAL_FIELDS = tuple(f.name for f in pb.ExperimentConfig.DESCRIPTOR.fields if f.has_presence)
_STRATEGY_FROM_PB = {v: k for k, v in STRATEGY_NUMBERS.items()} | {pb.STRATEGY_UNSPECIFIED: _DEFAULTS.strategy}
_MODE_FROM_PB = {v: k for k, v in SELECTION_MODE_NUMBERS.items()} | {
    pb.SELECTION_MODE_UNSPECIFIED: _DEFAULTS.selection_mode
}


def config_to_proto(config: ExperimentConfig) -> pb.ExperimentConfig:
    if config.strategy not in STRATEGY_NUMBERS:
        raise ValueError(f"unknown strategy {config.strategy!r}; expected one of {sorted(STRATEGY_NUMBERS)}")
    if config.selection_mode not in SELECTION_MODE_NUMBERS:
        raise ValueError(
            f"unknown selection_mode {config.selection_mode!r}; expected one of {sorted(SELECTION_MODE_NUMBERS)}"
        )
    message = pb.ExperimentConfig(
        strategy=STRATEGY_NUMBERS[config.strategy],
        selection_mode=SELECTION_MODE_NUMBERS[config.selection_mode],
        weak_feature=config.weak_feature,
        strong_feature=config.strong_feature,
    )
    for name in _OPTIONAL_FIELDS:
        setattr(message, name, getattr(config, name))
    return message


def config_from_proto(message: pb.ExperimentConfig) -> ExperimentConfig:
    """The config with every unset field at its default.

    Raises ValueError naming an enum value this version does not know.
    """
    if message.strategy not in _STRATEGY_FROM_PB:
        raise ValueError(f"unknown strategy enum value {message.strategy}")
    if message.selection_mode not in _MODE_FROM_PB:
        raise ValueError(f"unknown selection_mode enum value {message.selection_mode}")
    values = {name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)}
    return dataclasses.replace(
        _DEFAULTS,
        strategy=_STRATEGY_FROM_PB[message.strategy],
        selection_mode=_MODE_FROM_PB[message.selection_mode],
        weak_feature=message.weak_feature,
        strong_feature=message.strong_feature,
        **values,
    )


def timestamp(value: dt.datetime) -> timestamp_pb2.Timestamp:
    message = timestamp_pb2.Timestamp()
    message.FromDatetime(value.astimezone(dt.UTC))
    return message


def experiment_from_proto(message: pb.Experiment) -> Experiment:
    return Experiment(
        name=message.name,
        config=config_from_proto(message.config),
        step=message.step,
        num_tasks=message.num_tasks,
        open_batches=message.open_batches,
        capability=message.capability if message.HasField("capability") else None,
        create_time=message.create_time.ToDatetime(tzinfo=dt.UTC),
        forked_from=message.forked_from or None,
        forked_at_step=message.forked_at_step if message.forked_from else None,
    )


def experiment_to_proto(experiment: Experiment) -> pb.Experiment:
    message = pb.Experiment(
        name=experiment.name,
        config=config_to_proto(experiment.config),
        step=experiment.step,
        num_tasks=experiment.num_tasks,
        open_batches=experiment.open_batches,
        create_time=timestamp(experiment.create_time),
        forked_from=experiment.forked_from or "",
        forked_at_step=experiment.forked_at_step or 0,
    )
    if experiment.capability is not None:
        message.capability = experiment.capability
    return message


def task_to_proto(task: Task) -> pb.Task:
    message = pb.Task(key=task.key, features=dict(task.features), group=task.group)
    if task.embedding is not None:
        message.embedding = embedding_bytes(task.embedding, task.key)
    return message


def tasks_from_proto(messages: Iterable[pb.Task]) -> list[Task]:
    return [
        Task(key=m.key, features=dict(m.features), group=m.group, embedding=embedding_values(m.embedding))
        for m in messages
    ]


# The API's embeddings: little-endian float32 values, end to end.
EMBEDDING_DTYPE = np.dtype("<f4")


def embedding_bytes(values: Sequence[float] | np.ndarray, key: str = "") -> bytes:
    """A task's embedding as the API carries it. The server checks the
    values (finite, the experiment's embedding_dim of them)."""
    array = np.asarray(values, dtype=EMBEDDING_DTYPE)
    if array.ndim != 1:
        raise ValueError(f"task {key!r}: an embedding is one vector, not an array of shape {array.shape}")
    return array.tobytes()


def embedding_values(data: bytes) -> np.ndarray | None:
    """A task's embedding from the API's bytes (float32); None for none."""
    return np.frombuffer(data, dtype=EMBEDDING_DTYPE).astype(np.float32) if data else None


def embedding_matrix(rows: Sequence[bytes], dim: int) -> np.ndarray | None:
    """Tasks' embeddings as one float32 array (len(rows) x dim); None when
    there are none."""
    if not rows or dim == 0:
        return None
    return np.frombuffer(b"".join(rows), dtype=EMBEDDING_DTYPE).reshape(len(rows), dim).astype(np.float32)


def batch_from_proto(message: pb.Batch) -> Batch:
    return Batch(
        batch_id=message.batch_id,
        step=message.step,
        keys=list(message.keys),
        request_key=message.request_key,
        lease_expire_time=message.lease_expire_time.ToDatetime(tzinfo=dt.UTC),
        reported_step=message.reported_step if message.HasField("reported_step") else None,
    )


def batch_to_proto(batch: Batch) -> pb.Batch:
    return pb.Batch(
        batch_id=batch.batch_id,
        step=batch.step,
        keys=batch.keys,
        request_key=batch.request_key,
        lease_expire_time=timestamp(batch.lease_expire_time),
        reported_step=batch.reported_step,
    )


def report_from_proto(message: pb.ReportOutcomesResponse) -> ReportResult:
    return ReportResult(
        step=message.step,
        capability=message.capability if message.HasField("capability") else None,
        duplicate=message.duplicate,
    )


def report_to_proto(result: ReportResult) -> pb.ReportOutcomesResponse:
    message = pb.ReportOutcomesResponse(step=result.step, duplicate=result.duplicate)
    if result.capability is not None:
        message.capability = result.capability
    return message
