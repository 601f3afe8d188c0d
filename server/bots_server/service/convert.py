"""API messages <-> the server's domain types.

The config mapping is derived from the settings' declarations: a setting maps
to the proto field of the same name; enum settings map value NAME to
PREFIX_NAME of their proto enum (strategy "bots" <-> STRATEGY_BOTS), with
the UNSPECIFIED value meaning the default.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from google.protobuf import timestamp_pb2
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from bots_client.proto import bots_pb2 as pb
from bots_server.core.domain import (
    Batch,
    Experiment,
    ExperimentConfig,
    GroupInfo,
    NewTasks,
    Outcomes,
    ReportResult,
    RetireResult,
    config_settings,
)
from bots_server.core.limits import shown
from bots_server.core.priority import Pacer
from bots_server.errors import InvalidArgument

ENUM_SETTINGS: dict[str, tuple[str, EnumTypeWrapper]] = {
    "strategy": ("STRATEGY_", pb.Strategy),
    "selection_mode": ("SELECTION_MODE_", pb.SelectionMode),
}
_CONFIG_FIELDS = pb.ExperimentConfig.DESCRIPTOR.fields_by_name


def enum_names(setting: str) -> tuple[str, ...]:
    """The values the API can carry for an enum setting (UNSPECIFIED aside)."""
    prefix, enum = ENUM_SETTINGS[setting]
    return tuple(name.removeprefix(prefix).lower() for name, number in enum.items() if number != 0)


def config_from_proto(message: pb.ExperimentConfig) -> ExperimentConfig:
    """The config with every unset field at its default."""
    values: dict[str, Any] = {}
    for name, _, _ in config_settings():
        if name in ENUM_SETTINGS:
            prefix, enum = ENUM_SETTINGS[name]
            number = getattr(message, name)
            if number == 0:
                continue
            try:
                values[name] = enum.Name(number).removeprefix(prefix).lower()
            except ValueError:
                raise InvalidArgument(f"config.{name} enum value {number} is unknown") from None
        elif _CONFIG_FIELDS[name].has_presence:
            if message.HasField(name):
                values[name] = getattr(message, name)
        else:
            values[name] = getattr(message, name)  # plain proto3 field: its zero value is the default
    return ExperimentConfig(**values)


def config_to_proto(config: ExperimentConfig) -> pb.ExperimentConfig:
    message = pb.ExperimentConfig()
    for name, _, _ in config_settings():
        value = getattr(config, name)
        if name in ENUM_SETTINGS:
            prefix, enum = ENUM_SETTINGS[name]
            value = enum.Value(prefix + value.upper())
        setattr(message, name, value)
    return message


def timestamp(value: dt.datetime) -> timestamp_pb2.Timestamp:
    message = timestamp_pb2.Timestamp()
    message.FromDatetime(value.astimezone(dt.UTC))
    return message


def experiment_to_proto(experiment: Experiment) -> pb.Experiment:
    message = pb.Experiment(
        name=experiment.name,
        config=config_to_proto(experiment.config),
        step=experiment.step,
        num_tasks=experiment.num_tasks,
        open_batches=experiment.open_batches,
        create_time=timestamp(experiment.create_time),
        forked_from=experiment.forked_from or "",
        forked_at_step=experiment.forked_at_step or 0,
    )
    if experiment.capability is not None:
        message.capability = experiment.capability
    return message


def add_tasks_from_proto(into: NewTasks, messages: Iterable[pb.Task], pacer: Pacer) -> None:
    """Append the tasks of `messages` to `into`, giving way to trainer calls
    between blocks (see core/priority.py)."""
    for m in pacer.paced(messages):
        into.keys.append(m.key)
        into.features.append(dict(m.features))
        into.groups.append(m.group)
        into.embeddings.append(m.embedding)


def outcomes_from_proto(messages: Iterable[pb.Outcome]) -> Outcomes:
    return Outcomes.of(
        [(m.key, m.successes, m.trials, m.sum_squares if m.HasField("sum_squares") else None) for m in messages]
    )


def batch_to_proto(batch: Batch) -> pb.Batch:
    return pb.Batch(
        batch_id=batch.batch_id,
        step=batch.step,
        keys=batch.keys,
        request_key=batch.request_key,
        lease_expire_time=timestamp(batch.lease_expire_time),
        reported_step=batch.reported_step,
    )


def report_to_proto(result: ReportResult) -> pb.ReportOutcomesResponse:
    message = pb.ReportOutcomesResponse(step=result.step, duplicate=result.duplicate)
    if result.capability is not None:
        message.capability = result.capability
    return message


def shares_from_proto(messages: Iterable[pb.GroupShare], method: str = "SetGroupShares") -> dict[str, tuple[float, float]]:
    shares: dict[str, tuple[float, float]] = {}
    for m in messages:
        if m.group in shares:
            raise InvalidArgument(f"{method}: group {shown(m.group)} appears more than once")
        shares[m.group] = (m.min_share, m.max_share)
    return shares


def shares_to_proto(shares: dict[str, tuple[float, float]]) -> list[pb.GroupShare]:
    return [pb.GroupShare(group=g, min_share=low, max_share=high) for g, (low, high) in sorted(shares.items())]


def groups_to_proto(groups: Iterable[GroupInfo]) -> pb.ListGroupsResponse:
    response = pb.ListGroupsResponse()
    for g in groups:
        info = response.groups.add(
            name=g.name,
            num_tasks=g.num_tasks,
            num_retired=g.num_retired,
            mean_success=g.mean_success,
            near_target=g.near_target,
            informative=g.informative,
        )
        if g.min_share is not None and g.max_share is not None:
            info.min_share, info.max_share = g.min_share, g.max_share
        if g.adaptive_share is not None:
            info.adaptive_share = g.adaptive_share
    return response


def retire_to_proto(result: RetireResult) -> pb.RetireTasksResponse:
    return pb.RetireTasksResponse(changed=result.changed, num_retired=result.num_retired, num_tasks=result.num_tasks)
