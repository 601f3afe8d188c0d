"""Per-tenant quotas: how many experiments a tenant may hold, how many tasks
one experiment, and how many tasks all of them together.

Checked before the write, against the store's counts: two creates racing on
two replicas may both pass a quota that has room for one (the overshoot is at
most one call per replica). They bound memory and disk, not billing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bots_server.core import tenancy
from bots_server.core.runtime import Runtime
from bots_server.errors import ResourceExhausted


@dataclass(frozen=True)
class Quotas:
    """None: no limit."""

    max_experiments: int | None = None
    max_tasks_per_experiment: int | None = None
    max_tasks: int | None = None


UNLIMITED = Quotas()


@dataclass(frozen=True)
class StreamBounds:
    """What one AddTasks or RestoreExperiment stream may carry: the server
    holds a whole stream before it writes it (all or nothing). The defaults
    keep one stream near 1 GB of server memory at the most (measured:
    docs/operations.md)."""

    max_tasks: int = 1_000_000
    max_bytes: int = 256 * 1024 * 1024


DEFAULT_STREAM_BOUNDS = StreamBounds()

QuotasOf = Callable[[str], Quotas]  # tenant -> its quotas


class QuotaCheck:
    def __init__(self, runtime: Runtime, quotas_of: QuotasOf) -> None:
        self.runtime = runtime
        self.quotas_of = quotas_of

    async def new_experiment(self, name: str, num_tasks: int) -> None:
        """Before creating `name` (a stored name) with `num_tasks` tasks."""
        tenant = tenancy.tenant_of(name)
        quotas = self.quotas_of(tenant)
        _per_experiment(quotas, name, num_tasks)
        if quotas.max_experiments is None and quotas.max_tasks is None:
            return
        usage = await self.runtime.db(self.runtime.store.tenant_usage, tenant)
        if quotas.max_experiments is not None and usage.experiments + 1 > quotas.max_experiments:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {usage.experiments} experiments: quota max_experiments = "
                f"{quotas.max_experiments}; delete one or ask an administrator to raise the quota"
            )
        _tenant_tasks(quotas, tenant, usage.tasks, num_tasks)

    async def more_tasks(self, name: str, num_tasks: int, added: int) -> None:
        """Before adding `added` tasks to `name`, which has `num_tasks`."""
        tenant = tenancy.tenant_of(name)
        quotas = self.quotas_of(tenant)
        _per_experiment(quotas, name, num_tasks + added)
        if quotas.max_tasks is not None:
            usage = await self.runtime.db(self.runtime.store.tenant_usage, tenant)
            _tenant_tasks(quotas, tenant, usage.tasks, added)


def _per_experiment(quotas: Quotas, name: str, total: int) -> None:
    limit = quotas.max_tasks_per_experiment
    if limit is not None and total > limit:
        raise ResourceExhausted(
            f"experiment {name!r} would hold {total} tasks: quota max_tasks_per_experiment = {limit}; nothing was written"
        )


def _tenant_tasks(quotas: Quotas, tenant: str, used: int, added: int) -> None:
    limit = quotas.max_tasks
    if limit is not None and used + added > limit:
        raise ResourceExhausted(
            f"tenant {tenant!r} would hold {used + added} tasks in all its experiments: quota max_tasks = {limit}; "
            "nothing was written"
        )
