"""Checkpoints: an experiment's whole state written as of one step, as one
value, so a restart replays only the events after it. Written in the
background, every N steps or T seconds, and for every experiment at
shutdown; off the experiment's lock (the state's arrays are never changed in
place, so encoding them while calls go on is safe), and nothing the write
locks is taken by selects or reports."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from bots_server.core.allocator import release_free_memory
from bots_server.core.checkpoint_state import encode_state
from bots_server.core.experiment import LiveExperiment
from bots_server.core.runtime import Runtime
from bots_server.store import Store

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    every_steps: int = 100
    every_seconds: float = 60.0
    # After each checkpoint, compact the event log up to this many steps
    # before it (docs/design.md, Bounded storage); 0 keeps every event.
    event_retention_steps: int = 0


# Steps one compaction transaction covers: bounds how long it holds the
# write lock (SQLite) and how many rows it deletes at once.
COMPACTION_STEPS_PER_TRANSACTION = 500


def compact_events(store: Store, experiment_id: int, through_step: int) -> tuple[int, int]:
    """Compact an experiment's events up to `through_step`, a transaction per
    chunk, until done or held at its checkpoint: (horizon, values removed: a
    step's outcomes or a batch's tasks each).
    Blocking; the server runs it on a worker, `bots-server compact` directly."""
    removed, previous = 0, -1
    while True:
        done = store.compact(experiment_id, through_step, COMPACTION_STEPS_PER_TRANSACTION)
        removed += done.steps + done.batches
        if done.horizon >= through_step or done.horizon == previous:  # done, or held at the checkpoint
            return done.horizon, removed
        previous = done.horizon


class Checkpoints:
    def __init__(self, runtime: Runtime, policy: CheckpointPolicy) -> None:
        self.runtime = runtime
        self.policy = policy
        self._background: set[asyncio.Task[None]] = set()

    def after_step(self, live: LiveExperiment) -> None:
        if live.step - live.checkpoint_step >= self.policy.every_steps:
            self._start(live)

    def cancel(self, live: LiveExperiment) -> None:
        if live.checkpoint_task is not None:
            live.checkpoint_task.cancel()

    def _start(self, live: LiveExperiment) -> None:
        if live.checkpoint_task is not None and not live.checkpoint_task.done():
            return
        task = asyncio.create_task(self._write(live), name=f"checkpoint-{live.name}")
        live.checkpoint_task = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _write(self, live: LiveExperiment) -> None:
        state, step = live.state, live.step  # one consistent pair: both change together
        if step <= live.checkpoint_step:
            return
        runtime = self.runtime
        started = time.perf_counter()
        try:
            blob = await runtime.run(encode_state, state)
            size = len(blob)
            await runtime.db(runtime.store.write_checkpoint, live.id, step, state.num_tasks, blob, runtime.clock())
        except Exception:
            log.exception("checkpoint failed", extra={"experiment": live.name, "step": step})
            return
        live.checkpoint_step = step
        live.checkpoint_time = time.monotonic()
        seconds = time.perf_counter() - started
        del blob  # then give back its pages, and what the steps since the last checkpoint left free
        await runtime.run(release_free_memory, state.num_tasks)
        runtime.notify(runtime.observer.checkpoint_written, live.name, step, seconds)
        log.info(
            "checkpoint written",
            extra={
                "experiment": live.name,
                "step": step,
                "num_tasks": state.num_tasks,
                "bytes": size,
                "seconds": round(seconds, 3),
            },
        )
        if self.policy.event_retention_steps > 0:
            await self._compact(live, step - self.policy.event_retention_steps)

    async def _compact(self, live: LiveExperiment, through_step: int) -> None:
        """Compact the event log up to `through_step`, off the request path
        (it runs in the checkpoint's task)."""
        runtime = self.runtime
        try:
            horizon, removed = await runtime.db(compact_events, runtime.store, live.id, through_step)
        except Exception:
            log.exception("compaction failed", extra={"experiment": live.name, "through_step": through_step})
            return
        if removed:
            log.info("events compacted", extra={"experiment": live.name, "horizon": horizon, "values": removed})

    def due(self) -> None:
        """Checkpoint every experiment whose last one is older than the policy allows."""
        now = time.monotonic()
        for live in list(self.runtime.live.values()):
            if live.step > live.checkpoint_step and now - live.checkpoint_time >= self.policy.every_seconds:
                self._start(live)

    async def run(self, interval_s: float = 1.0) -> None:
        """Background loop: time-based checkpoints until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.due()

    async def close(self) -> None:
        """Finish running checkpoints, then checkpoint everything."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for live in list(self.runtime.live.values()):
            await self._write(live)
