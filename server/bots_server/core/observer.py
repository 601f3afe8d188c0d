"""Hooks the core calls on state changes, for metrics. The base class does
nothing; bots_server.metrics records them. Hooks run on worker threads and
must not raise. What they receive is already computed (by the engine): an
observer records, it does no math."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from bots_server.engine import BatchSignals, PosteriorState, PosteriorSummary, posterior_summary

__all__ = ["BatchSignals", "PosteriorSummary", "PosteriorView", "SelectorObserver"]


@dataclass(frozen=True)
class PosteriorView:
    """An experiment's posterior as monitoring sees it. `summary` computes the
    O(pool) summary relative to the target on demand: at scrape time, not per
    step."""

    step: int
    num_tasks: int
    capability: float  # NaN until known
    summary: Callable[[], PosteriorSummary]

    @classmethod
    def of(cls, step: int, state: PosteriorState, target: float) -> PosteriorView:
        # Cached: scrapes between two steps see the same posterior; compute it once.
        summary = functools.cache(functools.partial(posterior_summary, state, target))
        return cls(step, state.num_tasks, state.capability, summary)


class SelectorObserver:
    def batch_selected(self, experiment: str, batch_id: str, batch_size: int, lease_expires: float) -> None:
        """A new batch was stored; its lease ends at Unix time `lease_expires`."""

    def report_applied(
        self, experiment: str, batch_id: str, signals: BatchSignals, posterior: PosteriorView
    ) -> None:
        """Batch `batch_id`'s report was committed as step `posterior.step`, with the posterior after it."""

    def experiment_listed(self, experiment: str, step: int, num_tasks: int) -> None:
        """At start-up: an experiment in the store, not loaded (its posterior is not in memory)."""

    def checkpoint_written(self, experiment: str, step: int, seconds: float) -> None:
        """All posterior rows of `experiment` were written as of `step`."""

    def experiment_loaded(self, experiment: str, posterior: PosteriorView, seconds: float) -> None:
        """An experiment was rebuilt from the store (checkpoint + replay)."""

    def tasks_added(self, experiment: str, num_tasks: int) -> None:
        """Tasks were added; the pool now holds `num_tasks`."""

    def groups_selected(self, experiment: str, counts: dict[str, int]) -> None:
        """A new batch took `counts[group]` tasks of each group (experiments with groups only)."""

    def tasks_retired(self, experiment: str, num_retired: int, num_tasks: int) -> None:
        """Tasks were retired or re-activated; `num_retired` of `num_tasks` are retired now."""

    def experiment_removed(self, experiment: str) -> None:
        """An experiment was deleted (here or on another replica); drop its series."""

    def bulk_yielded(self, seconds: float) -> None:
        """A bulk call (upload, restore, snapshot) waited `seconds` for
        trainer calls (core/priority.py). Called on a worker thread."""

    def experiment_evicted(self, experiment: str) -> None:
        """An idle experiment left memory (the memory budget); it stays in the
        store, so its series stay."""

