"""Checks of every input value against core/limits.py. Each raises
InvalidArgument naming the value (cut short: see limits.shown)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from bots_server.core import limits
from bots_server.core.domain import ExperimentConfig, NewTasks, Outcomes, config_settings
from bots_server.core.limits import shown
from bots_server.core.priority import Pacer
from bots_server.errors import InvalidArgument


def text(what: str, value: str, max_length: int, *, empty: bool = True) -> None:
    """A string the store keeps or looks up: no NUL, bounded length."""
    if not empty and not value:
        raise InvalidArgument(f"{what} is empty")
    if len(value) > max_length:
        raise InvalidArgument(f"{what} {shown(value)} is longer than {max_length} characters")
    if "\x00" in value:
        raise InvalidArgument(f"{what} {shown(value)} contains a NUL character")


def experiment_name(name: str, what: str = "experiment name") -> None:
    """A stored name (core/tenancy.py): the service resolved the caller's
    reference to it; this guards the core's own callers."""
    if len(name) > limits.MAX_NAME_LENGTH or not limits.STORED_NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(
            f"{what} {shown(name)} is invalid: use 1-{limits.MAX_NAME_LENGTH} characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, optionally after 'tenant/'"
        )


def page(page_size: int, page_token: str) -> None:
    if page_size > limits.MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size = {page_size} is larger than {limits.MAX_PAGE_SIZE}")
    text("page_token", page_token, limits.MAX_NAME_LENGTH)


def config(cfg: ExperimentConfig) -> None:
    """Every setting against its declaration (engine/params.py, domain.py),
    then the rules that tie settings together."""
    for name, declared, _ in config_settings():
        value = getattr(cfg, name)
        problem = declared.problem(value)
        if problem is not None:
            raise InvalidArgument(f"config.{name} = {shown(value)} {problem}")
    if bool(cfg.weak_feature) != bool(cfg.strong_feature):
        raise InvalidArgument(
            f"config.weak_feature = {shown(cfg.weak_feature)} and config.strong_feature = "
            f"{shown(cfg.strong_feature)}: set both (interpolation plug-in) or neither"
        )
    if cfg.weak_feature and cfg.weak_feature == cfg.strong_feature:
        raise InvalidArgument(f"config.weak_feature and strong_feature are both {shown(cfg.weak_feature)}")
    for field in ("weak_feature", "strong_feature"):
        value = getattr(cfg, field)
        text(f"config.{field}", value, limits.MAX_FEATURE_NAME_LENGTH)
        if value and not limits.REFERENCE_FEATURE_PATTERN.fullmatch(value):
            raise InvalidArgument(
                f"config.{field} = {shown(value)}: use printable ASCII characters other than double quote and backslash"
            )


def tasks(cfg: ExperimentConfig, new: NewTasks, pacer: Pacer | None = None) -> None:
    """Keys non-empty, short and distinct; features bounded and finite;
    reference pass rates in [0, 1]. `pacer` gives way between blocks of
    tasks (see core/priority.py)."""
    if not new.keys:
        raise InvalidArgument("no tasks given")
    seen: set[str] = set()
    references = {cfg.weak_feature, cfg.strong_feature} - {""}
    rows = zip(new.keys, new.features, new.groups or itertools.repeat(""), strict=False)  # one length: NewTasks
    for position, (key, features, group) in enumerate(rows if pacer is None else pacer.paced(rows)):
        if not key:
            raise InvalidArgument(f"task #{position} has an empty key")
        text("task key", key, limits.MAX_KEY_LENGTH)
        if key in seen:
            raise InvalidArgument(f"task key {shown(key)} appears more than once in the request")
        seen.add(key)
        text(f"task {shown(key)}: group", group, limits.MAX_GROUP_NAME_LENGTH)
        if len(features) > limits.MAX_FEATURES_PER_TASK:
            raise InvalidArgument(
                f"task {shown(key)} has {len(features)} features; at most {limits.MAX_FEATURES_PER_TASK}"
            )
        for name, value in features.items():
            text(f"task {shown(key)}: feature name", name, limits.MAX_FEATURE_NAME_LENGTH, empty=False)
            if not math.isfinite(value):
                raise InvalidArgument(f"task {shown(key)}: feature {shown(name)} = {value!r} is not finite")
            if name in references and not 0.0 <= value <= 1.0:
                raise InvalidArgument(
                    f"task {shown(key)}: reference pass rate {shown(name)} = {value!r} is outside [0, 1]"
                )
    embeddings(cfg, new.keys, new.embeddings)


# Tasks whose embeddings are checked as one array: bounds the copy the check makes.
_EMBEDDINGS_PER_CHECK = 4096


def embeddings(cfg: ExperimentConfig, keys: Sequence[str], vectors: Sequence[bytes]) -> None:
    """Each task's embedding: exactly config.embedding_dim float32 values,
    all finite, when the experiment has an embedding_dim; none when it has
    not. `vectors` empty: no task has one."""
    dim = cfg.embedding_dim
    if dim == 0:
        given = next((j for j, v in enumerate(vectors) if v), None)
        if given is not None:
            raise InvalidArgument(
                f"task {shown(keys[given])} has an embedding, but the experiment has none (config.embedding_dim = 0)"
            )
        return
    if len(vectors) < len(keys):
        vectors = [*vectors, *[b""] * (len(keys) - len(vectors))]  # the missing ones: none
    size = dim * 4
    for start in range(0, len(keys), _EMBEDDINGS_PER_CHECK):
        block = vectors[start : start + _EMBEDDINGS_PER_CHECK]
        lengths = np.fromiter(map(len, block), dtype=np.int64, count=len(block))
        wrong = np.flatnonzero(lengths != size)
        if wrong.size:
            j = int(wrong[0])
            raise InvalidArgument(f"task {shown(keys[start + j])}: {_wrong_length(len(block[j]), dim)}")
        values = np.frombuffer(b"".join(block), dtype="<f4").reshape(len(block), dim)
        finite = np.isfinite(values)
        if not finite.all():
            j, k = (int(i) for i in np.argwhere(~finite)[0])
            raise InvalidArgument(
                f"task {shown(keys[start + j])}: embedding value #{k} is {float(values[j, k])!r}; "
                "every value must be finite"
            )


def _wrong_length(length: int, dim: int) -> str:
    if length == 0:
        return f"no embedding; the experiment's tasks each need {dim} values (config.embedding_dim)"
    if length % 4:
        return f"embedding of {length} bytes is not float32 values (4 bytes each)"
    return f"embedding has {length // 4} values; the experiment's embedding_dim is {dim}"


def task_keys(what: str, keys: Sequence[str]) -> None:
    """Keys naming existing tasks (retire, re-activate): at least one, each
    a possible key, none twice."""
    if not keys:
        raise InvalidArgument(f"{what}: no task keys given")
    seen: set[str] = set()
    for key in keys:
        text("task key", key, limits.MAX_KEY_LENGTH, empty=False)
        if key in seen:
            raise InvalidArgument(f"{what}: task key {shown(key)} appears more than once in the request")
        seen.add(key)


def snapshot_groups(groups: Sequence[str]) -> None:
    """The groups of a snapshot's tasks: bounded names, at most MAX_GROUPS of them."""
    for group in set(groups):
        text("group", group, limits.MAX_GROUP_NAME_LENGTH)
    if len(set(groups)) > limits.MAX_GROUPS:
        raise InvalidArgument(f"snapshot has {len(set(groups))} groups; at most {limits.MAX_GROUPS}")


def group_shares(shares: dict[str, tuple[float, float]]) -> None:
    """Names and bounds of shares; whether they fit the experiment's groups
    is checked against them (engine/quotas.py)."""
    if len(shares) > limits.MAX_GROUPS:
        raise InvalidArgument(f"{len(shares)} group shares given; an experiment has at most {limits.MAX_GROUPS} groups")
    for name in shares:
        text("group", name, limits.MAX_GROUP_NAME_LENGTH, empty=False)


def unknown_share_groups(shares: dict[str, tuple[float, float]], groups: Sequence[str]) -> str | None:
    """The names (up to 5, as shown in messages) of the groups `shares`
    names that have no tasks among `groups`; None when every one has."""
    unknown = sorted(set(shares) - set(groups))
    return ", ".join(shown(g) for g in unknown[:5]) if unknown else None


def batch_request(batch_size: int, request_key: str) -> None:
    if batch_size < 1:
        raise InvalidArgument(f"batch_size = {batch_size} must be at least 1")
    text("request_key", request_key, limits.MAX_REQUEST_KEY_LENGTH)


def outcomes(batch_id: str, reported: Outcomes) -> None:
    """Shape and values of a report, before it is matched against the batch."""
    text("batch_id", batch_id, limits.MAX_BATCH_ID_LENGTH, empty=False)
    if not len(reported):
        raise InvalidArgument(f"report for batch {shown(batch_id)} has no outcomes")
    if _plainly_valid(reported):
        return
    seen: set[str] = set()
    for key, successes, trials, sum_squares in reported.rows():
        text("reported task key", key, limits.MAX_KEY_LENGTH, empty=False)
        if key in seen:
            raise InvalidArgument(f"task {shown(key)} is reported more than once")
        seen.add(key)
        if not 1 <= trials <= limits.MAX_TRIALS:
            raise InvalidArgument(f"task {shown(key)}: trials = {trials} is outside [1, {limits.MAX_TRIALS}]")
        if not math.isfinite(successes) or not 0.0 <= successes <= trials:
            raise InvalidArgument(f"task {shown(key)}: successes = {successes!r} is outside [0, trials = {trials}]")
        if sum_squares is not None:
            _sum_squares(key, successes, trials, sum_squares)


def _plainly_valid(reported: Outcomes) -> bool:
    """True only if the loop in `outcomes` would find nothing, checked over
    whole columns: a report of 0/1 rewards whose keys and values are all in
    range. False sends the report through the loop, which names the first
    problem (or finds none: a report with sum_squares)."""
    keys = reported.keys
    if reported.sum_squares.count(None) != len(keys):
        return False
    if min(map(len, keys)) == 0 or max(map(len, keys)) > limits.MAX_KEY_LENGTH or "\x00" in "".join(keys):
        return False
    if len(set(keys)) != len(keys):
        return False
    successes = np.asarray(reported.successes, dtype=np.float64)
    trials = np.asarray(reported.trials, dtype=np.float64)
    # NaN fails every comparison, and infinity the last: both go to the loop.
    return bool(np.all((trials >= 1) & (trials <= limits.MAX_TRIALS) & (successes >= 0.0) & (successes <= trials)))


# Relative slack of the sum_squares bounds: the trainer sums its floats in
# an order of its own.
_SUM_SLACK = 1e-9


def _sum_squares(key: str, successes: float, trials: int, sum_squares: float) -> None:
    """Rewards r_i in [0, 1] have sum(r_i)^2 / n <= sum(r_i^2) <= sum(r_i)."""
    low, high = successes * successes / trials, successes
    slack = _SUM_SLACK * max(1.0, high)
    if not math.isfinite(sum_squares) or not low - slack <= sum_squares <= high + slack:
        raise InvalidArgument(
            f"task {shown(key)}: sum_squares = {sum_squares!r} is outside [successes^2 / trials, successes] = "
            f"[{low:g}, {high:g}] (the sum of squared rewards in [0, 1])"
        )


def snapshot(
    cfg: ExperimentConfig,
    step: int,
    source: str,
    keys: list[str],
    alpha: Sequence[float],
    beta: Sequence[float],
    features: list[dict[str, float]],
    capability: float | None,
    pacer: Pacer | None = None,
    embeddings: list[bytes] | None = None,
) -> None:
    """A snapshot to restore: one entry per task everywhere, a valid posterior."""
    if step > limits.MAX_STEP:
        raise InvalidArgument(f"snapshot step = {step} is larger than {limits.MAX_STEP}")
    text("snapshot source", source, limits.MAX_SOURCE_LENGTH)
    if not (len(keys) == len(alpha) == len(beta) == len(features)):
        raise InvalidArgument(
            f"snapshot arrays differ in length: {len(keys)} keys, {len(alpha)} alpha, "
            f"{len(beta)} beta, {len(features)} features"
        )
    if keys:
        tasks(cfg, NewTasks(keys, features, embeddings=embeddings or []), pacer)
    for name, values in (("alpha", alpha), ("beta", beta)):
        for key, value in zip(keys, values, strict=True):
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"snapshot {name} of task {shown(key)} = {value!r} must be a finite number > 0")
    if capability is not None and not math.isfinite(capability):
        raise InvalidArgument(f"snapshot capability = {capability!r} is not finite")
