"""Per-tenant quotas: how many experiments a tenant may hold, how many tasks
one experiment, and how many tasks all of them together.

A write that adds to a tenant's usage (create, fork, restore, add tasks) is
checked twice. First against the store's counts before its work: a call that
cannot fit is refused before a fork or restore encodes its state and without
waiting for a write lock. Then by the store in the write's own transaction,
under a lock per tenant (PostgreSQL: an advisory lock every replica takes;
SQLite: the database's single writer): that check decides, so no interleaving
of concurrent calls, on one server or on replicas of one database, leaves a
tenant above its quotas. One experiment's task count needs no lock: adding
tasks is a compare-and-set on it. Quotas bound memory and disk, not billing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from bots_server.core import tenancy
from bots_server.core.runtime import Runtime
from bots_server.errors import ResourceExhausted
from bots_server.store import OverQuota, TenantLimits, TenantUsage

T = TypeVar("T")


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
    # A stream that sends nothing this long is ended: the memory held for
    # it (reserved for the tasks its first message announced) must not be
    # held by a client that stalls, or means to.
    idle_seconds: float = 60.0


DEFAULT_STREAM_BOUNDS = StreamBounds()

QuotasOf = Callable[[str], Quotas]  # tenant -> its quotas


@dataclass(frozen=True)
class QuotaClaim:
    """A write QuotaCheck let through: `tenant`'s quotas and what the write
    claims of them (one experiment or none, `tasks` tasks), for the store to
    check again in the write's transaction."""

    tenant: str
    quotas: Quotas
    new_experiment: bool
    tasks: int

    @property
    def limits(self) -> TenantLimits | None:
        """What the store checks; None: no quota applies to this write."""
        max_experiments = self.quotas.max_experiments if self.new_experiment else None
        if max_experiments is None and self.quotas.max_tasks is None:
            return None
        return TenantLimits(self.tenant, max_experiments, self.quotas.max_tasks)

    def check(self, usage: TenantUsage) -> None:
        """ResourceExhausted if the write would take a tenant at `usage` past
        its quotas: the comparisons the store makes (store.base)."""
        limit = self.quotas.max_experiments
        if self.new_experiment and limit is not None and usage.experiments + 1 > limit:
            raise ResourceExhausted(
                f"tenant {self.tenant!r} has {usage.experiments} experiments: quota max_experiments = "
                f"{limit}; delete one or ask an administrator to raise the quota"
            )
        limit = self.quotas.max_tasks
        if limit is not None and usage.tasks + self.tasks > limit:
            raise ResourceExhausted(
                f"tenant {self.tenant!r} would hold {usage.tasks + self.tasks} tasks in all its experiments: "
                f"quota max_tasks = {limit}; nothing was written"
            )


class QuotaCheck:
    def __init__(self, runtime: Runtime, quotas_of: QuotasOf) -> None:
        self.runtime = runtime
        self.quotas_of = quotas_of

    async def new_experiment(self, name: str, num_tasks: int) -> QuotaClaim:
        """Before creating `name` (a stored name) with `num_tasks` tasks."""
        tenant = tenancy.tenant_of(name)
        quotas = self.quotas_of(tenant)
        _per_experiment(quotas, name, num_tasks)
        return await self._precheck(QuotaClaim(tenant, quotas, new_experiment=True, tasks=num_tasks))

    async def more_tasks(self, name: str, num_tasks: int, added: int) -> QuotaClaim:
        """Before adding `added` tasks to `name`, which has `num_tasks`."""
        tenant = tenancy.tenant_of(name)
        quotas = self.quotas_of(tenant)
        _per_experiment(quotas, name, num_tasks + added)
        return await self._precheck(QuotaClaim(tenant, quotas, new_experiment=False, tasks=added))

    async def _precheck(self, claim: QuotaClaim) -> QuotaClaim:
        if claim.limits is not None:
            claim.check(await self.runtime.db(self.runtime.store.tenant_usage, claim.tenant))
        return claim

    async def write(self, claim: QuotaClaim, fn: Callable[..., T], *args: object) -> T:
        """The store write `fn(*args, abandoned=..., limits=...)` (see
        Runtime.db_write_unless_cancelled), given the claim's limits: the
        store's refusal (OverQuota) is answered as the pre-check answers."""
        try:
            return await self.runtime.db_write_unless_cancelled(functools.partial(fn, limits=claim.limits), *args)
        except OverQuota as e:
            claim.check(e.usage)  # raises: it compares as the store does
            raise


def _per_experiment(quotas: Quotas, name: str, total: int) -> None:
    limit = quotas.max_tasks_per_experiment
    if limit is not None and total > limit:
        raise ResourceExhausted(
            f"experiment {name!r} would hold {total} tasks: quota max_tasks_per_experiment = {limit}; nothing was written"
        )
