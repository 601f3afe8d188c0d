"""The floor benchmark runs end to end and measures every mode it names
(bench/floor.py); a call whose transaction fails fails the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import floor
from tests.support.servers import require_postgres


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_mode_is_measured(tmp_path: Path, backend: str) -> None:
    if backend == "postgresql":
        require_postgres()
    output = tmp_path / "floor"
    argv = ["--backend", backend, "--repeats", "2", "--seconds", "1", "--callers", "4", "--output", str(output)]
    assert floor.main(argv) == 0
    runs = json.loads(output.with_suffix(".json").read_text())["runs"]
    assert list(runs) == (floor.SQLITE_MODES if backend == "sqlite" else floor.MODES)
    for mode, results in runs.items():
        assert len(results) == 2  # a second repeat starts from clean tables
        assert all(r["cycles_per_s"] > 10 and r["server_cpu_ms_per_cycle"] > 0 for r in results), mode
    table = output.with_suffix(".md").read_text()
    assert all(f"| {mode} |" in table for mode in runs)
