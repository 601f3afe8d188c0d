"""bench/critical_path.py runs a trainer loop with a stand-in GPU step in both report modes."""

from __future__ import annotations

import json
from pathlib import Path

from bench import critical_path


def test_both_modes_are_measured_interleaved(tmp_path: Path) -> None:
    out = tmp_path / "cp"
    args = ["--pools", "2000", "--step-s", "0.04", "--steps", "4", "--repeats", "2", "--output", str(out)]
    assert critical_path.main(args) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["pool"], r["mode"]) for r in rows] == [(2000, "sync"), (2000, "overlap")]
    for row in rows:
        assert len(row["median_ms"]) == 2 and all(ms > 0 for ms in row["median_ms"])
    assert "| 2,000 | 0.04 s | overlap |" in out.with_suffix(".md").read_text()
