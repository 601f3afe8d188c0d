"""The task pool of an experiment: adding tasks, retiring and re-activating
them, its groups and their shares of each batch (engine/quotas.py).

A retired task is never selected again until re-activated; its posterior is
kept and keeps being updated as that of any task a batch did not pick (the
plug-in's implicit evidence and forgetting), so a re-activated task resumes
from a current estimate. Retiring a task that is in an open batch leaves the
batch as it is: a retry of its request key returns it unchanged, and its
report is applied in full (the rollouts are real evidence, as a report after
the lease expired is); the task is only not handed out again.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from bots_server.core import audit, limits, validation
from bots_server.core.allocator import release_free_memory
from bots_server.core.domain import GroupInfo, NewTasks, RetireResult
from bots_server.core.experiment import LiveExperiment
from bots_server.core.limits import shown
from bots_server.core.quotas import QuotaCheck
from bots_server.core.runtime import MAX_WRITE_ATTEMPTS, Runtime, contended
from bots_server.engine import adapted_quotas, group_summary, informative_fractions, share_problem
from bots_server.errors import AlreadyExists, InvalidArgument
from bots_server.store import StaleStep


class Pool:
    def __init__(self, runtime: Runtime, quotas: QuotaCheck) -> None:
        self.runtime = runtime
        self.quotas = quotas

    async def add_tasks(self, name: str, tasks: NewTasks) -> tuple[int, int]:
        """Add tasks at the prior, all or nothing. Returns (added, tasks in the experiment)."""
        validation.experiment_name(name)
        rt = self.runtime
        async with rt.locked(name):
            live, _ = await rt.ready(name)
            pacer = rt.priority.pacer()
            await rt.run(validation.tasks, live.config, tasks, pacer)
            keys, features, groups = tasks.keys, tasks.features, tasks.groups or [""] * len(tasks)
            vectors = tasks.embeddings if live.config.embedding_dim else None  # validated: empty without
            for _ in range(MAX_WRITE_ATTEMPTS):
                taken = [keys[j] for j in np.flatnonzero(await rt.run(live.keys.lookup, keys) >= 0).tolist()]
                if taken:
                    raise _already_has(name, taken)
                new_groups = live.new_groups(groups)
                if len(live.group_names) + len(new_groups) > limits.MAX_GROUPS:
                    raise InvalidArgument(
                        f"experiment {name!r} has {len(live.group_names)} groups and these tasks add "
                        f"{len(new_groups)} more; at most {limits.MAX_GROUPS}"
                    )
                claim = await self.quotas.more_tasks(name, live.num_tasks, len(keys))
                try:
                    add = functools.partial(
                        rt.store.add_tasks, groups=groups, pace=pacer.pace, embeddings=vectors
                    )
                    await self.quotas.write(claim, add, live.id, live.num_tasks, keys, features)
                except StaleStep:
                    await rt.catch_up(live)
                    continue
                await rt.run(
                    lambda: live.append_tasks(keys, *live.reference_rates(features), groups, vectors or ())
                )
                await rt.run(release_free_memory, len(keys))  # the request's transient buffers
                rt.keep_within_budget()
                rt.notify(rt.observer.tasks_added, name, live.num_tasks)
                audit.experiments.info("tasks added", extra={"experiment": name, "added": len(keys), "num_tasks": live.num_tasks})
                return len(keys), live.num_tasks
            raise contended(name)

    async def set_retired(self, name: str, keys: Sequence[str], retired: bool) -> RetireResult:
        """Retire (or re-activate) the tasks named by `keys`, all or nothing:
        an unknown key rejects the whole call. Tasks already in that state
        are left as they are; a call that changes nothing writes nothing."""
        what = "RetireTasks" if retired else "ReactivateTasks"
        validation.experiment_name(name)
        validation.task_keys(what, keys)
        rt = self.runtime
        async with rt.locked(name):
            live, _ = await rt.ready(name)
            for _ in range(MAX_WRITE_ATTEMPTS):
                task_idx = live.keys.lookup(keys)
                if (task_idx < 0).any():
                    raise _unknown_keys(what, name, [keys[j] for j in np.flatnonzero(task_idx < 0).tolist()])
                changed = np.sort(task_idx[live.retired[task_idx] != retired])
                if changed.size == 0:
                    return RetireResult(changed=0, num_retired=live.num_retired, num_tasks=live.num_tasks)
                seq = live.pool_seq + 1
                try:
                    event = await rt.db_write_unless_cancelled(
                        rt.store.commit_retirement, live.id, seq, changed.tolist(), retired, rt.clock()
                    )
                except StaleStep:  # another replica retired or re-activated meanwhile
                    await rt.catch_up(live)
                    continue
                live.apply_pool_events([event])
                rt.notify(rt.observer.tasks_retired, name, live.num_retired, live.num_tasks)
                audit.experiments.info(
                    "tasks retired" if retired else "tasks reactivated",
                    extra={"experiment": name, "changed": int(changed.size), "retired": live.num_retired},
                )
                return RetireResult(changed=int(changed.size), num_retired=live.num_retired, num_tasks=live.num_tasks)
            raise contended(name)

    async def set_group_shares(self, name: str, shares: dict[str, tuple[float, float]]) -> list[GroupInfo]:
        """Set each named group's (min, max) share of every batch from the
        next select on (groups not named: (0, 1); none: no quotas), replacing
        the shares before. All or nothing: an unknown group or shares no batch
        could meet reject the call. Returns the groups afterwards."""
        validation.experiment_name(name)
        validation.group_shares(shares)
        rt = self.runtime
        async with rt.locked(name):
            live, _ = await rt.ready(name)
            for _ in range(MAX_WRITE_ATTEMPTS):
                unknown = validation.unknown_share_groups(shares, live.group_names)
                if unknown is not None:
                    raise InvalidArgument(
                        f"SetGroupShares: experiment {name!r} has no tasks in groups {unknown}; nothing was changed"
                    )
                problem = share_problem(shares, live.group_names)
                if problem is not None:
                    raise InvalidArgument(f"SetGroupShares: {problem}; nothing was changed")
                try:
                    event = await rt.db_write_unless_cancelled(
                        rt.store.commit_shares, live.id, live.pool_seq + 1, shares, rt.clock()
                    )
                except StaleStep:  # another replica changed the pool's events meanwhile
                    await rt.catch_up(live)
                    continue
                live.apply_pool_events([event])
                audit.experiments.info("group shares set", extra={"experiment": name, "groups": len(shares)})
                return await rt.run(_group_infos, live)
            raise contended(name)

    async def groups(self, name: str) -> list[GroupInfo]:
        """The experiment's groups, in order of first appearance."""
        validation.experiment_name(name)
        rt = self.runtime
        async with rt.locked(name):
            live, _ = await rt.ready(name)
            return await rt.run(_group_infos, live)


def _group_infos(live: LiveExperiment) -> list[GroupInfo]:
    num_groups = len(live.group_names)
    summary = group_summary(live.state, live.group_of, live.retired, num_groups, live.config.target_success)
    unretired = ~live.retired
    alpha, beta = live.state.alpha, live.state.beta
    informative, free = informative_fractions(live.config, alpha, beta, unretired, live.group_of, num_groups)
    quotas = live.quotas()
    adaptive = None
    if live.config.adaptive_shares > 0 and quotas is not None and unretired.any():
        adaptive = adapted_quotas(live.config, quotas, informative, free).min_shares
    infos = []
    for number, group in enumerate(live.group_names):
        low, high = live.shares.get(group, (None, None))
        infos.append(
            GroupInfo(
                name=group,
                num_tasks=int(summary.tasks[number]),
                num_retired=int(summary.retired[number]),
                min_share=low,
                max_share=high,
                mean_success=float(summary.mean_success[number]),
                near_target=float(summary.near_target[number]),
                informative=float(informative[number]),
                adaptive_share=None if adaptive is None else float(adaptive[number]),
            )
        )
    return infos


def _unknown_keys(what: str, name: str, unknown: list[str]) -> InvalidArgument:
    shown_keys = ", ".join(shown(k) for k in unknown[:5])
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    return InvalidArgument(f"{what}: experiment {name!r} has no tasks {shown_keys}{more}; nothing was changed")


def _already_has(name: str, taken: list[str]) -> AlreadyExists:
    shown = ", ".join(repr(k) for k in taken[:5])
    more = f" and {len(taken) - 5} more" if len(taken) > 5 else ""
    return AlreadyExists(f"experiment {name!r} already has tasks {shown}{more}")
