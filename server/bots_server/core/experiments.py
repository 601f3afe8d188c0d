"""Experiment use cases: create, get, list, delete, fork, restore, snapshot."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from bots_server.core import audit, embeddings, tenancy, validation
from bots_server.core.checkpoint_state import encode_state
from bots_server.core.checkpoints import Checkpoints
from bots_server.core.domain import Experiment, ExperimentConfig, RestoreData, Snapshot
from bots_server.core.experiment import reference_rates
from bots_server.core.priority import Pacer
from bots_server.core.quotas import QuotaCheck
from bots_server.core.runtime import Runtime
from bots_server.engine import PosteriorState, share_problem
from bots_server.errors import AlreadyExists, InvalidArgument, NotFound
from bots_server.store import ExperimentCopy, ExperimentRow

DEFAULT_PAGE_SIZE = 100


class Experiments:
    def __init__(self, runtime: Runtime, checkpoints: Checkpoints, quotas: QuotaCheck) -> None:
        self.runtime = runtime
        self.checkpoints = checkpoints
        self.quotas = quotas

    async def create(self, name: str, config: ExperimentConfig) -> Experiment:
        validation.experiment_name(name)
        validation.config(config)
        claim = await self.quotas.new_experiment(name, 0)
        rt = self.runtime
        row = await self.quotas.write(
            claim, rt.store.create_experiment, name, config.to_dict(), rt.clock(), tenancy.tenant_of(name)
        )
        audit.experiments.info("experiment created", extra={"experiment": name, "config": config.to_dict()})
        return summary(row, open_batches=0)

    async def get(self, name: str) -> Experiment:
        row = await self._row(name)
        rt = self.runtime
        return summary(row, await rt.db(rt.store.count_open_batches, row.id, rt.clock()))

    async def shape(self, name: str) -> tuple[int, int]:
        """The experiment's number of tasks and embedding_dim (NotFound if
        there is none): one lookup, for a call that sizes its memory first."""
        row = await self._row(name)
        return row.num_tasks, ExperimentConfig.from_dict(row.config).embedding_dim

    async def refuse_taken(self, name: str) -> None:
        """AlreadyExists if `name` is taken: one lookup, before a restore
        buffers its stream (its write checks again, atomically)."""
        validation.experiment_name(name)
        rt = self.runtime
        if await rt.db(rt.store.find_experiment, name) is not None:
            raise AlreadyExists(f"experiment {name!r} already exists")

    async def _row(self, name: str) -> ExperimentRow:
        validation.experiment_name(name)
        rt = self.runtime
        row = await rt.db(rt.store.find_experiment, name)
        if row is None:
            raise NotFound(f"experiment {name!r} not found")
        return row

    async def list(self, page_size: int, page_token: str, tenant: str | None = None) -> tuple[list[Experiment], str]:
        """A page of experiments by stored name: `tenant`'s, or every tenant's (None)."""
        validation.page(page_size, page_token)
        limit = page_size or DEFAULT_PAGE_SIZE
        rt = self.runtime
        rows = await rt.db(rt.store.list_experiments, page_token, limit, tenant)
        now = rt.clock()
        result = [summary(row, await rt.db(rt.store.count_open_batches, row.id, now)) for row in rows]
        next_token = rows[-1].name if len(rows) == limit else ""
        return result, next_token

    async def delete(self, name: str) -> None:
        validation.experiment_name(name)
        rt = self.runtime
        async with rt.locked(name):
            row = await rt.db(rt.store.find_experiment, name)
            if row is None:
                raise NotFound(f"experiment {name!r} not found")
            live = rt.live.get(name)
            if live is not None:
                self.checkpoints.cancel(live)
            try:
                delete = functools.partial(rt.store.delete_experiment, pace=rt.priority.pacer().pace)
                await rt.db_write_unless_cancelled(delete, row.id)
            finally:  # deleted, or maybe (a cancel during the commit): the next call reads the store
                rt.forget(name)
        audit.experiments.info("experiment deleted", extra={"experiment": name})

    async def fork(self, source: str, name: str, config: ExperimentConfig | None) -> Experiment:
        """A new experiment with the source's tasks, current posterior and step."""
        validation.experiment_name(source, "source experiment name")
        validation.experiment_name(name)
        if config is not None:
            validation.config(config)
        rt = self.runtime
        async with rt.locked(source):
            live, _ = await rt.ready(source)
            claim = await self.quotas.new_experiment(name, live.num_tasks)
            fork_config = config or live.config
            if fork_config.embedding_dim != live.config.embedding_dim:
                raise InvalidArgument(
                    f"config.embedding_dim = {fork_config.embedding_dim} differs from the source's "
                    f"({live.config.embedding_dim}): a fork keeps its source's tasks and their embeddings"
                )
            state = live.state
            if fork_config.reference_features != live.config.reference_features:
                # The fork reads other features as its reference pass rates.
                features = await rt.db(rt.store.load_features, live.id, state.num_tasks)
                weak, strong = await rt.run(reference_rates, fork_config, features)
                state = dataclasses.replace(state, weak=weak, strong=strong)
            copy = ExperimentCopy(
                name=name,
                config=fork_config.to_dict(),
                step=live.step,
                capability=live.capability,
                num_tasks=state.num_tasks,
                state=await rt.run(encode_state, state),
                forked_from=source,
                source_id=live.id,
                tenant=tenancy.tenant_of(name),
                retired=np.flatnonzero(live.retired).tolist(),  # a broken task stays retired in the fork
                shares=dict(live.shares),
            )
            row = await self.quotas.write(claim, rt.store.create_copy, copy, rt.clock())
        audit.experiments.info("experiment forked", extra={"experiment": name, "source": source, "step": row.step})
        return summary(row, open_batches=0)

    async def restore(self, data: RestoreData, pacer: Pacer | None = None) -> Experiment:
        """A new experiment from a snapshot: its tasks, posterior and step.
        `pacer`: the call's, if it has one already (see core/priority.py)."""
        validation.experiment_name(data.name)
        validation.config(data.config)
        rt = self.runtime
        pacer = pacer or rt.priority.pacer()
        await rt.run(
            validation.snapshot,
            data.config,
            data.step,
            data.source,
            data.keys,
            data.alpha,
            data.beta,
            data.features,
            data.capability,
            pacer,
            data.embeddings,
        )
        for what, values in (("retired flags", data.retired), ("groups", data.groups), ("embeddings", data.embeddings)):
            if values and len(values) != len(data.keys):
                raise InvalidArgument(f"snapshot arrays differ in length: {len(data.keys)} keys, {len(values)} {what}")
        if data.groups:
            await rt.run(validation.snapshot_groups, data.groups)
        _check_restored_shares(data)
        claim = await self.quotas.new_experiment(data.name, len(data.keys))
        copy = ExperimentCopy(
            name=data.name,
            config=data.config.to_dict(),
            step=data.step,
            capability=data.capability,
            num_tasks=len(data.keys),
            state=await rt.run(restored_state, data),
            forked_from=data.source or "snapshot",
            keys=data.keys,
            features=data.features,
            tenant=tenancy.tenant_of(data.name),
            retired=[i for i, r in enumerate(data.retired) if r],
            groups=data.groups or None,
            shares=dict(data.shares),
            embeddings=data.embeddings or None,
        )
        create = functools.partial(rt.store.create_copy, pace=pacer.pace)
        row = await self.quotas.write(claim, create, copy, rt.clock())
        audit.experiments.info("experiment restored", extra={"experiment": data.name, "source": copy.forked_from, "step": row.step})
        return summary(row, open_batches=0)

    async def snapshot(self, name: str, include_features: bool = False, pacer: Pacer | None = None) -> Snapshot:
        validation.experiment_name(name)
        rt = self.runtime
        async with rt.locked(name):
            live, _ = await rt.ready(name)
            state, step, keys, capability = live.state, live.step, live.keys, live.capability
            retired = live.retired
            groups = [live.group_names[g] for g in live.group_of.tolist()] if live.has_groups else None
            shares = dict(live.shares)
            halvings = state.rho_halvings
        row = await rt.db(rt.store.find_experiment, name)
        if row is None or row.id != live.id:
            raise NotFound(f"experiment {name!r} not found")
        open_batches = await rt.db(rt.store.count_open_batches, live.id, rt.clock())
        experiment = summary(
            dataclasses.replace(row, step=step, num_tasks=len(keys), capability=capability), open_batches
        )
        keys_list, alpha, beta = await rt.run(lambda: (keys.tolist(), state.alpha.tolist(), state.beta.tolist()))
        pace = None if pacer is None else pacer.pace
        features = await rt.db(rt.store.load_features, live.id, len(keys), pace) if include_features else None
        vectors = None
        if include_features and state.embeddings is not None:
            vectors = await rt.run(embeddings.as_bytes, state.embeddings)
        return Snapshot(
            experiment, keys_list, alpha, beta, features, retired.tolist(), groups, shares, halvings, vectors
        )


def _check_restored_shares(data: RestoreData) -> None:
    """A snapshot's group shares, checked as SetGroupShares checks them,
    against the groups of its tasks."""
    if not data.shares:
        return
    validation.group_shares(data.shares)
    groups = sorted(set(data.groups))
    unknown = validation.unknown_share_groups(data.shares, groups)
    if unknown is not None:
        raise InvalidArgument(f"RestoreExperiment: the snapshot has no tasks in groups {unknown}, which it gives shares")
    problem = share_problem(data.shares, groups)
    if problem is not None:
        raise InvalidArgument(f"RestoreExperiment: the snapshot's group shares: {problem}")


def restored_state(data: RestoreData) -> memoryview:
    """The checkpoint of a restored experiment: the snapshot's posterior, the
    reference pass rates its features give under its config, and every other
    field of the state at its starting value."""
    weak, strong = reference_rates(data.config, data.features)
    start = PosteriorState.from_prior(data.config, weak, strong)
    state = dataclasses.replace(
        start,
        alpha=np.asarray(data.alpha, dtype=np.float64),
        beta=np.asarray(data.beta, dtype=np.float64),
        capability=math.nan if data.capability is None else data.capability,
        rho_halvings=data.rho_halvings,
    )
    return encode_state(state)


def summary(row: ExperimentRow, open_batches: int) -> Experiment:
    return Experiment(
        name=row.name,
        config=ExperimentConfig.from_dict(row.config),
        step=row.step,
        num_tasks=row.num_tasks,
        open_batches=open_batches,
        capability=row.capability,
        create_time=row.create_time,
        forked_from=row.forked_from,
        forked_at_step=row.forked_at_step,
    )
