"""Hooks the core calls on state changes, for metrics. The base class does
nothing; bots_server.metrics records them. Hooks run on worker threads and
must not raise. What they receive is already computed (by the engine): an
observer records, it does no math."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from bots_server.engine import BatchSignals, PosteriorState, posterior_spread
from bots_server.engine.summary import SPREAD_HIGH, SPREAD_LOW

__all__ = ["SPREAD_HIGH", "SPREAD_LOW", "BatchSignals", "PosteriorView", "SelectorObserver"]


@dataclass(frozen=True)
class PosteriorView:
    """An experiment's posterior as monitoring sees it. `spread` computes the
    O(pool) shares (low, mid, high) on demand: at scrape time, not per step."""

    step: int
    num_tasks: int
    capability: float  # NaN until known
    spread: Callable[[], tuple[float, float, float]]

    @classmethod
    def of(cls, step: int, state: PosteriorState) -> PosteriorView:
        return cls(step, state.num_tasks, state.capability, functools.partial(posterior_spread, state))


class SelectorObserver:
    def batch_selected(self, experiment: str, batch_size: int, leased_tasks: int) -> None:
        """A new batch was stored; `leased_tasks` counts tasks in open batches, this one included."""

    def report_applied(self, experiment: str, signals: BatchSignals, posterior: PosteriorView) -> None:
        """A report was committed as step `posterior.step`, with the posterior after it."""

    def checkpoint_written(self, experiment: str, step: int, seconds: float) -> None:
        """All posterior rows of `experiment` were written as of `step`."""

    def experiment_loaded(self, experiment: str, posterior: PosteriorView, seconds: float) -> None:
        """An experiment was rebuilt from the store (checkpoint + replay)."""

    def tasks_added(self, experiment: str, num_tasks: int) -> None:
        """Tasks were added; the pool now holds `num_tasks`."""

    def experiment_removed(self, experiment: str) -> None:
        """An experiment was deleted (here or on another replica); drop its series."""

