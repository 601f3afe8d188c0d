"""SQLite's uploads and deletes in parts (store/sql_task_rows.py): a large
upload's or delete's tasks rows go in short transactions of their own, so
that other writers (other tenants' reports) go between them; no read sees
them until the one transaction that adds them commits, a failed upload
leaves none, and rows a crash left are removed at the next start.
PostgreSQL writes them in the upload's one transaction (others go on
meanwhile there), so these cases are SQLite's."""

from __future__ import annotations

import contextlib
import datetime as dt
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import bots_client
from bots_server.errors import AlreadyExists
from bots_server.store import Abandoned, ExperimentCopy, OverQuota, StaleStep, TenantLimits
from bots_server.store import schema as t
from bots_server.store.sqlite import SqliteStore
from bots_server.testing.processes import ServerProcess

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
PART = 100


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(f"sqlite:///{tmp_path / 'parts.db'}")
    s._task_rows_per_write = PART
    s.migrate()
    yield s
    s.close()


def tasks_rows(store: SqliteStore, experiment_id: int | None = None) -> int:
    query = sa.select(sa.func.count()).select_from(t.tasks)
    if experiment_id is not None:
        query = query.where(t.tasks.c.experiment_id == experiment_id)
    with store.engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(n)]


def on_pace(number: int, action: Callable[[], None]) -> Callable[[], None]:
    """A pace callback that runs `action` at its `number`-th call (1-based)."""
    calls = 0

    def pace() -> None:
        nonlocal calls
        calls += 1
        if calls == number:
            action()

    return pace


def abandoned_from(number: int) -> Callable[[], bool]:
    """An `abandoned` callback that says True from its `number`-th call on:
    the caller went away in the middle of the parts."""
    calls = 0

    def abandoned() -> bool:
        nonlocal calls
        calls += 1
        return calls >= number

    return abandoned


def test_an_upload_in_parts_is_invisible_until_it_commits_and_lets_other_writers_in(store: SqliteStore) -> None:
    big = store.create_experiment("big", {}, NOW).id
    other = store.create_experiment("other", {}, NOW).id
    seen: dict[str, object] = {}

    def meanwhile() -> None:
        rows = tasks_rows(store, big)
        if seen or rows == 0:
            return  # encoding, or seen already
        # Between two parts the write lock is free: another experiment's write commits.
        seen["rows"] = rows
        seen["other"] = store.add_tasks(other, 0, ["o"], [{}])
        loaded = store.load(big)
        assert loaded is not None
        seen["num_tasks"], seen["keys"] = loaded.experiment.num_tasks, loaded.keys
        seen["features"] = store.load_features(big, loaded.experiment.num_tasks)
        seen["usage"] = store.tenant_usage("default")

    n = 10 * PART
    assert store.add_tasks(big, 0, keys("k", n), [{"w": 1.0}] * n, pace=meanwhile) == n
    assert seen == {"other": 1, "num_tasks": 0, "keys": [], "features": [], "usage": (2, 1), "rows": PART}
    loaded = store.load(big)
    assert loaded is not None and loaded.keys == keys("k", n)
    assert store.load_features(big, n) == [{"w": 1.0}] * n


@pytest.mark.parametrize("failure", ["duplicate key", "abandoned", "over quota", "stale"])
def test_a_failed_upload_in_parts_leaves_no_rows(store: SqliteStore, failure: str) -> None:
    limits = TenantLimits("default", max_tasks=10 * PART)
    e = store.create_experiment("e", {}, NOW).id
    store.add_tasks(e, 0, ["first"], [{}])
    before = tasks_rows(store)
    n = 5 * PART
    new_keys = keys("k", n)
    abandoned, expected = None, 1
    error: type[Exception]
    if failure == "duplicate key":
        new_keys[-1], error = "first", AlreadyExists  # in the last part
    elif failure == "abandoned":
        abandoned, error = abandoned_from(3), Abandoned
    elif failure == "over quota":
        n, new_keys, error = 10 * PART, keys("k", 10 * PART), OverQuota  # one over, found at the commit
    else:
        expected, error = 0, StaleStep
    with pytest.raises(error) as raised:
        store.add_tasks(e, expected, new_keys, [{}] * n, abandoned, limits=limits)
    if failure == "duplicate key":
        assert "first" in str(raised.value)
    assert tasks_rows(store) == before
    loaded = store.load(e)
    assert loaded is not None and loaded.experiment.num_tasks == 1 and loaded.keys == ["first"]


def test_rows_a_crash_left_never_block_an_upload_and_are_removed_at_start(store: SqliteStore) -> None:
    e = store.create_experiment("e", {}, NOW).id
    store.add_tasks(e, 0, ["a"], [{}])
    idle = store.create_experiment("idle", {}, NOW).id
    store.add_tasks(idle, 0, ["b", "c"], [{}, {}])
    with store.engine.begin() as conn:  # what a crash in the middle of uploads and of a delete leaves
        rows = [(e, i, f"k{i:05d}", "{}", None) for i in range(1, 3 * PART)]
        rows += [(idle, i, f"late{i}", "{}", None) for i in range(2, PART + 2)]
        rows += [(e + 7, i, f"gone{i}", "{}", None) for i in range(2 * PART)]
        conn.execute(
            t.tasks.insert(),
            [dict(zip(("experiment_id", "task_idx", "key", "features", "group_name"), r)) for r in rows],
        )
    loaded = store.load(e)
    assert loaded is not None and loaded.keys == ["a"]  # invisible
    # A new experiment's id passes the ids the rows still carry.
    assert store.create_experiment("new", {}, NOW).id > e + 7
    # The next upload to `e` removes them first: their keys are free.
    assert store.add_tasks(e, 1, keys("k", 5)[1:], [{}] * 4) == 5
    assert tasks_rows(store, e) == 5
    store.remove_unfinished_writes()
    assert tasks_rows(store) == 5 + 2
    loaded = store.load(idle)
    assert loaded is not None and loaded.keys == ["b", "c"]


def test_a_delete_in_parts_lets_other_writers_in_and_its_id_is_not_reused_meanwhile(store: SqliteStore) -> None:
    n = 5 * PART
    gone = store.create_experiment("gone", {}, NOW).id
    store.add_tasks(gone, 0, keys("k", n), [{}] * n)
    made: list[int] = []

    def meanwhile() -> None:
        assert store.find_experiment("gone") is None  # deleted already; its rows go in parts
        copy = ExperimentCopy("copy", {}, 0, None, n, b"", "restore", keys=keys("k", n), features=[{}] * n)
        made.append(store.create_copy(copy, NOW).id)

    assert store.delete_experiment(gone, pace=on_pace(2, meanwhile))
    assert made and made[0] != gone
    assert tasks_rows(store) == tasks_rows(store, made[0]) == n


@pytest.mark.parametrize("source", ["restore", "fork"])
def test_a_copy_in_parts_is_invisible_until_it_commits_and_its_id_stays_its_own(
    store: SqliteStore, source: str
) -> None:
    n = 5 * PART
    original = store.create_experiment("original", {}, NOW).id
    store.add_tasks(original, 0, keys("k", n), [{"w": float(i)} for i in range(n)], groups=["g"] * n)
    given = {"keys": keys("k", n), "features": [{"w": float(i)} for i in range(n)], "groups": ["g"] * n}
    copy = ExperimentCopy(
        "copy", {}, 0, None, n, b"", source, **({"source_id": original} if source == "fork" else given)
    )
    seen: dict[str, object] = {}

    def meanwhile() -> None:
        if seen or tasks_rows(store) == n:
            return  # encoding, or seen already
        seen["found"] = store.find_experiment("copy")
        # An experiment created meanwhile gets an id of its own, and its rows do not collide.
        other = store.create_experiment("other", {}, NOW).id
        seen["other rows"] = store.add_tasks(other, 0, keys("k", 3), [{}] * 3)

    row = store.create_copy(copy, NOW, pace=meanwhile)
    assert seen == {"found": None, "other rows": 3}
    loaded = store.load(row.id)
    assert loaded is not None and loaded.keys == keys("k", n) and loaded.groups == ["g"] * n
    assert store.load_features(row.id, n) == [{"w": float(i)} for i in range(n)]
    assert tasks_rows(store, row.id) == n


@pytest.mark.parametrize("failure", ["name taken", "abandoned", "over quota"])
def test_a_failed_copy_in_parts_leaves_no_rows(store: SqliteStore, failure: str) -> None:
    store.create_experiment("taken", {}, NOW)
    before = tasks_rows(store)
    n = 5 * PART
    name, abandoned, limits = "copy", None, None
    error: type[Exception]
    if failure == "name taken":
        name, error = "taken", AlreadyExists
    elif failure == "abandoned":
        abandoned, error = abandoned_from(3), Abandoned
    else:
        limits, error = TenantLimits("default", max_tasks=n - 1), OverQuota
    copy = ExperimentCopy(name, {}, 0, None, n, b"", "restore", keys=keys("k", n), features=[{}] * n)
    with pytest.raises(error):
        store.create_copy(copy, NOW, abandoned, limits=limits)
    assert tasks_rows(store) == before
    assert [e.name for e in store.list_experiments("", 10)] == ["taken"]


def test_a_server_killed_in_the_middle_of_an_upload_restarts_clean(tmp_path: Path) -> None:
    """SIGKILL while an upload's parts are being written: after the restart
    the experiment has none of its tasks, no invisible rows remain, and the
    upload, retried, lands in full."""
    path = tmp_path / "crash.db"
    url = f"sqlite:///{path}"
    n = 200_000
    tasks = [bots_client.Task(k, {"w": 0.5}) for k in keys("t", n)]

    def rows_written() -> int:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            return int(db.execute("SELECT count(*) FROM tasks").fetchone()[0])

    server = ServerProcess(url).start()
    try:
        with bots_client.Client(server.address, retry_timeout=0) as client:
            client.create_experiment("e")

            def add() -> None:
                with contextlib.suppress(bots_client.BotsError):  # the server goes away
                    client.add_tasks("e", tasks)

            upload = threading.Thread(target=add)
            upload.start()
            deadline = time.monotonic() + 60
            while rows_written() == 0:
                assert time.monotonic() < deadline, "no part was written"
                time.sleep(0.01)
            server.kill()
            upload.join(30)
    finally:
        server.kill()
    assert 0 < rows_written() < n
    server = ServerProcess(url).start()
    try:
        assert rows_written() == 0
        with bots_client.Client(server.address) as client:
            assert client.get_experiment("e").num_tasks == 0
            assert client.add_tasks("e", tasks) == n
            assert client.get_experiment("e").num_tasks == n
    finally:
        server.stop()
    assert rows_written() == n
