"""Fixtures of the operations tests: a shared server with a metrics port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ops.support import MetricsServer


@pytest.fixture(scope="session")
def metrics_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsServer]:
    """One SQLite server for the metrics tests (they isolate by experiment
    name). Checkpoints every 2 steps and never by time, so checkpoint metrics
    follow the step count only."""
    db = Path(tmp_path_factory.mktemp("ops")) / "ops.db"
    server = MetricsServer(
        f"sqlite:///{db}", extra_args=["--checkpoint-every-steps", "2", "--checkpoint-every-seconds", "3600"]
    ).start()
    yield server
    server.stop()
