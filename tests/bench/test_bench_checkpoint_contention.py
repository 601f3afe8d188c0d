"""The checkpoint contention benchmark runs end to end on a small pool and
reports what it claims (bench/checkpoint_contention.py)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import checkpoint_contention, common


def test_commits_during_each_checkpoint_are_timed(tmp_path: Path) -> None:
    with common.database("sqlite") as url:
        runs = checkpoint_contention.run_once(url, 200_000, 2)
    assert len(runs) == 2
    for r in runs:
        assert r["checkpoint_s"] > 0
        assert r["commits_before"]["n"] > 0  # the writer ran before the checkpoint started
        assert r["commits_during"]["n"] + r["commits_before"]["n"] >= 2
    (tmp_path / "a.json").write_text(json.dumps({"runs": {"sqlite": runs}}))
    table = "\n".join(checkpoint_contention.compare([tmp_path / "a.json"], [tmp_path / "a.json"]))
    assert "| sqlite | commits during it, p50 ms |" in table
