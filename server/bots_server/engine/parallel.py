"""Independent parts of one computation on several cores: numpy releases
the GIL inside a Beta draw, so threads can draw the parts of a large pool
at once (engine/draws.py)."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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

    def take_parts() -> None:
        while (part := next(parts)) < count:
            work(part)

    helpers = [_helpers().submit(take_parts) for _ in range(min(HELPERS, count - 1))]
    take_parts()
    for helper in helpers:
        helper.result()


@functools.cache
def _helpers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(HELPERS, 1), thread_name_prefix="bots-engine")
