"""Batches: selecting them (leases, same request key -> same batch) and
applying their reports (one step each, acknowledged once committed)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from bots_server.core import audit, validation
from bots_server.core.checkpoints import Checkpoints
from bots_server.core.domain import Batch, Outcomes, ReportResult
from bots_server.core.experiment import LiveExperiment
from bots_server.core.observer import PosteriorView
from bots_server.core.runtime import MAX_WRITE_ATTEMPTS, Runtime, contended
from bots_server.engine import PosteriorState, apply_outcomes, batch_signals, evidence_of, select, step_rng
from bots_server.errors import FailedPrecondition, InvalidArgument, NotFound
from bots_server.store import (
    BatchAlreadyReported,
    BatchRow,
    LeaseConflict,
    Lookup,
    RequestKeyTaken,
    StaleStep,
    StepEvent,
    Store,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def _trainer_call(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Bulk work gives way while the call runs (see core/priority.py)."""

    @functools.wraps(method)
    async def call(self: Batches, *args: Any) -> T:
        with self.runtime.priority.foreground():
            return await method(self, *args)

    return call


class Batches:
    def __init__(self, runtime: Runtime, checkpoints: Checkpoints) -> None:
        self.runtime = runtime
        self.checkpoints = checkpoints

    @_trainer_call
    async def select(self, name: str, batch_size: int, request_key: str) -> Batch:
        """The next batch: chosen from this replica's copy and stored in one
        transaction, whose checks (the step, the pool, the open batches)
        make it catch up and choose again when another replica changed the
        experiment meanwhile. A request key that has its batch already gets
        that batch."""
        validation.experiment_name(name)
        validation.batch_request(batch_size, request_key)
        async with self.runtime.locked(name):
            live = await self.runtime.resident(name)
            return await self._select(live, batch_size, request_key or uuid.uuid4().hex)

    @_trainer_call
    async def report(self, name: str, batch_id: str, outcomes: Outcomes) -> ReportResult:
        """Apply one batch's outcomes as one step; acknowledged once committed.

        Tasks of the batch that are not reported count as unselected. A report
        after the batch's lease expired is still applied: the rollouts are real
        evidence. An identical retry returns the first answer. The update is
        computed on this replica's copy and committed in one transaction
        whose compare-and-set on the step makes it catch up and compute again
        when another replica got there first.
        """
        validation.experiment_name(name)
        validation.outcomes(batch_id, outcomes)
        async with self.runtime.locked(name):
            live = await self.runtime.resident(name)
            return await self._report(live, batch_id, outcomes)

    @_trainer_call
    async def report_and_select(
        self, name: str, batch_id: str, outcomes: Outcomes, batch_size: int, request_key: str
    ) -> tuple[ReportResult, Batch]:
        """report, then select, committed in one transaction: both or neither.

        The batch is the one select would choose right after the report. A
        batch reported already (a retry, or a ReportOutcomes call) is
        answered as report answers a repeat, and the select stands alone:
        its request key makes it idempotent. So does a request key that has
        its batch already (as select does): the report is applied alone and
        that batch returned, or, if select would reject it, neither."""
        validation.experiment_name(name)
        validation.outcomes(batch_id, outcomes)
        validation.batch_request(batch_size, request_key)
        rt = self.runtime
        request_key = request_key or uuid.uuid4().hex
        async with rt.locked(name):
            live = await rt.resident(name)
            caught_up = False
            for _ in range(MAX_WRITE_ATTEMPTS):
                batch = await self._batch_to_report(live, batch_id)
                if batch.compacted or batch.reported_step is not None:
                    return await self._repeated(live, batch, outcomes), await self._select(live, batch_size, request_key)
                await self._check_pool(live, batch_size)
                task_idx, successes, trials = _match(live, batch, outcomes)
                row = _new_row(live, live.step + 1, request_key, rt.clock())
                try:
                    state, event, stored = await rt.db(
                        _report_choose_and_commit, rt.store, live, batch_id, task_idx, successes, trials, row, batch_size
                    )
                except (StaleStep, LeaseConflict):  # another replica reported, leased, added or retired meanwhile
                    await rt.catch_up(live, Lookup(leases_at=rt.clock()))
                    continue
                except BatchAlreadyReported:  # another replica applied (or deleted) it meanwhile
                    reported = await self._reported_meanwhile(live, batch_id)
                    return await self._repeated(live, reported, outcomes), await self._select(live, batch_size, request_key)
                except RequestKeyTaken as taken:
                    existing = _same_request(live, taken.existing, batch_size)
                    return await self._report(live, batch_id, outcomes), existing
                except FailedPrecondition:  # too few free tasks, as this copy sees them (see _select)
                    if caught_up:
                        raise
                    rows = await rt.catch_up(live, Lookup(request_key=request_key, leases_at=rt.clock()))
                    if rows.batch is not None:
                        existing = _same_request(live, rows.batch, batch_size)
                        return await self._report(live, batch_id, outcomes), existing
                    caught_up = True
                    continue
                self._applied(live, state, event, outcomes, batch)
                self._stored(live, stored)
                self.checkpoints.after_step(live)
                return ReportResult(step=event.step, capability=event.capability, duplicate=False), _batch(live, stored)
            raise contended(name)

    async def _select(self, live: LiveExperiment, batch_size: int, request_key: str) -> Batch:
        """select, holding the experiment's lock."""
        rt = self.runtime
        await self._check_pool(live, batch_size)
        caught_up = False
        for _ in range(MAX_WRITE_ATTEMPTS):
            row = _new_row(live, live.step, request_key, rt.clock())
            try:
                stored = await rt.db(_choose_and_store, rt.store, live, row, batch_size)
            except (StaleStep, LeaseConflict):  # another replica reported, leased, added or retired meanwhile
                await rt.catch_up(live, Lookup(leases_at=rt.clock()))
                continue
            except FailedPrecondition:
                # Too few free tasks, as this copy sees them: unless this
                # request key has its batch already, or the copy was
                # behind, that is the answer.
                if caught_up:
                    raise
                rows = await rt.catch_up(live, Lookup(request_key=request_key, leases_at=rt.clock()))
                if rows.batch is not None:
                    return _same_request(live, rows.batch, batch_size)
                caught_up = True
                continue
            if stored.batch_id != row.batch_id:  # this request key has its batch already
                return _same_request(live, stored, batch_size)
            self._stored(live, stored)
            return _batch(live, stored)
        raise contended(live.name)

    async def _report(self, live: LiveExperiment, batch_id: str, outcomes: Outcomes) -> ReportResult:
        """report, holding the experiment's lock."""
        rt = self.runtime
        for _ in range(MAX_WRITE_ATTEMPTS):
            batch = await self._batch_to_report(live, batch_id)
            if batch.compacted or batch.reported_step is not None:
                return await self._repeated(live, batch, outcomes)
            task_idx, successes, trials = _match(live, batch, outcomes)
            try:
                state, event = await rt.db(
                    _apply_and_commit, rt.store, live, batch_id, task_idx, successes, trials, rt.clock()
                )
            except StaleStep:  # another replica reported or added tasks meanwhile
                await rt.catch_up(live)
                continue
            except BatchAlreadyReported:  # another replica applied (or deleted) it meanwhile
                reported = await self._reported_meanwhile(live, batch_id)
                return await self._repeated(live, reported, outcomes)
            self._applied(live, state, event, outcomes, batch)
            self.checkpoints.after_step(live)
            return ReportResult(step=event.step, capability=event.capability, duplicate=False)
        raise contended(live.name)

    async def _check_pool(self, live: LiveExperiment, batch_size: int) -> None:
        if live.num_tasks < batch_size:  # this copy may be behind another replica's AddTasks
            await self.runtime.catch_up(live)
        if live.num_tasks == 0:
            raise FailedPrecondition(f"experiment {live.name!r} has no tasks; add tasks first")
        if batch_size > live.num_tasks:
            raise InvalidArgument(f"batch_size = {batch_size} is larger than the pool of {live.num_tasks} tasks")

    async def _batch_to_report(self, live: LiveExperiment, batch_id: str) -> BatchRow:
        batch = live.open_batches.get(batch_id)
        if batch is None:  # selected before a restart, on another replica, or reported already
            batch = (await self.runtime.catch_up(live, Lookup(batch_id=batch_id))).batch
            if batch is None:
                raise self._not_found(live, batch_id)
        return batch

    async def _reported_meanwhile(self, live: LiveExperiment, batch_id: str) -> BatchRow:
        """The row of a batch the store found reported when this copy held it
        open: reported by another replica, or, never reported, deleted by
        one at the bound on such batches."""
        batch = (await self.runtime.catch_up(live, Lookup(batch_id=batch_id))).batch
        if batch is None:
            live.open_batches.pop(batch_id, None)
            raise self._not_found(live, batch_id)
        return batch

    def _not_found(self, live: LiveExperiment, batch_id: str) -> NotFound:
        return NotFound(
            f"batch {batch_id!r} not found in experiment {live.name!r} (a batch never reported is deleted after its "
            f"lease expired once the experiment holds {self.runtime.store.max_unreported_batches} such batches)"
        )

    def _stored(self, live: LiveExperiment, stored: BatchRow) -> None:
        """Bookkeeping of a batch just stored."""
        rt = self.runtime
        # Expired leases are dropped here, so the map holds the batches in flight.
        live.open_batches = {
            b: batch for b, batch in live.open_batches.items() if batch.lease_expire_time > stored.create_time
        }
        live.open_batches[stored.batch_id] = stored
        live.last_batch_keys = (stored.batch_id, live.keys.take(stored.task_idx))
        batch_size = len(stored.task_idx)
        expires = stored.lease_expire_time.timestamp()
        rt.notify(rt.observer.batch_selected, live.name, stored.batch_id, batch_size, expires)
        if live.has_groups:
            rt.notify(rt.observer.groups_selected, live.name, live.group_counts(stored.task_idx))
        audit.steps.info(
            "batch selected",
            extra={"experiment": live.name, "batch_id": stored.batch_id, "step": stored.step, "batch_size": batch_size},
        )

    def _applied(
        self, live: LiveExperiment, state: PosteriorState, event: StepEvent, outcomes: Outcomes, batch: BatchRow
    ) -> None:
        """Bookkeeping of a report just committed (signals from the outcomes
        as reported: the event holds the posterior's evidence)."""
        rt = self.runtime
        if len(event.task_idx) < len(batch.task_idx):
            # Allowed (a task whose rollouts failed counts as not selected),
            # but never silent: the batch is closed with the rest unreported.
            missing = sorted(set(live.batch_keys(batch)) - set(outcomes.keys))
            log.warning(
                "report of batch %s holds %d of its %d tasks; the batch is closed and the other %d count as not "
                "selected (first missing: %s)",
                event.batch_id, len(event.task_idx), len(batch.task_idx), len(missing), ", ".join(missing[:5]),
                extra={"experiment": live.name, "batch_id": event.batch_id, "missing_tasks": len(missing)},
            )  # fmt: skip
        live.state, live.step = state, event.step
        live.open_batches.pop(event.batch_id, None)
        signals = batch_signals(outcomes.successes, outcomes.trials, outcomes.sum_squares)
        view = PosteriorView.of(event.step, state, live.config.target_success)
        rt.notify(rt.observer.report_applied, live.name, event.batch_id, signals, view)
        audit.steps.info(
            "report applied",
            extra={"experiment": live.name, "step": event.step, "batch_id": event.batch_id, "tasks": len(event.task_idx)},
        )

    async def _repeated(self, live: LiveExperiment, batch: BatchRow, outcomes: Outcomes) -> ReportResult:
        """The answer to a report of a batch reported already."""
        assert batch.reported_step is not None
        rt = self.runtime
        event = await rt.db(rt.store.read_event, live.id, batch.reported_step)
        if batch.compacted or not event.complete:
            # Compacted: its outcomes cannot be compared any more; a retry
            # this old can only be a duplicate (docs/design.md, Bounded storage).
            return ReportResult(step=event.step, capability=event.capability, duplicate=True)
        if (event.task_idx, event.successes, event.trials) != _match(live, batch, outcomes):
            raise FailedPrecondition(
                f"batch {batch.batch_id!r} was already reported at step {batch.reported_step} with other outcomes"
            )
        return ReportResult(step=event.step, capability=event.capability, duplicate=True)


def _new_row(live: LiveExperiment, step: int, request_key: str, now: dt.datetime) -> BatchRow:
    """A batch to choose at `step`, its tasks not chosen yet."""
    return BatchRow(
        batch_id=uuid.uuid4().hex,
        request_key=request_key,
        step=step,
        task_idx=[],
        create_time=now,
        lease_expire_time=now + dt.timedelta(seconds=live.config.lease_ttl_seconds),
        reported_step=None,
    )


def _choose_and_store(store: Store, live: LiveExperiment, row: BatchRow, batch_size: int) -> BatchRow:
    """Choose a batch on `live` as of `row.step` and store it, on one worker
    (blocking): the stored batch, or the one the request key has already."""
    now = row.create_time
    open_ids, leased = live.leased_at(now)
    chosen = _choose(live, live.state, row.step, leased, batch_size, row.request_key)
    return store.insert_batch(
        live.id,
        dataclasses.replace(row, task_idx=chosen),
        now,
        live.pool_seq,
        open_batches=open_ids,
        num_tasks=live.num_tasks,
    )


def _choose(
    live: LiveExperiment, state: PosteriorState, step: int, leased: list[int], batch_size: int, request_key: str
) -> list[int]:
    """The batch chosen from `state` at `step` among the tasks neither
    retired nor `leased`."""
    available = ~live.retired
    num_active = int(available.sum())
    available[np.asarray(leased, dtype=np.int64)] = False
    free = int(available.sum())
    if free < batch_size:
        retired = live.num_tasks - num_active
        raise FailedPrecondition(
            f"batch_size = {batch_size} but only {free} of {live.num_tasks} tasks are free; "
            + (f"{retired} are retired and " if retired else "")
            + f"{num_active - free} are leased by open batches (report them or wait for their leases to expire)"
        )
    rng = step_rng(live.config.seed, step, request_key)
    chosen = select(live.config, state.alpha, state.beta, available, batch_size, rng, live.quotas())
    return chosen.tolist()


def _apply(
    live: LiveExperiment, batch_id: str, task_idx: list[int], successes: list[float], trials: list[int]
) -> tuple[PosteriorState, StepEvent]:
    """A report applied to `live`'s state: the new state and the step's event."""
    result = apply_outcomes(
        live.config,
        live.state,
        np.asarray(task_idx, dtype=np.int64),
        np.asarray(successes, dtype=np.float64),
        np.asarray(trials, dtype=np.float64),
    )
    event = StepEvent(
        step=live.step + 1,
        batch_id=batch_id,
        pool_size=live.num_tasks,
        task_idx=task_idx,
        successes=successes,
        trials=trials,
        capability=None if math.isnan(result.state.capability) else result.state.capability,
        capability_estimate=None if math.isnan(result.capability_estimate) else result.capability_estimate,
    )
    return result.state, event


def _apply_and_commit(
    store: Store,
    live: LiveExperiment,
    batch_id: str,
    task_idx: list[int],
    successes: list[float],
    trials: list[int],
    now: dt.datetime,
) -> tuple[PosteriorState, StepEvent]:
    """Apply a report to `live`'s state and commit it as the next step, on
    one worker (blocking): the new state and the committed event."""
    state, event = _apply(live, batch_id, task_idx, successes, trials)
    store.commit_report(live.id, live.step, event, now, num_tasks=live.num_tasks)
    return state, event


def _report_choose_and_commit(
    store: Store,
    live: LiveExperiment,
    batch_id: str,
    task_idx: list[int],
    successes: list[float],
    trials: list[int],
    row: BatchRow,
    batch_size: int,
) -> tuple[PosteriorState, StepEvent, BatchRow]:
    """Apply a report, choose the next batch from the new state at the new
    step, and commit both in one transaction, on one worker (blocking)."""
    state, event = _apply(live, batch_id, task_idx, successes, trials)
    now = row.create_time
    open_ids, leased = live.leased_at(now, besides=batch_id)
    batch = dataclasses.replace(row, task_idx=_choose(live, state, event.step, leased, batch_size, row.request_key))
    store.commit_report_and_insert_batch(
        live.id, live.step, event, batch, now, live.pool_seq, open_batches=open_ids, num_tasks=live.num_tasks
    )
    return state, event, batch


def _same_request(live: LiveExperiment, existing: BatchRow, batch_size: int) -> Batch:
    if existing.compacted:
        raise FailedPrecondition(
            f"request_key {existing.request_key!r} was used for batch {existing.batch_id!r}, reported at step "
            f"{existing.reported_step}; its tasks were compacted (--event-retention-steps): use a new request key"
        )
    if len(existing.task_idx) != batch_size:
        raise FailedPrecondition(
            f"request_key {existing.request_key!r} was already used for batch {existing.batch_id!r} "
            f"of {len(existing.task_idx)} tasks; this request asks for {batch_size}"
        )
    return _batch(live, existing)


def _batch(live: LiveExperiment, row: BatchRow) -> Batch:
    return Batch(
        batch_id=row.batch_id,
        step=row.step,
        keys=live.batch_keys(row),
        request_key=row.request_key,
        lease_expire_time=row.lease_expire_time,
        reported_step=row.reported_step,
    )


def _match(live: LiveExperiment, batch: BatchRow, outcomes: Outcomes) -> tuple[list[int], list[float], list[int]]:
    """Task indices, successes and trials sorted by task index (the order
    the event log stores, so a replay sums in the same order). The successes
    are the posterior's evidence (engine/rewards.py): what the event log
    keeps, so a replay needs nothing else."""
    # The batch's own keys, not a lookup in the whole pool: a few times cheaper.
    in_batch = dict(zip(live.batch_keys(batch), batch.task_idx, strict=True))
    found = list(map(in_batch.get, outcomes.keys))
    if None in found:
        key = outcomes.keys[found.index(None)]
        if key not in live.keys:
            raise InvalidArgument(f"task {key!r} is not in experiment {live.name!r}")
        raise InvalidArgument(f"task {key!r} is not in batch {batch.batch_id!r}")
    task_idx = np.asarray(found, dtype=np.int64)
    order = np.argsort(task_idx, kind="stable")  # the keys are distinct (validation.outcomes), so are the indices
    successes = evidence_of(outcomes.successes, outcomes.trials, outcomes.sum_squares)
    trials = np.asarray(outcomes.trials, dtype=np.int64)
    return task_idx[order].tolist(), successes[order].tolist(), trials[order].tolist()
