"""Principals of several tenants, as tests and benchmarks set them up: a
bearer token per principal name, the credentials file that grants them,
the call metadata that carries a token, and an upload big enough to be
charged against the in-flight budgets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bots_client.proto import bots_pb2 as pb
from bots_client.security import bearer as bearer_metadata
from bots_server.service.credentials import hash_token


def token(principal: str) -> str:
    return f"{principal}-secret-token-0123456789abcdef"


def bearer(principal: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that authenticates as `principal`."""
    return bearer_metadata(token(principal))


def credentials_file(path: Path, principals: dict[str, tuple[str, str]]) -> Path:
    """A credentials file granting each principal (name -> (tenant, role))
    its role in its tenant, with the token of token(name)."""
    entries = [
        f'[[principals]]\nname = "{name}"\ntenant = "{tenant}"\nrole = "{role}"\ntoken_sha256 = "{hash_token(token(name))}"\n'
        for name, (tenant, role) in principals.items()
    ]
    path.write_text("\n".join(entries))
    return path


def upload(
    experiment: str, tag: str, tasks: int, chunk: int, pause: float = 0.0, gate: threading.Event | None = None
) -> Iterator[pb.AddTasksRequest]:
    """An AddTasks stream of `tasks` tasks (keys tag-000000, ...) in messages
    of `chunk`, the first announcing the total; `pause` between messages
    keeps it in flight, `gate` holds its last message back."""
    for start in range(0, tasks, chunk):
        request = pb.AddTasksRequest(tasks=[pb.Task(key=f"{tag}-{i:06d}") for i in range(start, min(start + chunk, tasks))])
        if start == 0:
            request.experiment, request.total_tasks = experiment, tasks
        if start + chunk >= tasks and gate is not None:
            gate.wait(60)
        yield request
        time.sleep(pause)
