"""Checks of every input value. Each raises InvalidArgument naming the value."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from bots_server.core.domain import ExperimentConfig, Outcome, Task, config_settings
from bots_server.errors import InvalidArgument

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_KEY_LENGTH = 1024
MAX_REQUEST_KEY_LENGTH = 256
MAX_FEATURE_NAME_LENGTH = 256
REFERENCE_FEATURE_PATTERN = re.compile(r'[ !#-\[\]-~]+')


def experiment_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(
            f"experiment name {name!r} is invalid: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )


def config(cfg: ExperimentConfig) -> None:
    """Every setting against its declaration (engine/params.py, domain.py),
    then the rules that tie settings together."""
    for name, declared, _ in config_settings():
        value = getattr(cfg, name)
        problem = declared.problem(value)
        if problem is not None:
            raise InvalidArgument(f"config.{name} = {value!r} {problem}")
    if bool(cfg.weak_feature) != bool(cfg.strong_feature):
        raise InvalidArgument(
            f"config.weak_feature = {cfg.weak_feature!r} and config.strong_feature = {cfg.strong_feature!r}: "
            "set both (interpolation plug-in) or neither"
        )
    if cfg.weak_feature and cfg.weak_feature == cfg.strong_feature:
        raise InvalidArgument(f"config.weak_feature and strong_feature are both {cfg.weak_feature!r}")
    for field in ("weak_feature", "strong_feature"):
        value = getattr(cfg, field)
        if len(value) > MAX_FEATURE_NAME_LENGTH:
            raise InvalidArgument(f"config.{field} is longer than {MAX_FEATURE_NAME_LENGTH} characters")
        if value and not REFERENCE_FEATURE_PATTERN.fullmatch(value):
            # The store reads these features with SQL JSON paths.
            raise InvalidArgument(
                f"config.{field} = {value!r}: use printable ASCII characters other than double quote and backslash"
            )


def tasks(cfg: ExperimentConfig, new_tasks: Sequence[Task]) -> None:
    """Keys non-empty, short and distinct; features finite; reference pass rates in [0, 1]."""
    if not new_tasks:
        raise InvalidArgument("no tasks given")
    seen: set[str] = set()
    references = {cfg.weak_feature, cfg.strong_feature} - {""}
    for position, task in enumerate(new_tasks):
        if not task.key:
            raise InvalidArgument(f"task #{position} has an empty key")
        if len(task.key) > MAX_KEY_LENGTH:
            raise InvalidArgument(f"task key {task.key[:40]!r}... is longer than {MAX_KEY_LENGTH} characters")
        if task.key in seen:
            raise InvalidArgument(f"task key {task.key!r} appears more than once in the request")
        seen.add(task.key)
        for name, value in task.features.items():
            if not math.isfinite(value):
                raise InvalidArgument(f"task {task.key!r}: feature {name!r} = {value!r} is not finite")
            if name in references and not 0.0 <= value <= 1.0:
                raise InvalidArgument(f"task {task.key!r}: reference pass rate {name!r} = {value!r} is outside [0, 1]")


def batch_request(batch_size: int, request_key: str) -> None:
    if batch_size < 1:
        raise InvalidArgument(f"batch_size = {batch_size} must be at least 1")
    if len(request_key) > MAX_REQUEST_KEY_LENGTH:
        raise InvalidArgument(f"request_key {request_key[:40]!r}... is longer than {MAX_REQUEST_KEY_LENGTH} characters")


def outcomes(batch_id: str, reported: Sequence[Outcome]) -> None:
    """Shape and values of a report, before it is matched against the batch."""
    if not batch_id:
        raise InvalidArgument("batch_id is empty")
    if not reported:
        raise InvalidArgument(f"report for batch {batch_id!r} has no outcomes")
    seen: set[str] = set()
    for o in reported:
        if o.key in seen:
            raise InvalidArgument(f"task {o.key!r} is reported more than once")
        seen.add(o.key)
        if o.trials < 1:
            raise InvalidArgument(f"task {o.key!r}: trials = {o.trials} must be at least 1")
        if not math.isfinite(o.successes) or not 0.0 <= o.successes <= o.trials:
            raise InvalidArgument(f"task {o.key!r}: successes = {o.successes!r} is outside [0, trials = {o.trials}]")


def snapshot(
    cfg: ExperimentConfig,
    keys: Sequence[str],
    alpha: Sequence[float],
    beta: Sequence[float],
    features: Sequence[dict[str, float]],
    capability: float | None,
) -> None:
    """A snapshot to restore: one entry per task everywhere, a valid posterior."""
    if not (len(keys) == len(alpha) == len(beta) == len(features)):
        raise InvalidArgument(
            f"snapshot arrays differ in length: {len(keys)} keys, {len(alpha)} alpha, "
            f"{len(beta)} beta, {len(features)} features"
        )
    if keys:
        tasks(cfg, [Task(k, f) for k, f in zip(keys, features)])
    for name, values in (("alpha", alpha), ("beta", beta)):
        for key, value in zip(keys, values):
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"snapshot {name} of task {key!r} = {value!r} must be a finite number > 0")
    if capability is not None and not math.isfinite(capability):
        raise InvalidArgument(f"snapshot capability = {capability!r} is not finite")
