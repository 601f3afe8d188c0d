"""The cores shared fairly between tenants.

The engine's work of a trainer call runs as one unit of its tenant, and
the parts of a large pool's Beta draws as units within it or beside it,
each on one of `slots` (at least two, so that one unit waiting on its
database write leaves a slot to the other tenant). A tenant's first unit
starts at once; a further one only when a slot is free and the tenant runs
fewer units than its share: all slots while it is the only tenant with
calls in flight, else an equal part of them (at least one).
So one tenant's flood of selects on million-task pools takes its share of
the cores and leaves the rest to the other tenants' trainers, whose calls
queue behind nothing but their own; a tenant alone keeps every core. A
tenant below its share starts at once even when a tenant above its share
(which took the slots while alone) holds them all: that one gives a slot
back at its next part boundary.

Waiting units of one tenant start in arrival order; when a slot frees,
the waiting tenant that runs the fewest units goes first. A tenant counts as
calling until `linger_s` after its last call ended, so a trainer's calls
that come back to back (report, then select) keep its share.

Everything here blocks: it is called from worker threads, never the event
loop. A unit taken by a thread that already holds one runs within it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator

LINGER_S = 0.005


class FairShare:
    def __init__(self, slots: int, linger_s: float = LINGER_S) -> None:
        if slots < 1:
            raise ValueError(f"slots = {slots} must be at least 1")
        self.slots = slots
        self.linger_s = linger_s
        self._changed = threading.Condition()
        self._calls: dict[str, int] = {}  # tenant -> calls in flight
        self._ended: dict[str, float] = {}  # tenant -> when its last call ended
        self._running: dict[str, int] = {}  # tenant -> units running
        self._waiting: dict[str, deque[int]] = {}  # tenant -> tickets waiting, in arrival order
        self._tickets = itertools.count()
        self._held = threading.local()

    @contextlib.contextmanager
    def call(self, tenant: str) -> Iterator[None]:
        """A call of `tenant` is in flight while this is held."""
        with self._changed:
            self._calls[tenant] = self._calls.get(tenant, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                self._calls[tenant] -= 1
                if not self._calls[tenant]:
                    del self._calls[tenant]
                    self._ended[tenant] = time.monotonic()
                self._changed.notify_all()

    def _calling(self, now: float) -> set[str]:
        for tenant in [t for t, ended in self._ended.items() if now - ended >= self.linger_s]:
            del self._ended[tenant]
        return {*self._calls, *self._ended}

    def share(self, tenant: str, now: float) -> int:
        """Units `tenant` may run at once now."""
        calling = self._calling(now) | {tenant}
        return self.slots if len(calling) == 1 else max(1, self.slots // len(calling))

    def _may_start(self, tenant: str, ticket: int | None, now: float) -> bool:
        """Whether `tenant`'s unit `ticket` (None: one not queued) may start now."""
        running = self._running.get(tenant, 0)
        queue = self._waiting.get(tenant)
        if running == 0 and (not queue or queue[0] == ticket):
            return True  # every tenant runs one unit at once, whatever the others hold
        if running >= self.share(tenant, now):
            return False
        if sum(self._running.values()) >= self.slots and not self._over_share(now):
            # Every slot busy, none beyond its tenant's share. (A tenant
            # within its share starts beside one over it, which gives the
            # slot back at its next part boundary.)
            return False
        if queue and queue[0] != ticket:
            return False  # the tenant's earlier units first
        # A tenant that runs fewer units, waiting too, goes first.
        return not any(
            queue and other != tenant and self._running.get(other, 0) < running
            for other, queue in self._waiting.items()
        )

    @contextlib.contextmanager
    def unit(self, tenant: str, wait: bool = True) -> Iterator[bool]:
        """Run a unit of `tenant`'s work on one slot, once its turn comes;
        yields True. `wait=False`: yields False at once instead of waiting
        (a helper thread that finds no slot leaves the parts to the caller's).
        Taken again by the thread that holds it (a part of the engine's
        work within a trainer call's unit), it runs at once, unless the
        tenant runs more units than its share now and another tenant waits:
        then the slot goes to that tenant first."""
        if getattr(self._held, "tenant", None) is not None:
            self._give_way(tenant)
            yield True
            return
        with self._changed:
            turn = wait or self._may_start(tenant, None, time.monotonic())
            if turn:
                self._acquire(tenant)
        if not turn:
            yield False
            return
        self._held.tenant = tenant
        try:
            yield True
        finally:
            self._held.tenant = None
            with self._changed:
                self._release(tenant)

    def _acquire(self, tenant: str) -> None:
        ticket = next(self._tickets)
        queue = self._waiting.setdefault(tenant, deque())
        queue.append(ticket)
        while not self._may_start(tenant, ticket, time.monotonic()):
            # Woken when a unit ends or a call ends; a lingering tenant's
            # share returns within linger_s without a wake-up.
            self._changed.wait(self.linger_s)
        queue.popleft()
        if not queue:
            del self._waiting[tenant]
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def _release(self, tenant: str) -> None:
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        self._changed.notify_all()

    def _over_share(self, now: float) -> bool:
        return any(running > self.share(tenant, now) for tenant, running in self._running.items())

    def _give_way(self, tenant: str) -> None:
        with self._changed:
            now = time.monotonic()
            if self._running.get(tenant, 0) > self.share(tenant, now):
                crowded = sum(self._running.values()) > self.slots
                if crowded or any(queue for other, queue in self._waiting.items() if other != tenant):
                    self._release(tenant)
                    self._acquire(tenant)
