"""Tasks rows written and removed in short transactions of their own, for a
database whose every write holds all other writers (SQLite): a 250k-task
upload, restore or delete would otherwise hold every other tenant's reports
for a second or more.

Rows at task_idx >= the experiment's num_tasks, or of an experiment that
does not exist, are invisible: every read of tasks is bounded by num_tasks
and starts from an experiment row. So an upload writes its rows first, in
parts, and one short transaction then makes them the experiment's (the
compare-and-set of num_tasks, with the tenant's admission); a copy (fork,
restore) writes its rows under the id its experiment row then gets; a
delete removes the experiment row first, then its tasks rows in parts. What
a failed call wrote is removed before it raises; what a crash left is
removed by remove_unfinished_writes at the next start (or, for an upload,
by the next upload to the experiment). New experiment ids pass every id
that tasks rows still carry (_new_experiment_id), so rows on their way in
or out never meet another experiment's.

This needs the experiment's writes of tasks to take turns, which a lock in
the process gives only where one server owns the database: SQLite (its file
lock). The dialect enables it with `_task_rows_per_write`.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from bots_server.store import schema as t
from bots_server.store.errors import Abandoned, StaleStep
from bots_server.store.sql_base import SqlBase, _translate_errors

TASK_COLUMNS = ("experiment_id", "task_idx", "key", "features", "group_name", "embedding")
# A part of 250 tasks rows adds about 16 pages to SQLite's log: settled every
# 32, the log stays near half of the 1000 pages that set off the automatic
# checkpoint.
_PARTS_PER_SETTLE = 32


class TaskRowsSql(SqlBase):
    # Tasks rows per transaction of their own; None: written and removed in
    # the transaction that adds or deletes them. A dialect sets it.
    _task_rows_per_write: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._busy_experiments: set[int] = set()
        self._busy_changed = threading.Condition()

    @contextmanager
    def _staged_task_rows(
        self,
        experiment_id: int,
        first_task: int,
        rows: Iterable[tuple[Any, ...]],
        abandoned: Callable[[], bool] | None,
        pace: Callable[[], None] | None,
    ) -> Iterator[Iterable[tuple[Any, ...]]]:
        """Around the transaction that adds tasks first_task, ... to the
        experiment: yields the rows that transaction must still insert. With
        parts, none: they are written before it (StaleStep if the experiment
        does not have `first_task` tasks, Abandoned as soon as `abandoned`
        says so), and if a part or the transaction fails, they are removed
        before the error goes on."""
        size = self._task_rows_per_write
        if size is None:
            yield rows
            return
        with self._experiment_held(experiment_id):
            # Held, nothing else changes the experiment's number of tasks.
            with self._read() as conn:
                num_tasks = _num_tasks(conn, experiment_id)
            if num_tasks != first_task:
                raise StaleStep()
            self._remove_task_rows(experiment_id, pace)  # what a crash left
            try:
                # Made durable by the commit that adds them.
                self._write_parts(self._task_inserts(rows, size), abandoned, pace)
                yield ()
            except BaseException:
                self._remove_task_rows(experiment_id, pace)
                raise

    @contextmanager
    def _staged_copy_rows(
        self,
        insert_tasks: Callable[[sa.Connection, int, int, int], None],
        num_tasks: int,
        abandoned: Callable[[], bool] | None,
        pace: Callable[[], None] | None,
    ) -> Iterator[int | None]:
        """Around the transaction that creates a copy of num_tasks tasks
        (`insert_tasks(conn, experiment_id, start, stop)` inserts tasks
        start..stop-1): yields None, and that transaction inserts them; with
        parts, the id they were written under, before it, which it must give
        the experiment. The first part's transaction picks the id, which its
        rows then hold (see _new_experiment_id). If a part or the transaction
        fails, the rows are removed before the error goes on."""
        size = self._task_rows_per_write
        if size is None or num_tasks == 0:
            yield None
            return
        with self._unsynced_write() as conn:
            experiment_id = self._new_experiment_id(conn)
            assert experiment_id is not None
            insert_tasks(conn, experiment_id, 0, min(size, num_tasks))
        with self._experiment_held(experiment_id):
            try:
                # Made durable by the commit that creates the experiment.
                copies = (
                    lambda conn, start=start: insert_tasks(conn, experiment_id, start, min(start + size, num_tasks))
                    for start in range(size, num_tasks, size)
                )
                self._write_parts(copies, abandoned, pace, first=1)
                yield experiment_id
            except BaseException:
                self._remove_task_rows(experiment_id, pace)
                raise

    @contextmanager
    def _deleting_task_rows(self, experiment_id: int, pace: Callable[[], None] | None) -> Iterator[bool]:
        """Around the transaction that deletes the experiment: yields whether
        that transaction must delete the tasks rows itself. With parts, it
        must not: they are removed after it commits."""
        if self._task_rows_per_write is None:
            yield True
            return
        with self._experiment_held(experiment_id):
            yield False
            self._remove_task_rows(experiment_id, pace)

    def _new_experiment_id(self, conn: sa.Connection) -> int | None:
        """The id of an experiment inserted now; None: the database's choice.
        With parts, above every id that tasks rows carry: those of a copy
        being written, and those of a deleted experiment being removed,
        whose id SQLite would otherwise hand out again."""
        if self._task_rows_per_write is None:
            return None
        highest = (
            conn.execute(sa.select(sa.func.max(c))).scalar() or 0 for c in (t.experiments.c.id, t.tasks.c.experiment_id)
        )
        return max(highest) + 1

    def _task_inserts(self, rows: Iterable[tuple[Any, ...]], size: int) -> Iterator[Callable[[sa.Connection], None]]:
        """The inserts of `rows`, `size` at a time."""
        it = iter(rows)
        while part := list(itertools.islice(it, size)):
            yield functools.partial(self._bulk_insert, table=t.tasks, columns=TASK_COLUMNS, rows=part)

    def _write_parts(
        self,
        parts: Iterable[Callable[[sa.Connection], None]],
        abandoned: Callable[[], bool] | None,
        pace: Callable[[], None] | None,
        first: int = 0,
    ) -> None:
        """Each part in a transaction of its own, unsynced (`first`: how many
        the call wrote before). Before every part but a call's first, Abandoned
        as soon as `abandoned` says so, then way given to trainer calls."""
        for number, write in enumerate(parts, start=first):
            if number:
                if abandoned is not None and abandoned():
                    raise Abandoned()
                if pace is not None:
                    pace()
            with self._part(number) as conn:
                write(conn)
        self._settle_unsynced()

    @contextmanager
    def _part(self, number: int) -> Iterator[sa.Connection]:
        """The transaction of part `number` (0, 1, ...) of a call. Every few
        parts, first the database's copy of what they wrote
        (_settle_unsynced), here where no one waits for it: left to SQLite's
        automatic checkpoint, it would run in the commit of whichever writer
        took the log past 1000 pages, a trainer's report as often as not."""
        if number % _PARTS_PER_SETTLE == 0 and number:
            self._settle_unsynced()
        with self._unsynced_write() as conn:
            yield conn

    @contextmanager
    def _experiment_held(self, experiment_id: int) -> Iterator[None]:
        """One writer or remover of the experiment's tasks rows at a time in
        this process (uploads, copies, deletes, the sweep at start)."""
        with self._busy_changed:
            self._busy_changed.wait_for(lambda: experiment_id not in self._busy_experiments)
            self._busy_experiments.add(experiment_id)
        try:
            yield
        finally:
            with self._busy_changed:
                self._busy_experiments.discard(experiment_id)
                self._busy_changed.notify_all()

    def _remove_task_rows(self, experiment_id: int, pace: Callable[[], None] | None) -> None:
        """Remove the experiment's invisible tasks rows (all of them if it no
        longer exists), in parts."""
        assert self._task_rows_per_write is not None
        tasks = t.tasks.c
        with self._read() as conn:
            first = _num_tasks(conn, experiment_id) or 0
            last = conn.execute(
                sa.select(sa.func.max(tasks.task_idx)).where(tasks.experiment_id == experiment_id)
            ).scalar()
        if last is None or last < first:
            return
        size = self._task_rows_per_write
        deletes = (
            t.tasks.delete().where(
                tasks.experiment_id == experiment_id, tasks.task_idx >= start, tasks.task_idx < start + size
            )
            for start in range(first, last + 1, size)
        )
        # Lost in a crash, they are removed again.
        self._write_parts((functools.partial(_execute, delete) for delete in deletes), None, pace)

    @_translate_errors
    def remove_unfinished_writes(self) -> None:
        if self._task_rows_per_write is None or not self.schema_status().current:
            return
        with self._read() as conn:
            unfinished = conn.execute(_UNFINISHED).scalars().all()
        for experiment_id in unfinished:
            with self._experiment_held(experiment_id):
                self._remove_task_rows(experiment_id, None)


def _unfinished_writes() -> sa.Select[Any]:
    """The ids of the experiments whose tasks rows include invisible ones: at
    task_idx >= num_tasks, or of no experiment. One statement, so that the
    start of a server with many experiments costs index seeks in the
    database, not round trips: the ids come from a recursive walk of the
    (experiment_id, task_idx) index (each the least above the one before),
    never a scan of every row."""
    tasks, experiments = t.tasks.c, t.experiments
    walk = sa.select(sa.func.min(tasks.experiment_id).label("id")).cte("ids", recursive=True)
    following = sa.select(sa.func.min(tasks.experiment_id)).where(tasks.experiment_id > walk.c.id).scalar_subquery()
    ids = walk.union_all(sa.select(following).where(walk.c.id.is_not(None)))
    invisible = sa.exists().where(tasks.experiment_id == ids.c.id, tasks.task_idx >= experiments.c.num_tasks)
    return (
        sa.select(ids.c.id)
        .select_from(ids.outerjoin(experiments, experiments.c.id == ids.c.id))
        .where(ids.c.id.is_not(None), sa.or_(experiments.c.id.is_(None), invisible))
    )


_UNFINISHED = _unfinished_writes()


def _num_tasks(conn: sa.Connection, experiment_id: int) -> int | None:
    """The experiment's number of tasks; None if it does not exist."""
    return conn.execute(sa.select(t.experiments.c.num_tasks).where(t.experiments.c.id == experiment_id)).scalar()


def _execute(statement: sa.Executable, conn: sa.Connection) -> None:
    conn.execute(statement)
