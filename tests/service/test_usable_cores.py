"""The engine's threads follow a container's CPU limit (a cgroup quota)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bots_server.service.server import usable_cores

CORES = len(os.sched_getaffinity(0))


def test_without_a_cgroup_quota_every_core_this_process_may_run_on(tmp_path: Path) -> None:
    assert usable_cores(tmp_path) == CORES
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == CORES
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(tmp_path) == CORES


@pytest.mark.parametrize(("quota", "cores"), [(50_000, 1), (100_000, 1), (150_000, 2), (10**9, CORES)])
def test_a_quota_caps_the_cores_rounded_up(tmp_path: Path, quota: int, cores: int) -> None:
    (tmp_path / "cpu.max").write_text(f"{quota} 100000\n")
    assert usable_cores(tmp_path) == min(cores, CORES)
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(tmp_path) == min(cores, CORES)
