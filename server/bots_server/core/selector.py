"""SelectorService: the core's use cases wired together over one runtime.

The servicer calls the use cases through it: `experiments`, `pool`,
`batches`; `checkpoints` runs in the background.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from bots_server.core.batches import Batches
from bots_server.core.checkpoints import CheckpointPolicy, Checkpoints
from bots_server.core.experiments import Experiments
from bots_server.core.observer import SelectorObserver
from bots_server.core.pool import Pool
from bots_server.core.priority import DEFAULT_BULK_SHARE
from bots_server.core.quotas import UNLIMITED, QuotaCheck, QuotasOf
from bots_server.core.runtime import Runtime, utcnow
from bots_server.store import Store

DEFAULT_CHECKPOINT_POLICY = CheckpointPolicy()


class SelectorService:
    def __init__(
        self,
        store: Store,
        *,
        checkpoint_policy: CheckpointPolicy = DEFAULT_CHECKPOINT_POLICY,
        max_workers: int = 8,
        clock: Callable[[], dt.datetime] = utcnow,
        observer: SelectorObserver | None = None,
        database_timeout_s: float = 5.0,
        quotas_of: QuotasOf = lambda tenant: UNLIMITED,
        memory_budget_bytes: int | None = None,
        bulk_share: float = DEFAULT_BULK_SHARE,
    ) -> None:
        self.store = store
        self.runtime = Runtime(
            store,
            max_workers=max_workers,
            clock=clock,
            observer=observer or SelectorObserver(),
            database_timeout_s=database_timeout_s,
            memory_budget_bytes=memory_budget_bytes,
            bulk_share=bulk_share,
        )
        self.checkpoints = Checkpoints(self.runtime, checkpoint_policy)
        quotas = QuotaCheck(self.runtime, quotas_of)
        self.experiments = Experiments(self.runtime, self.checkpoints, quotas)
        self.pool = Pool(self.runtime, quotas)
        self.batches = Batches(self.runtime, self.checkpoints)

    async def close(self) -> None:
        """Finish running checkpoints, checkpoint everything, release threads."""
        await self.checkpoints.close()
        self.runtime.close()


__all__ = ["CheckpointPolicy", "SelectorService"]
