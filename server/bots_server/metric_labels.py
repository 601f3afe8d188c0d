"""The experiment and group labels of the metrics: names, or opaque labels.

The metrics endpoint has no credentials, so on a server shared by tenants
its labels must not carry one tenant's experiment names (or the group
names its callers chose) to whoever can scrape it. With opaque labels an
experiment is `tenant/<12 hex digits>` (the first 12 of the SHA-256 of its
stored name: stable across restarts and processes, and computable by whoever
knows the name) and a group `g-<10 hex digits>`. The tenant stays readable:
tenants are the operator's own configuration, and dashboards group by them.
"""

from __future__ import annotations

import hashlib

from bots_server.core import tenancy
from bots_server.core.observer import BatchSignals, PosteriorView, SelectorObserver

LABEL_MODES: tuple[str, ...] = ("auto", "names", "opaque")


def _digest(text: str, digits: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:digits]


def opaque_experiment(stored: str) -> str:
    return f"{tenancy.tenant_of(stored)}/{_digest(stored, 12)}"


def opaque_group(group: str) -> str:
    return f"g-{_digest(group, 10)}"


def opaque(setting: str, tenants: bool) -> bool:
    """Whether labels are opaque: `auto` makes them so when the server has
    tenants (a credentials file), and names when it serves one user."""
    return setting == "opaque" or (setting == "auto" and tenants)


class OpaqueLabels(SelectorObserver):
    """Passes every hook on to `inner` with the experiment (and group) names
    replaced by opaque labels."""

    def __init__(self, inner: SelectorObserver) -> None:
        self.inner = inner

    def batch_selected(self, experiment: str, batch_id: str, batch_size: int, lease_expires: float) -> None:
        self.inner.batch_selected(opaque_experiment(experiment), batch_id, batch_size, lease_expires)

    def report_applied(self, experiment: str, batch_id: str, signals: BatchSignals, posterior: PosteriorView) -> None:
        self.inner.report_applied(opaque_experiment(experiment), batch_id, signals, posterior)

    def experiment_listed(self, experiment: str, step: int, num_tasks: int) -> None:
        self.inner.experiment_listed(opaque_experiment(experiment), step, num_tasks)

    def checkpoint_written(self, experiment: str, step: int, seconds: float) -> None:
        self.inner.checkpoint_written(opaque_experiment(experiment), step, seconds)

    def experiment_loaded(self, experiment: str, posterior: PosteriorView, seconds: float) -> None:
        self.inner.experiment_loaded(opaque_experiment(experiment), posterior, seconds)

    def tasks_added(self, experiment: str, num_tasks: int) -> None:
        self.inner.tasks_added(opaque_experiment(experiment), num_tasks)

    def groups_selected(self, experiment: str, counts: dict[str, int]) -> None:
        labelled = {opaque_group(group) if group else group: n for group, n in counts.items()}
        self.inner.groups_selected(opaque_experiment(experiment), labelled)

    def tasks_retired(self, experiment: str, num_retired: int, num_tasks: int) -> None:
        self.inner.tasks_retired(opaque_experiment(experiment), num_retired, num_tasks)

    def experiment_removed(self, experiment: str) -> None:
        self.inner.experiment_removed(opaque_experiment(experiment))

    def experiment_evicted(self, experiment: str) -> None:
        self.inner.experiment_evicted(opaque_experiment(experiment))

    def bulk_yielded(self, seconds: float) -> None:
        self.inner.bulk_yielded(seconds)
