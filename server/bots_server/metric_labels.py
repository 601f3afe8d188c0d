"""The experiment, group and tenant labels of the metrics: names, or opaque labels.

On a server shared by tenants the metrics must not carry one tenant's
experiment names (or the group names its callers chose) to whoever can
scrape them, nor let a scraper confirm a name it guessed. With opaque labels
an experiment is `tenant/<16 hex digits>` and a group `g-<12 hex digits>`:
an HMAC-SHA256 of the stored name, keyed by a server secret
(--metrics-label-key-file or BOTS_METRICS_LABEL_KEY). The same key gives the
same labels after a restart and on every replica; without the key a
guessed name cannot be checked against a label. A server given no key
draws one at start (labels then change at each restart).

The tenant stays readable unless the tenant labels are opaque as well
(--metrics-tenant-labels opaque): then a tenant is `t-<10 hex digits>`, in
experiment labels and in bots_tenant_calls_total alike.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

from bots_server.core import tenancy
from bots_server.core.observer import BatchSignals, PosteriorView, SelectorObserver

log = logging.getLogger(__name__)

LABEL_MODES: tuple[str, ...] = ("auto", "names", "opaque")
TENANT_LABEL_MODES: tuple[str, ...] = ("names", "opaque")
# A key shorter than this is refused: the labels are only as hard to
# confirm as the key is to guess.
MIN_KEY_CHARS = 16


def opaque(setting: str, tenants: bool) -> bool:
    """Whether labels are opaque: `auto` makes them so when the server has
    tenants (a credentials file), and names when it serves one user."""
    return setting == "opaque" or (setting == "auto" and tenants)


def key_or_drawn(key: str, used: bool) -> str:
    """`key`, or one drawn now if it is empty (with a warning if `used`:
    the labels then change at each restart)."""
    if key:
        return key
    if used:
        log.warning(
            "opaque metrics labels with a key drawn at start: they change at each restart and differ between "
            "servers; set --metrics-label-key-file or BOTS_METRICS_LABEL_KEY for labels that stay"
        )
    return secrets.token_hex(32)


class Labeller:
    """Turns names into the labels the metrics show."""

    def __init__(self, key: str, opaque_tenants: bool = False) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"the metrics label key has {len(key)} characters; at least {MIN_KEY_CHARS} are needed")
        self._key = key.encode()
        self.opaque_tenants = opaque_tenants

    def _digest(self, kind: str, text: str, digits: int) -> str:
        # The kind keeps an experiment's label from ever equalling a group's
        # or a tenant's of the same text.
        return hmac.new(self._key, f"{kind}\0{text}".encode(), hashlib.sha256).hexdigest()[:digits]

    def tenant(self, tenant: str) -> str:
        return f"t-{self._digest('tenant', tenant, 10)}" if self.opaque_tenants else tenant

    def experiment(self, stored: str) -> str:
        return f"{self.tenant(tenancy.tenant_of(stored))}/{self._digest('experiment', stored, 16)}"

    def group(self, group: str) -> str:
        return f"g-{self._digest('group', group, 12)}" if group else group


class OpaqueLabels(SelectorObserver):
    """Passes every hook on to `inner` with the experiment (and group) names
    replaced by opaque labels."""

    def __init__(self, inner: SelectorObserver, labeller: Labeller) -> None:
        self.inner = inner
        self.label = labeller

    def batch_selected(self, experiment: str, batch_id: str, batch_size: int, lease_expires: float) -> None:
        self.inner.batch_selected(self.label.experiment(experiment), batch_id, batch_size, lease_expires)

    def report_applied(self, experiment: str, batch_id: str, signals: BatchSignals, posterior: PosteriorView) -> None:
        self.inner.report_applied(self.label.experiment(experiment), batch_id, signals, posterior)

    def experiment_listed(self, experiment: str, step: int, num_tasks: int) -> None:
        self.inner.experiment_listed(self.label.experiment(experiment), step, num_tasks)

    def checkpoint_written(self, experiment: str, step: int, seconds: float) -> None:
        self.inner.checkpoint_written(self.label.experiment(experiment), step, seconds)

    def experiment_loaded(self, experiment: str, posterior: PosteriorView, seconds: float) -> None:
        self.inner.experiment_loaded(self.label.experiment(experiment), posterior, seconds)

    def tasks_added(self, experiment: str, num_tasks: int) -> None:
        self.inner.tasks_added(self.label.experiment(experiment), num_tasks)

    def groups_selected(self, experiment: str, counts: dict[str, int]) -> None:
        labelled = {self.label.group(group): n for group, n in counts.items()}
        self.inner.groups_selected(self.label.experiment(experiment), labelled)

    def tasks_retired(self, experiment: str, num_retired: int, num_tasks: int) -> None:
        self.inner.tasks_retired(self.label.experiment(experiment), num_retired, num_tasks)

    def experiment_removed(self, experiment: str) -> None:
        self.inner.experiment_removed(self.label.experiment(experiment))

    def experiment_evicted(self, experiment: str) -> None:
        self.inner.experiment_evicted(self.label.experiment(experiment))

    def bulk_yielded(self, seconds: float) -> None:
        self.inner.bulk_yielded(seconds)
