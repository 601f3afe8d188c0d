"""Thompson draws: one Beta draw per task, in the experiment's random stream.

Stream 1 draws the whole pool from the step's generator, in one call (the
reference code's draw). Stream 2 draws a pool of PARTED_MIN_TASKS or more in
PARTS contiguous parts, part i from the i-th child of the step's generator
(`Generator.spawn`), so that the parts can be drawn on several cores at once:
numpy releases the GIL inside a draw. A smaller pool is drawn as stream 1
draws it. The numbers depend only on the generator and the pool size, never
on how many threads draw them (tests/engine/test_engine_draws.py).

In stream 2 the step's generator draws nothing for a parted pool (spawning
does not move it): what it draws next (ties at the cut, Gumbel noise) starts
where it was.
"""

from __future__ import annotations

import numpy as np

from bots_server.engine import parallel

STREAMS = (1, 2)
NEWEST_STREAM = 2
# Parts of a stream 2 draw: a fixed number, so that the numbers are the same
# on a machine of any size; enough for 8 cores.
PARTS = 8
# A smaller pool's draw is short (about 0.4 ms at 10k tasks on the
# benchmarks' machine): parts would save little of it.
PARTED_MIN_TASKS = 32768


def beta_draws(rng: np.random.Generator, alpha: np.ndarray, beta: np.ndarray, stream: int) -> np.ndarray:
    """Beta(alpha_i, beta_i) draws of every task, in stream `stream`."""
    n = alpha.shape[0]
    if stream == 1 or n < PARTED_MIN_TASKS:
        return rng.beta(alpha, beta)
    bounds = part_bounds(n)
    children = rng.spawn(PARTS)
    out = np.empty(n)

    def draw(part: int) -> None:
        lo, hi = bounds[part], bounds[part + 1]
        out[lo:hi] = children[part].beta(alpha[lo:hi], beta[lo:hi])

    parallel.run_parts(PARTS, draw)
    return out


def part_bounds(n: int) -> list[int]:
    """Where the parts of an n-task draw start, and n: part i is [b[i], b[i + 1])."""
    return [(i * n) // PARTS for i in range(PARTS + 1)]
