"""bench/checkpoint_encode.py times a checkpoint's encode and how late another thread wakes meanwhile."""

from __future__ import annotations

import json
from pathlib import Path

from bench import checkpoint_encode


def test_every_repeat_is_measured(tmp_path: Path) -> None:
    out = tmp_path / "encode.json"
    assert checkpoint_encode.main(["--tasks", "5000", "--repeats", "3", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tasks"] == 5000
    for key in ("encode_ms", "longest_wait_ms", "idle_longest_wait_ms"):
        assert len(result[key]) == 3
        assert all(ms > 0 for ms in result[key])
    # The other thread sleeps 0.5 ms at a time: it can never wake sooner.
    assert min(result["idle_longest_wait_ms"]) >= checkpoint_encode.TICK_S * 1e3
