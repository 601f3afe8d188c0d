"""The engine benchmark runs on a small pool, writes both files, and refuses
to report a speed when the two engines' answers differ (bench/engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import engine


def test_engine_benchmark_writes_every_case(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    engine.main(["--sizes", "9000", "--reps", "2", "--batch", "16", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [row["case"] for row in result["rows"]] == [
        "beta_draw",
        "beta_draw_float32",
        "select",
        "select_mean",
        "select_leased",
        "select_candidates",
        "top_k",
        "update",
        "update_extras",
    ]
    for row in result["rows"]:
        assert row["pool"] == 9000
        assert row["reference_ms"]["n"] == row["engine_ms"]["n"] == 2
        assert row["engine_cpu_ms"]["p50"] > 0
    assert "| top-k alone | 9,000 |" in out.with_suffix(".md").read_text()


def test_engine_benchmark_stops_when_the_answers_differ() -> None:
    state = engine.posterior(1000, seed=0)
    honest = engine.cases(8, state)[2]
    off_by_one = engine.Case(
        "select", "broken", honest.reference, lambda s, seed: [i + 1 for i in honest.engine(s, seed)]
    )
    with pytest.raises(AssertionError, match="disagree"):
        engine.measure(off_by_one, state, reps=1)
    assert np.isfinite(engine.measure(honest, state, reps=1)["speedup_median_of_ratios"])
