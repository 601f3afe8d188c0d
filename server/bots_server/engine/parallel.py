"""Independent parts of one computation on several cores: numpy releases
the GIL inside a Beta draw, so threads can draw the parts of a large pool
at once (engine/draws.py).

Each part runs within `PART_GATE`'s context manager when the caller set one
(the core's fair share of the cores between tenants, core/fairshare.py):
the gate decides when a part may start, the engine only where parts begin
and end. The calling thread waits for its turn (gate(True)); a helper
takes a part only when it may start at once (gate(False) yields False
otherwise), so the caller never waits for a helper that waits for a turn.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

# A part runs within PART_GATE.get()(may_wait), if it yields True (None: at once).
Gate = Callable[[bool], AbstractContextManager[bool]]
PART_GATE: contextvars.ContextVar[Gate | None] = contextvars.ContextVar("part_gate", default=None)

MAX_THREADS = 8
# Threads besides the caller's, shared by every experiment: one per further
# core this process may run on, unless use_cores says fewer.
HELPERS = min(MAX_THREADS, len(os.sched_getaffinity(0))) - 1


def use_cores(cores: int) -> None:
    """Run parts on at most `cores` threads, the caller's included (a
    server under a CPU quota: more threads would only be throttled).
    Before the first run_parts."""
    global HELPERS
    HELPERS = max(1, min(MAX_THREADS, cores)) - 1


def run_parts(count: int, work: Callable[[int], None]) -> None:
    """work(0), ..., work(count - 1), each once, on the calling thread and
    up to HELPERS others; returns when all are done. A part must write only
    what is its own, so the result does not depend on which thread ran it."""
    parts = itertools.count()  # next() on it is atomic
    gate = PART_GATE.get() or _always

    def take_parts(caller: bool) -> None:
        while True:
            with gate(caller) as turn:  # the turn first, then a part: no part waits taken
                if not turn or (part := next(parts)) >= count:
                    return
                work(part)

    helpers = [_helpers().submit(take_parts, False) for _ in range(min(HELPERS, count - 1))]
    take_parts(True)
    for helper in helpers:
        helper.result()


def _always(may_wait: bool) -> AbstractContextManager[bool]:
    return contextlib.nullcontext(True)


@functools.cache
def _helpers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(HELPERS, 1), thread_name_prefix="bots-engine")
