"""What every use case runs on: the worker threads, the clock, the observer,
and the experiments held in memory, loaded from the store and caught up with
what other replicas committed.

Every call on one experiment runs under that experiment's lock on this
replica; correctness across replicas comes from the store (the step is a
compare-and-set, the request key and the batch's reported mark are unique).
Blocking work (SQL, numpy over the pool) runs in a thread pool so the event
loop keeps serving other experiments.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import datetime as dt
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn, TypeVar

from bots_server import tracing
from bots_server.core.allocator import release_free_memory
from bots_server.core.database import DatabaseHealth
from bots_server.core.domain import ExperimentConfig
from bots_server.core.experiment import LiveExperiment
from bots_server.core.fairshare import FairShare
from bots_server.core.observer import PosteriorView, SelectorObserver
from bots_server.core.priority import DEFAULT_BULK_SHARE, TRAINER_CALL, Priority
from bots_server.core.tenancy import tenant_of
from bots_server.engine import parallel
from bots_server.errors import NotFound, Unavailable
from bots_server.store import LoadedRows, Lookup, Store

log = logging.getLogger(__name__)

T = TypeVar("T")

# Compare-and-set retries when other replicas keep changing the experiment.
MAX_WRITE_ATTEMPTS = 20


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Runtime:
    def __init__(
        self,
        store: Store,
        *,
        max_workers: int,
        clock: Callable[[], dt.datetime],
        observer: SelectorObserver,
        database_timeout_s: float,
        memory_budget_bytes: int | None = None,
        bulk_share: float = DEFAULT_BULK_SHARE,
    ) -> None:
        self.store = store
        self.memory_budget_bytes = memory_budget_bytes
        self.database = DatabaseHealth(store, database_timeout_s)
        self.observer = observer
        self.clock = clock
        # Least recently used first (see keep_within_budget).
        self.live: dict[str, LiveExperiment] = {}
        self.evictions = 0
        self._locks: dict[str, _NamedLock] = {}
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bots-worker")
        self.priority = Priority(bulk_share, on_yield=observer.bulk_yielded)
        # Trainer calls' engine work, on the cores this process may use (two
        # at least), shared between the tenants with calls in flight
        # (core/fairshare.py).
        self.fair = FairShare(slots=max(2, parallel.HELPERS + 1))

    async def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run blocking work on the pool, in this call's context (its request id)."""
        return await self._submit(fn, *args, **kwargs)

    def _submit(self, fn: Callable[..., T], *args: object, **kwargs: object) -> asyncio.Future[T]:
        context = contextvars.copy_context()
        gate = parallel.PART_GATE.get()
        if gate is not None and TRAINER_CALL.get():
            # A trainer call's work is one unit of its tenant's fair share
            # (core/fairshare.py), its engine parts the points where it
            # gives way; bulk work gives way by Priority instead.
            work = functools.partial(context.run, _within, gate, functools.partial(fn, *args, **kwargs))
        else:
            work = functools.partial(context.run, fn, *args, **kwargs)
        return asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def db(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """A store call on the pool; Unavailable at once while the database
        is not answering (see core/database.py)."""
        return await self.database.call(functools.partial(self._submit, tracing.database_call(fn), *args, **kwargs))

    async def db_write_unless_cancelled(self, fn: Callable[..., T], *args: object) -> T:
        """A store write (taking `abandoned=`) that commits only if this call
        is still wanted: if the call is cancelled (its client cancelled, its
        stream broke, its deadline passed) before the transaction commits,
        the transaction rolls back. A cancellation that arrives during the
        COMMIT itself finds the write complete: it is then applied in full."""
        cancelled = threading.Event()
        try:
            return await self.db(fn, *args, abandoned=cancelled.is_set)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def notify(self, hook: Callable[..., None], *args: object) -> None:
        """Run an observer hook soon, on the event loop, after the call that
        notifies has moved on. Hooks only update counters (metrics.py): a
        worker thread's hand-off cost more than the hook."""
        asyncio.get_running_loop().call_soon(_run_hook, hook, args)

    @contextlib.asynccontextmanager
    async def locked(self, name: str) -> AsyncIterator[None]:
        """Hold the experiment's lock. A lock exists only while a call holds or
        awaits it, so calls on names that do not exist leave nothing behind.
        Meanwhile the call counts as its tenant's, and the engine's parts it
        runs take turns with other tenants' (core/fairshare.py)."""
        entry = self._locks.get(name)
        if entry is None:
            entry = self._locks[name] = _NamedLock()
        entry.users += 1
        tenant = tenant_of(name)
        gate = parallel.PART_GATE.set(functools.partial(self.fair.unit, tenant))
        try:
            with self.fair.call(tenant):
                async with entry.lock:
                    yield
        finally:
            parallel.PART_GATE.reset(gate)
            entry.users -= 1
            if entry.users == 0:
                del self._locks[name]

    @property
    def locks_held(self) -> int:
        return len(self._locks)

    async def resident(self, name: str) -> LiveExperiment:
        """The experiment as this replica holds it, without reading the store
        when it is in memory; rebuilt from the store if not. For calls whose
        write checks in its own transaction that nothing changed meanwhile
        (insert_batch's and commit_report's compare-and-sets), and catches up
        only when that check fails: one transaction per call. Call under the
        experiment's lock."""
        live = self.live.pop(name, None)
        if live is None:
            live, _ = await self.ready(name)
        else:
            self.live[name] = live  # now the most recently used
        return live

    async def ready(self, name: str, lookup: Lookup | None = None) -> tuple[LiveExperiment, LoadedRows]:
        """The experiment, rebuilt from the store if not in memory, and caught
        up with whatever other replicas committed; with the rows `lookup` asks
        for, from the same read. Call under the experiment's lock."""
        live = self.live.pop(name, None)
        if live is not None:
            self.live[name] = live  # now the most recently used
            try:
                return live, await self.catch_up(live, lookup)
            except NotFound:
                pass  # deleted elsewhere; the name may have been reused: look it up again
        row = await self.db(self.store.find_experiment, name)
        if row is None:
            raise NotFound(f"experiment {name!r} not found")
        config = ExperimentConfig.from_dict(row.config)
        started = time.perf_counter()
        rows = await self.db(
            self.store.load,
            row.id,
            reference_features=config.reference_features,
            lookup=self._with_leases(lookup),
            embeddings=config.embedding_dim > 0,
        )
        if rows is None:
            raise NotFound(f"experiment {name!r} not found")
        live = await self.run(LiveExperiment.rebuild, rows, config)
        # The loaded keys are in `live` now: free them, and their pages.
        rows = dataclasses.replace(rows, keys=[], weak=[], strong=[], groups=[], embeddings=[])
        await self.run(release_free_memory, live.num_tasks)
        self.live[name] = live
        self.keep_within_budget()
        seconds = time.perf_counter() - started
        self.notify(
            self.observer.experiment_loaded,
            name,
            PosteriorView.of(live.step, live.state, live.config.target_success),
            seconds,
        )
        if live.num_retired:
            self.notify(self.observer.tasks_retired, name, live.num_retired, live.num_tasks)
        log.info(
            "experiment loaded",
            extra={
                "experiment": name,
                "step": live.step,
                "num_tasks": live.num_tasks,
                "replayed_steps": len(rows.events),
                "seconds": round(seconds, 3),
            },
        )
        return live, rows

    async def catch_up(self, live: LiveExperiment, lookup: Lookup | None = None) -> LoadedRows:
        rows = await self.db(
            self.store.load,
            live.id,
            reference_features=live.config.reference_features,
            after_step=live.step,
            first_task=live.num_tasks,
            lookup=lookup,
            after_pool_event=live.pool_seq,
            embeddings=live.config.embedding_dim > 0,
        )
        if rows is None or rows.experiment.name != live.name:
            await self._gone(live)
        if rows.experiment.compacted_through > live.step:
            # Another replica compacted events this copy has not applied:
            # rebuild it from the checkpoint, in place (callers hold `live`).
            full = await self.db(
                self.store.load,
                live.id,
                reference_features=live.config.reference_features,
                lookup=self._with_leases(lookup),
                embeddings=live.config.embedding_dim > 0,
            )
            if full is None:
                await self._gone(live)
            live.take(await self.run(LiveExperiment.rebuild, full, live.config))
            return full
        if rows.keys or rows.events or rows.pool_events:
            await self.run(live.catch_up, rows)
        live.know_open_batches(rows)
        if rows.pool_events:  # retirements another replica committed
            self.notify(self.observer.tasks_retired, live.name, live.num_retired, live.num_tasks)
        return rows

    async def _gone(self, live: LiveExperiment) -> NoReturn:
        """`live`'s experiment is no longer in the store: forget the copy.
        NotFound, unless another replica deleted it and created one of the
        same name meanwhile: then the call is retried (Unavailable) and
        finds the new experiment, rebuilt from the store."""
        self.forget(live.name)
        if await self.db(self.store.find_experiment, live.name) is not None:
            raise Unavailable(f"experiment {live.name!r} was deleted and created again meanwhile; retry")
        raise NotFound(f"experiment {live.name!r} not found")

    def _with_leases(self, lookup: Lookup | None) -> Lookup:
        """`lookup`, also asking for the open batches (a rebuilt copy starts
        knowing them)."""
        lookup = lookup or Lookup()
        return lookup if lookup.leases_at is not None else dataclasses.replace(lookup, leases_at=self.clock())

    def keep_within_budget(self) -> None:
        """Over the memory budget, drop experiments that no call is using
        (holding or awaiting their lock). They stay in the store and are
        rebuilt on their next call, bit-identical: a rebuild is the
        checkpoint plus a replay of the committed events, as after a
        restart. The most recently used experiment (the one just loaded or
        grown) stays, even alone over the budget.

        Fair across tenants: the next one dropped is the least recently used
        of the tenant that holds the most memory, so a tenant that loads
        more than its share evicts its own experiments before another's
        (with one tenant: the least recently used)."""
        budget = self.memory_budget_bytes
        if budget is None:
            return
        sizes = {name: live.memory_bytes() for name, live in list(self.live.items())}
        total = sum(sizes.values())
        if total <= budget:
            return
        held: dict[str, int] = {}
        for name, size in sizes.items():
            held[tenant_of(name)] = held.get(tenant_of(name), 0) + size
        candidates = [name for name in list(sizes)[:-1] if name not in self._locks]  # least recently used first
        while total > budget and candidates:
            heaviest = max(sorted({tenant_of(n) for n in candidates}), key=lambda tenant: held[tenant])
            name = next(n for n in candidates if tenant_of(n) == heaviest)
            candidates.remove(name)
            live = self.live.pop(name)
            total -= sizes[name]
            held[heaviest] -= sizes[name]
            self.evictions += 1
            self.notify(self.observer.experiment_evicted, name)
            log.info("experiment evicted", extra={"experiment": name, "step": live.step, "num_tasks": live.num_tasks})

    @property
    def memory_bytes(self) -> int:
        # Also read by the metrics scrape on its own thread: list() takes the
        # values in one step, so a load or eviction meanwhile cannot break it.
        return sum(live.memory_bytes() for live in list(self.live.values()))

    def forget(self, name: str) -> LiveExperiment | None:
        """Drop an experiment (deleted here or elsewhere) from memory and metrics."""
        live = self.live.pop(name, None)
        self.notify(self.observer.experiment_removed, name)
        return live

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@dataclasses.dataclass
class _NamedLock:
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    users: int = 0


def contended(name: str) -> Unavailable:
    return Unavailable(f"experiment {name!r} is being changed by other writers; retry")


def _within(gate: parallel.Gate, work: Callable[[], T]) -> T:
    with gate(True):
        return work()


def _run_hook(hook: Callable[..., None], args: tuple[object, ...]) -> None:
    try:
        hook(*args)
    except Exception:
        log.exception("observer hook failed")
