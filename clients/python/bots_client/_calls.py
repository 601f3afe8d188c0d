"""What the sync and async clients share: request building, response
assembly, chunking and the retry schedule."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from bots_client import _convert
from bots_client._proto import bots_pb2 as pb
from bots_client.types import Snapshot, Task

# Each AddTasks message stays far below gRPC's 4 MB default limit.
ADD_TASKS_CHUNK_BYTES = 1 << 20

OutcomeValue = tuple[float, int]


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


def snapshot_from_chunks(chunks: Iterable[pb.SnapshotChunk]) -> Snapshot:
    keys: list[str] = []
    alpha: list[float] = []
    beta: list[float] = []
    experiment = None
    for chunk in chunks:
        if chunk.HasField("experiment"):
            experiment = _convert.experiment_from_proto(chunk.experiment)
        keys.extend(chunk.keys)
        alpha.extend(chunk.alpha)
        beta.extend(chunk.beta)
    if experiment is None:
        raise RuntimeError("snapshot stream ended without the experiment header")
    return Snapshot(experiment, keys, np.asarray(alpha, dtype=np.float64), np.asarray(beta, dtype=np.float64))


def backoff(initial: float = 0.1, maximum: float = 2.0) -> Iterator[float]:
    """Exponential backoff with full jitter."""
    delay = initial
    while True:
        yield random.uniform(0, delay)
        delay = min(delay * 2, maximum)
