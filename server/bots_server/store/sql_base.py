"""What every part of the SQL store (sql.py) stands on: connections and
transactions, the translation of database errors, the schema, tenant
admission, and the hooks a dialect implements (sqlite.py, postgresql.py).

Database errors are translated here, in one place: connection loss, timeouts
and a locked SQLite file become `Unavailable` (retryable).
"""

from __future__ import annotations

import abc
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import URL, Connection, Engine

from bots_server.errors import Unavailable
from bots_server.store import revisions
from bots_server.store import schema as t
from bots_server.store.base import Store
from bots_server.store.errors import Abandoned, OverQuota
from bots_server.store.records import SchemaStatus, TenantLimits, TenantUsage
from bots_server.store.sql_statements import _STEP_AND_NUM_TASKS

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def _translate_errors(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (exc.OperationalError, exc.InterfaceError, exc.TimeoutError) as e:
            _count_error(args, e)
            raise Unavailable(f"database unavailable: {_first_line(e)}") from e
        except exc.DBAPIError as e:
            _count_error(args, e)
            if e.connection_invalidated:
                raise Unavailable(f"database connection lost: {_first_line(e)}") from e
            if getattr(e.orig, "sqlstate", None) == _READ_ONLY_SQLSTATE:
                raise Unavailable(f"database is read-only (a standby?): {_first_line(e)}") from e
            raise

    return wrapper


# PostgreSQL's read_only_sql_transaction: a write on a standby, e.g. behind an
# address that moved to one in a failover. Retryable: the primary returns.
_READ_ONLY_SQLSTATE = "25006"


def error_kind(e: exc.SQLAlchemyError) -> str:
    """A small fixed set of kinds, for the database error counter's label."""
    if isinstance(e, exc.TimeoutError):
        return "timeout"  # no pooled connection free in time
    if isinstance(e, exc.DBAPIError) and e.connection_invalidated:
        return "connection_lost"
    if isinstance(e, (exc.OperationalError, exc.InterfaceError)):
        return "unavailable"
    if isinstance(e, exc.IntegrityError):
        return "integrity"
    return "other"


def _count_error(args: tuple[object, ...], e: exc.SQLAlchemyError) -> None:
    on_error = getattr(args[0], "on_error", None) if args else None
    if on_error is not None:
        try:
            on_error(error_kind(e))
        except Exception:  # counting must never mask the database error
            log.exception("database error callback failed")


def _first_line(e: BaseException) -> str:
    return str(getattr(e, "orig", e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# Rows between two calls of a bulk write's `pace` (see _bulk_insert): about
# a millisecond of encoding or of the database's COPY (see core/priority.py).
ROWS_PER_PACE = 250


def in_blocks(fn: Callable[[T], R], items: Sequence[T], pace: Callable[[], None] | None) -> list[R]:
    """[fn(item) for item in items], calling `pace` between blocks of ROWS_PER_PACE."""
    blocks = (items[start : start + ROWS_PER_PACE] for start in range(0, len(items), ROWS_PER_PACE))
    return over_parts(fn, blocks, pace)


def over_parts(fn: Callable[[T], R], parts: Iterable[Sequence[T]], pace: Callable[[], None] | None) -> list[R]:
    """[fn(item) for each part's items], calling `pace` between parts."""
    out: list[R] = []
    for number, part in enumerate(parts):
        if pace is not None and number:
            pace()
        out += [fn(item) for item in part]
    return out


class SqlBase(Store):
    """Connections, transactions, schema, admission and the dialect hooks
    of SqlStore; the mixins of sql_experiments.py, sql_tasks.py and
    sql_batches.py build on it."""

    def __init__(self, url: URL, engine: Engine, on_error: Callable[[str], None] | None) -> None:
        self.url = url
        self.engine = engine
        self.on_error = on_error
        self._locked_step = self._lock_row(_STEP_AND_NUM_TASKS)

    @property
    def display_url(self) -> str:
        return self.url.render_as_string(hide_password=True)

    @contextmanager
    def _write(self, abandoned: Callable[[], bool] | None = None) -> Iterator[Connection]:
        """A write transaction; `abandoned` is asked last, just before the
        commit: if it says True, the transaction rolls back (Abandoned)."""
        with self._write_connection() as conn, conn.begin():
            yield conn
            if abandoned is not None and abandoned():
                raise Abandoned()

    def _unsynced_write(self) -> AbstractContextManager[Connection]:
        """A write transaction whose commit need not be durable on its own
        (checkpoint chunks, tasks rows written in parts): the later, durable
        commit that makes new rows current makes them durable too (the log
        is written in order), and rows whose removal a crash lost are
        removed again; so a dialect may skip the sync here."""
        return self._write()

    def _settle_unsynced(self) -> None:
        """Called after unsynced writes, holding no lock: work they left
        (SQLite: the WAL's copy into the database file)."""

    @contextmanager
    def _read(self, snapshot: bool = False) -> Iterator[Connection]:
        """A read transaction; `snapshot`: every statement sees the same
        snapshot (where the dialect must ask for it, it costs extra round
        trips, so only where statements must agree)."""
        with self.engine.connect() as conn:
            if snapshot:
                self._snapshot(conn)
            with conn.begin():
                yield conn

    def close(self) -> None:
        self.engine.dispose()

    # -- schema -----------------------------------------------------------

    @_translate_errors
    def migrate(self, revision: str = "head") -> list[str]:
        with self._migration_lock(), self._write() as conn:
            return revisions.upgrade(conn, revision)

    @_translate_errors
    def schema_status(self) -> SchemaStatus:
        with self._read() as conn:
            return revisions.status(conn)

    @_translate_errors
    def ping(self) -> None:
        with self.engine.connect() as conn:
            self._ping(conn)

    def _ping(self, conn: Connection) -> None:
        conn.exec_driver_sql("SELECT 1")

    # -- tenant admission -------------------------------------------------

    def _admit(self, conn: Connection, limits: TenantLimits | None, *, new_experiment: bool, tasks: int) -> None:
        """At the start of a write that adds an experiment (`new_experiment`)
        and `tasks` tasks to `limits.tenant`: take the tenant's lock, held to
        the commit, and raise OverQuota if the write would take the tenant
        past `limits` (see the contract's module docstring)."""
        if limits is None or (limits.max_experiments is None and limits.max_tasks is None):
            return
        self._lock_tenant(conn, limits.tenant)
        usage = _tenant_usage(conn, limits.tenant)
        if (
            new_experiment and limits.max_experiments is not None and usage.experiments + 1 > limits.max_experiments
        ) or (limits.max_tasks is not None and usage.tasks + tasks > limits.max_tasks):
            raise OverQuota(usage)

    # -- dialect hooks ---------------------------------------------------------

    @abc.abstractmethod
    def _write_connection(self) -> AbstractContextManager[Connection]:
        """A connection for one write transaction, which _write begins: the
        dialect queues or locks writers as the database needs."""

    @abc.abstractmethod
    def _lock_tenant(self, conn: Connection, tenant: str) -> None:
        """Lock `tenant` until `conn`'s write transaction ends: what
        serializes the writes that check its limits (_admit), across
        replicas."""

    @abc.abstractmethod
    def _snapshot(self, conn: Connection) -> None:
        """Make the transaction `conn` begins next see one snapshot in every
        statement."""

    @abc.abstractmethod
    def _lock_row(self, query: sa.Select[Any]) -> sa.Select[Any]:
        """`query`, made to hold the rows it reads locked until the write
        transaction ends: what serializes selects and reports of one
        experiment across replicas."""

    @abc.abstractmethod
    def _json(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        """A TEXT column holding JSON, as SQLAlchemy's JSON type (to index
        into it in SQL)."""

    @abc.abstractmethod
    def _bulk_insert(
        self,
        conn: Connection,
        table: sa.Table,
        columns: Sequence[str],
        rows: Iterable[tuple[Any, ...]],
        pace: Callable[[], None] | None = None,
    ) -> None:
        """Insert many rows, fast, in `conn`'s transaction. Driver errors
        surface as SQLAlchemy's (IntegrityError, ...), as those of statements
        run through SQLAlchemy do. `pace`, if given, may be called between
        blocks of rows where the database lets others write meanwhile."""

    @abc.abstractmethod
    def _migration_lock(self) -> AbstractContextManager[None]:
        """Held around a migration, so that concurrent migrators take turns."""


_TENANT_USAGE = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(t.experiments.c.num_tasks), 0)).where(
    t.experiments.c.tenant == sa.bindparam("tenant")
)


def _tenant_usage(conn: Connection, tenant: str) -> TenantUsage:
    experiments, tasks = conn.execute(_TENANT_USAGE, {"tenant": tenant}).one()
    return TenantUsage(int(experiments), int(tasks))
