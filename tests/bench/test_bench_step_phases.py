"""bench/step_phases.py times the phases of a ReportAndSelect step and counts its statements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import step_phases
from tests.support.servers import require_postgres


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_phase_is_timed_and_the_statements_counted(tmp_path: Path, backend: str) -> None:
    if backend == "postgresql":
        require_postgres()
    out = tmp_path / "phases.json"
    args = ["--backend", backend, "--pool", "400", "--batch", "16", "--steps", "20", "--warmup", "2", "--out", str(out)]
    assert step_phases.main(args) == 0
    result = json.loads(out.read_text())
    assert set(result["median_ms"]) == {
        "update",
        "choose the next batch",
        "store: commit the report and the batch",
        "the whole call (client included)",
    }
    assert all(ms > 0 for ms in result["median_ms"].values())
    # A step's writes: one statement for the report and one for the batch
    # on PostgreSQL, four and three on SQLite.
    expected = {"WITH": 2.0} if backend == "postgresql" else {"BEGIN": 1.0, "INSERT": 4.0, "SELECT": 1.0, "UPDATE": 2.0}
    assert result["statements_per_step"] == expected
