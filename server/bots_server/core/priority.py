"""Trainer calls before bulk work.

A trainer waits for its select and report on the GPU's critical path; an
upload, a restore or a snapshot of a large experiment is seconds of CPU
(converting, validating, encoding, the database's COPY) that nobody waits
for step by step. On a shared server the two compete for the same cores
and the same interpreter lock, so one team's upload would multiply another
team's step latency.

Bulk work therefore runs in blocks of a few milliseconds and, between
blocks, gives way while any select or report is in flight on this process.
So that bulk work is never starved by a steady stream of trainer calls, it
waits at most `(1 - share) / share` times as long as it ran since its last
wait: it keeps at least `share` of the time (a fifth by default).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

# True within a trainer call (Priority.foreground), in its context and in
# the work it hands to worker threads.
TRAINER_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("trainer_call", default=False)

DEFAULT_BULK_SHARE = 0.2
# Tasks per block: about a millisecond of conversion, validation or encoding
# (1-4 µs a task), the most a trainer call that arrives meanwhile shares the
# interpreter with. Blocks of 500 left team B's p99 at 2.2 times its p99 alone
# under team A's flood on SQLite, blocks of 250 at 1.8-2.0 (bench.fairness).
BLOCK = 250
# A trainer's calls come back to back (report, then select): bulk work waits
# this long after one ends before it takes the cores back.
LINGER_S = 0.002


class Priority:
    def __init__(
        self,
        bulk_share: float = DEFAULT_BULK_SHARE,
        linger_s: float = LINGER_S,
        on_yield: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        """`on_yield(seconds)`: after each pause, on the bulk call's thread."""
        if not 0.0 < bulk_share <= 1.0:
            raise ValueError(f"bulk share {bulk_share} is not in (0, 1]")
        self.patience = (1.0 - bulk_share) / bulk_share
        self.linger_s = linger_s
        self.on_yield = on_yield
        self._changed = threading.Condition()
        self._foreground = 0
        self._last_end = -math.inf

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Bulk work gives way while this is held (a trainer call). Within
        it, TRAINER_CALL is True."""
        with self._changed:
            self._foreground += 1
        token = TRAINER_CALL.set(True)
        try:
            yield
        finally:
            TRAINER_CALL.reset(token)
            with self._changed:
                self._foreground -= 1
                self._last_end = time.monotonic()
                if self._foreground == 0:
                    self._changed.notify_all()

    def pacer(self) -> Pacer:
        return Pacer(self)

    def give_way(self, ran_s: float) -> None:
        """Wait until no trainer call has been in flight for `linger_s`, or
        for `patience` times `ran_s`, whichever is first."""
        start = now = time.monotonic()
        deadline = now + ran_s * self.patience
        with self._changed:
            while now < deadline:
                if self._foreground:
                    self._changed.wait(deadline - now)
                else:
                    quiet = now - self._last_end
                    if quiet >= self.linger_s:
                        break
                    self._changed.wait(min(self.linger_s - quiet, deadline - now))
                now = time.monotonic()
        if now > start:
            self.on_yield(now - start)


class Pacer:
    """One bulk call's pauses: `pace()` is called between its blocks, from
    a worker thread (never the event loop: it blocks)."""

    def __init__(self, priority: Priority) -> None:
        self.priority = priority
        self._since = time.monotonic()

    def pace(self) -> None:
        """Give way (Priority.give_way) for at most `patience` times as long
        as this call ran since its last wait."""
        self.priority.give_way(time.monotonic() - self._since)
        self._since = time.monotonic()

    def paced(self, items: Iterable[T], size: int = BLOCK) -> Iterator[T]:
        """`items`, pacing before each block of `size` of them but the first."""
        for n, item in enumerate(items):
            if n and n % size == 0:
                self.pace()
            yield item
