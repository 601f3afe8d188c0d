"""Summaries of a posterior and of a reported batch, for monitoring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bots_server.engine.state import PosteriorState

# Posterior means below LOW are tasks the model (almost) never solves, above
# HIGH ones it (almost) always solves: neither gives a GRPO gradient.
SPREAD_LOW, SPREAD_HIGH = 0.1, 0.9


def posterior_spread(state: PosteriorState) -> tuple[float, float, float]:
    """Shares of tasks with posterior mean < LOW, in between, > HIGH."""
    mean = state.alpha / (state.alpha + state.beta)
    n = mean.shape[0]
    low = int(np.count_nonzero(mean < SPREAD_LOW)) / n
    high = int(np.count_nonzero(mean > SPREAD_HIGH)) / n
    return low, 1.0 - low - high, high


@dataclass(frozen=True)
class BatchSignals:
    """What one report says about the curriculum."""

    tasks: int
    informative: int  # tasks with 0 < successes < trials: a GRPO gradient
    successes: float
    trials: float

    @property
    def success_rate(self) -> float | None:
        return self.successes / self.trials if self.trials > 0 else None

    @property
    def informative_fraction(self) -> float | None:
        return self.informative / self.tasks if self.tasks else None


def batch_signals(successes: Sequence[float], trials: Sequence[int]) -> BatchSignals:
    s = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    return BatchSignals(
        tasks=len(n),
        informative=int(np.count_nonzero((s > 0) & (s < n))),
        successes=float(s.sum()),
        trials=float(n.sum()),
    )
