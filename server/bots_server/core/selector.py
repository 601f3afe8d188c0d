"""The service's use cases: experiments, tasks, batches, reports, snapshots.

Every call on one experiment runs under that experiment's lock on this
replica; correctness across replicas comes from the store (the step is a
compare-and-set, the request key and the batch's reported mark are unique).
Blocking work (SQL, numpy over the pool) runs in a thread pool so the event
loop keeps serving other experiments.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import datetime as dt
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from bots_client.types import Batch, Experiment, ExperimentConfig, Outcome, ReportResult, Task
from bots_server.core import validation
from bots_server.core.experiment import LiveExperiment
from bots_server.core.observer import SelectorObserver
from bots_server.engine import apply_outcomes, select, step_rng
from bots_server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from bots_server.store import (
    BatchAlreadyReported,
    BatchRow,
    ExperimentCopy,
    ExperimentRow,
    LeaseConflict,
    LoadedRows,
    Lookup,
    StaleStep,
    StepEvent,
    Store,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
# Compare-and-set retries when other replicas keep advancing the experiment.
_MAX_WRITE_ATTEMPTS = 20


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    every_steps: int = 100
    every_seconds: float = 60.0


@dataclasses.dataclass(frozen=True)
class SnapshotData:
    experiment: Experiment
    keys: list[str]
    alpha: list[float]
    beta: list[float]
    features: list[dict[str, float]] | None


@dataclasses.dataclass(frozen=True)
class RestoreData:
    """A snapshot to start a new experiment from."""

    name: str
    config: ExperimentConfig
    step: int
    capability: float | None
    source: str
    keys: list[str]
    alpha: list[float]
    beta: list[float]
    features: list[dict[str, float]]


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class SelectorService:
    def __init__(
        self,
        store: Store,
        *,
        checkpoint_policy: CheckpointPolicy = CheckpointPolicy(),
        max_workers: int = 8,
        clock: Callable[[], dt.datetime] = _utcnow,
        observer: SelectorObserver | None = None,
    ) -> None:
        self.store = store
        self.observer = observer or SelectorObserver()
        self.checkpoint_policy = checkpoint_policy
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bots-worker")
        self._clock = clock
        self._live: dict[str, LiveExperiment] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def _run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run blocking work on the pool, in this call's context (its request id)."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(self._executor, functools.partial(context.run, fn, *args, **kwargs))

    def _notify(self, hook: Callable[..., None], *args: object) -> None:
        """Run an observer hook on a worker thread, off the request's path."""
        future = self._executor.submit(hook, *args)
        future.add_done_callback(_log_hook_failure)

    # -- experiments ----------------------------------------------------------

    async def create_experiment(self, name: str, config: ExperimentConfig) -> Experiment:
        validation.experiment_name(name)
        validation.config(config)
        row = await self._run(self.store.create_experiment, name, config, self._clock())
        log.info("experiment created", extra={"experiment": name, "config": dataclasses.asdict(config)})
        return _summary(row, open_batches=0)

    async def get_experiment(self, name: str) -> Experiment:
        validation.experiment_name(name)
        row = await self._run(self.store.find_experiment, name)
        if row is None:
            raise NotFound(f"experiment {name!r} not found")
        return _summary(row, await self._run(self.store.count_open_batches, row.id, self._clock()))

    async def fork_experiment(self, source: str, name: str, config: ExperimentConfig | None) -> Experiment:
        """A new experiment with the source's tasks, current posterior and step."""
        validation.experiment_name(source)
        validation.experiment_name(name)
        if config is not None:
            validation.config(config)
        async with self._lock(source):
            live, _ = await self._ready(source)
            state = live.state
            copy = ExperimentCopy(
                name=name,
                config=config or live.config,
                step=live.step,
                capability=live.capability,
                alpha=state.alpha,
                beta=state.beta,
                forked_from=source,
                source_id=live.id,
            )
            row = await self._run(self.store.create_copy, copy, self._clock())
        log.info("experiment forked", extra={"experiment": name, "source": source, "step": row.step})
        return _summary(row, open_batches=0)

    async def restore_experiment(self, data: RestoreData) -> Experiment:
        """A new experiment from a snapshot: its tasks, posterior and step."""
        validation.experiment_name(data.name)
        validation.config(data.config)
        await self._run(validation.snapshot, data.config, data.keys, data.alpha, data.beta, data.features, data.capability)
        copy = ExperimentCopy(
            name=data.name,
            config=data.config,
            step=data.step,
            capability=data.capability,
            alpha=data.alpha,
            beta=data.beta,
            forked_from=data.source or "snapshot",
            keys=data.keys,
            features=data.features,
        )
        row = await self._run(self.store.create_copy, copy, self._clock())
        log.info("experiment restored", extra={"experiment": data.name, "source": copy.forked_from, "step": row.step})
        return _summary(row, open_batches=0)

    async def list_experiments(self, page_size: int, page_token: str) -> tuple[list[Experiment], str]:
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size = {page_size} is larger than {MAX_PAGE_SIZE}")
        limit = page_size or DEFAULT_PAGE_SIZE
        rows = await self._run(self.store.list_experiments, page_token, limit)
        now = self._clock()
        result = [_summary(row, await self._run(self.store.count_open_batches, row.id, now)) for row in rows]
        next_token = rows[-1].name if len(rows) == limit else ""
        return result, next_token

    async def delete_experiment(self, name: str) -> None:
        validation.experiment_name(name)
        async with self._lock(name):
            row = await self._run(self.store.find_experiment, name)
            if row is None:
                raise NotFound(f"experiment {name!r} not found")
            live = self._live.pop(name, None)
            if live is not None and live.checkpoint_task is not None:
                live.checkpoint_task.cancel()
            await self._run(self.store.delete_experiment, row.id)
        self._notify(self.observer.experiment_removed, name)
        log.info("experiment deleted", extra={"experiment": name})

    # -- tasks --------------------------------------------------------------------

    async def add_tasks(self, name: str, tasks: Sequence[Task]) -> tuple[int, int]:
        """Add tasks at the prior. Returns (added, tasks in the experiment)."""
        validation.experiment_name(name)
        async with self._lock(name):
            live, _ = await self._ready(name)
            await self._run(validation.tasks, live.config, tasks)
            keys = [task.key for task in tasks]
            features = [dict(task.features) for task in tasks]
            for _ in range(_MAX_WRITE_ATTEMPTS):
                taken = [key for key in keys if key in live.index]
                if taken:
                    raise _already_has(name, taken)
                try:
                    await self._run(self.store.add_tasks, live.id, live.num_tasks, keys, features)
                except StaleStep:
                    await self._catch_up(live)
                    continue
                await self._run(live.append_tasks, keys, *live.reference_features(features))
                self._notify(self.observer.tasks_added, name, live.num_tasks)
                log.info("tasks added", extra={"experiment": name, "added": len(keys), "num_tasks": live.num_tasks})
                return len(keys), live.num_tasks
            raise _contended(name)

    # -- batches --------------------------------------------------------------------

    async def select_batch(self, name: str, batch_size: int, request_key: str) -> Batch:
        validation.experiment_name(name)
        validation.batch_request(batch_size, request_key)
        async with self._lock(name):
            now = self._clock()
            # One read: catch up, the batch of this request key, the leases.
            live, rows = await self._ready(name, Lookup(request_key=request_key, leases_at=now))
            if live.num_tasks == 0:
                raise FailedPrecondition(f"experiment {name!r} has no tasks; add tasks first")
            if batch_size > live.num_tasks:
                raise InvalidArgument(f"batch_size = {batch_size} is larger than the pool of {live.num_tasks} tasks")
            if rows.batch is not None:
                return self._same_request(live, rows.batch, batch_size)
            request_key = request_key or uuid.uuid4().hex
            leased = rows.leased or []
            for _ in range(_MAX_WRITE_ATTEMPTS):
                chosen = await self._run(self._choose, live, leased, batch_size, request_key)
                row = BatchRow(
                    batch_id=uuid.uuid4().hex,
                    request_key=request_key,
                    step=live.step,
                    task_idx=chosen,
                    create_time=now,
                    lease_expire_time=now + dt.timedelta(seconds=live.config.lease_ttl_seconds),
                    reported_step=None,
                )
                try:
                    stored = await self._run(self.store.insert_batch, live.id, row, now)
                except (StaleStep, LeaseConflict):  # another replica reported or leased meanwhile
                    now = self._clock()
                    leased = (await self._catch_up(live, Lookup(leases_at=now))).leased or []
                    continue
                if stored.batch_id != row.batch_id:  # a racing call with the same key won
                    return self._same_request(live, stored, batch_size)
                self._notify(self.observer.batch_selected, name, batch_size, len(leased) + batch_size)
                log.debug(
                    "batch selected",
                    extra={"experiment": name, "batch_id": row.batch_id, "step": live.step, "batch_size": batch_size},
                )
                return self._batch(live, stored)
            raise _contended(name)

    @staticmethod
    def _choose(live: LiveExperiment, leased: list[int], batch_size: int, request_key: str) -> list[int]:
        available = np.ones(live.num_tasks, dtype=bool)
        available[np.asarray(leased, dtype=np.int64)] = False
        free = int(available.sum())
        if free < batch_size:
            raise FailedPrecondition(
                f"batch_size = {batch_size} but only {free} of {live.num_tasks} tasks are free; "
                f"{live.num_tasks - free} are leased by open batches (report them or wait for their leases to expire)"
            )
        rng = step_rng(live.config.seed, live.step, request_key)
        chosen = select(live.params, live.state.alpha, live.state.beta, available, batch_size, rng)
        return chosen.tolist()

    def _same_request(self, live: LiveExperiment, existing: BatchRow, batch_size: int) -> Batch:
        if len(existing.task_idx) != batch_size:
            raise FailedPrecondition(
                f"request_key {existing.request_key!r} was already used for batch {existing.batch_id!r} "
                f"of {len(existing.task_idx)} tasks; this request asks for {batch_size}"
            )
        return self._batch(live, existing)

    @staticmethod
    def _batch(live: LiveExperiment, row: BatchRow) -> Batch:
        return Batch(
            batch_id=row.batch_id,
            step=row.step,
            keys=[live.keys[i] for i in row.task_idx],
            request_key=row.request_key,
            lease_expire_time=row.lease_expire_time,
        )

    # -- reports --------------------------------------------------------------------

    async def report_outcomes(self, name: str, batch_id: str, outcomes: Sequence[Outcome]) -> ReportResult:
        """Apply one batch's outcomes as one step; acknowledged once committed.

        Tasks of the batch that are not reported count as unselected. A report
        after the batch's lease expired is still applied: the rollouts are real
        evidence. An identical retry returns the first answer.
        """
        validation.experiment_name(name)
        validation.outcomes(batch_id, outcomes)
        async with self._lock(name):
            live, rows = await self._ready(name, Lookup(batch_id=batch_id))
            batch = rows.batch
            if batch is None:
                raise NotFound(f"batch {batch_id!r} not found in experiment {name!r}")
            task_idx, successes, trials = self._match(live, batch, outcomes)
            if batch.reported_step is not None:
                return await self._repeated_report(live, batch, task_idx, successes, trials)
            for _ in range(_MAX_WRITE_ATTEMPTS):
                result = await self._run(
                    apply_outcomes,
                    live.params,
                    live.state,
                    np.asarray(task_idx, dtype=np.int64),
                    np.asarray(successes, dtype=np.float64),
                    np.asarray(trials, dtype=np.float64),
                )
                capability = None if math.isnan(result.state.capability) else result.state.capability
                event = StepEvent(
                    step=live.step + 1,
                    batch_id=batch_id,
                    pool_size=live.num_tasks,
                    task_idx=task_idx,
                    successes=successes,
                    trials=trials,
                    capability=capability,
                    capability_estimate=None if math.isnan(result.capability_estimate) else result.capability_estimate,
                )
                try:
                    await self._run(self.store.commit_report, live.id, live.step, event, self._clock())
                except StaleStep:
                    await self._catch_up(live)
                    continue
                except BatchAlreadyReported:  # another replica applied it meanwhile
                    batch = (await self._catch_up(live, Lookup(batch_id=batch_id))).batch
                    assert batch is not None
                    return await self._repeated_report(live, batch, task_idx, successes, trials)
                live.state, live.step = result.state, event.step
                self._notify(self.observer.report_applied, name, event.step, successes, trials, result.state)
                log.info(
                    "report applied",
                    extra={"experiment": name, "step": event.step, "batch_id": batch_id, "tasks": len(task_idx)},
                )
                self._maybe_checkpoint(live)
                return ReportResult(step=event.step, capability=capability, duplicate=False)
            raise _contended(name)

    @staticmethod
    def _match(
        live: LiveExperiment, batch: BatchRow, outcomes: Sequence[Outcome]
    ) -> tuple[list[int], list[float], list[int]]:
        """Task indices, successes and trials sorted by task index (the order
        the event log stores, so a replay sums in the same order)."""
        in_batch = set(batch.task_idx)
        rows = []
        for o in outcomes:
            idx = live.index.get(o.key)
            if idx is None:
                raise InvalidArgument(f"task {o.key!r} is not in experiment {live.name!r}")
            if idx not in in_batch:
                raise InvalidArgument(f"task {o.key!r} is not in batch {batch.batch_id!r}")
            rows.append((idx, float(o.successes), int(o.trials)))
        rows.sort()
        return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]

    async def _repeated_report(
        self, live: LiveExperiment, batch: BatchRow, task_idx: list[int], successes: list[float], trials: list[int]
    ) -> ReportResult:
        assert batch.reported_step is not None
        event = await self._run(self.store.read_event, live.id, batch.reported_step)
        if (event.task_idx, event.successes, event.trials) != (task_idx, successes, trials):
            raise FailedPrecondition(
                f"batch {batch.batch_id!r} was already reported at step {batch.reported_step} with other outcomes"
            )
        return ReportResult(step=event.step, capability=event.capability, duplicate=True)

    # -- snapshot -------------------------------------------------------------------

    async def snapshot(self, name: str, include_features: bool = False) -> SnapshotData:
        validation.experiment_name(name)
        async with self._lock(name):
            live, _ = await self._ready(name)
            state, step, keys, capability = live.state, live.step, list(live.keys), live.capability
        row = await self._run(self.store.find_experiment, name)
        if row is None or row.id != live.id:
            raise NotFound(f"experiment {name!r} not found")
        open_batches = await self._run(self.store.count_open_batches, live.id, self._clock())
        experiment = _summary(dataclasses.replace(row, step=step, num_tasks=len(keys), capability=capability), open_batches)
        alpha, beta = await self._run(lambda: (state.alpha.tolist(), state.beta.tolist()))
        features = await self._run(self.store.load_features, live.id, len(keys)) if include_features else None
        return SnapshotData(experiment, keys, alpha, beta, features)

    # -- loading and catching up ---------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    async def _ready(self, name: str, lookup: Lookup | None = None) -> tuple[LiveExperiment, LoadedRows]:
        """The experiment, rebuilt from the store if not in memory, and caught
        up with whatever other replicas committed; with the rows `lookup` asks
        for, from the same read. Call under the experiment's lock."""
        live = self._live.get(name)
        if live is not None:
            try:
                return live, await self._catch_up(live, lookup)
            except NotFound:
                pass  # deleted elsewhere; the name may have been reused: look it up again
        row = await self._run(self.store.find_experiment, name)
        if row is None:
            self._locks.pop(name, None)
            raise NotFound(f"experiment {name!r} not found")
        params = validation.engine_params(row.config)
        started = time.perf_counter()
        rows = await self._run(self.store.load, row.id, lookup=lookup)
        if rows is None:
            raise NotFound(f"experiment {name!r} not found")
        live = await self._run(LiveExperiment.rebuild, rows, params)
        self._live[name] = live
        self._notify(self.observer.experiment_loaded, name, live.step, live.state, time.perf_counter() - started)
        log.info(
            "experiment loaded",
            extra={
                "experiment": name,
                "step": live.step,
                "num_tasks": live.num_tasks,
                "replayed_steps": len(rows.events),
                "seconds": round(time.perf_counter() - started, 3),
            },
        )
        return live, rows

    async def _catch_up(self, live: LiveExperiment, lookup: Lookup | None = None) -> LoadedRows:
        rows = await self._run(self.store.load, live.id, after_step=live.step, first_task=live.num_tasks, lookup=lookup)
        if rows is None or rows.experiment.name != live.name:
            self._live.pop(live.name, None)
            self._notify(self.observer.experiment_removed, live.name)
            raise NotFound(f"experiment {live.name!r} not found")
        if rows.keys or rows.events:
            await self._run(live.catch_up, rows)
        return rows

    # -- checkpoints ------------------------------------------------------------------

    def _maybe_checkpoint(self, live: LiveExperiment) -> None:
        if live.step - live.checkpoint_step >= self.checkpoint_policy.every_steps:
            self._start_checkpoint(live)

    def _start_checkpoint(self, live: LiveExperiment) -> None:
        if live.checkpoint_task is not None and not live.checkpoint_task.done():
            return
        task = asyncio.create_task(self._checkpoint(live), name=f"checkpoint-{live.name}")
        live.checkpoint_task = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _checkpoint(self, live: LiveExperiment) -> None:
        state, step = live.state, live.step  # one consistent pair: both change together
        if step <= live.checkpoint_step:
            return
        capability = None if math.isnan(state.capability) else state.capability
        started = time.perf_counter()
        try:
            await self._run(self.store.write_checkpoint, live.id, step, capability, state.alpha, state.beta, self._clock())
        except Exception:
            log.exception("checkpoint failed", extra={"experiment": live.name, "step": step})
            return
        live.checkpoint_step = step
        live.checkpoint_time = time.monotonic()
        self._notify(self.observer.checkpoint_written, live.name, step, time.perf_counter() - started)
        log.info(
            "checkpoint written",
            extra={
                "experiment": live.name,
                "step": step,
                "num_tasks": state.alpha.shape[0],
                "seconds": round(time.perf_counter() - started, 3),
            },
        )

    async def checkpoint_due(self) -> None:
        """Checkpoint every experiment whose last one is older than the policy allows."""
        now = time.monotonic()
        for live in list(self._live.values()):
            if live.step > live.checkpoint_step and now - live.checkpoint_time >= self.checkpoint_policy.every_seconds:
                self._start_checkpoint(live)

    async def run_checkpoints(self, interval_s: float = 1.0) -> None:
        """Background loop: time-based checkpoints until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.checkpoint_due()

    async def close(self) -> None:
        """Finish running checkpoints, checkpoint everything, release threads."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for live in list(self._live.values()):
            await self._checkpoint(live)
        self._executor.shutdown(wait=True)


def _summary(row: ExperimentRow, open_batches: int) -> Experiment:
    return Experiment(
        name=row.name,
        config=row.config,
        step=row.step,
        num_tasks=row.num_tasks,
        open_batches=open_batches,
        capability=row.capability,
        create_time=row.create_time,
        forked_from=row.forked_from,
        forked_at_step=row.forked_at_step,
    )


def _log_hook_failure(future: Future[None]) -> None:
    if future.exception() is not None:
        log.error("observer hook failed", exc_info=future.exception())


def _already_has(name: str, taken: list[str]) -> AlreadyExists:
    shown = ", ".join(repr(k) for k in taken[:5])
    more = f" and {len(taken) - 5} more" if len(taken) > 5 else ""
    return AlreadyExists(f"experiment {name!r} already has tasks {shown}{more}")


def _contended(name: str) -> Unavailable:
    return Unavailable(f"experiment {name!r} is being changed by other writers; retry")
