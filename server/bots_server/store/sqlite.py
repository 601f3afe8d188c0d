"""The SQLite dialect: one embedded file, one writer at a time, one server
per file."""

from __future__ import annotations

import fcntl
import itertools
import os
import pathlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import IO, Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine

from bots_server.store import schema as t
from bots_server.store.errors import DatabaseInUse
from bots_server.store.sql import SqlStore


class SqliteStore(SqlStore):
    """`exclusive`: hold an advisory lock on FILE.lock for the store's life,
    so a second server on the same file fails with DatabaseInUse instead of
    two writers caching diverging state."""

    def __init__(
        self,
        url: str | URL,
        *,
        exclusive: bool = False,
        busy_timeout_ms: int = 10_000,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        parsed = sa.make_url(url)
        self._lock_file: IO[str] | None = None
        if exclusive and parsed.database not in (None, "", ":memory:"):
            self._lock_file = _lock_file(str(parsed.database))
        # SQLite has one writer at a time; queueing this process's writers on
        # a lock is fairer and faster than SQLite's sleeping busy handler.
        self._writer = threading.Lock()
        super().__init__(parsed, _create_engine(parsed, busy_timeout_ms), on_error)

    def close(self) -> None:
        super().close()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock
            self._lock_file = None

    @contextmanager
    def _write_connection(self) -> Iterator[Connection]:
        with self._writer, self.engine.connect() as conn:
            yield conn.execution_options(write=True)  # BEGIN IMMEDIATE, see _create_engine

    def _snapshot(self, conn: Connection) -> None:
        pass  # a read transaction in WAL mode sees one snapshot already

    def _lock_row(self, query: sa.Select[Any]) -> sa.Select[Any]:
        return query  # a write transaction holds the database's single write lock already (BEGIN IMMEDIATE)

    def _json(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        return sa.type_coerce(column, sa.JSON)  # SQLite's JSON functions take the text as it is

    def _bulk_insert(
        self, conn: Connection, table: sa.Table, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]
    ) -> None:
        # The driver's executemany on plain tuples: no per-row dict or
        # statement compilation, and still SQLAlchemy's events and errors.
        params = list(rows)
        if params:
            placeholders = ", ".join("?" for _ in columns)
            conn.exec_driver_sql(f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES ({placeholders})", params)

    def _insert_posteriors(self, conn: Connection, experiment_id: int, alpha: np.ndarray, beta: np.ndarray) -> None:
        rows = zip(itertools.repeat(experiment_id), range(len(alpha)), alpha.tolist(), beta.tolist())
        self._bulk_insert(conn, t.posteriors, ("experiment_id", "task_idx", "alpha", "beta"), rows)

    def _migration_lock(self) -> AbstractContextManager[None]:
        return nullcontext()  # the migration's write transaction (BEGIN IMMEDIATE) excludes other writers


def _create_engine(url: URL, busy_timeout_ms: int) -> Engine:
    engine = sa.create_engine(url, connect_args={"timeout": busy_timeout_ms / 1000, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # transactions are begun below, explicitly
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")  # an acknowledged report survives power loss
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the lock up front: a deferred transaction that reads
        # and then writes can fail with SQLITE_BUSY despite the busy timeout.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("write") else "BEGIN")

    return engine


def _lock_file(database: str) -> IO[str]:
    path = pathlib.Path(database).resolve()
    lock = open(f"{path}.lock", "a+")  # noqa: SIM115 - open for the store's life: closing it releases the lock
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise DatabaseInUse(
            f"SQLite database {path} is in use by another bots-server (pid {holder}); "
            "SQLite allows one server per file: stop the other one, or use PostgreSQL for several replicas"
        ) from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock
