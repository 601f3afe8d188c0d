"""Tasks and the posterior state in SQL: tasks with their keys and features,
loading an experiment (checkpoint, step events, what a lookup asks for),
checkpoints, and the compaction of old events."""

from __future__ import annotations

import datetime as dt
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection

from bots_server.errors import AlreadyExists
from bots_server.store import pieces
from bots_server.store import schema as t
from bots_server.store.errors import StaleStep
from bots_server.store.records import CheckpointRow, Compacted, LoadedRows, Lookup, StepEvent, TenantLimits
from bots_server.store.sql_base import ROWS_PER_PACE, _translate_errors, in_blocks, over_parts
from bots_server.store.sql_batches import _find_batch, _read_open_batches, _read_pool_events
from bots_server.store.sql_rows import _EXPERIMENTS, _experiment_row, _utc
from bots_server.store.sql_task_rows import TASK_COLUMNS, TaskRowsSql


class TasksSql(TaskRowsSql):
    """The tasks and task_key_blocks rows, the checkpoints and
    checkpoint_chunks rows, and the reads and compaction of the steps and
    step_outcomes rows."""

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
        pace: Callable[[], None] | None = None,
        embeddings: Sequence[bytes] | None = None,
    ) -> int:
        total = expected_num_tasks + len(keys)
        groups = groups or [""] * len(keys)
        vectors: Sequence[bytes | None] = embeddings or [None] * len(keys)
        # The features are encoded before the write begins: on SQLite a write
        # holds every other writer of the database (other tenants' reports
        # too), and encoding them takes longer than storing them.
        encoded = in_blocks(json.dumps, features, pace)
        # Each row's tuple is made as it is written, not a million of them at once
        # (see core/domain.NewTasks).
        rows = (
            (experiment_id, i, key, f, g or None, e)
            for i, (key, f, g, e) in enumerate(zip(keys, encoded, groups, vectors, strict=True), start=expected_num_tasks)
        )
        try:
            with (
                self._staged_task_rows(experiment_id, expected_num_tasks, rows, abandoned, pace) as rows_left,
                self._write(abandoned) as conn,
            ):
                self._admit(conn, limits, new_experiment=False, tasks=len(keys))
                updated = conn.execute(
                    t.experiments.update()
                    .where(t.experiments.c.id == experiment_id, t.experiments.c.num_tasks == expected_num_tasks)
                    .values(num_tasks=total)
                ).rowcount
                if updated != 1:
                    raise StaleStep()
                self._bulk_insert(conn, t.tasks, TASK_COLUMNS, rows_left, pace)
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
        embeddings: bool = False,
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
                keys, groups = _read_keys(conn, experiment_id, first_task, features_from)
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
            vectors: list[bytes] = []
            if embeddings and first_task < experiment.num_tasks:
                query = self._tasks_query(experiment_id, first_task, experiment.num_tasks, t.tasks.c.embedding)
                vectors = [bytes(e) for e in conn.execute(query).scalars()]
            events = self._read_events(conn, experiment_id, after_step, experiment.step)
            batch = open_batches = None
            if lookup is not None:
                if lookup.batch_id:
                    batch = _find_batch(conn, experiment_id, t.batches.c.batch_id == lookup.batch_id)
                elif lookup.request_key:
                    batch = _find_batch(conn, experiment_id, t.batches.c.request_key == lookup.request_key)
                if lookup.leases_at is not None:
                    open_batches = _read_open_batches(conn, experiment_id, lookup.leases_at)
            pool_events = _read_pool_events(conn, experiment_id, after_pool_event)
        return LoadedRows(
            experiment, keys, weak, strong, checkpoint, events, batch, open_batches, pool_events, groups, vectors
        )

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
    def load_features(
        self, experiment_id: int, num_tasks: int, pace: Callable[[], None] | None = None
    ) -> list[dict[str, float]]:
        query = (
            sa.select(t.tasks.c.features)
            .where(t.tasks.c.experiment_id == experiment_id, t.tasks.c.task_idx < num_tasks)
            .order_by(t.tasks.c.task_idx)
        )
        with self._read() as conn:
            # In parts: the driver converts the rows it fetches in one call
            # without letting go of the GIL (about 200 ms for 250k rows, a
            # stall for every other caller of the process).
            parts = conn.execution_options(yield_per=ROWS_PER_PACE).execute(query).scalars().partitions()
            return over_parts(json.loads, parts, pace)

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
            with self._unsynced_write() as conn:
                _insert_chunk(conn, experiment_id, version, seq, step, data)
        self._settle_unsynced()
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
            with self._unsynced_write() as conn:  # need not be durable: lost, they are removed next time
                for version, seq in group:
                    conn.execute(
                        c.delete().where(c.c.experiment_id == experiment_id, c.c.version == version, c.c.seq == seq)
                    )


def _read_keys(conn: Connection, experiment_id: int, start: int, stop: int) -> tuple[list[str], list[str]]:
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
