"""Store.compact on SQLite and PostgreSQL: it removes the outcomes and batch
tasks of old steps in chunks, never past the checkpoint, keeps the rows
retries need, and is idempotent."""

from __future__ import annotations

import sqlalchemy as sa

from bots_server.store import Lookup
from bots_server.store.sql import SqlStore
from tests.store import test_store
from tests.store.test_store import NOW, batch, event, experiment_with_tasks

store = test_store.store  # the fixture: a fresh, migrated store


def counts(store: SqlStore, experiment_id: int) -> dict[str, int]:
    """Rows of `steps` and `batches`, and how many of them still have their outcomes or tasks."""
    queries = {
        "steps": "SELECT count(*) FROM steps WHERE experiment_id = :e",
        "with outcomes": "SELECT count(*) FROM step_outcomes WHERE experiment_id = :e",
        "batches": "SELECT count(*) FROM batches WHERE experiment_id = :e",
        "with tasks": "SELECT count(*) FROM batch_task_lists WHERE experiment_id = :e",
    }
    with store.engine.connect() as conn:
        return {name: conn.execute(sa.text(q), {"e": experiment_id}).scalar_one() for name, q in queries.items()}


def ten_steps(store: SqlStore) -> int:
    """An experiment of 4 tasks with 10 reported batches of 2 (steps 1..10)
    and its checkpoint at step 6."""
    exp = experiment_with_tasks(store, "e", 4)
    for step in range(1, 11):
        tasks = [step % 4, (step + 1) % 4]
        store.insert_batch(exp, batch(f"b{step}", f"r{step}", step - 1, tasks), NOW)
        store.commit_report(exp, step - 1, event(step, f"b{step}", 4, sorted(tasks)), NOW)
    assert store.write_checkpoint(exp, 6, 4, b"state at 6", NOW)
    return exp


def test_compaction_goes_in_chunks_and_stops_at_the_checkpoint(store: SqlStore) -> None:
    exp = ten_steps(store)
    assert counts(store, exp) == {"steps": 10, "with outcomes": 10, "batches": 10, "with tasks": 10}
    first = store.compact(exp, through_step=100, max_steps=4)
    assert first == (4, 4, 4)  # steps 1-4: their outcomes, and the tasks of their batches
    second = store.compact(exp, through_step=100, max_steps=4)
    assert second == (6, 2, 2)  # held at the checkpoint (step 6)
    assert store.compact(exp, through_step=100, max_steps=4) == (6, 0, 0)  # idempotent
    # Kept: every step and batch row, and the events after the checkpoint.
    assert counts(store, exp) == {"steps": 10, "with outcomes": 4, "batches": 10, "with tasks": 4}
    find = store.find_experiment("e")
    assert find is not None and find.compacted_through == 6

    # A rebuild reads the checkpoint and events 7..10, all complete.
    rows = store.load(exp)
    assert rows is not None and [e.step for e in rows.events] == [7, 8, 9, 10]
    assert all(len(e.task_idx) == 2 for e in rows.events)

    # An old step keeps its scalars; its outcomes are marked gone.
    old, recent = store.read_event(exp, 3), store.read_event(exp, 8)
    assert (old.step, old.capability, old.complete, old.task_idx) == (3, 0.5, False, [])
    assert recent.complete and len(recent.task_idx) == 2
    # A reused request key of a compacted batch says so; a recent one is whole.
    gone = store.load(exp, after_step=10, first_task=4, lookup=Lookup(request_key="r2"))
    kept = store.load(exp, after_step=10, first_task=4, lookup=Lookup(request_key="r9"))
    assert gone is not None and gone.batch is not None and gone.batch.compacted and gone.batch.task_idx == []
    assert kept is not None and kept.batch is not None and not kept.batch.compacted and len(kept.batch.task_idx) == 2


def test_compaction_never_touches_open_batches_or_other_experiments(store: SqlStore) -> None:
    exp = ten_steps(store)
    other = experiment_with_tasks(store, "other", 4)
    store.insert_batch(other, batch("x1", "x1", 0, [0, 1]), NOW)
    store.commit_report(other, 0, event(1, "x1", 4, [0, 1]), NOW)
    store.insert_batch(exp, batch("open", "open", 10, [0, 1]), NOW)  # selected, not reported
    store.compact(exp, through_step=6, max_steps=100)
    assert counts(store, other) == {"steps": 1, "with outcomes": 1, "batches": 1, "with tasks": 1}
    rows = store.load(exp, after_step=10, first_task=4, lookup=Lookup(request_key="open"))
    assert rows is not None and rows.batch is not None and rows.batch.task_idx == [0, 1]
    assert store.compact(12345, through_step=6, max_steps=100) == (0, 0, 0)  # no such experiment
