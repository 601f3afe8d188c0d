"""Bulk work gives way to trainer calls, and keeps its share (core/priority.py)."""

from __future__ import annotations

import collections
import gc
import threading
import time
import traceback

import pytest

import bots_client
from bots_client.proto import bots_pb2 as pb
from bots_server.core.domain import NewTasks
from bots_server.core.observer import SelectorObserver
from bots_server.core.priority import BLOCK, Pacer, Priority
from bots_server.service import convert
from bots_server.store.sqlite import SqliteStore
from bots_server.testing.inprocess import InProcessService


def paced_after(priority: Priority, worked_s: float) -> float:
    """Seconds one pace() waits after a block that took `worked_s`."""
    pacer = priority.pacer()
    time.sleep(worked_s)  # the block
    start = time.monotonic()
    pacer.pace()
    return time.monotonic() - start


def test_bulk_runs_on_at_once_when_no_trainer_call_is_in_flight() -> None:
    assert paced_after(Priority(linger_s=0.5), 0.02) < 0.1


def test_bulk_waits_for_the_trainer_call_and_its_linger() -> None:
    priority = Priority(bulk_share=0.01, linger_s=0.1)  # patience: 99 x the block
    released = threading.Event()

    def trainer_call() -> None:
        with priority.foreground():
            released.wait()

    caller = threading.Thread(target=trainer_call)
    caller.start()
    time.sleep(0.05)
    threading.Timer(0.3, released.set).start()
    waited = paced_after(priority, 0.05)  # may wait up to 5 s
    caller.join()
    # The call ended at least 0.25 s after the pace began, then 0.1 s of linger.
    assert 0.3 <= waited < 2.0


def test_bulk_keeps_its_share_under_a_call_that_never_ends() -> None:
    yielded: list[float] = []
    priority = Priority(bulk_share=0.2, linger_s=0.0, on_yield=yielded.append)  # waits at most 4 x the block
    with priority.foreground():
        waited = paced_after(priority, 0.05)
    assert 0.15 <= waited < 1.0
    assert len(yielded) == 1 and 0.15 <= yielded[0] <= waited  # what bots_bulk_yield_seconds_total counts


def test_bulk_share_must_be_a_fraction() -> None:
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="bulk share"):
            Priority(bulk_share=share)


def test_paced_yields_every_item_in_order_and_paces_between_blocks() -> None:
    priority = Priority()
    pacer = priority.pacer()
    calls = []
    pacer.pace = lambda: calls.append(1)  # type: ignore[method-assign]
    assert list(pacer.paced(range(10), size=4)) == list(range(10))
    assert len(calls) == 2  # before items 4 and 8


def test_uploaded_tasks_give_the_garbage_collector_nothing_to_scan() -> None:
    """A million uploaded tasks as objects made every full collection of the
    process scan them, in pauses of 50-150 ms that every caller waited
    through; as columns of strings and dicts of numbers they are not scanned."""
    message = pb.AddTasksRequest(
        tasks=[pb.Task(key=f"t-{i}", features={"weak": 0.5}, group="g") for i in range(20_000)]
    )
    tasks = NewTasks()
    gc.collect()
    before = len(gc.get_objects())
    convert.add_tasks_from_proto(tasks, message.tasks, Priority().pacer())
    assert len(tasks) == 20_000 and tasks.features[7] == {"weak": 0.5} and tasks.groups[7] == "g"
    assert len(gc.get_objects()) - before < 100


def test_every_stage_of_uploads_restores_and_snapshots_gives_way(
    fresh_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each stage of the bulk calls paces between its blocks: converting the
    messages, validating, encoding, and writing (on SQLite, between the
    transactions of the rows' parts); a snapshot's decoding and chunks."""
    stages: collections.Counter[str] = collections.Counter()
    pace = Pacer.pace

    def counted(self: Pacer) -> None:
        innermost = next(frame.name for frame in reversed(traceback.extract_stack()) if frame.name in STAGES)
        stages[STAGES[innermost]] += 1
        pace(self)

    monkeypatch.setattr(Pacer, "pace", counted)
    monkeypatch.setattr(SqliteStore, "_task_rows_per_write", BLOCK)
    n = 3 * BLOCK
    with InProcessService(fresh_db_url) as service:
        with bots_client.Client("", channel=service.channel(), retry_timeout=0) as client:
            client.create_experiment("e")
            client.add_tasks("e", [bots_client.Task(f"t-{i}", {"w": i / n}, group="ab"[i % 2]) for i in range(n)])
            uploaded = dict(stages)
            stages.clear()
            snap = client.snapshot("e", include_features=True)
            snapshotted = dict(stages)
            stages.clear()
            client.restore_experiment("copy", snap)
            restored = dict(stages)
    # Blocks of BLOCK (SQLite's parts too): a pace before the second and the third.
    assert uploaded == {"convert": 2, "validate": 2, "encode": 2, "write": 2}
    assert snapshotted == {"decode": 2, "chunks": 2, "fill": 2}
    assert restored == {"convert": 2, "validate": 2, "encode": 2, "write": 2}


# The stage of a pace: the innermost of these frames on its thread's stack.
STAGES = {
    "add_tasks_from_proto": "convert",  # AddTasks' messages
    "take": "convert",  # RestoreExperiment's messages
    "tasks": "validate",
    "add_tasks": "encode",  # the store's, before its write
    "create_copy": "encode",
    "_bulk_insert": "write",
    "_staged_task_rows": "write",  # SQLite's parts
    "_staged_copy_rows": "write",
    "load_features": "decode",
    "_chunk_bounds": "chunks",
    "_fill": "fill",
}


class _Yields(SelectorObserver):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def bulk_yielded(self, seconds: float) -> None:
        self.seconds.append(seconds)


def test_an_upload_during_a_trainer_call_waits_and_says_so(fresh_db_url: str) -> None:
    """The upload completes (it keeps its share), and its waits reach the
    observer (bots_bulk_yield_seconds_total)."""
    observer = _Yields()
    with InProcessService(fresh_db_url, observer=observer) as service:
        with bots_client.Client("", channel=service.channel(), retry_timeout=0) as client:
            client.create_experiment("e")
            with service.core.runtime.priority.foreground():  # a trainer call that does not end
                assert client.add_tasks("e", [bots_client.Task(f"t-{i}") for i in range(3 * BLOCK)]) == 3 * BLOCK
    assert len(observer.seconds) >= 6 and all(s > 0 for s in observer.seconds)  # convert, validate, encode: 2 each
