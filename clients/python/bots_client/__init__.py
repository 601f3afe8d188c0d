"""Python client of the BOTS selection service.

    import bots_client
    client = bots_client.Client("127.0.0.1:50051")
    client.create_experiment("exp", config=bots_client.ExperimentConfig(seed=0))
    client.add_tasks("exp", [bots_client.Task("t0", {"weak": 0.1, "strong": 0.5})])
    batch = client.select_batch("exp", batch_size=32, request_key="step-0")
    client.report_outcomes("exp", batch.batch_id, {"t0": (3, 16)})
"""

from bots_client.aio import AsyncClient
from bots_client.client import Client
from bots_client.connection import Connection
from bots_client.errors import (
    AlreadyExistsError,
    BotsError,
    ConfigMismatchError,
    DeadlineExceededError,
    ExperimentInUseError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from bots_client.security import bearer, tls_credentials
from bots_client.types import (
    Batch,
    Experiment,
    ExperimentConfig,
    GroupInfo,
    Outcome,
    ReportResult,
    RetireResult,
    Snapshot,
    Task,
)

# The release, the same as bots-server's (see bots_server/__init__.py);
# pyproject.toml reads it from here.
__version__ = "0.2.0"

__all__ = [
    "AlreadyExistsError",
    "AsyncClient",
    "Batch",
    "BotsError",
    "Client",
    "ConfigMismatchError",
    "Connection",
    "DeadlineExceededError",
    "Experiment",
    "ExperimentConfig",
    "ExperimentInUseError",
    "FailedPreconditionError",
    "GroupInfo",
    "InvalidArgumentError",
    "NotFoundError",
    "Outcome",
    "PermissionDeniedError",
    "ReportResult",
    "ResourceExhaustedError",
    "RetireResult",
    "Snapshot",
    "Task",
    "UnauthenticatedError",
    "UnavailableError",
    "bearer",
    "tls_credentials",
]
