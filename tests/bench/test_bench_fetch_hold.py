"""bench/fetch_hold.py reads the same rows both ways, on both backends, and times both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import fetch_hold


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_both_ways_are_measured_on_each_repeat(backend: str, tmp_path: Path) -> None:
    out = tmp_path / "fetch.json"
    assert fetch_hold.main(["--backend", backend, "--rows", "2000", "--repeats", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["how"], r["repeat"]) for r in results] == [
        (how, repeat) for repeat in range(2) for how in ("one fetch", f"fetches of {fetch_hold.PART_ROWS}")
    ]
    for r in results:
        assert r["backend"] == backend
        assert r["read_ms"] > 0
        # The ticker sleeps 0.5 ms at a time: no gap is shorter.
        assert r["gap_ms"] >= 0.5
