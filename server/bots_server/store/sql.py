"""The store in SQLAlchemy Core, shared by the SQLite and PostgreSQL dialects.

Every method is one transaction. What differs between the two databases goes
through the hook methods at the end of SqlStore, implemented in sqlite.py and
postgresql.py; nothing here depends on either.

Database errors are translated here, in one place: connection loss, timeouts
and a locked SQLite file become `Unavailable` (retryable); constraint
violations become domain errors.
"""

from __future__ import annotations

import abc
import datetime as dt
import functools
import json
import logging
import secrets
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import URL, Connection, Engine

from bots_server.errors import AlreadyExists, Unavailable
from bots_server.store import pieces, revisions
from bots_server.store import schema as t
from bots_server.store.base import Store
from bots_server.store.errors import (
    Abandoned,
    BatchAlreadyReported,
    LeaseConflict,
    OverQuota,
    RequestKeyTaken,
    StaleStep,
)
from bots_server.store.records import (
    DEFAULT_TENANT,
    BatchRow,
    CheckpointRow,
    Compacted,
    ExperimentCopy,
    ExperimentRow,
    LoadedRows,
    Lookup,
    PoolEvent,
    RetirementEvent,
    SchemaStatus,
    SharesEvent,
    StepEvent,
    TenantLimits,
    TenantUsage,
)

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


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
        except Exception:  # counting must never mask the database error
            log.exception("database error callback failed")


def _first_line(e: BaseException) -> str:
    return str(getattr(e, "orig", e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _utc(value: dt.datetime) -> dt.datetime:
    """SQLite returns naive datetimes; every stored time is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


class SqlStore(Store):
    """All SQL of the service, over an engine a dialect configured.

    `engine` is public for tests, benchmarks and tooling that read the tables
    directly; the core uses the Store methods only. `on_error(kind)` is
    called for every database error a method raises (kinds: see error_kind).
    """

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

    def _chunk_write(self) -> AbstractContextManager[Connection]:
        """A write transaction adding or removing checkpoint chunks. Its
        commit need not be durable on its own: the later, durable commit that
        makes new chunks current makes them durable too (the log is written
        in order), and stale chunks lost in a crash are removed again; so a
        dialect may skip the sync here."""
        return self._write()

    def _settle_chunks(self) -> None:
        """Called after a checkpoint's chunks are written, before they are
        made current, holding no lock: work their writes left (SQLite: the
        WAL's copy into the database file)."""

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
    def migrate(self, revision: str = "head") -> None:
        with self._migration_lock(), self._write() as conn:
            revisions.upgrade(conn, revision)

    @_translate_errors
    def schema_status(self) -> SchemaStatus:
        with self._read() as conn:
            return revisions.status(conn)

    @_translate_errors
    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    # -- experiments ----------------------------------------------------

    @_translate_errors
    def create_experiment(
        self,
        name: str,
        config: Mapping[str, Any],
        now: dt.datetime,
        tenant: str = DEFAULT_TENANT,
        abandoned: Callable[[], bool] | None = None,
        *,
        limits: TenantLimits | None = None,
    ) -> ExperimentRow:
        try:
            with self._write(abandoned) as conn:
                self._admit(conn, limits, new_experiment=True, tasks=0)
                experiment_id = _insert_experiment(
                    conn, name=name, tenant=tenant, step=0, num_tasks=0, create_time=now, config=_config_json(config)
                )
                conn.execute(
                    t.checkpoints.insert().values(experiment_id=experiment_id, step=0, num_tasks=0, create_time=now)
                )
        except exc.IntegrityError as e:
            raise AlreadyExists(f"experiment {name!r} already exists") from e
        return ExperimentRow(experiment_id, name, config, 0, 0, None, now)

    @_translate_errors
    def create_copy(
        self,
        copy: ExperimentCopy,
        now: dt.datetime,
        abandoned: Callable[[], bool] | None = None,
        *,
        limits: TenantLimits | None = None,
    ) -> ExperimentRow:
        n = copy.num_tasks
        try:
            with self._write(abandoned) as conn:
                self._admit(conn, limits, new_experiment=True, tasks=n)
                experiment_id = _insert_experiment(
                    conn,
                    name=copy.name,
                    tenant=copy.tenant,
                    step=copy.step,
                    num_tasks=n,
                    create_time=now,
                    forked_from=copy.forked_from,
                    forked_at_step=copy.step,
                    config=_config_json(copy.config),
                )
                if copy.source_id is not None:
                    conn.execute(
                        t.tasks.insert().from_select(
                            ["experiment_id", "task_idx", "key", "features", "group_name"],
                            sa.select(
                                sa.literal(experiment_id),
                                t.tasks.c.task_idx,
                                t.tasks.c.key,
                                t.tasks.c.features,
                                t.tasks.c.group_name,
                            )
                            .where(t.tasks.c.experiment_id == copy.source_id, t.tasks.c.task_idx < n),
                        )
                    )
                else:
                    assert copy.keys is not None and copy.features is not None
                    groups = copy.groups or [""] * len(copy.keys)
                    rows = (
                        (experiment_id, i, k, json.dumps(f), g or None)
                        for i, (k, f, g) in enumerate(zip(copy.keys, copy.features, groups, strict=True))
                    )
                    self._bulk_insert(conn, t.tasks, _TASK_COLUMNS, rows)
                self._copy_key_blocks(conn, experiment_id, copy)
                version, size = _new_version(), pieces.chunk_bytes(copy.state)
                conn.execute(
                    t.checkpoints.insert().values(
                        experiment_id=experiment_id,
                        step=copy.step,
                        num_tasks=n,
                        create_time=now,
                        version=version,
                        chunk_bytes=size,
                    )
                )
                for seq, data in enumerate(pieces.chunks(copy.state, size)):
                    _insert_chunk(conn, experiment_id, version, seq, copy.step, data)
                if len(copy.retired):
                    retired = ((experiment_id, 1, int(i), True, copy.step, now) for i in sorted(copy.retired))
                    self._bulk_insert(conn, t.retirements, _RETIREMENT_COLUMNS, retired)
                if copy.shares:
                    seq = 2 if len(copy.retired) else 1
                    conn.execute(
                        t.group_shares.insert().values(
                            experiment_id=experiment_id, seq=seq, shares=_shares_json(copy.shares), step=copy.step,
                            create_time=now,
                        )
                    )
        except exc.IntegrityError as e:
            if self._name_taken(copy.name):
                raise AlreadyExists(f"experiment {copy.name!r} already exists") from e
            raise
        return ExperimentRow(
            experiment_id, copy.name, copy.config, copy.step, n, copy.capability, now, copy.forked_from, copy.step
        )

    def _copy_key_blocks(self, conn: Connection, experiment_id: int, copy: ExperimentCopy) -> None:
        """The key blocks of a copy's tasks (the source's first num_tasks, or the given keys)."""
        if copy.source_id is not None:
            keys, groups = self._read_keys(conn, copy.source_id, 0, copy.num_tasks)
        else:
            assert copy.keys is not None
            keys, groups = list(copy.keys), list(copy.groups or [])
        for first in range(0, len(keys), pieces.KEY_BLOCK_TASKS):
            end = first + pieces.KEY_BLOCK_TASKS
            _insert_key_block(conn, experiment_id, first, keys[first:end], groups[first:end])

    def _name_taken(self, name: str) -> bool:
        with self._read() as conn:
            return conn.execute(sa.select(t.experiments.c.id).where(t.experiments.c.name == name)).first() is not None

    @_translate_errors
    def find_experiment(self, name: str) -> ExperimentRow | None:
        with self._read() as conn:
            row = conn.execute(_EXPERIMENTS.where(t.experiments.c.name == name)).one_or_none()
        return None if row is None else _experiment_row(row)

    @_translate_errors
    def list_experiments(self, after_name: str, limit: int, tenant: str | None = None) -> list[ExperimentRow]:
        query = _EXPERIMENTS.where(t.experiments.c.name > after_name)
        if tenant is not None:
            query = query.where(t.experiments.c.tenant == tenant)
        with self._read() as conn:
            return [_experiment_row(r) for r in conn.execute(query.order_by(t.experiments.c.name).limit(limit))]

    @_translate_errors
    def tenant_usage(self, tenant: str) -> TenantUsage:
        with self._read() as conn:
            return _tenant_usage(conn, tenant)

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

    @_translate_errors
    def delete_experiment(self, experiment_id: int, abandoned: Callable[[], bool] | None = None) -> bool:
        with self._write(abandoned) as conn:
            tables: tuple[sa.Table, ...] = (t.group_shares, t.retirements, t.batch_task_lists, t.batches)
            tables += (t.step_outcomes, t.steps)
            tables += (t.checkpoint_chunks, t.checkpoints, t.task_key_blocks, t.tasks)
            for table in tables:
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
        self,
        experiment_id: int,
        expected_num_tasks: int,
        keys: Sequence[str],
        features: Sequence[dict[str, float]],
        abandoned: Callable[[], bool] | None = None,
        groups: Sequence[str] | None = None,
        *,
        limits: TenantLimits | None = None,
    ) -> int:
        total = expected_num_tasks + len(keys)
        groups = groups or [""] * len(keys)
        try:
            with self._write(abandoned) as conn:
                self._admit(conn, limits, new_experiment=False, tasks=len(keys))
                updated = conn.execute(
                    t.experiments.update()
                    .where(t.experiments.c.id == experiment_id, t.experiments.c.num_tasks == expected_num_tasks)
                    .values(num_tasks=total)
                ).rowcount
                if updated != 1:
                    raise StaleStep()
                rows = (
                    (experiment_id, expected_num_tasks + i, key, json.dumps(f), g or None)
                    for i, (key, f, g) in enumerate(zip(keys, features, groups, strict=True))
                )
                self._bulk_insert(conn, t.tasks, _TASK_COLUMNS, rows)
                _insert_key_block(conn, experiment_id, expected_num_tasks, keys, groups)
        except exc.IntegrityError as e:
            existing = self._existing_keys(experiment_id, keys, limit=5)
            raise AlreadyExists(f"task keys already in the experiment: {existing}") from e
        return total

    def _existing_keys(self, experiment_id: int, keys: Sequence[str], limit: int) -> list[str]:
        found: list[str] = []
        with self._read() as conn:
            for start in range(0, len(keys), 500):
                chunk = list(keys[start : start + 500])
                query = sa.select(t.tasks.c.key).where(
                    t.tasks.c.experiment_id == experiment_id, t.tasks.c.key.in_(chunk)
                )
                found.extend(conn.execute(query).scalars())
                if len(found) >= limit:
                    break
        return found[:limit]

    @_translate_errors
    def load(
        self,
        experiment_id: int,
        *,
        reference_features: tuple[str, str] = ("", ""),
        after_step: int | None = None,
        first_task: int = 0,
        lookup: Lookup | None = None,
        after_pool_event: int = 0,
    ) -> LoadedRows | None:
        # A rebuild reads the checkpoint and the events after it: one snapshot.
        # Catching up reads append-only rows bounded by the experiment row.
        with self._read(snapshot=after_step is None) as conn:
            row = conn.execute(_EXPERIMENTS.where(t.experiments.c.id == experiment_id)).one_or_none()
            if row is None:
                return None
            experiment = _experiment_row(row)
            checkpoint = None
            features_from = first_task
            if after_step is None:
                checkpoint = self._read_checkpoint(conn, experiment_id)
                after_step = checkpoint.step
                # The checkpoint holds what the features gave its tasks.
                features_from = max(first_task, checkpoint.num_tasks)
            keys: list[str] = []
            weak: list[float | None] = []
            strong: list[float | None] = []
            groups: list[str] = []
            if features_from > first_task:
                keys, groups = self._read_keys(conn, experiment_id, first_task, features_from)
            if features_from < experiment.num_tasks:
                # Only the two reference features are needed: extracted in SQL,
                # without decoding every task's JSON in Python.
                weak_name, strong_name = reference_features
                columns = (t.tasks.c.key, self._feature(weak_name), self._feature(strong_name), t.tasks.c.group_name)
                query = self._tasks_query(experiment_id, features_from, experiment.num_tasks, *columns)
                for key, w, s, g in conn.execute(query):
                    keys.append(key)
                    weak.append(w)
                    strong.append(s)
                    groups.append(g or "")
            events = self._read_events(conn, experiment_id, after_step, experiment.step)
            batch = open_batches = None
            if lookup is not None:
                if lookup.batch_id:
                    batch = self._find_batch(conn, experiment_id, t.batches.c.batch_id == lookup.batch_id)
                elif lookup.request_key:
                    batch = self._find_batch(conn, experiment_id, t.batches.c.request_key == lookup.request_key)
                if lookup.leases_at is not None:
                    open_batches = _read_open_batches(conn, experiment_id, lookup.leases_at)
            pool_events = _read_pool_events(conn, experiment_id, after_pool_event)
        return LoadedRows(experiment, keys, weak, strong, checkpoint, events, batch, open_batches, pool_events, groups)

    def _read_keys(self, conn: Connection, experiment_id: int, start: int, stop: int) -> tuple[list[str], list[str]]:
        """Keys and groups ("": none) of tasks start..stop-1, from their blocks:
        a few values, not a row per task."""
        blocks = conn.execute(
            sa.select(
                t.task_key_blocks.c.first_task,
                t.task_key_blocks.c.num_tasks,
                t.task_key_blocks.c["keys"],
                t.task_key_blocks.c.groups,
            )
            .where(
                t.task_key_blocks.c.experiment_id == experiment_id,
                t.task_key_blocks.c.first_task < stop,
                t.task_key_blocks.c.first_task + t.task_key_blocks.c.num_tasks > start,
            )
            .order_by(t.task_key_blocks.c.first_task)
        )
        keys: list[str] = []
        groups: list[str] = []
        position = start
        for first, count, block_keys, block_groups in blocks:
            if first > position:
                raise RuntimeError(f"experiment {experiment_id}: the keys of tasks {position}..{first - 1} are missing")
            cut = slice(position - first, min(stop - first, count))
            keys.extend(pieces.split_texts(block_keys, count)[cut])
            if block_groups is None:
                groups.extend([""] * (cut.stop - cut.start))
            else:
                groups.extend(pieces.split_texts(block_groups, count)[cut])
            position = first + cut.stop
        if position != stop:
            raise RuntimeError(f"experiment {experiment_id}: the keys of tasks {position}..{stop - 1} are missing")
        return keys, groups

    @staticmethod
    def _tasks_query(experiment_id: int, start: int, stop: int, *columns: Any) -> sa.Select[Any]:
        """`columns` of tasks start..stop-1, in task order."""
        return (
            sa.select(*columns)
            .where(t.tasks.c.experiment_id == experiment_id, t.tasks.c.task_idx >= start, t.tasks.c.task_idx < stop)
            .order_by(t.tasks.c.task_idx)
        )

    def _feature(self, name: str) -> Any:
        """A task feature as a float column (NULL where missing)."""
        if not name:
            return sa.null()
        return self._json(t.tasks.c.features)[name].as_float()

    @_translate_errors
    def load_features(self, experiment_id: int, num_tasks: int) -> list[dict[str, float]]:
        query = (
            sa.select(t.tasks.c.features)
            .where(t.tasks.c.experiment_id == experiment_id, t.tasks.c.task_idx < num_tasks)
            .order_by(t.tasks.c.task_idx)
        )
        with self._read() as conn:
            return [json.loads(f) for f in conn.execute(query).scalars()]

    def _read_checkpoint(self, conn: Connection, experiment_id: int) -> CheckpointRow:
        row = conn.execute(sa.select(t.checkpoints).where(t.checkpoints.c.experiment_id == experiment_id)).one()
        chunks = conn.execute(
            sa.select(t.checkpoint_chunks.c.data)
            .where(t.checkpoint_chunks.c.experiment_id == experiment_id, t.checkpoint_chunks.c.version == row.version)
            .order_by(t.checkpoint_chunks.c.seq)
        ).scalars()
        state = b"".join(chunks)
        return CheckpointRow(step=row.step, num_tasks=row.num_tasks, state=state, create_time=_utc(row.create_time))

    def _read_events(self, conn: Connection, experiment_id: int, after_step: int, until_step: int) -> list[StepEvent]:
        """Events of steps after_step+1 .. until_step, ascending."""
        if after_step >= until_step:
            return []
        rows = conn.execute(
            sa.select(t.steps, t.step_outcomes.c.outcomes)
            .outerjoin(
                t.step_outcomes,
                sa.and_(t.step_outcomes.c.experiment_id == t.steps.c.experiment_id, t.step_outcomes.c.step == t.steps.c.step),
            )
            .where(t.steps.c.experiment_id == experiment_id, t.steps.c.step > after_step, t.steps.c.step <= until_step)
            .order_by(t.steps.c.step)
        ).all()
        return [_step_event(row) for row in rows]

    @_translate_errors
    def read_event(self, experiment_id: int, step: int) -> StepEvent:
        with self._read() as conn:
            return self._read_events(conn, experiment_id, step - 1, step)[0]

    @_translate_errors
    def compact(self, experiment_id: int, through_step: int, max_steps: int) -> Compacted:
        with self._write() as conn:
            row = conn.execute(
                sa.select(t.experiments.c.compacted_through, t.checkpoints.c.step)
                .join(t.checkpoints, t.checkpoints.c.experiment_id == t.experiments.c.id)
                .where(t.experiments.c.id == experiment_id)
            ).one_or_none()
            if row is None:
                return Compacted(0, 0, 0)
            horizon, checkpoint_step = row
            # Never past the checkpoint: a rebuild replays the events after it.
            target = min(through_step, checkpoint_step, horizon + max_steps)
            if target <= horizon:
                return Compacted(horizon, 0, 0)
            steps = conn.execute(
                t.step_outcomes.delete().where(
                    t.step_outcomes.c.experiment_id == experiment_id,
                    t.step_outcomes.c.step > horizon,
                    t.step_outcomes.c.step <= target,
                )
            ).rowcount
            reported = sa.select(t.batches.c.batch_id).where(
                t.batches.c.experiment_id == experiment_id,
                t.batches.c.reported_step > horizon,
                t.batches.c.reported_step <= target,
            )
            batches = conn.execute(
                t.batch_task_lists.delete().where(
                    t.batch_task_lists.c.experiment_id == experiment_id, t.batch_task_lists.c.batch_id.in_(reported)
                )
            ).rowcount
            # Compare-and-set: of two compactions racing, one moves the horizon.
            conn.execute(
                t.experiments.update()
                .where(t.experiments.c.id == experiment_id, t.experiments.c.compacted_through == horizon)
                .values(compacted_through=target)
            )
        return Compacted(target, steps, batches)

    @_translate_errors
    def write_checkpoint(
        self, experiment_id: int, step: int, num_tasks: int, state: bytes | memoryview, now: dt.datetime
    ) -> bool:
        # The chunks of a new version first, each in its own transaction (so
        # SQLite's write lock is held for one chunk at a time, not for the
        # whole value), then one small transaction that makes the version
        # current. Nothing here locks what selects and reports lock: the
        # chunks' foreign key names the checkpoint row, not the experiment.
        with self._read() as conn:
            current = conn.execute(
                sa.select(t.checkpoints.c.step).where(t.checkpoints.c.experiment_id == experiment_id)
            ).scalar_one_or_none()
        if current is None or current >= step:
            return False
        version, size = _new_version(), pieces.chunk_bytes(state)
        for seq, data in enumerate(pieces.chunks(state, size)):
            with self._chunk_write() as conn:
                _insert_chunk(conn, experiment_id, version, seq, step, data)
        self._settle_chunks()
        with self._write() as conn:
            # Compare-and-set on the step: of two writers (replicas) one wins.
            updated = conn.execute(
                t.checkpoints.update()
                .where(t.checkpoints.c.experiment_id == experiment_id, t.checkpoints.c.step < step)
                .values(step=step, num_tasks=num_tasks, create_time=now, version=version, chunk_bytes=size)
            ).rowcount
        self._remove_stale_chunks(experiment_id)
        return updated == 1

    def _remove_stale_chunks(self, experiment_id: int) -> None:
        """Remove chunks that can never be read again: those of a version
        other than the current one, of a step at or below the checkpoint's
        (a writer's version becomes current only above it, so chunks a
        writer is still adding are never among them). A few per transaction."""
        c = t.checkpoint_chunks
        with self._read() as conn:
            stale = conn.execute(
                sa.select(c.c.version, c.c.seq)
                .join(t.checkpoints, t.checkpoints.c.experiment_id == c.c.experiment_id)
                .where(
                    c.c.experiment_id == experiment_id,
                    c.c.step <= t.checkpoints.c.step,
                    c.c.version != t.checkpoints.c.version,
                )
                .order_by(c.c.version, c.c.seq)
            ).all()
        for start in range(0, len(stale), _STALE_CHUNKS_PER_TRANSACTION):
            group = stale[start : start + _STALE_CHUNKS_PER_TRANSACTION]
            with self._chunk_write() as conn:  # need not be durable: lost, they are removed next time
                for version, seq in group:
                    conn.execute(
                        c.delete().where(c.c.experiment_id == experiment_id, c.c.version == version, c.c.seq == seq)
                    )

    # -- batches and reports --------------------------------------------------

    def _find_batch(self, conn: Connection, experiment_id: int, condition: Any) -> BatchRow | None:
        found = _read_batches(conn, experiment_id, condition)
        return found[0] if found else None

    @_translate_errors
    def insert_batch(
        self,
        experiment_id: int,
        batch: BatchRow,
        now: dt.datetime,
        pool_seq: int | None = None,
        *,
        open_batches: Collection[str] | None = None,
        num_tasks: int | None = None,
    ) -> BatchRow:
        with self._write() as conn:
            existing = self._insert_batch_in(conn, experiment_id, batch, now, pool_seq, open_batches, num_tasks)
        return existing or batch

    @_translate_errors
    def commit_report(
        self, experiment_id: int, expected_step: int, event: StepEvent, now: dt.datetime, num_tasks: int | None = None
    ) -> None:
        with self._write() as conn:
            self._commit_report_in(conn, experiment_id, expected_step, event, now, num_tasks)

    @_translate_errors
    def commit_report_and_insert_batch(
        self,
        experiment_id: int,
        expected_step: int,
        event: StepEvent,
        batch: BatchRow,
        now: dt.datetime,
        pool_seq: int,
        *,
        open_batches: Collection[str],
        num_tasks: int,
    ) -> None:
        if batch.step != event.step:
            raise ValueError(f"the batch must be chosen at the report's step {event.step}, not {batch.step}")
        with self._write() as conn:
            self._commit_report_in(conn, experiment_id, expected_step, event, now, num_tasks)
            # The report's compare-and-set holds the row lock and checked the step and the pool size.
            existing = self._insert_batch_in(conn, experiment_id, batch, now, pool_seq, open_batches, None, locked=True)
            if existing is not None:
                raise RequestKeyTaken(existing)  # rolls the report back too

    def _insert_batch_in(
        self,
        conn: Connection,
        experiment_id: int,
        batch: BatchRow,
        now: dt.datetime,
        pool_seq: int | None,
        open_batches: Collection[str] | None,
        num_tasks: int | None,
        locked: bool = False,
    ) -> BatchRow | None:
        """insert_batch's checks and writes in `conn`'s transaction: None
        once stored, or the request key's batch (nothing written).
        `locked`: the transaction holds the row lock and checked the step."""
        # The lock first, then the checks in a statement of their own: on
        # PostgreSQL a statement that waited for the lock reads with the
        # snapshot it started with, blind to what the holder committed.
        step = None if locked else conn.execute(self._locked_step, {"experiment_id": experiment_id}).one_or_none()
        if not locked and step is None:
            raise StaleStep()  # deleted (and maybe created again): nothing may be inserted for it
        known = sorted(set(open_batches or ()))
        values = {
            "experiment_id": experiment_id,
            "request_key": batch.request_key,
            "now": now,
            "known": known,
            "n_batch_id": batch.batch_id,
            "n_step": batch.step,
            "n_batch_size": len(batch.task_idx),
            "n_create_time": batch.create_time,
            "n_lease_expire_time": batch.lease_expire_time,
            "n_tasks": pieces.pack_tasks(batch.task_idx),
        }
        checks, inserted = self._check_and_insert_batch(conn, values)
        if checks.existing is not None:
            existing = self._find_batch(conn, experiment_id, t.batches.c.batch_id == checks.existing)
            assert existing is not None
            return existing
        # Past here a failed check raises, and the transaction rolls back what was inserted.
        if step is not None and step.step != batch.step:
            raise StaleStep()
        if step is not None and num_tasks is not None and step.num_tasks != num_tasks:
            raise StaleStep()
        if pool_seq is not None and max(checks.retired_seq, checks.shares_seq) != pool_seq:
            raise StaleStep()
        if open_batches is not None:
            # The caller chose among the tasks these batches leave free:
            # any other open batch (another replica's) voids the choice.
            if not checks.open == checks.open_known == len(known):
                raise LeaseConflict()
        else:
            others = [b for b in _read_open_batches(conn, experiment_id, now) if b.batch_id != batch.batch_id]
            leased = {idx for open_batch in others for idx in open_batch.task_idx}
            if not leased.isdisjoint(batch.task_idx):
                raise LeaseConflict()
        if not inserted:
            conn.execute(INSERT_BATCH, values)
            conn.execute(INSERT_BATCH_TASKS, values)
        return None

    def _commit_report_in(
        self,
        conn: Connection,
        experiment_id: int,
        expected_step: int,
        event: StepEvent,
        now: dt.datetime,
        num_tasks: int | None,
    ) -> None:
        """commit_report's compare-and-set and writes in `conn`'s transaction."""
        # No parameter named after a column of an updated table: SQLAlchemy would SET it.
        values = {
            "expected_step": expected_step,
            "new_step": event.step,
            "b_num_tasks": num_tasks,
            "b_experiment_id": experiment_id,
            "b_batch_id": event.batch_id,
            "s_pool_size": event.pool_size,
            "s_capability": event.capability,
            "s_capability_estimate": event.capability_estimate,
            "s_create_time": now,
            "s_outcomes": pieces.pack_outcomes(event.task_idx, event.successes, event.trials),
        }
        advanced, marked = self._write_report(conn, values, same_pool=num_tasks is not None)
        if advanced != 1:
            raise StaleStep()
        if marked != 1:
            raise BatchAlreadyReported()  # rolls the step back too

    def _next_pool_event(self, conn: Connection, experiment_id: int, seq: int) -> int:
        """Lock the experiment row and check that `seq` is its next pool
        event (StaleStep otherwise); the experiment's step."""
        query = sa.select(t.experiments.c.step).where(t.experiments.c.id == experiment_id)
        step = conn.execute(self._lock_row(query)).scalar_one_or_none()
        if step is None or _last_pool_event(conn, experiment_id) != seq - 1:
            raise StaleStep()
        return int(step)

    @_translate_errors
    def commit_retirement(
        self,
        experiment_id: int,
        seq: int,
        task_idx: Sequence[int],
        retired: bool,
        now: dt.datetime,
        abandoned: Callable[[], bool] | None = None,
    ) -> RetirementEvent:
        with self._write(abandoned) as conn:
            step = self._next_pool_event(conn, experiment_id, seq)
            rows = ((experiment_id, seq, int(i), retired, step, now) for i in task_idx)
            self._bulk_insert(conn, t.retirements, _RETIREMENT_COLUMNS, rows)
        return RetirementEvent(seq=seq, step=step, task_idx=list(task_idx), retired=retired)

    @_translate_errors
    def commit_shares(
        self,
        experiment_id: int,
        seq: int,
        shares: Mapping[str, tuple[float, float]],
        now: dt.datetime,
        abandoned: Callable[[], bool] | None = None,
    ) -> SharesEvent:
        with self._write(abandoned) as conn:
            step = self._next_pool_event(conn, experiment_id, seq)
            conn.execute(
                t.group_shares.insert().values(
                    experiment_id=experiment_id, seq=seq, shares=_shares_json(shares), step=step, create_time=now
                )
            )
        return SharesEvent(seq=seq, step=step, shares=dict(shares))

    # -- dialect hooks ---------------------------------------------------------

    def _write_report(self, conn: Connection, values: Mapping[str, Any], same_pool: bool) -> tuple[int, int]:
        """A report's writes in `conn`'s transaction: the experiments rows
        whose step advanced (with `same_pool`, only if the pool size is
        b_num_tasks) and the batches rows marked reported. The step's rows
        are inserted only if both are 1. A dialect may do it in fewer round
        trips."""
        advanced = conn.execute(ADVANCE_STEP_SAME_POOL if same_pool else ADVANCE_STEP, values).rowcount
        if advanced != 1:
            return advanced, 0
        marked = conn.execute(MARK_REPORTED, values).rowcount
        if marked == 1:
            conn.execute(INSERT_STEP, values)
            conn.execute(INSERT_OUTCOMES, values)
        return advanced, marked

    def _check_and_insert_batch(self, conn: Connection, values: Mapping[str, Any]) -> tuple[Any, bool]:
        """insert_batch's checks (SELECT_CHECKS) in `conn`'s transaction, and
        whether the batch was inserted too: a dialect may insert it in the
        same round trip when the request key has no batch yet, for the
        caller to roll back if a check fails. Here: never."""
        return conn.execute(SELECT_CHECKS, values).one(), False

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
        self, conn: Connection, table: sa.Table, columns: Sequence[str], rows: Iterable[tuple[Any, ...]]
    ) -> None:
        """Insert many rows, fast, in `conn`'s transaction. Driver errors
        surface as SQLAlchemy's (IntegrityError, ...), as those of statements
        run through SQLAlchemy do."""

    @abc.abstractmethod
    def _migration_lock(self) -> AbstractContextManager[None]:
        """Held around a migration, so that concurrent migrators take turns."""


# Experiments with the capability after their latest step (NULL before any).
_EXPERIMENTS = sa.select(t.experiments, t.steps.c.capability).outerjoin(
    t.steps, sa.and_(t.steps.c.experiment_id == t.experiments.c.id, t.steps.c.step == t.experiments.c.step)
)


def _insert_experiment(conn: Connection, **values: Any) -> int:
    """Insert an experiment row; its new id."""
    key = conn.execute(t.experiments.insert().values(**values)).inserted_primary_key
    assert key is not None  # None only for statements that insert no single row
    return int(key[0])


_TENANT_USAGE = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(t.experiments.c.num_tasks), 0)).where(
    t.experiments.c.tenant == sa.bindparam("tenant")
)


def _tenant_usage(conn: Connection, tenant: str) -> TenantUsage:
    experiments, tasks = conn.execute(_TENANT_USAGE, {"tenant": tenant}).one()
    return TenantUsage(int(experiments), int(tasks))


def _open_batch(experiment_id: int, now: dt.datetime) -> sa.ColumnElement[bool]:
    return sa.and_(
        t.batches.c.experiment_id == experiment_id,
        t.batches.c.reported_step.is_(None),
        t.batches.c.lease_expire_time > now,
    )


_RETIREMENT_COLUMNS = ("experiment_id", "seq", "task_idx", "retired", "step", "create_time")


_TASK_COLUMNS = ("experiment_id", "task_idx", "key", "features", "group_name")

# Deleting a chunk frees its pages: cheap, but a transaction each would cost
# a commit (an fsync on SQLite) each.
_STALE_CHUNKS_PER_TRANSACTION = 8


def _new_version() -> int:
    """A checkpoint version number, unique among one experiment's writers
    (replicas) in practice; 0 is the empty value's."""
    return secrets.randbits(62) + 1


def _insert_chunk(conn: Connection, experiment_id: int, version: int, seq: int, step: int, data: memoryview) -> None:
    conn.execute(
        t.checkpoint_chunks.insert().values(experiment_id=experiment_id, version=version, seq=seq, step=step, data=data)
    )


def _insert_key_block(
    conn: Connection, experiment_id: int, first_task: int, keys: Sequence[str], groups: Sequence[str]
) -> None:
    """One block of task keys (and groups, if any task has one)."""
    named = [g or "" for g in groups] if any(groups) else []
    conn.execute(
        t.task_key_blocks.insert().values(
            experiment_id=experiment_id,
            first_task=first_task,
            num_tasks=len(keys),
            keys=pieces.join_texts(keys),
            groups=pieces.join_texts(named) if named else None,
        )
    )


def _last_pool_event(conn: Connection, experiment_id: int) -> int:
    """The seq of the experiment's last pool event (retirement or shares), 0 if none."""
    row = conn.execute(_LAST_POOL_EVENTS, {"experiment_id": experiment_id}).one()
    return max(row)


def _read_open_batches(conn: Connection, experiment_id: int, now: dt.datetime) -> list[BatchRow]:
    """The batches open at `now`, each with its tasks in selection order."""
    return _read_batches(conn, experiment_id, _open_batch(experiment_id, now))


def _read_batches(conn: Connection, experiment_id: int, condition: Any) -> list[BatchRow]:
    """The experiment's batches that meet `condition`, oldest first, each
    with its tasks in selection order (none left: compacted)."""
    batches = conn.execute(
        sa.select(t.batches, t.batch_task_lists.c.tasks)
        .outerjoin(
            t.batch_task_lists,
            sa.and_(
                t.batch_task_lists.c.experiment_id == t.batches.c.experiment_id,
                t.batch_task_lists.c.batch_id == t.batches.c.batch_id,
            ),
        )
        .where(t.batches.c.experiment_id == experiment_id, condition)
        .order_by(t.batches.c.create_time, t.batches.c.batch_id)
    ).all()
    return [
        BatchRow(
            batch_id=b.batch_id,
            request_key=b.request_key,
            step=b.step,
            task_idx=[] if b.tasks is None else pieces.unpack_tasks(bytes(b.tasks)),
            create_time=_utc(b.create_time),
            lease_expire_time=_utc(b.lease_expire_time),
            reported_step=b.reported_step,
            compacted=b.tasks is None and b.reported_step is not None,
        )
        for b in batches
    ]


# The statements of every select and report, built once with bound
# parameters: building them per call cost more than running them.
_ID: sa.BindParameter[int] = sa.bindparam("experiment_id")
_STEP_AND_NUM_TASKS = sa.select(t.experiments.c.step, t.experiments.c.num_tasks).where(t.experiments.c.id == _ID)
_LAST_POOL_EVENTS = sa.select(
    *(
        sa.select(sa.func.coalesce(sa.func.max(table.c.seq), 0)).where(table.c.experiment_id == _ID).scalar_subquery()
        for table in (t.retirements, t.group_shares)
    )
)
_OPEN_NOW = sa.and_(
    t.batches.c.experiment_id == _ID,
    t.batches.c.reported_step.is_(None),
    t.batches.c.lease_expire_time > sa.bindparam("now"),
)
# What insert_batch checks after taking the lock, in one round trip: the
# batch of the request key, the last pool events, and how many batches are
# open and how many of those are among the `known` ones.
SELECT_CHECKS = sa.select(
    sa.select(t.batches.c.batch_id)
    .where(t.batches.c.experiment_id == _ID, t.batches.c.request_key == sa.bindparam("request_key"))
    .scalar_subquery()
    .label("existing"),
    _LAST_POOL_EVENTS.selected_columns[0].label("retired_seq"),
    _LAST_POOL_EVENTS.selected_columns[1].label("shares_seq"),
    sa.select(sa.func.count()).where(_OPEN_NOW).scalar_subquery().label("open"),
    sa.select(sa.func.count())
    .where(_OPEN_NOW, t.batches.c.batch_id.in_(sa.bindparam("known", expanding=True)))
    .scalar_subquery()
    .label("open_known"),
)


def _params(table: sa.Table, **names: str) -> dict[str, sa.BindParameter[Any]]:
    """Column name -> a parameter of the column's type."""
    return {column: sa.bindparam(name, type_=table.c[column].type) for column, name in names.items()}


# The values of a new batch, of a step and of its outcomes (a dialect may insert them otherwise).
BATCH_VALUES = _params(
    t.batches,
    experiment_id="experiment_id",
    batch_id="n_batch_id",
    request_key="request_key",
    step="n_step",
    batch_size="n_batch_size",
    create_time="n_create_time",
    lease_expire_time="n_lease_expire_time",
)
BATCH_TASKS_VALUES = _params(t.batch_task_lists, experiment_id="experiment_id", batch_id="n_batch_id", tasks="n_tasks")
STEP_VALUES = _params(
    t.steps,
    experiment_id="b_experiment_id",
    step="new_step",
    batch_id="b_batch_id",
    pool_size="s_pool_size",
    capability="s_capability",
    capability_estimate="s_capability_estimate",
    create_time="s_create_time",
)
OUTCOMES_VALUES = _params(t.step_outcomes, experiment_id="b_experiment_id", step="new_step", outcomes="s_outcomes")
INSERT_BATCH = t.batches.insert().values(BATCH_VALUES)
INSERT_BATCH_TASKS = t.batch_task_lists.insert().values(BATCH_TASKS_VALUES)
INSERT_STEP = t.steps.insert().values(STEP_VALUES)
INSERT_OUTCOMES = t.step_outcomes.insert().values(OUTCOMES_VALUES)
ADVANCE_STEP = (
    t.experiments.update()
    .where(t.experiments.c.id == sa.bindparam("b_experiment_id"), t.experiments.c.step == sa.bindparam("expected_step"))
    .values(step=sa.bindparam("new_step"))
)
ADVANCE_STEP_SAME_POOL = ADVANCE_STEP.where(t.experiments.c.num_tasks == sa.bindparam("b_num_tasks"))
MARK_REPORTED = (
    t.batches.update()
    .where(
        t.batches.c.experiment_id == sa.bindparam("b_experiment_id"),
        t.batches.c.batch_id == sa.bindparam("b_batch_id"),
        t.batches.c.reported_step.is_(None),
    )
    .values(reported_step=sa.bindparam("new_step"))
)

def _read_pool_events(conn: Connection, experiment_id: int, after_seq: int) -> list[PoolEvent]:
    """Pool events after `after_seq`, by seq; a retirement's tasks ascending."""
    rows = conn.execute(
        sa.select(t.retirements.c.seq, t.retirements.c.step, t.retirements.c.task_idx, t.retirements.c.retired)
        .where(t.retirements.c.experiment_id == experiment_id, t.retirements.c.seq > after_seq)
        .order_by(t.retirements.c.seq, t.retirements.c.task_idx)
    ).all()
    events: list[PoolEvent] = []
    for r in rows:
        last = events[-1] if events else None
        if not isinstance(last, RetirementEvent) or last.seq != r.seq:
            last = RetirementEvent(seq=r.seq, step=r.step, task_idx=[], retired=bool(r.retired))
            events.append(last)
        last.task_idx.append(r.task_idx)
    share_rows = conn.execute(
        sa.select(t.group_shares.c.seq, t.group_shares.c.step, t.group_shares.c.shares).where(
            t.group_shares.c.experiment_id == experiment_id, t.group_shares.c.seq > after_seq
        )
    ).all()
    for row in share_rows:
        shares = {name: (float(low), float(high)) for name, (low, high) in json.loads(row.shares).items()}
        events.append(SharesEvent(seq=row.seq, step=row.step, shares=shares))
    return sorted(events, key=lambda e: e.seq)


def _shares_json(shares: Mapping[str, tuple[float, float]]) -> str:
    return json.dumps({name: [low, high] for name, (low, high) in shares.items()}, sort_keys=True)


def _config_json(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)


def _experiment_row(row: Any) -> ExperimentRow:
    config = json.loads(row.config)
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
        row.compacted_through,
    )


def _step_event(row: Any) -> StepEvent:
    """The event of a `steps` row joined with its outcomes; incomplete if
    compaction removed them."""
    task_idx, successes, trials = pieces.unpack_outcomes(b"" if row.outcomes is None else bytes(row.outcomes))
    return StepEvent(
        step=row.step,
        batch_id=row.batch_id,
        pool_size=row.pool_size,
        task_idx=task_idx,
        successes=successes,
        trials=trials,
        capability=row.capability,
        capability_estimate=row.capability_estimate,
        complete=row.outcomes is not None,
    )
