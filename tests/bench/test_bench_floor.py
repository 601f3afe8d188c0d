"""The floor benchmark runs end to end and measures every mode it names
(bench/floor.py); a call whose transaction fails fails the run."""

from __future__ import annotations

import json
from pathlib import Path

from bench import floor
from tests.support.servers import require_postgres


def test_every_mode_is_measured(tmp_path: Path) -> None:
    require_postgres()
    output = tmp_path / "floor"
    assert floor.main(["--repeats", "1", "--seconds", "1", "--output", str(output)]) == 0
    runs = json.loads(output.with_suffix(".json").read_text())["runs"]
    assert list(runs) == floor.MODES
    for mode, (result,) in runs.items():
        assert result["cycles_per_s"] > 10, mode
        assert result["server_cpu_ms_per_cycle"] > 0, mode
    table = output.with_suffix(".md").read_text()
    assert all(f"| {mode} |" in table for mode in floor.MODES)
