"""The SQL store: every read and write of the service, one transaction each.

Database errors are translated here, in one place: connection loss, timeouts
and a locked SQLite file become `Unavailable` (retryable); constraint
violations become domain errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import functools
import itertools
import json
import logging
import os
import pathlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, ParamSpec, TypeVar

import numpy as np
import sqlalchemy as sa
from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine

from bots_server.core.domain import ExperimentConfig
from bots_server.errors import AlreadyExists, Unavailable
from bots_server.store import schema as t
from bots_server.store.records import (
    BatchRow,
    CheckpointRow,
    ExperimentCopy,
    ExperimentRow,
    LoadedRows,
    Lookup,
    StepEvent,
)

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

_CONFIG_COLUMNS = tuple(f.name for f in dataclasses.fields(ExperimentConfig))
_MIGRATIONS = pathlib.Path(__file__).parent / "migrations"


class StaleStep(Exception):
    """The experiment moved on (another replica or a racing call): re-read and retry."""


class BatchAlreadyReported(Exception):
    """A concurrent report of the same batch committed first."""


class LeaseConflict(Exception):
    """Another writer leased some of the chosen tasks first: choose again."""


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
            raise

    return wrapper


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
        except Exception:  # noqa: BLE001 - counting must never mask the database error
            log.exception("database error callback failed")


def _first_line(e: BaseException) -> str:
    return str(getattr(e, "orig", e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _lock_sqlite_file(database: str) -> IO[str]:
    path = pathlib.Path(database).resolve()
    lock = open(f"{path}.lock", "a+")
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


def _utc(value: dt.datetime) -> dt.datetime:
    """SQLite returns naive datetimes; every stored time is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)


class DatabaseInUse(Exception):
    """Another server process holds this SQLite file."""


class Store:
    """All SQL of the service.

    `exclusive`: on SQLite, hold an advisory lock on FILE.lock for the store's
    life, so a second server on the same file fails with a clear error instead
    of two writers caching diverging state. `on_error(kind)` is called for every
    database error a method raises (kinds: see error_kind); the server counts
    them in a metric.
    """

    def __init__(
        self,
        url: str,
        *,
        exclusive: bool = False,
        busy_timeout_ms: int = 10_000,
        connect_timeout_s: int = 5,
        statement_timeout_ms: int = 120_000,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.on_error = on_error
        self.url = sa.make_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        self._lock_file: IO[str] | None = None
        if exclusive and self.is_sqlite and self.url.database not in (None, "", ":memory:"):
            self._lock_file = _lock_sqlite_file(str(self.url.database))
        self.engine = self._create_engine(busy_timeout_ms, connect_timeout_s, statement_timeout_ms)
        self._sqlite_writer: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if self.is_sqlite else contextlib.nullcontext()
        )

    def _create_engine(self, busy_timeout_ms: int, connect_timeout_s: int, statement_timeout_ms: int) -> Engine:
        if not self.is_sqlite:
            # Fail fast instead of hanging: bounded connect, statement and lock
            # waits, and TCP keepalives to notice a database host that vanished.
            return sa.create_engine(
                self.url,
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
                },
            )
        engine = sa.create_engine(self.url, connect_args={"timeout": busy_timeout_ms / 1000, "check_same_thread": False})

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

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        # SQLite has one writer at a time; queueing this process's writers on a
        # lock is fairer and faster than SQLite's sleeping busy handler.
        with self._sqlite_writer, self.engine.connect() as conn:
            conn.execution_options(write=True)
            with conn.begin():
                yield conn

    @contextmanager
    def _read(self, snapshot: bool = False) -> Iterator[Connection]:
        """A read transaction; `snapshot`: every statement sees the same
        snapshot on PostgreSQL too (REPEATABLE READ, which costs extra round
        trips to set and reset, so only where statements must agree)."""
        with self.engine.connect() as conn:
            if snapshot and not self.is_sqlite:
                conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn

    def close(self) -> None:
        self.engine.dispose()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock
            self._lock_file = None

    # -- schema -----------------------------------------------------------

    @_translate_errors
    def migrate(self, revision: str = "head") -> None:
        """Create or upgrade the schema with the Alembic migrations."""
        config = AlembicConfig()
        config.set_main_option("script_location", str(_MIGRATIONS))
        with self._write() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, revision)

    @_translate_errors
    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    # -- experiments ----------------------------------------------------

    @_translate_errors
    def create_experiment(self, name: str, config: ExperimentConfig, now: dt.datetime) -> ExperimentRow:
        values = {c: getattr(config, c) for c in _CONFIG_COLUMNS}
        try:
            with self._write() as conn:
                experiment_id = conn.execute(
                    t.experiments.insert().values(name=name, step=0, num_tasks=0, create_time=now, **values)
                ).inserted_primary_key[0]
                conn.execute(
                    t.checkpoints.insert().values(
                        experiment_id=experiment_id, step=0, num_tasks=0, capability=None, create_time=now
                    )
                )
        except exc.IntegrityError as e:
            raise AlreadyExists(f"experiment {name!r} already exists") from e
        return ExperimentRow(experiment_id, name, config, 0, 0, None, now)

    @_translate_errors
    def create_copy(self, copy: ExperimentCopy, now: dt.datetime) -> ExperimentRow:
        """A new experiment starting at a given posterior and step, in one
        transaction: its tasks, a checkpoint at that step, no events yet."""
        values = {c: getattr(copy.config, c) for c in _CONFIG_COLUMNS}
        n = len(copy.alpha)
        try:
            with self._write() as conn:
                experiment_id = conn.execute(
                    t.experiments.insert().values(
                        name=copy.name,
                        step=copy.step,
                        num_tasks=n,
                        create_time=now,
                        forked_from=copy.forked_from,
                        forked_at_step=copy.step,
                        **values,
                    )
                ).inserted_primary_key[0]
                if copy.source_id is not None:
                    conn.execute(
                        t.tasks.insert().from_select(
                            ["experiment_id", "task_idx", "key", "features"],
                            sa.select(sa.literal(experiment_id), t.tasks.c.task_idx, t.tasks.c.key, t.tasks.c.features)
                            .where(t.tasks.c.experiment_id == copy.source_id, t.tasks.c.task_idx < n),
                        )
                    )
                else:
                    assert copy.keys is not None and copy.features is not None
                    rows = ((experiment_id, i, k, json.dumps(f)) for i, (k, f) in enumerate(zip(copy.keys, copy.features)))
                    self._bulk_insert(conn, t.tasks, ("experiment_id", "task_idx", "key", "features"), rows)
                conn.execute(
                    t.checkpoints.insert().values(
                        experiment_id=experiment_id, step=copy.step, num_tasks=n, capability=copy.capability, create_time=now
                    )
                )
                alpha, beta = np.asarray(copy.alpha, dtype=np.float64), np.asarray(copy.beta, dtype=np.float64)
                if alpha.shape != beta.shape:
                    raise ValueError(f"{len(alpha)} alpha values but {len(beta)} beta values")
                self._insert_posteriors(conn, experiment_id, alpha, beta)
        except exc.IntegrityError as e:
            if self._name_taken(copy.name):
                raise AlreadyExists(f"experiment {copy.name!r} already exists") from e
            raise
        return ExperimentRow(
            experiment_id, copy.name, copy.config, copy.step, n, copy.capability, now, copy.forked_from, copy.step
        )

    def _name_taken(self, name: str) -> bool:
        with self._read() as conn:
            return conn.execute(sa.select(t.experiments.c.id).where(t.experiments.c.name == name)).first() is not None

    @_translate_errors
    def find_experiment(self, name: str) -> ExperimentRow | None:
        with self._read() as conn:
            row = conn.execute(_EXPERIMENTS.where(t.experiments.c.name == name)).one_or_none()
        return None if row is None else _experiment_row(row)

    @_translate_errors
    def list_experiments(self, after_name: str, limit: int) -> list[ExperimentRow]:
        query = _EXPERIMENTS.where(t.experiments.c.name > after_name).order_by(t.experiments.c.name)
        with self._read() as conn:
            return [_experiment_row(r) for r in conn.execute(query.limit(limit))]

    @_translate_errors
    def delete_experiment(self, experiment_id: int) -> bool:
        with self._write() as conn:
            for table in (t.batch_tasks, t.batches, t.outcomes, t.steps, t.posteriors, t.checkpoints, t.tasks):
                conn.execute(table.delete().where(table.c.experiment_id == experiment_id))
            deleted = conn.execute(t.experiments.delete().where(t.experiments.c.id == experiment_id)).rowcount
        return deleted == 1

    @_translate_errors
    def count_open_batches(self, experiment_id: int, now: dt.datetime) -> int:
        with self._read() as conn:
            return conn.execute(
                sa.select(sa.func.count()).select_from(t.batches).where(_open_batch(experiment_id, now))
            ).scalar_one()

    # -- tasks and state --------------------------------------------------

    @_translate_errors
    def add_tasks(
        self, experiment_id: int, expected_num_tasks: int, keys: Sequence[str], features: Sequence[dict[str, float]]
    ) -> int:
        """Append tasks at indices expected_num_tasks.. in one transaction.

        Raises StaleStep if another writer added tasks first, AlreadyExists
        naming up to 5 keys the experiment already has.
        """
        total = expected_num_tasks + len(keys)
        try:
            with self._write() as conn:
                updated = conn.execute(
                    t.experiments.update()
                    .where(t.experiments.c.id == experiment_id, t.experiments.c.num_tasks == expected_num_tasks)
                    .values(num_tasks=total)
                ).rowcount
                if updated != 1:
                    raise StaleStep()
                rows = (
                    (experiment_id, expected_num_tasks + i, key, json.dumps(f))
                    for i, (key, f) in enumerate(zip(keys, features, strict=True))
                )
                self._bulk_insert(conn, t.tasks, ("experiment_id", "task_idx", "key", "features"), rows)
        except exc.IntegrityError as e:
            existing = self._existing_keys(experiment_id, keys, limit=5)
            raise AlreadyExists(f"task keys already in the experiment: {existing}") from e
        return total

    def _existing_keys(self, experiment_id: int, keys: Sequence[str], limit: int) -> list[str]:
        found: list[str] = []
        with self._read() as conn:
            for start in range(0, len(keys), 500):
                chunk = list(keys[start : start + 500])
                query = sa.select(t.tasks.c.key).where(t.tasks.c.experiment_id == experiment_id, t.tasks.c.key.in_(chunk))
                found.extend(conn.execute(query).scalars())
                if len(found) >= limit:
                    break
        return found[:limit]

    def _bulk_insert(self, conn: Connection, table: sa.Table, columns: Sequence[str], rows: Any) -> None:
        """Insert many rows fast: COPY on PostgreSQL, executemany on SQLite.

        Driver errors are wrapped as SQLAlchemy's (IntegrityError, ...), as
        statements run through SQLAlchemy are.
        """
        names = ", ".join(columns)
        driver_error = self.engine.dialect.loaded_dbapi.Error
        try:
            if self.is_sqlite:
                sql = f"INSERT INTO {table.name} ({names}) VALUES ({', '.join('?' for _ in columns)})"
                params = list(rows)
                if params:
                    conn.exec_driver_sql(sql, params)  # executemany, in SQLAlchemy's view (events, errors)
                return
            sql = f"COPY {table.name} ({names}) FROM STDIN"
            with conn.connection.driver_connection.cursor() as cursor, cursor.copy(sql) as copy:
                for row in rows:
                    copy.write_row(row)
        except driver_error as e:
            raise exc.DBAPIError.instance(sql, None, e, driver_error) from e

    @_translate_errors
    def load(
        self, experiment_id: int, *, after_step: int | None = None, first_task: int = 0, lookup: Lookup | None = None
    ) -> LoadedRows | None:
        """Rows to rebuild or catch up an experiment, read in one consistent
        snapshot, plus what `lookup` asks for.

        after_step None: the last checkpoint and every event after it (a full
        rebuild). Otherwise only tasks from `first_task` and events after
        `after_step` (catching up a cached copy). None if the experiment is gone.
        """
        # A rebuild reads the checkpoint and the events after it: one snapshot.
        # Catching up reads append-only rows bounded by the experiment row.
        with self._read(snapshot=after_step is None) as conn:
            row = conn.execute(_EXPERIMENTS.where(t.experiments.c.id == experiment_id)).one_or_none()
            if row is None:
                return None
            experiment = _experiment_row(row)
            checkpoint = None
            if after_step is None:
                checkpoint = self._read_checkpoint(conn, experiment_id)
                after_step = checkpoint.step
            keys: list[str] = []
            weak: list[float | None] = []
            strong: list[float | None] = []
            if first_task < experiment.num_tasks:
                # Only the two reference features are needed: extracted in SQL,
                # without decoding every task's JSON in Python.
                config = experiment.config
                query = (
                    sa.select(t.tasks.c.key, self._feature(config.weak_feature), self._feature(config.strong_feature))
                    .where(
                        t.tasks.c.experiment_id == experiment_id,
                        t.tasks.c.task_idx >= first_task,
                        t.tasks.c.task_idx < experiment.num_tasks,
                    )
                    .order_by(t.tasks.c.task_idx)
                )
                for key, w, s in conn.execute(query):
                    keys.append(key)
                    weak.append(w)
                    strong.append(s)
            events = self._read_events(conn, experiment_id, after_step, experiment.step)
            batch = leased = None
            if lookup is not None:
                if lookup.batch_id:
                    batch = self._find_batch(conn, experiment_id, t.batches.c.batch_id == lookup.batch_id)
                elif lookup.request_key:
                    batch = self._find_batch(conn, experiment_id, t.batches.c.request_key == lookup.request_key)
                if lookup.leases_at is not None:
                    leased = list(conn.execute(_leased_tasks(experiment_id, lookup.leases_at)).scalars())
        return LoadedRows(experiment, keys, weak, strong, checkpoint, events, batch, leased)

    def _feature(self, name: str) -> Any:
        """A task feature as a float column (NULL where missing)."""
        if not name:
            return sa.null()
        features = t.tasks.c.features
        as_json = sa.type_coerce(features, sa.JSON) if self.is_sqlite else sa.cast(features, sa.JSON)
        return as_json[name].as_float()

    @_translate_errors
    def load_features(self, experiment_id: int, num_tasks: int) -> list[dict[str, float]]:
        """The features of tasks 0..num_tasks-1, in task order."""
        query = (
            sa.select(t.tasks.c.features)
            .where(t.tasks.c.experiment_id == experiment_id, t.tasks.c.task_idx < num_tasks)
            .order_by(t.tasks.c.task_idx)
        )
        with self._read() as conn:
            return [json.loads(f) for f in conn.execute(query).scalars()]

    def _read_checkpoint(self, conn: Connection, experiment_id: int) -> CheckpointRow:
        meta = conn.execute(sa.select(t.checkpoints).where(t.checkpoints.c.experiment_id == experiment_id)).one()
        rows = conn.execute(
            sa.select(t.posteriors.c.alpha, t.posteriors.c.beta)
            .where(t.posteriors.c.experiment_id == experiment_id)
            .order_by(t.posteriors.c.task_idx)
        ).all()
        if len(rows) != meta.num_tasks:
            raise RuntimeError(f"checkpoint of experiment {experiment_id} has {len(rows)} rows, expected {meta.num_tasks}")
        return CheckpointRow(
            step=meta.step,
            capability=meta.capability,
            alpha=[r[0] for r in rows],
            beta=[r[1] for r in rows],
            create_time=_utc(meta.create_time),
        )

    def _read_events(self, conn: Connection, experiment_id: int, after_step: int, until_step: int) -> list[StepEvent]:
        """Events of steps after_step+1 .. until_step, ascending."""
        if after_step >= until_step:
            return []
        step_rows = conn.execute(
            sa.select(t.steps)
            .where(t.steps.c.experiment_id == experiment_id, t.steps.c.step > after_step, t.steps.c.step <= until_step)
            .order_by(t.steps.c.step)
        ).all()
        outcome_rows = conn.execute(
            sa.select(t.outcomes.c.step, t.outcomes.c.task_idx, t.outcomes.c.successes, t.outcomes.c.trials)
            .where(
                t.outcomes.c.experiment_id == experiment_id,
                t.outcomes.c.step > after_step,
                t.outcomes.c.step <= until_step,
            )
            .order_by(t.outcomes.c.step, t.outcomes.c.task_idx)
        ).all()
        by_step: dict[int, list[Any]] = {}
        for r in outcome_rows:
            by_step.setdefault(r.step, []).append(r)
        return [_step_event(s, by_step.get(s.step, [])) for s in step_rows]

    @_translate_errors
    def read_event(self, experiment_id: int, step: int) -> StepEvent:
        with self._read() as conn:
            return self._read_events(conn, experiment_id, step - 1, step)[0]

    @_translate_errors
    def write_checkpoint(
        self,
        experiment_id: int,
        step: int,
        capability: float | None,
        alpha: np.ndarray,
        beta: np.ndarray,
        now: dt.datetime,
    ) -> bool:
        """Replace the experiment's posterior rows with the state at `step`.

        False (and nothing written) if a checkpoint at or after `step` exists:
        the checkpoint row is updated first, which also serializes writers.
        """
        with self._write() as conn:
            updated = conn.execute(
                t.checkpoints.update()
                .where(t.checkpoints.c.experiment_id == experiment_id, t.checkpoints.c.step < step)
                .values(step=step, num_tasks=len(alpha), capability=capability, create_time=now)
            ).rowcount
            if updated != 1:
                return False
            conn.execute(t.posteriors.delete().where(t.posteriors.c.experiment_id == experiment_id))
            self._insert_posteriors(conn, experiment_id, np.asarray(alpha), np.asarray(beta))
        return True

    def _insert_posteriors(self, conn: Connection, experiment_id: int, alpha: np.ndarray, beta: np.ndarray) -> None:
        """All (task_idx, alpha, beta) rows of an experiment. On PostgreSQL a
        binary COPY encoded in one pass (no per-row Python): a million rows in
        well under a second."""
        if self.is_sqlite:
            rows = zip(itertools.repeat(experiment_id), range(len(alpha)), alpha.tolist(), beta.tolist())
            self._bulk_insert(conn, t.posteriors, ("experiment_id", "task_idx", "alpha", "beta"), rows)
            return
        n = len(alpha)
        rows = np.empty(n, dtype=_PG_POSTERIOR_ROW)
        rows["fields"] = 4
        rows["experiment_id_len"], rows["experiment_id"] = 4, experiment_id
        rows["task_idx_len"], rows["task_idx"] = 8, np.arange(n)
        rows["alpha_len"], rows["alpha"] = 8, alpha
        rows["beta_len"], rows["beta"] = 8, beta
        sql = "COPY posteriors (experiment_id, task_idx, alpha, beta) FROM STDIN (FORMAT BINARY)"
        try:
            with conn.connection.driver_connection.cursor() as cursor, cursor.copy(sql) as copy:
                copy.write(_PG_COPY_HEADER + rows.tobytes() + _PG_COPY_TRAILER)
        except self.engine.dialect.loaded_dbapi.Error as e:
            raise exc.DBAPIError.instance(sql, None, e, self.engine.dialect.loaded_dbapi.Error) from e

    # -- batches and reports --------------------------------------------------

    @_translate_errors
    def find_batch(self, experiment_id: int, *, batch_id: str = "", request_key: str = "") -> BatchRow | None:
        condition = t.batches.c.batch_id == batch_id if batch_id else t.batches.c.request_key == request_key
        with self._read() as conn:
            return self._find_batch(conn, experiment_id, condition)

    def _find_batch(self, conn: Connection, experiment_id: int, condition: Any) -> BatchRow | None:
        row = conn.execute(
            sa.select(t.batches).where(t.batches.c.experiment_id == experiment_id, condition)
        ).one_or_none()
        if row is None:
            return None
        task_idx = conn.execute(
            sa.select(t.batch_tasks.c.task_idx)
            .where(t.batch_tasks.c.experiment_id == experiment_id, t.batch_tasks.c.batch_id == row.batch_id)
            .order_by(t.batch_tasks.c.position)
        ).scalars()
        return BatchRow(
            batch_id=row.batch_id,
            request_key=row.request_key,
            step=row.step,
            task_idx=list(task_idx),
            create_time=_utc(row.create_time),
            lease_expire_time=_utc(row.lease_expire_time),
            reported_step=row.reported_step,
        )

    @_translate_errors
    def leased_tasks(self, experiment_id: int, now: dt.datetime) -> list[int]:
        """Tasks in open batches: not reported, lease not expired."""
        with self._read() as conn:
            return list(conn.execute(_leased_tasks(experiment_id, now)).scalars())

    @_translate_errors
    def insert_batch(self, experiment_id: int, batch: BatchRow, now: dt.datetime) -> BatchRow:
        """Store a batch chosen at step `batch.step`, atomically with its checks.

        The experiment row is locked (serializing selects and reports across
        replicas); if the step moved on, StaleStep; if a task was leased by
        another batch meanwhile, LeaseConflict. If a batch with the same
        request key exists (a racing call), that one is returned instead.
        """
        with self._write() as conn:
            step = conn.execute(self._lock_experiment(experiment_id)).scalar_one_or_none()
            existing = self._find_batch(conn, experiment_id, t.batches.c.request_key == batch.request_key)
            if existing is not None:
                return existing
            if step != batch.step:
                raise StaleStep()
            chosen = set(batch.task_idx)
            if any(idx in chosen for idx in conn.execute(_leased_tasks(experiment_id, now)).scalars()):
                raise LeaseConflict()
            conn.execute(
                t.batches.insert().values(
                    experiment_id=experiment_id,
                    batch_id=batch.batch_id,
                    request_key=batch.request_key,
                    step=batch.step,
                    batch_size=len(batch.task_idx),
                    create_time=batch.create_time,
                    lease_expire_time=batch.lease_expire_time,
                    reported_step=None,
                )
            )
            rows = ((experiment_id, batch.batch_id, i, idx) for i, idx in enumerate(batch.task_idx))
            self._bulk_insert(conn, t.batch_tasks, ("experiment_id", "batch_id", "position", "task_idx"), rows)
        return batch

    def _lock_experiment(self, experiment_id: int) -> sa.Select[Any]:
        """SELECT the step, locking the row on PostgreSQL (SQLite's BEGIN
        IMMEDIATE already holds the database's single write lock)."""
        query = sa.select(t.experiments.c.step).where(t.experiments.c.id == experiment_id)
        return query if self.is_sqlite else query.with_for_update()

    @_translate_errors
    def commit_report(self, experiment_id: int, expected_step: int, event: StepEvent, now: dt.datetime) -> None:
        """Append one step's event and advance the experiment, atomically.

        The step is a compare-and-set: StaleStep if the experiment is no longer
        at `expected_step` (another writer got there first; nothing written).
        BatchAlreadyReported if the batch was reported meanwhile.
        """
        with self._write() as conn:
            advanced = conn.execute(
                t.experiments.update()
                .where(t.experiments.c.id == experiment_id, t.experiments.c.step == expected_step)
                .values(step=event.step)
            ).rowcount
            if advanced != 1:
                raise StaleStep()
            marked = conn.execute(
                t.batches.update()
                .where(
                    t.batches.c.experiment_id == experiment_id,
                    t.batches.c.batch_id == event.batch_id,
                    t.batches.c.reported_step.is_(None),
                )
                .values(reported_step=event.step)
            ).rowcount
            if marked != 1:
                raise BatchAlreadyReported()  # rolls the step back too
            conn.execute(
                t.steps.insert().values(
                    experiment_id=experiment_id,
                    step=event.step,
                    batch_id=event.batch_id,
                    pool_size=event.pool_size,
                    capability=event.capability,
                    capability_estimate=event.capability_estimate,
                    create_time=now,
                )
            )
            rows = (
                (experiment_id, event.step, i, s, n)
                for i, s, n in zip(event.task_idx, event.successes, event.trials, strict=True)
            )
            self._bulk_insert(conn, t.outcomes, ("experiment_id", "step", "task_idx", "successes", "trials"), rows)


# Experiments with the capability after their latest step (NULL before any).
_EXPERIMENTS = sa.select(t.experiments, t.steps.c.capability).outerjoin(
    t.steps, sa.and_(t.steps.c.experiment_id == t.experiments.c.id, t.steps.c.step == t.experiments.c.step)
)


# PostgreSQL's binary COPY format: a header, per row a field count and
# (length, big-endian value) per field, and a trailer.
_PG_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
_PG_COPY_TRAILER = (-1).to_bytes(2, "big", signed=True)
_PG_POSTERIOR_ROW = np.dtype(
    [
        ("fields", ">i2"),
        ("experiment_id_len", ">i4"),
        ("experiment_id", ">i4"),
        ("task_idx_len", ">i4"),
        ("task_idx", ">i8"),
        ("alpha_len", ">i4"),
        ("alpha", ">f8"),
        ("beta_len", ">i4"),
        ("beta", ">f8"),
    ]
)


def _leased_tasks(experiment_id: int, now: dt.datetime) -> sa.Select[Any]:
    """Tasks of open batches. An IN over the open batches (ix_batches_open),
    so its cost follows the open batches, not every batch ever selected."""
    open_batches = sa.select(t.batches.c.batch_id).where(_open_batch(experiment_id, now))
    return sa.select(t.batch_tasks.c.task_idx).where(
        t.batch_tasks.c.experiment_id == experiment_id, t.batch_tasks.c.batch_id.in_(open_batches)
    )


def _open_batch(experiment_id: int, now: dt.datetime) -> Any:
    return sa.and_(
        t.batches.c.experiment_id == experiment_id,
        t.batches.c.reported_step.is_(None),
        t.batches.c.lease_expire_time > now,
    )


def _experiment_row(row: Any) -> ExperimentRow:
    config = ExperimentConfig(**{c: getattr(row, c) for c in _CONFIG_COLUMNS})
    return ExperimentRow(
        row.id,
        row.name,
        config,
        row.step,
        row.num_tasks,
        row.capability,
        _utc(row.create_time),
        row.forked_from,
        row.forked_at_step,
    )


def _step_event(step_row: Any, outcome_rows: list[Any]) -> StepEvent:
    return StepEvent(
        step=step_row.step,
        batch_id=step_row.batch_id,
        pool_size=step_row.pool_size,
        task_idx=[r.task_idx for r in outcome_rows],
        successes=[r.successes for r in outcome_rows],
        trials=[r.trials for r in outcome_rows],
        capability=step_row.capability,
        capability_estimate=step_row.capability_estimate,
    )
