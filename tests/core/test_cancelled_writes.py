"""A unary write whose call is cancelled before its transaction commits
leaves no trace: create, delete, fork, retire, re-activate and group shares,
on both backends. (Uploads, which stream: tests/faults/test_cancelled_uploads.py.)

The store call is held at its start until the call has been cancelled, so
the cancellation lands while the write is in flight, every time."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

import bots_client
from bots_server.core.domain import ExperimentConfig
from bots_server.core.selector import SelectorService
from bots_server.testing.inprocess import InProcessService

CASES: dict[str, tuple[str, Callable[[SelectorService], Coroutine[Any, Any, object]]]] = {
    "create": ("create_experiment", lambda core: core.experiments.create("new", ExperimentConfig())),
    "delete": ("delete_experiment", lambda core: core.experiments.delete("e")),
    "fork": ("create_copy", lambda core: core.experiments.fork("e", "forked", None)),
    "retire": ("commit_retirement", lambda core: core.pool.set_retired("e", ["t-0", "t-1"], True)),
    "reactivate": ("commit_retirement", lambda core: core.pool.set_retired("e", ["t-5"], False)),
    "shares": ("commit_shares", lambda core: core.pool.set_group_shares("e", {"a": (0.5, 1.0)})),
}


def state(client: bots_client.Client) -> tuple[object, ...]:
    names = sorted(e.name for e in client.list_experiments())
    snap = client.snapshot("e")
    assert snap.retired is not None
    groups = [(g.name, g.min_share, g.max_share) for g in client.list_groups("e")]
    return names, snap.step, snap.alpha.tobytes(), snap.retired.tobytes(), groups


@pytest.mark.parametrize("case", list(CASES))
def test_a_write_cancelled_in_flight_leaves_no_trace(fresh_db_url: str, case: str) -> None:
    method, start = CASES[case]
    with InProcessService(fresh_db_url) as service:
        with bots_client.Client("", channel=service.channel(), retry_timeout=0) as client:
            client.create_experiment("e")
            client.add_tasks("e", [bots_client.Task(f"t-{i}", group="ab"[i % 2]) for i in range(10)])
            client.retire_tasks("e", ["t-5"])
            batch = client.select_batch("e", 4, request_key="s0")
            client.report_outcomes("e", batch.batch_id, dict.fromkeys(batch.keys, (1.0, 1)))
            before = state(client)

            store = service.core.runtime.store
            real = getattr(store, method)
            entered, cancelled, finished = threading.Event(), threading.Event(), threading.Event()
            outcome: list[BaseException | object] = []

            def held(*args: Any, **kwargs: Any) -> object:
                entered.set()
                cancelled.wait(10)
                try:
                    outcome.append(real(*args, **kwargs))
                except BaseException as e:
                    outcome.append(e)
                    raise
                finally:
                    finished.set()

            async def cancel_in_flight() -> None:
                call = asyncio.ensure_future(start(service.core))
                await asyncio.to_thread(entered.wait, 10)
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await call
                cancelled.set()

            setattr(store, method, held)
            try:
                service.call(cancel_in_flight(), timeout=30)
                assert finished.wait(10)
            finally:
                setattr(store, method, real)
            assert len(outcome) == 1 and type(outcome[0]).__name__ == "Abandoned"  # rolled back, not committed
            assert state(client) == before
            # And the experiment goes on: the cancelled call leaves nothing to trip over.
            batch = client.select_batch("e", 4, request_key="s1")
            assert client.report_outcomes("e", batch.batch_id, dict.fromkeys(batch.keys, (0.0, 1))).step == 2
