"""The statements of every select and report, built once with bound
parameters: building them per call cost more than running them. The
dialects may run them otherwise (postgresql.py builds its one-round-trip
forms from them)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from bots_server.store import schema as t

_ID: sa.BindParameter[int] = sa.bindparam("experiment_id")
_STEP_AND_NUM_TASKS = sa.select(t.experiments.c.step, t.experiments.c.num_tasks).where(t.experiments.c.id == _ID)
_LAST_POOL_EVENTS = sa.select(
    *(
        sa.select(sa.func.coalesce(sa.func.max(table.c.seq), 0)).where(table.c.experiment_id == _ID).scalar_subquery()
        for table in (t.retirements, t.group_shares)
    )
)
_OPEN_NOW = sa.and_(
    t.batches.c.experiment_id == _ID,
    t.batches.c.reported_step.is_(None),
    t.batches.c.lease_expire_time > sa.bindparam("now"),
)
# What insert_batch checks after taking the lock, in one round trip: the
# batch of the request key, the last pool events, how many batches are
# open and how many of those are among the `known` ones, and how many were
# never reported (expired or not).
SELECT_CHECKS = sa.select(
    sa.select(t.batches.c.batch_id)
    .where(t.batches.c.experiment_id == _ID, t.batches.c.request_key == sa.bindparam("request_key"))
    .scalar_subquery()
    .label("existing"),
    _LAST_POOL_EVENTS.selected_columns[0].label("retired_seq"),
    _LAST_POOL_EVENTS.selected_columns[1].label("shares_seq"),
    sa.select(sa.func.count()).where(_OPEN_NOW).scalar_subquery().label("open"),
    sa.select(sa.func.count())
    .where(_OPEN_NOW, t.batches.c.batch_id.in_(sa.bindparam("known", expanding=True)))
    .scalar_subquery()
    .label("open_known"),
    sa.select(sa.func.count())
    .where(t.batches.c.experiment_id == _ID, t.batches.c.reported_step.is_(None))
    .scalar_subquery()
    .label("unreported"),
)


def _params(table: sa.Table, **names: str) -> dict[str, sa.BindParameter[Any]]:
    """Column name -> a parameter of the column's type."""
    return {column: sa.bindparam(name, type_=table.c[column].type) for column, name in names.items()}


# The values of a new batch, of a step and of its outcomes (a dialect may insert them otherwise).
BATCH_VALUES = _params(
    t.batches,
    experiment_id="experiment_id",
    batch_id="n_batch_id",
    request_key="request_key",
    step="n_step",
    batch_size="n_batch_size",
    create_time="n_create_time",
    lease_expire_time="n_lease_expire_time",
)
BATCH_TASKS_VALUES = _params(t.batch_task_lists, experiment_id="experiment_id", batch_id="n_batch_id", tasks="n_tasks")
STEP_VALUES = _params(
    t.steps,
    experiment_id="b_experiment_id",
    step="new_step",
    batch_id="b_batch_id",
    pool_size="s_pool_size",
    capability="s_capability",
    capability_estimate="s_capability_estimate",
    create_time="s_create_time",
)
OUTCOMES_VALUES = _params(t.step_outcomes, experiment_id="b_experiment_id", step="new_step", outcomes="s_outcomes")
INSERT_BATCH = t.batches.insert().values(BATCH_VALUES)
INSERT_BATCH_TASKS = t.batch_task_lists.insert().values(BATCH_TASKS_VALUES)
INSERT_STEP = t.steps.insert().values(STEP_VALUES)
INSERT_OUTCOMES = t.step_outcomes.insert().values(OUTCOMES_VALUES)
ADVANCE_STEP = (
    t.experiments.update()
    .where(t.experiments.c.id == sa.bindparam("b_experiment_id"), t.experiments.c.step == sa.bindparam("expected_step"))
    .values(step=sa.bindparam("new_step"))
)
ADVANCE_STEP_SAME_POOL = ADVANCE_STEP.where(t.experiments.c.num_tasks == sa.bindparam("b_num_tasks"))
MARK_REPORTED = (
    t.batches.update()
    .where(
        t.batches.c.experiment_id == sa.bindparam("b_experiment_id"),
        t.batches.c.batch_id == sa.bindparam("b_batch_id"),
        t.batches.c.reported_step.is_(None),
    )
    .values(reported_step=sa.bindparam("new_step"))
)
