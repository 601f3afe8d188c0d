"""What the sync and async clients share: request building, response
assembly, chunking and the retry schedule."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from bots_client import _convert
from bots_client.proto import bots_pb2 as pb
from bots_client.types import ExperimentConfig, Snapshot, Task

# Each AddTasks message stays far below gRPC's 4 MB default limit.
ADD_TASKS_CHUNK_BYTES = 1 << 20

OutcomeValue = tuple[float, int]

# Reconnect quickly after a server restart (gRPC's default backoff grows to
# 120 s, longer than a pod restart); retries are bounded by retry_timeout.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


Metadata = tuple[tuple[str, str], ...]
REQUEST_ID_KEY = "x-request-id"


def with_request_id(metadata: Metadata) -> tuple[str, Metadata]:
    """A fresh request id (kept across retries of one call, so the server's
    log lines of every attempt share it) and the metadata carrying it."""
    request_id = uuid.uuid4().hex
    return request_id, ((REQUEST_ID_KEY, request_id), *metadata)


def request_key(given: str | None) -> str:
    """Every select carries a key, so a retried call cannot select twice."""
    return given if given else f"auto-{uuid.uuid4().hex}"


def task_chunks(experiment: str, tasks: Iterable[Task], chunk_bytes: int = ADD_TASKS_CHUNK_BYTES) -> list[pb.AddTasksRequest]:
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
    return chunks


def report_request(experiment: str, batch_id: str, outcomes: Mapping[str, OutcomeValue]) -> pb.ReportOutcomesRequest:
    return pb.ReportOutcomesRequest(
        experiment=experiment,
        batch_id=batch_id,
        outcomes=[pb.Outcome(key=k, successes=float(s), trials=int(n)) for k, (s, n) in outcomes.items()],
    )


def snapshot_from_chunks(chunks: Iterable[pb.SnapshotChunk], include_features: bool) -> Snapshot:
    keys: list[str] = []
    alpha: list[float] = []
    beta: list[float] = []
    features: list[dict[str, float]] = []
    experiment = None
    for chunk in chunks:
        if chunk.HasField("experiment"):
            experiment = _convert.experiment_from_proto(chunk.experiment)
        keys.extend(chunk.keys)
        alpha.extend(chunk.alpha)
        beta.extend(chunk.beta)
        features.extend(dict(f.values) for f in chunk.features)
    if experiment is None:
        raise RuntimeError("snapshot stream ended without the experiment header")
    return Snapshot(
        experiment,
        keys,
        np.asarray(alpha, dtype=np.float64),
        np.asarray(beta, dtype=np.float64),
        features if include_features else None,
    )


def restore_chunks(
    name: str, snapshot: Snapshot, config: ExperimentConfig | None, source: str, chunk_bytes: int = ADD_TASKS_CHUNK_BYTES
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
    )
    if experiment.capability is not None:
        first.capability = experiment.capability
    chunks, current, size = [first], first, 0
    for key, a, b, f in zip(snapshot.keys, snapshot.alpha.tolist(), snapshot.beta.tolist(), snapshot.features):
        task_size = len(key) + 24 + sum(len(n) + 16 for n in f)
        if size and size + task_size > chunk_bytes:
            current, size = pb.RestoreExperimentRequest(), 0
            chunks.append(current)
        current.keys.append(key)
        current.alpha.append(a)
        current.beta.append(b)
        current.features.append(pb.Features(values=f))
        size += task_size
    return chunks


def backoff(initial: float = 0.1, maximum: float = 2.0) -> Iterator[float]:
    """Exponential backoff with full jitter."""
    delay = initial
    while True:
        yield random.uniform(0, delay)
        delay = min(delay * 2, maximum)
