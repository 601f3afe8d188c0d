"""The SQLite dialect: one embedded file, one writer at a time, one server
per file."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine

from bots_server.store import revisions
from bots_server.store.errors import DatabaseInUse
from bots_server.store.records import SchemaStatus
from bots_server.store.sql import SqlStore


class SqliteStore(SqlStore):
    """`exclusive`: hold an advisory lock (flock) on the database file itself
    for the store's life, so a second server on the same file, whatever path
    reaches it (a hard link, a symlink, a relative path), fails with
    DatabaseInUse instead of two writers caching diverging state."""

    # A write holds every other writer of the file: an upload's or a delete's
    # tasks rows go in transactions of their own (sql_task_rows.py), each
    # a millisecond or two, which other tenants' reports go between.
    _task_rows_per_write = 250

    def __init__(
        self,
        url: str | URL,
        *,
        exclusive: bool = False,
        busy_timeout_ms: int = 10_000,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        parsed = sa.make_url(url)
        self._file = pathlib.Path(parsed.database) if parsed.database not in (None, "", ":memory:") else None
        self._lock_fd: int | None = None
        self._created = False  # this store created the (empty) file
        if exclusive and self._file is not None:
            self._lock_fd, self._created = _lock_database_file(str(self._file))
        # SQLite has one writer at a time; queueing this process's writers on
        # a lock is fairer and faster than SQLite's sleeping busy handler.
        self._writer = threading.Lock()
        super().__init__(parsed, _create_engine(parsed, busy_timeout_ms), on_error)

    def close(self) -> None:
        super().close()
        if self._lock_fd is not None:
            # Only now: closing any descriptor of the file drops the process's
            # POSIX locks on it, SQLite's own included.
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def close_unused(self) -> None:
        # Unlinked while still locked: no other server can have opened it meanwhile.
        if self._created and self._file is not None and self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(self._lock_fd).st_size == 0:
                    self._file.unlink()
        self.close()

    def schema_status(self) -> SchemaStatus:
        # Connecting would create a missing file: a check changes nothing.
        if self._file is not None and not self._file.exists():
            return SchemaStatus(False, [], revisions.heads())
        return super().schema_status()

    @contextmanager
    def _write_connection(self) -> Iterator[Connection]:
        with self._writer, self.engine.connect() as conn:
            yield conn.execution_options(write=True)  # BEGIN IMMEDIATE, see _create_engine

    @contextmanager
    def _unsynced_write(self) -> Iterator[Connection]:
        # synchronous=NORMAL: the commit appends to the WAL without an fsync;
        # the final (FULL) commit that makes the rows current syncs the WAL,
        # these frames included. wal_autocheckpoint=0: the commit does not also copy the
        # WAL into the database file while this process's writers wait
        # (_settle_unsynced does, without holding them up). secure_delete=FAST:
        # removing an old chunk does not overwrite its megabyte with zeros
        # (builds that turn secure_delete on by default do; checkpoint floats
        # need no erasing). Set outside a transaction (SQLite refuses the
        # first inside one) and put back before the connection returns to the
        # pool; a connection whose settings cannot be put back is discarded.
        with self._writer, self.engine.connect() as conn:
            raw: Any = conn.connection.driver_connection  # sqlite3.Connection
            secure_delete = raw.execute("PRAGMA secure_delete").fetchone()[0]
            raw.execute("PRAGMA synchronous=NORMAL")
            raw.execute("PRAGMA wal_autocheckpoint=0")
            raw.execute("PRAGMA secure_delete=FAST")
            try:
                with conn.execution_options(write=True).begin():
                    yield conn
            finally:
                try:
                    raw.execute("PRAGMA synchronous=FULL")
                    raw.execute(f"PRAGMA wal_autocheckpoint={_WAL_AUTOCHECKPOINT}")
                    raw.execute(f"PRAGMA secure_delete={int(secure_delete)}")
                except BaseException:
                    conn.invalidate()
                    raise

    def _settle_unsynced(self) -> None:
        # A passive WAL checkpoint: copies the unsynced writes' pages into the
        # database file while other writers go on (it takes no write lock).
        with self.engine.connect() as conn:
            raw: Any = conn.connection.driver_connection
            raw.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def _lock_tenant(self, conn: Connection, tenant: str) -> None:
        pass  # a write transaction holds the database's single write lock already (BEGIN IMMEDIATE)

    def _snapshot(self, conn: Connection) -> None:
        pass  # a read transaction in WAL mode sees one snapshot already

    def _lock_row(self, query: sa.Select[Any]) -> sa.Select[Any]:
        return query  # a write transaction holds the database's single write lock already (BEGIN IMMEDIATE)

    def _json(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        return sa.type_coerce(column, sa.JSON)  # SQLite's JSON functions take the text as it is

    def _bulk_insert(
        self,
        conn: Connection,
        table: sa.Table,
        columns: Sequence[str],
        rows: Iterable[tuple[Any, ...]],
        pace: Callable[[], None] | None = None,
    ) -> None:
        # The driver's executemany on plain tuples: no per-row dict or
        # statement compilation, and still SQLAlchemy's events and errors.
        # No pauses (`pace`): the transaction holds every writer of the file.
        params = list(rows)
        if params:
            placeholders = ", ".join("?" for _ in columns)
            conn.exec_driver_sql(f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES ({placeholders})", params)

    def _migration_lock(self) -> AbstractContextManager[None]:
        return nullcontext()  # the migration's write transaction (BEGIN IMMEDIATE) excludes other writers


_WAL_AUTOCHECKPOINT = 1000  # pages: SQLite's default, which the connections keep


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


def _lock_database_file(database: str) -> tuple[int, bool]:
    """An exclusive flock on the database file, created empty if missing (an
    empty file is an empty SQLite database). flock locks belong to the file
    (its inode), not to the path, and are independent of SQLite's own POSIX
    locks. Returns the descriptor to keep open, and whether this call
    created the file."""
    path = pathlib.Path(database).resolve()
    try:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _flock_holder(os.fstat(fd))
        os.close(fd)
        raise DatabaseInUse(
            f"SQLite database {path} is in use by another bots-server (pid {holder}); "
            "SQLite allows one server per file: stop the other one, or use PostgreSQL for several replicas"
        ) from None
    return fd, created


def _flock_holder(stat: os.stat_result) -> str:
    """The pid holding a flock on the file, from /proc/locks (Linux); "unknown" elsewhere."""
    inode = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
                    return fields[4]
    except OSError:
        pass
    return "unknown"
