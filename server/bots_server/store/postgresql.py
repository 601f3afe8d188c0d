"""The PostgreSQL dialect (psycopg 3): any number of replicas on one database,
bounded waits everywhere, COPY for bulk rows."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import URL, Connection, Engine

from bots_server.errors import Unavailable
from bots_server.store import schema as t
from bots_server.store.sql import SqlStore
from bots_server.store.sql_base import ROWS_PER_PACE
from bots_server.store.sql_statements import (
    ADVANCE_STEP,
    ADVANCE_STEP_SAME_POOL,
    BATCH_TASKS_VALUES,
    BATCH_VALUES,
    MARK_REPORTED,
    OUTCOMES_VALUES,
    SELECT_CHECKS,
    STEP_VALUES,
)

# pg_advisory_lock key ("bots" in ASCII): serializes schema upgrades, so that
# replicas starting together (or migrate init containers) do not race on DDL.
MIGRATION_LOCK_KEY = 0x626F7473
_LOCK_TENANT = sa.text("SELECT pg_advisory_xact_lock(:key)")


def tenant_lock_key(tenant: str) -> int:
    """The advisory lock key of `tenant`: a signed 64-bit hash of its name,
    the same in every process (unlike hash()) and in every release: replicas
    of two releases, in a rolling upgrade, must lock the same key. Two
    tenants sharing a key only take turns."""
    digest = hashlib.blake2b(tenant.encode(), digest_size=8, person=b"bots-tenant").digest()
    return int.from_bytes(digest, "big", signed=True)


class PostgresStore(SqlStore):
    """Calls fail fast instead of hanging: connecting, waiting for a pooled
    connection, statements and lock waits are bounded, and TCP keepalives and
    the TCP user timeout notice a database host that vanished. A database
    that hangs but keeps its connections open is noticed by the core's
    health check (core/database.py)."""

    def __init__(
        self,
        url: str | URL,
        *,
        connect_timeout_s: int = 5,
        statement_timeout_ms: int = 120_000,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        parsed = sa.make_url(url)
        super().__init__(parsed, _create_engine(parsed, connect_timeout_s, statement_timeout_ms), on_error)

    def _write_connection(self) -> Connection:
        # Writers of one experiment are serialized by its row (_lock_row and
        # the compare-and-set updates), not in this process.
        return self.engine.connect()

    @contextmanager
    def _unsynced_write(self) -> Iterator[Connection]:
        # An asynchronous commit: the checkpoint's final commit waits for the
        # WAL to be flushed up to it, these records included.
        with self._write() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            yield conn

    def _write_report(self, conn: Connection, values: Mapping[str, Any], same_pool: bool) -> tuple[int, int]:
        row = conn.execute(_REPORT_SAME_POOL if same_pool else _REPORT, values).one()
        return row.advanced, row.marked

    def _check_and_insert_batch(self, conn: Connection, values: Mapping[str, Any]) -> tuple[Any, bool]:
        return conn.execute(_CHECK_AND_INSERT_BATCH, values).one(), True

    def _ping(self, conn: Connection) -> None:
        # A standby answers reads but refuses every write the service makes:
        # it is not a database this server can serve from.
        if conn.exec_driver_sql("SHOW transaction_read_only").scalar() == "on":
            raise Unavailable("database is read-only (a standby?); every write would fail")

    def _lock_tenant(self, conn: Connection, tenant: str) -> None:
        # Released by the commit or rollback. A statement after it (READ
        # COMMITTED) sees what the lock's previous holder committed.
        conn.execute(_LOCK_TENANT, {"key": tenant_lock_key(tenant)})

    def _snapshot(self, conn: Connection) -> None:
        conn.execution_options(isolation_level="REPEATABLE READ")

    def _lock_row(self, query: sa.Select[Any]) -> sa.Select[Any]:
        return query.with_for_update()

    def _json(self, column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
        return sa.cast(column, sa.JSON)  # the column is TEXT: PostgreSQL's JSON operators need the cast

    def _bulk_insert(
        self,
        conn: Connection,
        table: sa.Table,
        columns: Sequence[str],
        rows: Iterable[tuple[Any, ...]],
        pace: Callable[[], None] | None = None,
    ) -> None:
        # Pauses between blocks hold only this transaction's own locks: other
        # experiments' writes go on meanwhile. Each block is a COPY of its own,
        # so that no one statement lasts as long as the pauses add up to.
        sql = f"COPY {table.name} ({', '.join(columns)}) FROM STDIN"
        remaining = iter(rows)
        blocks = [remaining] if pace is None else iter(lambda: list(itertools.islice(remaining, ROWS_PER_PACE)), [])
        for n, block in enumerate(blocks):
            if pace is not None and n:
                pace()
            with _copy(conn, sql) as copy:
                for row in block:
                    copy.write_row(row)

    @contextmanager
    def _migration_lock(self) -> Iterator[None]:
        with self.engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})")
            conn.commit()
            try:
                yield
            finally:
                # The lock belongs to the session, and pooled connections
                # outlive this call: release it explicitly.
                with suppress(exc.DBAPIError):
                    conn.exec_driver_sql(f"SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})")
                    conn.commit()


def _create_engine(url: URL, connect_timeout_s: int, statement_timeout_ms: int) -> Engine:
    return sa.create_engine(
        url,
        # No ping per checkout (a round trip per transaction): a dead
        # connection fails its call with Unavailable, which clients
        # retry, and the disconnect invalidates the whole pool.
        pool_pre_ping=False,
        pool_recycle=1800,
        pool_size=8,
        max_overflow=8,
        pool_timeout=connect_timeout_s,
        connect_args={
            "connect_timeout": connect_timeout_s,
            "options": f"-c statement_timeout={statement_timeout_ms} -c lock_timeout={statement_timeout_ms}",
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
            # Sent data unacknowledged this long (a dead network path): the
            # connection fails instead of waiting for TCP's many minutes.
            "tcp_user_timeout": 30_000,
        },
    )


@contextmanager
def _copy(conn: Connection, sql: str) -> Iterator[psycopg.Copy]:
    """A COPY in `conn`'s transaction, through the driver (SQLAlchemy has no
    COPY). Driver errors are wrapped as SQLAlchemy's (IntegrityError, ...),
    so they are translated like every other statement's."""
    driver = conn.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    try:
        with driver.cursor() as cursor, cursor.copy(sql) as copy:
            yield copy
    except psycopg.Error as e:
        raise exc.DBAPIError.instance(sql, None, e, psycopg.Error) from e


# A report's writes and a select's checks and writes in one statement each
# (data-modifying CTEs), rather than four and three round trips. Two
# statements, not one: the report's UPDATE takes the experiment's row lock,
# waiting for another replica's transaction if need be, and a statement
# reads with the snapshot it started with; the checks must see what that
# transaction committed, so they start after the lock is held.


def _insert_where(table: sa.Table, values: Mapping[str, sa.BindParameter[Any]], condition: Any) -> sa.Insert:
    """INSERT of one row of `values` if `condition` holds."""
    return table.insert().from_select(list(values), sa.select(*values.values()).where(condition))


def _report(advance: sa.Update) -> sa.Select[Any]:
    """SqlStore._write_report's statements as one: (advanced, marked); the
    step's rows are inserted only if the step advanced and the batch was marked."""
    advanced = advance.returning(t.experiments.c.id).cte("advanced")
    marked = MARK_REPORTED.where(sa.exists(advanced.select())).returning(t.batches.c.batch_id).cte("marked")
    is_marked = sa.exists(marked.select())
    return sa.select(
        sa.select(sa.func.count()).select_from(advanced).scalar_subquery().label("advanced"),
        sa.select(sa.func.count()).select_from(marked).scalar_subquery().label("marked"),
    ).add_cte(
        _insert_where(t.steps, STEP_VALUES, is_marked).cte("step"),
        _insert_where(t.step_outcomes, OUTCOMES_VALUES, is_marked).cte("outcomes"),
    )


_REPORT = _report(ADVANCE_STEP)
_REPORT_SAME_POOL = _report(ADVANCE_STEP_SAME_POOL)


def _check_and_insert_batch() -> sa.Select[Any]:
    """SqlStore._check_and_insert_batch's checks, with the batch inserted if
    its request key has none yet."""
    checks = SELECT_CHECKS.cte("checks")
    no_batch_yet = sa.exists(sa.select(checks.c.existing).where(checks.c.existing.is_(None)))
    inserted = _insert_where(t.batches, BATCH_VALUES, no_batch_yet).returning(t.batches.c.batch_id).cte("inserted")
    return (
        sa.select(checks)
        .add_cte(inserted)
        .add_cte(_insert_where(t.batch_task_lists, BATCH_TASKS_VALUES, sa.exists(inserted.select())).cte("tasks"))
    )


_CHECK_AND_INSERT_BATCH = _check_and_insert_batch()
