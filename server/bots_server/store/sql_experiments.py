"""Experiments in SQL: create, copy (fork, restore), find, list, delete, and
a tenant's usage."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Connection

from bots_server.errors import AlreadyExists
from bots_server.store import pieces
from bots_server.store import schema as t
from bots_server.store.records import DEFAULT_TENANT, ExperimentCopy, ExperimentRow, TenantLimits, TenantUsage
from bots_server.store.sql_base import _tenant_usage, _translate_errors, in_blocks
from bots_server.store.sql_batches import _RETIREMENT_COLUMNS, _shares_json
from bots_server.store.sql_rows import _EXPERIMENTS, _experiment_row
from bots_server.store.sql_task_rows import TASK_COLUMNS, TaskRowsSql
from bots_server.store.sql_tasks import _insert_chunk, _insert_key_block, _new_version, _read_keys


class ExperimentsSql(TaskRowsSql):
    """The experiments rows, and all rows of a new copy."""

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
                experiment_id = self._insert_experiment(
                    conn, None, name=name, tenant=tenant, step=0, num_tasks=0, create_time=now, config=_config_json(config)
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
        pace: Callable[[], None] | None = None,
    ) -> ExperimentRow:
        n = copy.num_tasks
        # Encoded before the write begins, as in add_tasks: a write holds
        # every other writer of an SQLite database.
        encoded = None if copy.features is None else in_blocks(json.dumps, copy.features, pace)

        def insert_tasks(conn: Connection, experiment_id: int, start: int, stop: int) -> None:
            if copy.source_id is not None:
                source = t.tasks.c
                conn.execute(
                    t.tasks.insert().from_select(
                        TASK_COLUMNS,
                        sa.select(
                            sa.literal(experiment_id),
                            source.task_idx,
                            source.key,
                            source.features,
                            source.group_name,
                            source.embedding,
                        ).where(
                            source.experiment_id == copy.source_id, source.task_idx >= start, source.task_idx < stop
                        ),
                    )
                )
            else:
                assert copy.keys is not None and encoded is not None
                keys, groups, vectors = copy.keys, copy.groups, copy.embeddings
                rows = (
                    (
                        experiment_id,
                        i,
                        keys[i],
                        encoded[i],
                        (groups[i] if groups else "") or None,  # "": NULL
                        vectors[i] if vectors else None,
                    )
                    for i in range(start, stop)
                )
                self._bulk_insert(conn, t.tasks, TASK_COLUMNS, rows, pace)

        try:
            with (
                self._staged_copy_rows(insert_tasks, n, abandoned, pace) as staged_id,
                self._write(abandoned) as conn,
            ):
                self._admit(conn, limits, new_experiment=True, tasks=n)
                experiment_id = self._insert_experiment(
                    conn,
                    staged_id,
                    name=copy.name,
                    tenant=copy.tenant,
                    step=copy.step,
                    num_tasks=n,
                    create_time=now,
                    forked_from=copy.forked_from,
                    forked_at_step=copy.step,
                    config=_config_json(copy.config),
                )
                if staged_id is None:
                    insert_tasks(conn, experiment_id, 0, n)
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
            keys, groups = _read_keys(conn, copy.source_id, 0, copy.num_tasks)
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

    @_translate_errors
    def delete_experiment(
        self, experiment_id: int, abandoned: Callable[[], bool] | None = None, pace: Callable[[], None] | None = None
    ) -> bool:
        with self._deleting_task_rows(experiment_id, pace) as with_tasks, self._write(abandoned) as conn:
            tables: tuple[sa.Table, ...] = (t.group_shares, t.retirements, t.batch_task_lists, t.batches)
            tables += (t.step_outcomes, t.steps, t.checkpoint_chunks, t.checkpoints, t.task_key_blocks)
            tables += (t.tasks,) if with_tasks else ()
            for table in tables:
                conn.execute(table.delete().where(table.c.experiment_id == experiment_id))
            deleted = conn.execute(t.experiments.delete().where(t.experiments.c.id == experiment_id)).rowcount
        return deleted == 1

    def _insert_experiment(self, conn: Connection, experiment_id: int | None, **values: Any) -> int:
        """Insert an experiment row, with `experiment_id` (its tasks rows were
        staged under it) or a new one; its id."""
        if experiment_id is None:
            experiment_id = self._new_experiment_id(conn)
        if experiment_id is not None:
            values["id"] = experiment_id
        key = conn.execute(t.experiments.insert().values(**values)).inserted_primary_key
        assert key is not None  # None only for statements that insert no single row
        return int(key[0])


def _config_json(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)
