"""Wall-clock bounds that hold on a busy machine.

A test that checks a deadline asserts the deadline itself exactly (a retry
budget is not cut short) and gives what comes on top of it (process start,
scheduling, the event loop's turn) a margin that stretches with the machine's
load: on two cores at load 6 a process gets a third of the CPU it gets on a
quiet machine, so everything around the deadline takes about three times as
long.
"""

from __future__ import annotations

import os


def load_factor() -> float:
    """How many times slower than a quiet machine this one runs now: the
    1-minute load average per core, at least 1."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def slack(seconds: float) -> float:
    """A margin of `seconds` on a quiet machine, stretched by the load."""
    return seconds * load_factor()
