"""The store's retirement events on both dialects: a compare-and-set on the
sequence number, read back in order (whole or after a seq), checked by
insert_batch, copied by forks and removed with their experiment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bots_server.store import ExperimentCopy, RetirementEvent, StaleStep
from bots_server.store.sql import SqlStore
from tests.store.test_store import NOW, batch, event, experiment_with_tasks, open_sql_store


@pytest.fixture
def store(fresh_db_url: str) -> Iterator[SqlStore]:
    s = open_sql_store(fresh_db_url)
    s.migrate()
    yield s
    s.close()


def test_retirement_events_are_a_compare_and_set_sequence(store: SqlStore) -> None:
    exp = experiment_with_tasks(store, "e", 6)
    assert store.commit_retirement(exp, 1, [1, 3], True, NOW) == RetirementEvent(1, 0, [1, 3], True)
    with pytest.raises(StaleStep):  # a writer that missed event 1
        store.commit_retirement(exp, 1, [2], True, NOW)
    store.insert_batch(exp, batch("b1", "r1", 0, [0]), NOW)
    store.commit_report(exp, 0, event(1, "b1", 6, [0]), NOW)
    # The step recorded is the experiment's at the commit.
    assert store.commit_retirement(exp, 2, [3], False, NOW) == RetirementEvent(2, 1, [3], False)
    rows = store.load(exp)
    assert rows is not None and rows.pool_events == [RetirementEvent(1, 0, [1, 3], True), RetirementEvent(2, 1, [3], False)]
    newer = store.load(exp, after_step=1, first_task=6, after_pool_event=1)
    assert newer is not None and newer.pool_events == [RetirementEvent(2, 1, [3], False)]


def test_a_select_made_before_a_retirement_is_stale(store: SqlStore) -> None:
    exp = experiment_with_tasks(store, "e", 6)
    store.commit_retirement(exp, 1, [2], True, NOW)
    with pytest.raises(StaleStep):
        store.insert_batch(exp, batch("b1", "r1", 0, [2]), NOW, pool_seq=0)
    assert store.insert_batch(exp, batch("b1", "r1", 0, [1]), NOW, pool_seq=1).batch_id == "b1"


def test_forks_copy_retirements_and_delete_removes_them(store: SqlStore) -> None:
    exp = experiment_with_tasks(store, "e", 4)
    store.commit_retirement(exp, 1, [0, 2], True, NOW)
    copy = ExperimentCopy("f", {}, 0, None, 4, b"state", "e", source_id=exp, retired=[2, 0])
    fork = store.create_copy(copy, NOW)
    rows = store.load(fork.id)
    assert rows is not None and rows.pool_events == [RetirementEvent(1, 0, [0, 2], True)]
    assert store.delete_experiment(exp) and store.delete_experiment(fork.id)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM retirements").scalar_one() == 0
