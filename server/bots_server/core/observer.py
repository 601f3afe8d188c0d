"""Hooks the core calls on state changes, for metrics. The base class does
nothing; bots_server.metrics records them. Hooks run on worker threads and
must not raise."""

from __future__ import annotations

from collections.abc import Sequence

from bots_server.engine import PosteriorState


class SelectorObserver:
    def batch_selected(self, experiment: str, batch_size: int, leased_tasks: int) -> None:
        """A new batch was stored; `leased_tasks` counts tasks in open batches, this one included."""

    def report_applied(
        self, experiment: str, step: int, successes: Sequence[float], trials: Sequence[int], state: PosteriorState
    ) -> None:
        """A report was committed as `step`; `state` is the posterior after it."""

    def checkpoint_written(self, experiment: str, step: int, seconds: float) -> None:
        """All posterior rows of `experiment` were written as of `step`."""

    def experiment_loaded(self, experiment: str, step: int, state: PosteriorState, seconds: float) -> None:
        """An experiment was rebuilt from the store (checkpoint + replay); `state` is its posterior."""

    def tasks_added(self, experiment: str, num_tasks: int) -> None:
        """Tasks were added; the pool now holds `num_tasks`."""

    def experiment_removed(self, experiment: str) -> None:
        """An experiment was deleted (here or on another replica); drop its series."""
