"""The checked-in protobuf code is what proto/ generates (CI fails if stale)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
