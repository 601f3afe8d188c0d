"""The store on SQLite and PostgreSQL: schema from migrations, O(batch)
writes per report, plain-SQL readable posteriors."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from bots_client import ExperimentConfig
from bots_server.errors import AlreadyExists
from bots_server.store import BatchRow, LeaseConflict, StaleStep, StepEvent, open_store
from bots_server.store.schema import metadata
from bots_server.store.sql import SqlStore

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture
def store(fresh_db_url: str) -> SqlStore:
    s = open_store(fresh_db_url)
    assert isinstance(s, SqlStore)  # the tests read its tables
    s.migrate()
    yield s
    s.close()


def test_migrations_create_exactly_the_declared_schema(store: SqlStore) -> None:
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_migrate_is_idempotent(store: SqlStore) -> None:
    store.migrate()
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar_one() == "0002"


def count_rows(store: SqlStore) -> int:
    with store.engine.connect() as conn:
        return sum(
            conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for table in metadata.sorted_tables
        )


def rows_per_report(store: SqlStore, pool: int, batch: int) -> int:
    name = f"pool-{pool}"
    row = store.create_experiment(name, ExperimentConfig(), NOW)
    store.add_tasks(row.id, 0, [f"k{i}" for i in range(pool)], [{}] * pool)
    store.insert_batch(row.id, BatchRow("b1", "r1", 0, list(range(batch)), NOW, NOW, None), NOW)
    before = count_rows(store)
    event = StepEvent(1, "b1", pool, list(range(batch)), [1.0] * batch, [2] * batch, None, None)
    store.commit_report(row.id, 0, event, NOW)
    return count_rows(store) - before


def test_rows_written_per_report_do_not_grow_with_the_pool(store: SqlStore) -> None:
    # One steps row plus one outcomes row per reported task; the experiment
    # and batch rows are updated in place.
    assert rows_per_report(store, pool=100, batch=16) == 17
    assert rows_per_report(store, pool=20_000, batch=16) == 17


def test_report_is_a_compare_and_set_on_the_step(store: SqlStore) -> None:
    row = store.create_experiment("cas", ExperimentConfig(), NOW)
    store.add_tasks(row.id, 0, ["a", "b"], [{}, {}])
    store.insert_batch(row.id, BatchRow("b1", "r1", 0, [0], NOW, NOW, None), NOW)
    store.insert_batch(row.id, BatchRow("b2", "r2", 0, [1], NOW, NOW, None), NOW)
    store.commit_report(row.id, 0, StepEvent(1, "b1", 2, [0], [1.0], [1], None, None), NOW)
    before = count_rows(store)
    with pytest.raises(StaleStep):  # a writer still at step 0 loses
        store.commit_report(row.id, 0, StepEvent(1, "b2", 2, [1], [1.0], [1], None, None), NOW)
    assert count_rows(store) == before
    with pytest.raises(StaleStep):  # adding tasks is a compare-and-set on the pool size
        store.add_tasks(row.id, 1, ["c"], [{}])


def test_duplicate_keys_name_the_keys_and_write_nothing(store: SqlStore) -> None:
    row = store.create_experiment("dups", ExperimentConfig(), NOW)
    store.add_tasks(row.id, 0, ["a", "b"], [{}, {}])
    before = count_rows(store)
    with pytest.raises(AlreadyExists, match="'b'"):
        store.add_tasks(row.id, 2, ["c", "b"], [{}, {}])
    assert count_rows(store) == before
    assert store.find_experiment("dups").num_tasks == 2


def test_request_key_race_returns_the_stored_batch(store: SqlStore) -> None:
    row = store.create_experiment("race", ExperimentConfig(), NOW)
    store.add_tasks(row.id, 0, ["a", "b"], [{}, {}])
    first = store.insert_batch(row.id, BatchRow("b1", "same", 0, [0], NOW, NOW, None), NOW)
    second = store.insert_batch(row.id, BatchRow("b2", "same", 0, [1], NOW, NOW, None), NOW)
    assert second == first


def test_checkpointed_posteriors_are_plain_rows(store: SqlStore) -> None:
    row = store.create_experiment("plain", ExperimentConfig(), NOW)
    store.add_tasks(row.id, 0, ["x", "y"], [{}, {}])
    assert store.write_checkpoint(row.id, 3, 0.25, [2.5, 1.0], [1.5, 4.0], NOW)
    assert not store.write_checkpoint(row.id, 2, None, [9.0, 9.0], [9.0, 9.0], NOW)  # older: ignored
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT task_key, alpha, beta, mean, checkpoint_step FROM task_posteriors "
            "WHERE experiment = 'plain' ORDER BY task_key"
        ).all()
    assert [tuple(r) for r in rows] == [("x", 2.5, 1.5, 2.5 / 4.0, 3), ("y", 1.0, 4.0, 0.2, 3)]


def test_delete_removes_every_row_of_the_experiment(store: SqlStore) -> None:
    keep = store.create_experiment("keep", ExperimentConfig(), NOW)
    store.add_tasks(keep.id, 0, ["a"], [{}])
    baseline = count_rows(store)
    gone = store.create_experiment("gone", ExperimentConfig(), NOW)
    store.add_tasks(gone.id, 0, ["a", "b"], [{}, {}])
    store.insert_batch(gone.id, BatchRow("b1", "r1", 0, [0, 1], NOW, NOW, None), NOW)
    store.commit_report(gone.id, 0, StepEvent(1, "b1", 2, [0, 1], [1.0, 0.0], [1, 1], 0.5, 0.5), NOW)
    store.write_checkpoint(gone.id, 1, 0.5, [1.0, 2.0], [2.0, 1.0], NOW)
    assert store.delete_experiment(gone.id)
    assert count_rows(store) == baseline


def test_insert_batch_checks_step_and_leases_under_the_lock(store: SqlStore) -> None:
    later = NOW + dt.timedelta(hours=1)
    row = store.create_experiment("leases", ExperimentConfig(), NOW)
    store.add_tasks(row.id, 0, ["a", "b", "c"], [{}, {}, {}])
    store.insert_batch(row.id, BatchRow("b1", "r1", 0, [0, 1], NOW, later, None), NOW)
    with pytest.raises(LeaseConflict):  # task 1 is leased by b1
        store.insert_batch(row.id, BatchRow("b2", "r2", 0, [1, 2], NOW, later, None), NOW)
    with pytest.raises(StaleStep):  # chosen at a step the experiment has left
        store.insert_batch(row.id, BatchRow("b3", "r3", 7, [2], NOW, later, None), NOW)
    # Once b1's lease has expired its tasks may be leased again.
    after = later + dt.timedelta(seconds=1)
    assert store.insert_batch(row.id, BatchRow("b4", "r4", 0, [1, 2], after, after, None), after).batch_id == "b4"
