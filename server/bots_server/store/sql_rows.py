"""Row conversions shared by the parts of the SQL store: stored times, and
experiment rows as ExperimentRow."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import sqlalchemy as sa

from bots_server.store import schema as t
from bots_server.store.records import ExperimentRow


def _utc(value: dt.datetime) -> dt.datetime:
    """SQLite returns naive datetimes; every stored time is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


# Experiments with the capability after their latest step (NULL before any).
_EXPERIMENTS = sa.select(t.experiments, t.steps.c.capability).outerjoin(
    t.steps, sa.and_(t.steps.c.experiment_id == t.experiments.c.id, t.steps.c.step == t.experiments.c.step)
)


def _experiment_row(row: Any) -> ExperimentRow:
    config = json.loads(row.config)
    return ExperimentRow(
        row.id,
        row.name,
        config,
        row.step,
        row.num_tasks,
        row.capability,
        _utc(row.create_time),
        row.forked_from,
        row.forked_at_step,
        row.compacted_through,
    )
