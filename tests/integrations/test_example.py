"""A smoke run of examples/grpo_curriculum/run.py: a few steps of both arms
against the test server, the summary table and the PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integrations.conftest import need

REPO = Path(__file__).resolve().parents[2]


def test_example_runs_both_arms_and_plots(address: str, tmp_path: Path) -> None:
    need("torch")
    need("matplotlib")
    png = tmp_path / "curves.png"
    cmd = [
        sys.executable, str(REPO / "examples" / "grpo_curriculum" / "run.py"), "--address", address,
        "--seeds", "1", "--steps", "12", "--tasks", "200", "--eval-every", "4", "--targets", "0.01", "0.99",
        "--out", str(png),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "uniform seed 0" in out.stdout and "service seed 0" in out.stdout
    assert "Steps to reach each pool accuracy" in out.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
