"""Per-experiment locks exist only while calls hold or await them: calls on
names that do not exist (a typo in a loop, a scan) leave nothing behind, and
calls on one experiment still run one at a time."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

import bots_client
from bots_server.testing.inprocess import InProcessService


def test_calls_on_unknown_names_leave_no_lock_behind(tmp_path: Path) -> None:
    with InProcessService(f"sqlite:///{tmp_path / 'locks.db'}") as service:
        with bots_client.Client("", channel=service.channel(), retry_timeout=0) as client:
            for i in range(300):
                ghost = f"ghost-{i}-{uuid.uuid4().hex[:6]}"
                for call in (
                    lambda: client.select_batch(ghost, 1, request_key="k"),
                    lambda: client.report_outcomes(ghost, "b", {"a": (1, 1)}),
                    lambda: client.snapshot(ghost),
                    lambda: client.delete_experiment(ghost),
                    lambda: client.add_tasks(ghost, [bots_client.Task("a")]),
                ):
                    with pytest.raises(bots_client.NotFoundError):
                        call()
        assert service.core.runtime.locks_held == 0
        assert service.core.runtime.live == {}


def test_calls_on_one_experiment_hold_its_lock_one_at_a_time(tmp_path: Path) -> None:
    with InProcessService(f"sqlite:///{tmp_path / 'locks.db'}") as service:
        runtime = service.core.runtime
        inside: list[int] = []
        overlaps: list[int] = []

        async def hold(i: int) -> None:
            async with runtime.locked("e"):
                inside.append(i)
                if len(inside) > 1:
                    overlaps.append(i)
                await asyncio.sleep(0.001)
                inside.remove(i)

        async def many() -> int:
            await asyncio.gather(*(hold(i) for i in range(50)))
            return runtime.locks_held

        assert service.call(many()) == 0
        assert overlaps == []
