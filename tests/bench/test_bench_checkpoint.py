"""The checkpoint benchmark runs end to end on a tiny pool and measures what
it claims (bench/checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import checkpoint, common


def test_checkpoints_stop_and_rebuilds_are_measured(tmp_path: Path) -> None:
    args = checkpoint.build_parser().parse_args(["--steps", "6", "--every", "3", "--crash-steps", "1", "--batch", "16"])
    with common.database("sqlite") as url:
        r = checkpoint.run_once("sqlite", url, 2000, args)
    assert len(r["checkpoint_s"]) == 2  # every 3 of 6 steps
    assert r["calls_during_checkpoint"]["n"] + r["calls_otherwise"]["n"] == 12  # 6 selects, 6 reports
    assert r["graceful_stop_s"] > 0 and r["graceful_stop_cpu_s"] > 0
    assert r["restart"]["replayed_steps"] == 0  # the graceful stop checkpointed
    # The restart's own cycle and the crash step: 2 steps, fewer than --every,
    # so no checkpoint can have been written before the SIGKILL.
    assert r["crash_restart"]["replayed_steps"] == 2
    assert r["crash_restart"]["first_cycle_cpu_s"] > 0
    (tmp_path / "a.json").write_text(json.dumps({"runs": [r]}))
    table = "\n".join(checkpoint.compare([tmp_path / "a.json"], [tmp_path / "a.json"]))
    assert "| sqlite | graceful stop, s |" in table
