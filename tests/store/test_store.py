"""The store contract (bots_server.store.base.Store), every case on SQLite and
on PostgreSQL: what each method returns, raises and writes (nothing, when it
raises), its guarantees under concurrency, and the schema from migrations.

Row counts read the tables through the SQL implementation's engine."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from bots_server.errors import AlreadyExists, Unavailable
from bots_server.store import (
    BatchAlreadyReported,
    BatchRow,
    CheckpointRow,
    ExperimentCopy,
    LeaseConflict,
    Lookup,
    OverQuota,
    RequestKeyTaken,
    StaleStep,
    StepEvent,
    TenantLimits,
    TenantUsage,
    UnsupportedDatabase,
    checkpoint_blob,
    open_store,
    pieces,
)
from bots_server.store.postgresql import PostgresStore, tenant_lock_key
from bots_server.store.schema import metadata
from bots_server.store.sql import SqlStore
from bots_server.store.sqlite import SqliteStore

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
LATER = NOW + dt.timedelta(hours=1)
T = TypeVar("T")


def open_sql_store(url: str) -> SqlStore:
    store = open_store(url)
    assert isinstance(store, SqlStore)  # the row counts read its tables
    return store


@pytest.fixture
def store(fresh_db_url: str) -> Iterator[SqlStore]:
    s = open_sql_store(fresh_db_url)
    s.migrate()
    yield s
    s.close()


def count_rows(store: SqlStore) -> int:
    with store.engine.connect() as conn:
        return sum(
            conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for table in metadata.sorted_tables
        )


def batch(batch_id: str, request_key: str, step: int, task_idx: list[int], expires: dt.datetime = LATER) -> BatchRow:
    return BatchRow(batch_id, request_key, step, task_idx, NOW, expires, None)


def event(step: int, batch_id: str, pool_size: int, task_idx: list[int]) -> StepEvent:
    n = len(task_idx)
    return StepEvent(step, batch_id, pool_size, task_idx, [1.0] * n, [2] * n, 0.5, 0.25)


def experiment_with_tasks(store: SqlStore, name: str, n: int) -> int:
    row = store.create_experiment(name, {}, NOW)
    store.add_tasks(row.id, 0, [f"k{i}" for i in range(n)], [{}] * n)
    return row.id


# -- opening and schema ------------------------------------------------------------------


def test_open_store_picks_the_dialect_by_scheme(fresh_db_url: str) -> None:
    store = open_store(fresh_db_url)
    try:
        expected = SqliteStore if fresh_db_url.startswith("sqlite") else PostgresStore
        assert type(store) is expected
    finally:
        store.close()


def test_display_url_hides_the_password() -> None:
    store = open_store("postgresql+psycopg://bots:secret@127.0.0.1:1/bots")  # connects lazily: never here
    assert store.display_url == "postgresql+psycopg://bots:***@127.0.0.1:1/bots"
    store.close()


@pytest.mark.parametrize(
    "url", ["mysql+pymysql://u@localhost/db", "postgresql+asyncpg://u@localhost/db", "postgresql+psycopg2://u@h/db"]
)
def test_open_store_rejects_unsupported_databases(url: str) -> None:
    with pytest.raises(UnsupportedDatabase, match=r"unsupported database URL scheme .*postgresql://"):
        open_store(url)


@pytest.mark.parametrize("scheme", ["postgresql", "postgres", "postgresql+psycopg"])
def test_open_store_takes_postgresql_urls_without_a_driver(scheme: str, pg_url: str) -> None:
    # postgresql:// and postgres:// (what psql, libpq and most tools take)
    # mean PostgreSQL through psycopg 3: a real round trip on the test server.
    url = sa.make_url(pg_url).set(drivername=scheme).render_as_string(hide_password=False)
    assert url.startswith(f"{scheme}://")
    store = open_store(url)
    try:
        assert type(store) is PostgresStore
        assert store.display_url.startswith("postgresql+psycopg://")
        store.ping()
        assert store.schema_status().heads  # a query answered by the server
    finally:
        store.close()


def test_open_store_rejects_what_is_not_a_url_without_echoing_it() -> None:
    with pytest.raises(UnsupportedDatabase, match="cannot parse") as error:
        open_store("bots:secret@nowhere")
    assert "secret" not in str(error.value)


def test_schema_status_before_and_after_migrate(fresh_db_url: str) -> None:
    store = open_store(fresh_db_url)
    try:
        before = store.schema_status()
        assert not before.current and before.revisions == [] and len(before.heads) == 1
        store.migrate("0001")
        assert store.schema_status() == (False, ["0001"], before.heads)
        store.migrate()
        assert store.schema_status() == (True, before.heads, before.heads)
    finally:
        store.close()


def test_migrations_create_exactly_the_declared_schema(store: SqlStore) -> None:
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def test_migrate_twice_is_a_no_op(store: SqlStore) -> None:
    experiment_with_tasks(store, "kept", 2)
    rows = count_rows(store)
    store.migrate()
    assert store.schema_status().current
    assert count_rows(store) == rows
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), metadata) == []


def test_migrators_at_once_take_turns(fresh_db_url: str) -> None:
    # Replicas (or init containers) starting together: every one succeeds.
    stores = [open_store(fresh_db_url) for _ in range(3)]
    try:
        run_together([s.migrate for s in stores])
        assert all(s.schema_status().current for s in stores)
    finally:
        for s in stores:
            s.close()


@pytest.mark.parametrize(
    "url", ["sqlite:////nonexistent-directory/bots.db", "postgresql+psycopg://postgres@127.0.0.1:1/none"]
)
def test_an_unreachable_database_is_unavailable_and_counted(url: str) -> None:
    kinds: list[str] = []
    store = open_store(url, on_error=kinds.append)
    try:
        with pytest.raises(Unavailable, match="database unavailable"):
            store.ping()
        with pytest.raises(Unavailable):
            store.find_experiment("any")
    finally:
        store.close()
    assert kinds == ["unavailable", "unavailable"]


# -- experiments --------------------------------------------------------------------------


def test_experiments_are_created_found_listed_and_deleted(store: SqlStore) -> None:
    config = {"seed": 7, "a setting of a later version": [1, "x"]}
    created = store.create_experiment("b", config, NOW)
    store.create_experiment("a", {}, NOW)
    store.create_experiment("c", {}, NOW)
    assert store.find_experiment("b") == created
    assert (created.step, created.num_tasks, created.capability, created.config) == (0, 0, None, config)
    assert created.create_time == NOW and created.create_time.tzinfo is not None
    assert store.find_experiment("missing") is None
    assert [e.name for e in store.list_experiments("", 2)] == ["a", "b"]
    assert [e.name for e in store.list_experiments("b", 2)] == ["c"]
    assert store.delete_experiment(created.id)
    assert not store.delete_experiment(created.id)
    assert store.find_experiment("b") is None


def test_a_taken_name_is_already_exists_and_writes_nothing(store: SqlStore) -> None:
    source = experiment_with_tasks(store, "taken", 2)
    before = count_rows(store)
    with pytest.raises(AlreadyExists, match="'taken'"):
        store.create_experiment("taken", {}, NOW)
    copy = ExperimentCopy("taken", {}, 0, None, 2, b"state", "taken", source_id=source)
    with pytest.raises(AlreadyExists, match="'taken'"):
        store.create_copy(copy, NOW)
    assert count_rows(store) == before


def test_create_copy_starts_at_the_given_posterior_and_step(store: SqlStore) -> None:
    source = store.create_experiment("source", {}, NOW)
    store.add_tasks(source.id, 0, ["x", "y", "z"], [{"w": 0.1}, {"w": 0.2}, {"w": 0.3}])
    fork = store.create_copy(ExperimentCopy("fork", {}, 5, 0.5, 2, b"fork state", "source", source_id=source.id), NOW)
    assert (fork.step, fork.num_tasks, fork.capability, fork.forked_from, fork.forked_at_step) == (5, 2, 0.5, "source", 5)
    given = ExperimentCopy("restored", {}, 3, None, 1, b"restored", "elsewhere", keys=["q"], features=[{"w": 1.0}])
    restored = store.create_copy(given, NOW)

    rows = store.load(fork.id, reference_features=("w", ""))
    assert rows is not None
    assert (rows.keys, rows.weak, rows.checkpoint, rows.events) == (["x", "y"], [], CheckpointRow(5, 2, b"fork state", NOW), [])
    assert store.load_features(fork.id, 2) == [{"w": 0.1}, {"w": 0.2}]
    assert store.load_features(restored.id, 1) == [{"w": 1.0}]


def test_delete_removes_every_row_of_the_experiment(store: SqlStore) -> None:
    experiment_with_tasks(store, "keep", 1)
    baseline = count_rows(store)
    gone = experiment_with_tasks(store, "gone", 2)
    store.insert_batch(gone, batch("b1", "r1", 0, [0, 1], NOW), NOW)
    store.commit_report(gone, 0, StepEvent(1, "b1", 2, [0, 1], [1.0, 0.0], [1, 1], 0.5, 0.5), NOW)
    store.write_checkpoint(gone, 1, 2, b"state", NOW)
    assert store.delete_experiment(gone)
    assert count_rows(store) == baseline


def test_writes_past_the_tenant_limits_are_over_quota_and_write_nothing(store: SqlStore) -> None:
    limits = TenantLimits("t", max_experiments=2, max_tasks=3)
    first = store.create_experiment("t/a", {}, NOW, "t", limits=limits)
    given = ExperimentCopy("t/b", {}, 0, None, 1, b"", "x", keys=["k"], features=[{}], tenant="t")
    store.create_copy(given, NOW, limits=limits)
    assert store.add_tasks(first.id, 0, ["x", "y"], [{}, {}], limits=limits) == 2  # adds no experiment
    before = count_rows(store)
    refused = [
        functools.partial(store.create_experiment, "t/c", {}, NOW, "t", limits=limits),
        functools.partial(store.add_tasks, first.id, 2, ["z"], [{}], limits=limits),
        functools.partial(
            store.create_copy,
            ExperimentCopy("t/d", {}, 0, None, 1, b"", "x", source_id=first.id, tenant="t"),
            NOW,
            limits=dataclasses.replace(limits, max_experiments=3),
        ),
    ]
    for write in refused:
        with pytest.raises(OverQuota) as e:
            write()
        assert e.value.usage == TenantUsage(2, 3)
    assert count_rows(store) == before
    store.create_experiment("u/a", {}, NOW, "u", limits=TenantLimits("u", max_experiments=1))  # another tenant


# -- tasks, loading and checkpoints ----------------------------------------------------------


def test_add_tasks_is_a_compare_and_set_on_the_pool_size(store: SqlStore) -> None:
    row = store.create_experiment("grow", {}, NOW)
    assert store.add_tasks(row.id, 0, ["a", "b"], [{}, {}]) == 2
    before = count_rows(store)
    with pytest.raises(StaleStep):  # another writer added tasks since this one read 1
        store.add_tasks(row.id, 1, ["c"], [{}])
    assert count_rows(store) == before
    assert store.add_tasks(row.id, 2, ["c"], [{}]) == 3


def test_duplicate_keys_name_the_keys_and_write_nothing(store: SqlStore) -> None:
    row = store.create_experiment("dups", {}, NOW)
    store.add_tasks(row.id, 0, ["a", "b"], [{}, {}])
    before = count_rows(store)
    with pytest.raises(AlreadyExists, match="'b'"):
        store.add_tasks(row.id, 2, ["c", "b"], [{}, {}])
    assert count_rows(store) == before
    assert store.find_experiment("dups").num_tasks == 2


def test_load_rebuilds_from_the_checkpoint_and_the_events_after_it(store: SqlStore) -> None:
    config = {"weak_feature": "w", "strong_feature": "s"}
    row = store.create_experiment("load", config, NOW)
    store.add_tasks(row.id, 0, ["a", "b", "c"], [{"w": 0.1, "s": 0.9}, {"w": 0.2}, {}])
    for step in (1, 2, 3):
        store.insert_batch(row.id, batch(f"b{step}", f"r{step}", step - 1, [step - 1]), NOW)
        store.commit_report(row.id, step - 1, event(step, f"b{step}", 3, [step - 1]), NOW)
    store.write_checkpoint(row.id, 1, 1, b"state of task a", NOW)

    rows = store.load(row.id, reference_features=("w", "s"))
    assert rows is not None
    assert (rows.experiment.step, rows.experiment.capability) == (3, 0.5)
    assert rows.checkpoint == CheckpointRow(1, 1, b"state of task a", NOW)
    # Every key; the reference features only of the tasks after the checkpoint's.
    assert (rows.keys, rows.weak, rows.strong) == (["a", "b", "c"], [0.2, None], [None, None])
    assert rows.events == [event(2, "b2", 3, [1]), event(3, "b3", 3, [2])]
    assert (rows.batch, rows.leased) == (None, None)

    store.add_tasks(row.id, 3, ["d"], [{"w": 0.4}])
    caught_up = store.load(row.id, reference_features=("w", "s"), after_step=2, first_task=3)
    assert caught_up is not None
    assert (caught_up.checkpoint, caught_up.keys, caught_up.weak, caught_up.events) == (None, ["d"], [0.4], [event(3, "b3", 3, [2])])
    assert store.read_event(row.id, 2) == event(2, "b2", 3, [1])
    assert store.load(row.id + 100) is None


def test_load_looks_up_batches_and_leases_in_the_same_read(store: SqlStore) -> None:
    experiment = experiment_with_tasks(store, "lookup", 4)
    first = store.insert_batch(experiment, batch("b1", "r1", 0, [2, 0]), NOW)
    store.insert_batch(experiment, batch("b2", "r2", 0, [1], expires=NOW), NOW)  # expired at once
    by_id = store.load(experiment, after_step=0, first_task=4, lookup=Lookup(batch_id="b1", leases_at=NOW))
    assert by_id is not None and (by_id.batch, sorted(by_id.leased or [])) == (first, [0, 2])
    by_key = store.load(experiment, after_step=0, first_task=4, lookup=Lookup(request_key="r1"))
    assert by_key is not None and (by_key.batch, by_key.leased) == (first, None)
    none = store.load(experiment, after_step=0, first_task=4, lookup=Lookup(batch_id="nope"))
    assert none is not None and none.batch is None
    assert store.count_open_batches(experiment, NOW) == 1


def test_checkpoints_only_move_forward_and_are_one_value(store: SqlStore) -> None:
    row = store.create_experiment("plain", {}, NOW)
    assert store.load(row.id).checkpoint == CheckpointRow(0, 0, b"", NOW)  # empty until the first one
    store.add_tasks(row.id, 0, ["x", "y"], [{}, {}])
    assert store.write_checkpoint(row.id, 3, 2, b"at step 3", NOW)
    before = count_rows(store)
    assert not store.write_checkpoint(row.id, 2, 2, b"older", LATER)
    assert not store.write_checkpoint(row.id, 3, 2, b"same step", LATER)
    assert count_rows(store) == before
    assert store.load(row.id).checkpoint == CheckpointRow(3, 2, b"at step 3", NOW)
    assert store.write_checkpoint(row.id, 4, 2, b"at step 4", LATER)
    assert count_rows(store) == before  # replaced in place: no row per task
    assert store.load(row.id).checkpoint == CheckpointRow(4, 2, b"at step 4", LATER)


def test_postgresql_view_reads_the_checkpointed_posterior_exactly(fresh_pg_url: str) -> None:
    store = open_sql_store(fresh_pg_url)
    store.migrate()
    try:
        row = store.create_experiment("view", {}, NOW)
        store.add_tasks(row.id, 0, ["x", "y", "z", "later"], [{}] * 4)
        # Values whose decoding is easy to get wrong: a repeating binary
        # fraction, the smallest subnormal, a large exponent.
        alpha = np.array([0.1, 5e-324, 2.5])
        beta = np.array([1.5, 1.0, 1e300])
        weak = np.full(3, np.nan)
        state = checkpoint_blob.encode(3, {"weak": weak, "alpha": alpha, "beta": beta}, {"capability": 0.25})
        assert store.write_checkpoint(row.id, 7, 3, state, NOW)
        with store.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT task_key, alpha, beta, mean, checkpoint_step FROM task_posteriors "
                "WHERE experiment = 'view' ORDER BY task_key"
            ).all()
            header = conn.exec_driver_sql(
                "SELECT bots_checkpoint_header(data) -> 'scalars' -> 'capability' ->> 'value' "
                "FROM checkpoint_chunks JOIN checkpoints USING (experiment_id, version) WHERE seq = 0"
            ).scalar_one()
        means = alpha / (alpha + beta)
        assert [tuple(r) for r in rows] == [
            ("x", 0.1, 1.5, means[0], 7),
            ("y", 5e-324, 1.0, means[1], 7),
            ("z", 2.5, 1e300, means[2], 7),
        ]  # "later" is not in the checkpoint yet
        assert float.fromhex(header) == 0.25
    finally:
        store.close()


def test_a_checkpoint_in_many_chunks_reads_back_whole_and_leaves_no_old_chunks(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks as small as the header: every array spans many, and floats
    sit at both ends of chunks. The value comes back byte for byte; a later
    checkpoint's write removes the earlier one's chunks; on PostgreSQL the
    view decodes each float from the chunk holding it."""
    monkeypatch.setattr(pieces, "CHUNK_BYTES", 8)
    n = 50
    row = store.create_experiment("chunks", {}, NOW)
    store.add_tasks(row.id, 0, [f"k{i:02d}" for i in range(n)], [{}] * n)
    rng = np.random.default_rng(3)
    alpha, beta = rng.gamma(2.0, size=n), rng.gamma(3.0, size=n)
    first = checkpoint_blob.encode(n, {"alpha": alpha, "beta": beta}, {"capability": 0.5})
    assert store.write_checkpoint(row.id, 1, n, first, NOW)
    after_one = count_rows(store)
    second = checkpoint_blob.encode(n, {"alpha": alpha + 1, "beta": beta}, {"capability": 0.75})
    assert store.write_checkpoint(row.id, 2, n, second, LATER)
    assert store.load(row.id).checkpoint == CheckpointRow(2, n, second, LATER)
    assert count_rows(store) == after_one  # the first value's chunks are gone
    if store.engine.dialect.name == "postgresql":
        with store.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT alpha, beta FROM task_posteriors WHERE experiment = 'chunks' ORDER BY task_key"
            ).all()
        assert [tuple(r) for r in rows] == list(zip((alpha + 1).tolist(), beta.tolist(), strict=True))


# -- batches and reports -------------------------------------------------------------------------


def rows_per_report(store: SqlStore, pool: int, batch_size: int) -> int:
    experiment = experiment_with_tasks(store, f"pool-{pool}", pool)
    store.insert_batch(experiment, batch("b1", "r1", 0, list(range(batch_size)), NOW), NOW)
    before = count_rows(store)
    store.commit_report(experiment, 0, event(1, "b1", pool, list(range(batch_size))), NOW)
    return count_rows(store) - before


def test_rows_written_per_report_grow_with_neither_the_pool_nor_the_batch(store: SqlStore) -> None:
    # A steps row and a step_outcomes row holding the outcomes; the
    # experiment and batch rows are updated in place.
    assert rows_per_report(store, pool=100, batch_size=16) == 2
    assert rows_per_report(store, pool=20_000, batch_size=256) == 2


def test_a_select_writes_two_rows_and_reads_its_tasks_back_in_order(store: SqlStore) -> None:
    experiment = experiment_with_tasks(store, "one-row", 300)
    tasks = [299, 0, 7, 150, 3] + list(range(10, 250))  # selection order, not sorted
    before = count_rows(store)
    store.insert_batch(experiment, batch("b1", "r1", 0, tasks), NOW)
    assert count_rows(store) - before == 2  # the batch, and its tasks as one value
    rows = store.load(experiment, lookup=Lookup(batch_id="b1"))
    assert rows is not None and rows.batch is not None and rows.batch.task_idx == tasks


def test_batches_never_reported_are_deleted_oldest_expired_first_past_the_bound(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Selects without reports (a trainer that never reports, a lease of a
    # millisecond) would grow the batches without end: at the bound, a new
    # batch deletes those whose lease expired longest ago, and nothing else.
    store.max_unreported_batches = 3
    experiment = experiment_with_tasks(store, "leaky", 10)
    other = experiment_with_tasks(store, "other", 10)
    for i in range(4):
        store.insert_batch(other, batch(f"o{i}", f"o{i}", 0, [i], expires=NOW), NOW)
    store.insert_batch(experiment, batch("reported", "r", 0, [9], expires=NOW), NOW)
    store.commit_report(experiment, 0, event(1, "reported", 10, [9]), NOW)
    store.insert_batch(experiment, batch("leased", "l", 1, [8]), NOW)  # its lease runs to LATER
    for i in range(3):
        store.insert_batch(experiment, batch(f"b{i}", f"k{i}", 1, [i], expires=NOW), NOW)
    unreported = "SELECT batch_id FROM batches WHERE experiment_id = :e AND reported_step IS NULL ORDER BY batch_id"

    def kept(e: int) -> list[str]:
        with store.engine.connect() as conn:
            return list(conn.execute(sa.text(unreported), {"e": e}).scalars())

    assert kept(experiment) == ["b1", "b2", "leased"]  # b2 made 4: the oldest expired one went
    caplog.clear()
    with caplog.at_level("WARNING", logger="bots_server.store"):
        store.insert_batch(experiment, batch("b3", "k3", 1, [3]), NOW)
    assert kept(experiment) == ["b2", "b3", "leased"]
    assert "deleted the 1 batches of experiment 'leaky' that were never reported" in caplog.text
    assert kept(other) == ["o1", "o2", "o3"]  # bounded per experiment: o3 made 4 there
    rows = store.load(experiment, lookup=Lookup(batch_id="reported"))
    assert rows is not None and rows.batch is not None and rows.batch.reported_step == 1  # reported ones stay
    # The deleted ones are gone with their tasks; their request keys are free.
    with store.engine.connect() as conn:
        lists = conn.execute(sa.text("SELECT count(*) FROM batch_task_lists WHERE experiment_id = :e"), {"e": experiment})
        assert lists.scalar_one() == 4
    store.insert_batch(experiment, batch("again", "k0", 1, [0]), NOW)  # b0's key: a new batch
    # Leased batches are never deleted: with no expired one, the bound waits.
    assert kept(experiment) == ["again", "b3", "leased"]
    store.insert_batch(experiment, batch("b4", "k4", 1, [4]), NOW)
    assert kept(experiment) == ["again", "b3", "b4", "leased"]
    # Down to nine tenths of the bound at once, so the next selects need not delete.
    store.max_unreported_batches = 20
    third = experiment_with_tasks(store, "third", 10)
    for i in range(21):
        store.insert_batch(third, batch(f"t{i:02d}", f"t{i}", 0, [0], expires=NOW + dt.timedelta(seconds=i)), LATER)
    assert kept(third) == [f"t{i:02d}" for i in range(3, 21)]  # 21 made 18: the three that expired first went
    # A backlog far above the bound (left by a release without it) goes a
    # tenth of the bound per select: no select deletes for long.
    store.max_unreported_batches = 0  # never: the backlog builds up
    backlog = experiment_with_tasks(store, "backlog", 10)
    for i in range(60):
        store.insert_batch(backlog, batch(f"x{i:02d}", f"x{i}", 0, [0], expires=NOW), LATER)
    store.max_unreported_batches = 20
    store.insert_batch(backlog, batch("y", "y", 0, [1]), LATER)
    assert len(kept(backlog)) == 61 - 3


def test_report_is_a_compare_and_set_on_the_step(store: SqlStore) -> None:
    experiment = experiment_with_tasks(store, "cas", 2)
    store.insert_batch(experiment, batch("b1", "r1", 0, [0]), NOW)
    store.insert_batch(experiment, batch("b2", "r2", 0, [1]), NOW)
    store.commit_report(experiment, 0, event(1, "b1", 2, [0]), NOW)
    before = count_rows(store)
    with pytest.raises(StaleStep):  # a writer still at step 0 loses
        store.commit_report(experiment, 0, event(1, "b2", 2, [1]), NOW)
    assert count_rows(store) == before
    assert store.find_experiment("cas").step == 1


def test_report_given_the_pool_size_is_stale_after_tasks_were_added(store: SqlStore) -> None:
    experiment = experiment_with_tasks(store, "grown", 2)
    store.insert_batch(experiment, batch("b1", "r1", 0, [0]), NOW)
    store.add_tasks(experiment, 2, ["k2"], [{}])  # by another replica: the writer below still has 2 tasks
    before = count_rows(store)
    with pytest.raises(StaleStep):
        store.commit_report(experiment, 0, event(1, "b1", 2, [0]), NOW, num_tasks=2)
    assert count_rows(store) == before
    store.commit_report(experiment, 0, event(1, "b1", 3, [0]), NOW, num_tasks=3)
    assert store.find_experiment("grown").step == 1


def test_a_batch_reported_meanwhile_is_already_reported_and_writes_nothing(store: SqlStore) -> None:
    experiment = experiment_with_tasks(store, "twice", 2)
    store.insert_batch(experiment, batch("b1", "r1", 0, [0]), NOW)
    store.commit_report(experiment, 0, event(1, "b1", 2, [0]), NOW)
    before = count_rows(store)
    with pytest.raises(BatchAlreadyReported):  # at the right step, but b1 is reported: the step is not advanced
        store.commit_report(experiment, 1, event(2, "b1", 2, [0]), NOW)
    assert count_rows(store) == before
    assert store.find_experiment("twice").step == 1


def test_request_key_race_returns_the_stored_batch(store: SqlStore) -> None:
    experiment = experiment_with_tasks(store, "race", 2)
    first = store.insert_batch(experiment, batch("b1", "same", 0, [0]), NOW)
    store.insert_batch(experiment, batch("b2", "other", 0, [1]), NOW)
    store.commit_report(experiment, 0, event(1, "b2", 2, [1]), NOW)
    before = count_rows(store)
    # The stored batch wins over every other check: the step moved on and task 0 is leased.
    assert store.insert_batch(experiment, batch("b3", "same", 0, [0]), NOW) == first
    assert count_rows(store) == before


def test_insert_batch_checks_step_and_leases_under_the_lock(store: SqlStore) -> None:
    experiment = experiment_with_tasks(store, "leases", 3)
    store.insert_batch(experiment, batch("b1", "r1", 0, [0, 1]), NOW)
    before = count_rows(store)
    with pytest.raises(LeaseConflict):  # task 1 is leased by b1
        store.insert_batch(experiment, batch("b2", "r2", 0, [1, 2]), NOW)
    with pytest.raises(StaleStep):  # chosen at a step the experiment has left
        store.insert_batch(experiment, batch("b3", "r3", 7, [2]), NOW)
    assert count_rows(store) == before
    # Once b1's lease has expired its tasks may be leased again.
    after = LATER + dt.timedelta(seconds=1)
    stored = store.insert_batch(experiment, BatchRow("b4", "r4", 0, [1, 2], after, after, None), after)
    assert stored.batch_id == "b4"


def test_insert_batch_for_a_deleted_experiment_is_stale_and_writes_nothing(store: SqlStore) -> None:
    """A replica whose copy outlived its experiment (deleted on another one)."""
    experiment = experiment_with_tasks(store, "gone", 3)
    assert store.delete_experiment(experiment)
    before = count_rows(store)
    with pytest.raises(StaleStep):
        store.insert_batch(experiment, batch("b1", "r1", 0, [0]), NOW, open_batches=[], num_tasks=3)
    assert count_rows(store) == before


def test_insert_batch_given_the_open_batches_checks_them_exactly(store: SqlStore) -> None:
    # The caller chose among the tasks the batches it knows leave free: a
    # batch it does not know (another replica's) voids the choice even when
    # the tasks do not overlap, since knowing it could have changed the draw.
    experiment = experiment_with_tasks(store, "known", 6)
    store.insert_batch(experiment, batch("b1", "r1", 0, [0, 1]), NOW)
    store.insert_batch(experiment, batch("b2", "r2", 0, [2], expires=NOW), NOW)  # expired at once
    before = count_rows(store)
    with pytest.raises(LeaseConflict):  # b1 is open, the caller knows none
        store.insert_batch(experiment, batch("b3", "r3", 0, [4]), NOW, open_batches=[])
    with pytest.raises(LeaseConflict):  # b2 expired: not open any more
        store.insert_batch(experiment, batch("b3", "r3", 0, [4]), NOW, open_batches=["b1", "b2"])
    with pytest.raises(StaleStep):  # the caller's copy has fewer tasks
        store.insert_batch(experiment, batch("b3", "r3", 0, [4]), NOW, open_batches=["b1"], num_tasks=5)
    assert count_rows(store) == before
    stored = store.insert_batch(experiment, batch("b3", "r3", 0, [4]), NOW, open_batches=["b1"], num_tasks=6)
    assert stored.batch_id == "b3"
    opened = store.load(experiment, after_step=0, first_task=6, lookup=Lookup(leases_at=NOW)).open_batches
    assert [(b.batch_id, b.task_idx) for b in opened] == [("b1", [0, 1]), ("b3", [4])]


def test_report_and_insert_batch_write_both_or_nothing(store: SqlStore) -> None:
    experiment = experiment_with_tasks(store, "both", 6)
    store.insert_batch(experiment, batch("b1", "r1", 0, [0, 1]), NOW)
    store.insert_batch(experiment, batch("b2", "r2", 0, [2]), NOW)
    store.insert_batch(experiment, batch("held", "taken", 0, [5]), NOW)
    before = count_rows(store)

    def attempt(next_batch: BatchRow, open_batches: list[str], expected_step: int = 0) -> None:
        store.commit_report_and_insert_batch(
            experiment, expected_step, event(1, "b1", 6, [0, 1]), next_batch, NOW, 0, open_batches=open_batches, num_tasks=6
        )

    with pytest.raises(RequestKeyTaken) as taken:  # the report is rolled back with the batch
        attempt(batch("b3", "taken", 1, [3]), ["b2", "held"])
    assert taken.value.existing.batch_id == "held"
    with pytest.raises(LeaseConflict):  # b2 is open, the caller did not know it
        attempt(batch("b3", "r3", 1, [3]), ["held"])
    with pytest.raises(ValueError, match="chosen at the report's step 1"):  # the caller's mistake
        attempt(batch("b3", "r3", 0, [3]), ["b2", "held"])
    with pytest.raises(StaleStep):  # the report's compare-and-set
        attempt(batch("b3", "r3", 1, [3]), ["b2", "held"], expected_step=1)
    assert count_rows(store) == before
    assert store.find_experiment("both").step == 0

    # The reported batch is not among the open ones: its tasks may be chosen again.
    attempt(batch("b3", "r3", 1, [0, 3]), ["b2", "held"])
    assert store.find_experiment("both").step == 1
    assert store.read_event(experiment, 1).task_idx == [0, 1]
    opened = store.load(experiment, after_step=1, first_task=6, lookup=Lookup(leases_at=NOW)).open_batches
    assert sorted((b.batch_id, b.step, tuple(b.task_idx)) for b in opened) == [
        ("b2", 0, (2,)), ("b3", 1, (0, 3)), ("held", 0, (5,))
    ]


# -- several replicas on one database --------------------------------------------------------------


def run_together(calls: list[Callable[[], T]]) -> list[T | Exception]:
    """Start the calls at the same moment on threads of their own; their
    results, or the exceptions they raised."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], T]) -> T | Exception:
        barrier.wait()
        try:
            return call()
        except Exception as e:
            return e

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


@pytest.fixture
def replicas(store: SqlStore, fresh_db_url: str) -> Iterator[tuple[SqlStore, SqlStore]]:
    """Two stores on one database, as two servers have."""
    other = open_sql_store(fresh_db_url)
    yield store, other
    other.close()


def test_racing_selects_of_the_same_tasks_lease_them_once(replicas: tuple[SqlStore, SqlStore]) -> None:
    a, b = replicas
    experiment = experiment_with_tasks(a, "selects", 20)
    for round_ in range(10):
        tasks = [2 * round_, 2 * round_ + 1]
        results = run_together(
            [
                functools.partial(a.insert_batch, experiment, batch(f"a{round_}", f"ra{round_}", 0, tasks), NOW),
                functools.partial(b.insert_batch, experiment, batch(f"b{round_}", f"rb{round_}", 0, tasks), NOW),
            ]
        )
        assert sorted(type(r).__name__ for r in results) == ["BatchRow", "LeaseConflict"], results
    assert a.count_open_batches(experiment, NOW) == 10


def test_racing_reports_advance_the_step_once(replicas: tuple[SqlStore, SqlStore]) -> None:
    a, b = replicas
    experiment = experiment_with_tasks(a, "reports", 20)
    for step in range(10):
        a.insert_batch(experiment, batch(f"a{step}", f"ra{step}", step, [2 * step]), NOW)
        b.insert_batch(experiment, batch(f"b{step}", f"rb{step}", step, [2 * step + 1]), NOW)
        results = run_together(
            [
                functools.partial(a.commit_report, experiment, step, event(step + 1, f"a{step}", 20, [2 * step]), NOW),
                functools.partial(b.commit_report, experiment, step, event(step + 1, f"b{step}", 20, [2 * step + 1]), NOW),
            ]
        )
        assert sorted(type(r).__name__ for r in results) == ["NoneType", "StaleStep"], results
    rows = b.load(experiment)
    assert rows is not None and rows.experiment.step == 10 and [e.step for e in rows.events] == list(range(1, 11))


def test_the_tenant_lock_key_is_the_same_in_every_release() -> None:
    # Replicas of two releases (a rolling upgrade) must lock the same key.
    assert (tenant_lock_key("team-a"), tenant_lock_key("default")) == (-4304809284944768907, 234917281408703869)


def test_racing_writes_of_one_tenant_on_two_replicas_stay_within_its_limits(
    replicas: tuple[SqlStore, SqlStore],
) -> None:
    limits = TenantLimits("t", max_experiments=3)
    calls = [
        functools.partial(s.create_experiment, f"t/e{i}", {}, NOW, "t", limits=limits)
        for i, s in enumerate(replicas * 5)
    ]
    results = run_together(calls)
    assert sorted(type(r).__name__ for r in results) == ["ExperimentRow"] * 3 + ["OverQuota"] * 7, results
    assert replicas[0].tenant_usage("t") == TenantUsage(3, 0)


def test_a_replica_catches_up_with_what_another_committed(replicas: tuple[SqlStore, SqlStore]) -> None:
    a, b = replicas
    experiment = experiment_with_tasks(a, "catch-up", 3)
    stale = b.load(experiment)
    assert stale is not None
    a.insert_batch(experiment, batch("b1", "r1", 0, [1]), NOW)
    a.commit_report(experiment, 0, event(1, "b1", 3, [1]), NOW)
    a.add_tasks(experiment, 3, ["new"], [{}])
    rows = b.load(experiment, after_step=stale.experiment.step, first_task=stale.experiment.num_tasks)
    assert rows is not None
    assert (rows.experiment.step, rows.keys, rows.events) == (1, ["new"], [event(1, "b1", 3, [1])])
    assert dataclasses.replace(rows.experiment, step=0, num_tasks=3, capability=None) == stale.experiment
