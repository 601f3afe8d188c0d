"""Admission control: a bound on the memory that calls hold at once.

AddTasks and RestoreExperiment hold their whole stream before they write it
(all or nothing), and Snapshot holds the experiment's copy while it streams
it out. Each call is charged an estimate of what it holds; the charges of
all calls in flight stay under a server-wide budget and, per tenant, under
a tenant budget, so no caller (nor any number of them) can push the process
past its memory limit and take every tenant's calls down with it.

A call that does not fit waits up to `wait_s` for others to finish, then
gets RESOURCE_EXHAUSTED with a retry hint (gRPC's retry pushback, which
bots_client follows); nothing was written. A call
whose charge alone exceeds a budget is refused at once.

Each tenant also runs at most `tenant_calls` of these calls at once; the
rest wait their turn in arrival order (until their deadline). Their work is
seconds of CPU and of database writes, so this keeps one tenant's flood to
one worker's share of the process, and leaves the rest to other tenants.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from bots_server.errors import ResourceExhausted

# Peak resident bytes per task while AddTasks holds and writes a stream:
# 667-807 B/task measured with 12-character keys and two features
# (bench/memory.py; docs/operations/ memory section), so 700 per task plus
# the stream's own bytes.
BYTES_PER_STREAMED_TASK = 700
# A snapshot's copy while it streams out: the posterior, retired flags and
# the keys as Python strings (about 100 B/task), and with features their
# dicts (about 400 B/task more; measured with tracemalloc on 100k tasks).
BYTES_PER_SNAPSHOT_TASK = 100
BYTES_PER_SNAPSHOT_FEATURES = 400
# With features, each task's embedding too: its bytes, and a bytes object's
# header (33 B) around them.
BYTES_PER_SNAPSHOT_EMBEDDING = 40
_MB = 1024 * 1024
# A call refused for want of room (after waiting wait_s for it) tells the
# client to try again this much later: the calls holding the room finish in
# seconds (bots_client retries it, within its retry_timeout).
RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class Budgets:
    """None: no bound."""

    total_bytes: int | None = None
    tenant_bytes: int | None = None
    tenant_calls: int | None = None
    wait_s: float = 5.0


def _mb(n: int) -> str:
    return f"{n / _MB:.0f} MB"


class Admission:
    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets
        self.held_total = 0
        self.held: defaultdict[str, int] = defaultdict(int)
        self._changed = asyncio.Condition()
        self._turns: dict[str, asyncio.Semaphore] = {}

    def _fits(self, tenant: str, n: int) -> bool:
        b = self.budgets
        total_ok = b.total_bytes is None or self.held_total + n <= b.total_bytes
        tenant_ok = b.tenant_bytes is None or self.held[tenant] + n <= b.tenant_bytes
        return total_ok and tenant_ok

    async def acquire(self, tenant: str, n: int, method: str) -> None:
        b = self.budgets
        for limit, what, flag in ((b.total_bytes, "the server", "--inflight-budget-mb"),
                                  (b.tenant_bytes, f"tenant {tenant!r}", "--tenant-inflight-budget-mb")):  # fmt: skip
            if limit is not None and n > limit:
                raise ResourceExhausted(
                    f"{method}: this call needs about {_mb(n)} of server memory, more than {what} may hold at once "
                    f"({flag} = {_mb(limit)}); send the tasks in several smaller calls; nothing was written"
                )
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._fits(tenant, n)), self.budgets.wait_s)
            except TimeoutError:
                raise ResourceExhausted(
                    f"{method}: the server is holding {_mb(self.held_total)} for calls in flight "
                    f"({_mb(self.held[tenant])} of them tenant {tenant!r}'s) and this call needs about {_mb(n)} "
                    f"more (--inflight-budget-mb, --tenant-inflight-budget-mb); retry in a few seconds; "
                    "nothing was written",
                    retry_after_s=RETRY_AFTER_S,
                ) from None
            self.held_total += n
            self.held[tenant] += n

    async def release(self, tenant: str, n: int) -> None:
        if n <= 0:
            return
        async with self._changed:
            self.held_total -= n
            self.held[tenant] -= n
            if self.held[tenant] == 0:
                del self.held[tenant]
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def holding(self, tenant: str, method: str) -> AsyncIterator[Charge]:
        """The tenant's turn, then a charge that grows as the call takes
        memory; both released when the call ends."""
        calls = self.budgets.tenant_calls
        turn = contextlib.nullcontext() if calls is None else self._turns.setdefault(tenant, asyncio.Semaphore(calls))
        async with turn:
            charge = Charge(self, tenant, method)
            try:
                yield charge
            finally:
                await self.release(tenant, charge.bytes)


class Charge:
    def __init__(self, admission: Admission, tenant: str, method: str) -> None:
        self.admission, self.tenant, self.method = admission, tenant, method
        self.bytes = 0

    async def at_least(self, n: int) -> None:
        """Hold `n` bytes in all (no-op when this call holds that much already)."""
        more = n - self.bytes
        if more > 0:
            await self.admission.acquire(self.tenant, more, self.method)
            self.bytes = n


def stream_cost(tasks: int, stream_bytes: int, embedding_bytes: int = 0) -> int:
    """`embedding_bytes`: of one task's embedding (0: none). The stream's
    bytes hold each once; the call holds it twice more (a bytes object per
    task, then the experiment's array): bench/memory.py --embedding-dim 256
    measured 3.0-3.1 KB/task more at the peak of an AddTasks call."""
    return tasks * (BYTES_PER_STREAMED_TASK + 2 * embedding_bytes) + stream_bytes


def snapshot_cost(tasks: int, include_features: bool, embedding_bytes: int = 0) -> int:
    """`embedding_bytes`: of one task's embedding (0: none)."""
    per_task = BYTES_PER_SNAPSHOT_TASK
    if include_features:
        per_task += BYTES_PER_SNAPSHOT_FEATURES
        if embedding_bytes:
            per_task += embedding_bytes + BYTES_PER_SNAPSHOT_EMBEDDING
    return tasks * per_task
