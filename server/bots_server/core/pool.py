"""The task pool of an experiment: adding tasks."""

from __future__ import annotations

from collections.abc import Sequence

from bots_server.core import audit, validation
from bots_server.core.domain import Task
from bots_server.core.quotas import QuotaCheck
from bots_server.core.runtime import MAX_WRITE_ATTEMPTS, Runtime, contended
from bots_server.errors import AlreadyExists
from bots_server.store import StaleStep


class Pool:
    def __init__(self, runtime: Runtime, quotas: QuotaCheck) -> None:
        self.runtime = runtime
        self.quotas = quotas

    async def add_tasks(self, name: str, tasks: Sequence[Task]) -> tuple[int, int]:
        """Add tasks at the prior, all or nothing. Returns (added, tasks in the experiment)."""
        validation.experiment_name(name)
        rt = self.runtime
        async with rt.locked(name):
            live, _ = await rt.ready(name)
            await rt.run(validation.tasks, live.config, tasks)
            keys = [task.key for task in tasks]
            features = [dict(task.features) for task in tasks]
            for _ in range(MAX_WRITE_ATTEMPTS):
                taken = [key for key in keys if key in live.index]
                if taken:
                    raise _already_has(name, taken)
                await self.quotas.more_tasks(name, live.num_tasks, len(keys))
                try:
                    await rt.db_write_unless_cancelled(rt.store.add_tasks, live.id, live.num_tasks, keys, features)
                except StaleStep:
                    await rt.catch_up(live)
                    continue
                await rt.run(live.append_tasks, keys, *live.reference_rates(features))
                rt.keep_within_budget()
                rt.notify(rt.observer.tasks_added, name, live.num_tasks)
                audit.experiments.info("tasks added", extra={"experiment": name, "added": len(keys), "num_tasks": live.num_tasks})
                return len(keys), live.num_tasks
            raise contended(name)


def _already_has(name: str, taken: list[str]) -> AlreadyExists:
    shown = ", ".join(repr(k) for k in taken[:5])
    more = f" and {len(taken) - 5} more" if len(taken) > 5 else ""
    return AlreadyExists(f"experiment {name!r} already has tasks {shown}{more}")
