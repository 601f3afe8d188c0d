"""Giving memory the process no longer uses back to the operating system.

glibc's malloc keeps what is freed for reuse. After a rebuild frees a
million loaded keys, or the checkpoint's value, the pages stay resident; and
each worker thread gets an arena of its own, which keeps its own copy of a
step's temporary arrays (8 MB each at 1M tasks) once glibc has raised its
mmap threshold past them. So the server caps the arenas (`configure`, at
start) and returns free pages after the large one-off allocations
(`release_free_memory`): bench/memory.py measures both.

Not a fixed mmap threshold: mapping and faulting in every temporary array
anew cost about 40 ms of CPU per step at 1M tasks (a scratch measurement,
against 80-100 ms for the whole step). Elsewhere than glibc these do nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

# mallopt's parameter number (malloc.h).
M_ARENA_MAX = -8
# One arena for every thread: the workers' large allocations are few per step
# (Python's small objects do not go through malloc), and with one arena per
# worker each kept its own copy of a step's temporaries: at 1M tasks, 2
# arenas measured 267 bytes per task after 5 steps, 1 arena 191.
ARENAS = 1


def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


_MALLOPT = _libc_function("mallopt")
_MALLOC_TRIM = _libc_function("malloc_trim")


def configure() -> None:
    """Cap malloc's arenas, unless MALLOC_ARENA_MAX already says how many.
    Call before the worker threads start."""
    if _MALLOPT is not None and "MALLOC_ARENA_MAX" not in os.environ:
        _MALLOPT(M_ARENA_MAX, ARENAS)


# Below this many tasks handled, what was freed is too little to be worth a
# trim (a few ms, paid again by the calls that fault the pages back in).
MIN_TASKS_TO_TRIM = 50_000


def release_free_memory(tasks: int) -> None:
    """After work over `tasks` tasks: return every arena's free pages to
    the operating system (a few ms), if there is enough to gain."""
    if _MALLOC_TRIM is not None and tasks >= MIN_TASKS_TO_TRIM:
        _MALLOC_TRIM(0)
