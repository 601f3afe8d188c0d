"""Batches and reports in SQL: leasing batches, committing reports (steps
and their outcomes), open batches, and the pool events (retirements, group
shares)."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bots_server.store import pieces
from bots_server.store import schema as t
from bots_server.store.errors import BatchAlreadyReported, LeaseConflict, RequestKeyTaken, StaleStep
from bots_server.store.records import BatchRow, PoolEvent, RetirementEvent, SharesEvent, StepEvent
from bots_server.store.sql_base import SqlBase, _translate_errors
from bots_server.store.sql_rows import _utc
from bots_server.store.sql_statements import (
    _LAST_POOL_EVENTS,
    ADVANCE_STEP,
    ADVANCE_STEP_SAME_POOL,
    INSERT_BATCH,
    INSERT_BATCH_TASKS,
    INSERT_OUTCOMES,
    INSERT_STEP,
    MARK_REPORTED,
    SELECT_CHECKS,
)

log = logging.getLogger(__name__)


class BatchesSql(SqlBase):
    """The batches and batch_task_lists rows, the steps and step_outcomes
    rows a report writes, and the retirements and group_shares rows."""

    @_translate_errors
    def count_open_batches(self, experiment_id: int, now: dt.datetime) -> int:
        with self._read() as conn:
            return conn.execute(
                sa.select(sa.func.count()).select_from(t.batches).where(_open_batch(experiment_id, now))
            ).scalar_one()

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
            existing = _find_batch(conn, experiment_id, t.batches.c.batch_id == checks.existing)
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
        bound = self.max_unreported_batches
        if checks.unreported >= bound > 0:
            # With the new batch, down to nine tenths: the next selects need
            # not delete. A backlog above the bound (left by an older
            # release) goes as fast, so no select holds the lock long.
            self._delete_stale_batches(conn, experiment_id, now, bound // 10 + 1)
        return None

    def _delete_stale_batches(self, conn: Connection, experiment_id: int, now: dt.datetime, count: int) -> None:
        """Delete the `count` batches of the experiment that were never
        reported and whose lease expired longest ago (fewer if fewer are)."""
        stale = (
            sa.select(t.batches.c.batch_id)
            .where(
                t.batches.c.experiment_id == experiment_id,
                t.batches.c.reported_step.is_(None),
                t.batches.c.lease_expire_time <= now,
            )
            .order_by(t.batches.c.lease_expire_time, t.batches.c.batch_id)  # ix_batches_open's order
            .limit(count)
        )
        # The task lists first: the subquery, run again, then finds the same batches.
        conn.execute(
            t.batch_task_lists.delete().where(
                t.batch_task_lists.c.experiment_id == experiment_id, t.batch_task_lists.c.batch_id.in_(stale)
            )
        )
        deleted = conn.execute(
            t.batches.delete().where(t.batches.c.experiment_id == experiment_id, t.batches.c.batch_id.in_(stale))
        ).rowcount
        if not deleted:
            return  # all of them leased: as many as the pool has room for
        name = conn.execute(sa.select(t.experiments.c.name).where(t.experiments.c.id == experiment_id)).scalar()
        log.warning(
            "deleted the %d batches of experiment %r that were never reported and whose leases expired longest "
            "ago: it holds at most %d batches never reported (a trainer that selects and does not report?); a "
            "report of one of them is now NOT_FOUND",
            deleted,
            name,
            self.max_unreported_batches,
        )

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


def _find_batch(conn: Connection, experiment_id: int, condition: Any) -> BatchRow | None:
    found = _read_batches(conn, experiment_id, condition)
    return found[0] if found else None


def _open_batch(experiment_id: int, now: dt.datetime) -> sa.ColumnElement[bool]:
    return sa.and_(
        t.batches.c.experiment_id == experiment_id,
        t.batches.c.reported_step.is_(None),
        t.batches.c.lease_expire_time > now,
    )


_RETIREMENT_COLUMNS = ("experiment_id", "seq", "task_idx", "retired", "step", "create_time")


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
