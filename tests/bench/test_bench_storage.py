"""Smoke test of bench/storage.py: a few steps on each backend grow the
tables the benchmark attributes the growth to."""

from __future__ import annotations

import pytest

from bench import storage
from tests.support.servers import require_postgres


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_short_run_measures_growth_by_table(backend: str) -> None:
    if backend == "postgresql":
        require_postgres()
    # Enough rows to fill new pages: SQLite grows a 4 KiB page at a time.
    result = storage.run(backend, steps=20, pool=128, batch=32)
    per_step = result["bytes_per_step"]
    assert isinstance(per_step, dict) and set(per_step) == set(storage.GROWING)
    # Each step appends its 32 outcomes and a batch's 32 tasks: both grow.
    assert per_step["step_outcomes"] > 0 and per_step["batch_task_lists"] > 0
    assert result["bytes_per_step_total"] == pytest.approx(sum(per_step.values()), abs=4)
