"""Batches: selecting them (leases, same request key -> same batch) and
applying their reports (one step each, acknowledged once committed)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import uuid
from collections.abc import Sequence

import numpy as np

from bots_server.core import audit, validation
from bots_server.core.checkpoints import Checkpoints
from bots_server.core.domain import Batch, Outcome, ReportResult
from bots_server.core.experiment import LiveExperiment
from bots_server.core.observer import PosteriorView
from bots_server.core.runtime import MAX_WRITE_ATTEMPTS, Runtime, contended
from bots_server.engine import PosteriorState, apply_outcomes, batch_signals, select, step_rng
from bots_server.errors import FailedPrecondition, InvalidArgument, NotFound
from bots_server.store import BatchAlreadyReported, BatchRow, LeaseConflict, Lookup, StaleStep, StepEvent, Store


class Batches:
    def __init__(self, runtime: Runtime, checkpoints: Checkpoints) -> None:
        self.runtime = runtime
        self.checkpoints = checkpoints

    async def select(self, name: str, batch_size: int, request_key: str) -> Batch:
        """The next batch: chosen from this replica's copy and stored in one
        transaction, whose checks (the step, the pool, the open batches)
        make it catch up and choose again when another replica changed the
        experiment meanwhile. A request key that has its batch already gets
        that batch."""
        validation.experiment_name(name)
        validation.batch_request(batch_size, request_key)
        rt = self.runtime
        async with rt.locked(name):
            live = await rt.resident(name)
            if live.num_tasks < batch_size:  # this copy may be behind another replica's AddTasks
                await rt.catch_up(live)
            if live.num_tasks == 0:
                raise FailedPrecondition(f"experiment {name!r} has no tasks; add tasks first")
            if batch_size > live.num_tasks:
                raise InvalidArgument(f"batch_size = {batch_size} is larger than the pool of {live.num_tasks} tasks")
            request_key = request_key or uuid.uuid4().hex
            caught_up = False
            for _ in range(MAX_WRITE_ATTEMPTS):
                now = rt.clock()
                row = BatchRow(
                    batch_id=uuid.uuid4().hex,
                    request_key=request_key,
                    step=live.step,
                    task_idx=[],
                    create_time=now,
                    lease_expire_time=now + dt.timedelta(seconds=live.config.lease_ttl_seconds),
                    reported_step=None,
                )
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
                # Expired leases are dropped here, so the map holds the batches in flight.
                live.open_batches = {
                    b: batch for b, batch in live.open_batches.items() if batch.lease_expire_time > now
                }
                live.open_batches[stored.batch_id] = stored
                rt.notify(rt.observer.batch_selected, name, row.batch_id, batch_size, row.lease_expire_time.timestamp())
                if live.has_groups:
                    rt.notify(rt.observer.groups_selected, name, live.group_counts(stored.task_idx))
                audit.steps.info(
                    "batch selected",
                    extra={"experiment": name, "batch_id": row.batch_id, "step": live.step, "batch_size": batch_size},
                )
                return _batch(live, stored)
            raise contended(name)

    async def report(self, name: str, batch_id: str, outcomes: Sequence[Outcome]) -> ReportResult:
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
        rt = self.runtime
        async with rt.locked(name):
            live = await rt.resident(name)
            for _ in range(MAX_WRITE_ATTEMPTS):
                batch = live.open_batches.get(batch_id)
                if batch is None:  # selected before a restart, on another replica, or reported already
                    batch = (await rt.catch_up(live, Lookup(batch_id=batch_id))).batch
                    if batch is None:
                        raise NotFound(f"batch {batch_id!r} not found in experiment {name!r}")
                    if batch.compacted:  # reported long ago: its tasks are gone, nothing to match
                        return await self._repeated(live, batch, [], [], [])
                task_idx, successes, trials = _match(live, batch, outcomes)
                if batch.reported_step is not None:
                    return await self._repeated(live, batch, task_idx, successes, trials)
                try:
                    state, event = await rt.db(
                        _apply_and_commit, rt.store, live, batch_id, task_idx, successes, trials, rt.clock()
                    )
                except StaleStep:  # another replica reported or added tasks meanwhile
                    await rt.catch_up(live)
                    continue
                except BatchAlreadyReported:  # another replica applied it meanwhile
                    batch = (await rt.catch_up(live, Lookup(batch_id=batch_id))).batch
                    assert batch is not None
                    return await self._repeated(live, batch, task_idx, successes, trials)
                live.state, live.step = state, event.step
                live.open_batches.pop(batch_id, None)
                signals = batch_signals(successes, trials)
                view = PosteriorView.of(event.step, state, live.config.target_success)
                rt.notify(rt.observer.report_applied, name, batch_id, signals, view)
                audit.steps.info(
                    "report applied",
                    extra={"experiment": name, "step": event.step, "batch_id": batch_id, "tasks": len(task_idx)},
                )
                self.checkpoints.after_step(live)
                return ReportResult(step=event.step, capability=event.capability, duplicate=False)
            raise contended(name)

    async def _repeated(
        self, live: LiveExperiment, batch: BatchRow, task_idx: list[int], successes: list[float], trials: list[int]
    ) -> ReportResult:
        assert batch.reported_step is not None
        rt = self.runtime
        event = await rt.db(rt.store.read_event, live.id, batch.reported_step)
        if not event.complete:
            # Compacted: its outcomes cannot be compared any more; a retry
            # this old can only be a duplicate (docs/design-compaction.md).
            return ReportResult(step=event.step, capability=event.capability, duplicate=True)
        if (event.task_idx, event.successes, event.trials) != (task_idx, successes, trials):
            raise FailedPrecondition(
                f"batch {batch.batch_id!r} was already reported at step {batch.reported_step} with other outcomes"
            )
        return ReportResult(step=event.step, capability=event.capability, duplicate=True)


def _choose_and_store(store: Store, live: LiveExperiment, row: BatchRow, batch_size: int) -> BatchRow:
    """Choose a batch on `live` as of `row.step` and store it, on one worker
    (blocking): the stored batch, or the one the request key has already."""
    now = row.create_time
    open_ids, leased = live.leased_at(now)
    chosen = _choose(live, leased, batch_size, row.request_key)
    return store.insert_batch(
        live.id,
        dataclasses.replace(row, task_idx=chosen),
        now,
        live.pool_seq,
        open_batches=open_ids,
        num_tasks=live.num_tasks,
    )


def _choose(live: LiveExperiment, leased: list[int], batch_size: int, request_key: str) -> list[int]:
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
    rng = step_rng(live.config.seed, live.step, request_key)
    chosen = select(live.config, live.state.alpha, live.state.beta, available, batch_size, rng, live.quotas())
    return chosen.tolist()


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
    store.commit_report(live.id, live.step, event, now, num_tasks=live.num_tasks)
    return result.state, event


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
        keys=live.keys.take(row.task_idx),
        request_key=row.request_key,
        lease_expire_time=row.lease_expire_time,
    )


def _match(
    live: LiveExperiment, batch: BatchRow, outcomes: Sequence[Outcome]
) -> tuple[list[int], list[float], list[int]]:
    """Task indices, successes and trials sorted by task index (the order
    the event log stores, so a replay sums in the same order)."""
    in_batch = set(batch.task_idx)
    rows = []
    for o, idx in zip(outcomes, live.keys.lookup([o.key for o in outcomes]).tolist(), strict=True):
        if idx < 0:
            raise InvalidArgument(f"task {o.key!r} is not in experiment {live.name!r}")
        if idx not in in_batch:
            raise InvalidArgument(f"task {o.key!r} is not in batch {batch.batch_id!r}")
        rows.append((idx, float(o.successes), int(o.trials)))
    rows.sort()
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
