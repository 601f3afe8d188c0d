"""The floor benchmark runs end to end and measures every mode it names
(bench/floor.py); a call whose transaction fails fails the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import floor
from tests.support.servers import require_postgres

ONE_CALL = {
    "sqlite": ["grpc", "grpc (one call)", "grpc+interceptors", "grpc+interceptors (one call)", "grpc+sql", "grpc+sql (one call)"],
    "postgresql": [
        "grpc", "grpc (one call)", "grpc+interceptors", "grpc+interceptors (one call)", "grpc+sql", "grpc+sql-arrays",
        "grpc+sql-copy", "grpc+sql-copy (one call)",
    ],
}  # fmt: skip


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_mode_is_measured(tmp_path: Path, backend: str) -> None:
    """One run covers every mode: --one-call measures each plain mode and,
    right after it, each that can again as one call; two repeats, the
    second from clean tables. Short windows: this checks that every mode
    runs and is measured, not how fast."""
    if backend == "postgresql":
        require_postgres()
    output = tmp_path / "floor"
    repeats = 2
    argv = ["--backend", backend, "--repeats", str(repeats), "--seconds", "0.5", "--callers", "4", "--one-call",
            "--output", str(output)]  # fmt: skip
    assert floor.main(argv) == 0
    runs = json.loads(output.with_suffix(".json").read_text())["runs"]
    assert list(runs) == ONE_CALL[backend]
    assert {m for m in runs if not m.endswith("(one call)")} == set(
        floor.SQLITE_MODES if backend == "sqlite" else floor.MODES
    )
    for mode, results in runs.items():
        assert len(results) == repeats
        assert all(r["cycles_per_s"] > 10 and r["server_cpu_ms_per_cycle"] > 0 for r in results), mode
    table = output.with_suffix(".md").read_text()
    assert all(f"| {mode} |" in table for mode in runs)
