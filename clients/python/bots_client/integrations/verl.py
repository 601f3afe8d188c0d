"""verl: a curriculum sampler for `data.sampler.class_path` / `class_name`.

verl (0.5 to 0.7.x; 0.8 removed the hook) builds the train sampler from the
data config when `data.sampler.class_path` is set, asserts it is an
`AbstractSampler`, and after every training step calls `sampler.update(batch)`
on samplers that are `AbstractCurriculumSampler`s:

    data.sampler.class_path=pkg://bots_client.integrations.verl
    data.sampler.class_name=BotsCurriculumSampler
    data.dataloader_num_workers=0                  # verl requires it for curricula
    +data.sampler.address=bots.internal:50051      # or env BOTS_ADDRESS
    +data.sampler.experiment=qwen-math-run-7       # or env BOTS_EXPERIMENT
    +data.sampler.experiment_config.target_success=0.5   # create it if missing
    +data.sampler.experiment_config.rollouts_per_task=16 # = rollout.n

Keys: every dataset row needs a stable, unique task key, read from
`key_field` (default "index": verl's `extra_info.index`). Where each field is
read from is fixed at start and read from the same place in `update()`: a
field inside `extra_info` is read there (under verl 0.7's agent loop only
data_source, reward_model and extra_info of a row reach `update()`); a field
that is only a top-level column is read there (with a WARNING unless it is
data_source or reward_model); a field that is both a top-level column and
inside `extra_info` is read from `extra_info` if the two agree on every row
and raises ValueError at start if they differ (name the one you mean:
"extra_info.<name>"). A dotted path ("extra_info.uid") digs into dict
columns; a list of fields (["data_source", "index"]) joins their values with
":", unique across several data files. A row without a key raises at start;
a batch row without one raises in `update()`.

Strict: outcomes that cannot be filed under the batch they were drawn in (a
task in no open batch: never drawn by this run, or reported already; or in
several) raise `UnattributedOutcomesError` before anything is reported.
`data.sampler.strict: false` drops, logs and counts them instead
(`sampler.dropped_outcomes`, and `curriculum/dropped_outcomes` in every
step's signals). A new run on an experiment that has reported steps or open
batches raises `ExperimentInUseError` at the first draw unless verl loads
its checkpoint (the dataloader state) or `data.sampler.resume: true`.

Rewards: `reward_key` (default "token_level_scores", summed over the
response, i.e. the verifier's sequence score before any KL penalty; a
`non_tensor_batch` entry such as "acc" works too); a rollout succeeds when its
reward is >= `success_threshold` (default 0.5; null counts rewards in [0, 1]
fractionally).

Report before filtering: `update(batch)` sees the batch verl trains on. A
trainer that drops groups first (DAPO-style `filter_groups`, which removes the
all-correct and all-wrong groups the posterior needs most) must call
`sampler.report(batch)` right after the rewards are computed, before the
filter; `update()` then skips the tasks already reported, quietly.

verl is imported when `BotsCurriculumSampler` is first accessed; without verl
the class is a plain `torch.utils.data.Sampler` with the same contract.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from bots_client.integrations._core import (
    Curriculum,
    CurriculumSignals,
    OutcomeValue,
    UnattributedOutcomesError,
    address_and_experiment,
    aggregate_outcomes,
    config_flag,
    lazy_class,
    torch_sampler,
)
from bots_client.integrations.torch import _BotsSampler
from bots_client.types import ExperimentConfig, ReportResult

__all__ = ["BotsCurriculumSampler", "dataset_field", "locate_key_fields", "outcomes_from_batch"]

log = logging.getLogger("bots_client.integrations.verl")


def _plain(value: Any) -> Any:
    """OmegaConf containers (or any mapping) -> plain dicts and lists."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def _dig(value: Any, parts: Sequence[str]) -> Any:
    for part in parts:
        if value is None:
            return None
        value = value.get(part) if hasattr(value, "get") else value[part]
    return value


def dataset_keys(data_source: Any, key_field: Any) -> list[str | None]:
    """The task key of every dataset row (None where a field is missing),
    each field read from where `locate_key_fields` puts it."""
    return locate_key_fields(data_source, key_field)[1]


def locate_key_fields(data_source: Any, key_field: Any) -> tuple[list[str], list[str | None]]:
    """Where each key field is read from, and the task key of every row.

    A location is a path into a row that `update()` reads the same way: a
    field inside `extra_info` becomes "extra_info.<field>", a field that is
    only a top-level column stays as it is. A field that is both, with the
    same value on every row, is read from `extra_info` (it survives verl
    0.7's agent loop); with other values it raises ValueError, since the
    sampler would otherwise key the rows by one at selection and by the
    other in `update()`. A field found in neither place raises too.
    """
    fields = key_fields(key_field)
    locations: list[str] = []
    columns: list[list[Any]] = []
    for field in fields:
        location, values = _locate(data_source, field, fields)
        locations.append(location)
        columns.append(values)
    return locations, [join_key(values) for values in zip(*columns)]


def _locate(data_source: Any, field: str, fields: Sequence[str]) -> tuple[str, list[Any]]:
    parts = field.split(".")
    top, inner, columns = _field_sources(data_source, parts)
    if parts[0] == "extra_info":  # named explicitly
        if top is None:
            raise ValueError(f"key field {field!r}: the dataset has no extra_info column (columns: {columns})")
        return field, top
    has_top = top is not None and any(v is not None for v in top)
    has_inner = inner is not None and any(v is not None for v in inner)
    if has_top and has_inner:
        assert top is not None and inner is not None
        differ = [i for i, (t, e) in enumerate(zip(top, inner)) if t is not None and e is not None and str(t) != str(e)]
        if differ:
            i = differ[0]
            fix = [f"extra_info.{f}" if f == field else f for f in fields]
            named = fix[0] if len(fix) == 1 else "[" + ",".join(fix) + "]"
            why = (
                "verl's RLHFDataset replaces each row's top-level index with extra_info.index, and "
                if parts[0] == "index"
                else ""
            )
            raise ValueError(
                f"key field {field!r} is both a top-level dataset column and a field of extra_info, with other "
                f"values ({len(differ)} of {len(top)} rows differ; e.g. row {i}: {field} = {top[i]!r} but "
                f"extra_info.{field} = {inner[i]!r}). The task keys must be read from one place at selection and in "
                f"update(): {why}under verl 0.7's agent loop a top-level column other than "
                f"{', '.join(SURVIVING_FIELDS)} does not survive to update(). Name the field explicitly: "
                f"data.sampler.key_field={named} (or copy the key you mean into extra_info and drop the other)"
            )
        return f"extra_info.{field}", inner
    if has_inner:
        assert inner is not None
        return f"extra_info.{field}", inner
    if has_top:
        assert top is not None
        if parts[0] == "index" and _frame(data_source) is not None:
            raise ValueError(
                "key field 'index' is a top-level dataset column but not in extra_info: verl's RLHFDataset "
                "replaces each row's index with extra_info.index (0 where it is missing), so this column never "
                "reaches update(). Put the key into extra_info (extra_info.index) or key by another field"
            )
        if parts[0] not in SURVIVING_FIELDS:
            log.warning(
                "key field %r is a top-level dataset column; verl 0.7's agent loop drops it before update() "
                "(only %s survive), which then fails: keep the key in extra_info",
                field,
                list(SURVIVING_FIELDS),
            )
        return field, top
    raise ValueError(
        f"no dataset row has the key field {field!r}: it is neither a top-level column (columns: {columns}) nor "
        "a field of extra_info. Every row needs a task key (data.sampler.key_field)"
    )


def _frame(data_source: Any) -> Any:
    """verl's RLHFDataset keeps its rows in a HF `dataframe`."""
    frame = getattr(data_source, "dataframe", None)
    return frame if frame is not None and hasattr(frame, "column_names") else None


def _field_sources(data_source: Any, parts: Sequence[str]) -> tuple[list[Any] | None, list[Any] | None, list[str]]:
    """`parts` of every row read as a top-level column and inside
    `extra_info` (None: no such column / no extra_info), and the columns."""
    frame = _frame(data_source)
    look_inside = parts[0] != "extra_info"
    if frame is not None:
        columns = list(frame.column_names)
        top = [_dig(v, parts[1:]) for v in frame[parts[0]]] if parts[0] in columns else None
        inner = None
        if look_inside and "extra_info" in columns:
            inner = [_dig(v, parts) if isinstance(v, Mapping) else None for v in frame["extra_info"]]
        return top, inner, columns
    tops: list[Any] = []
    inners: list[Any] = []
    seen: set[str] = set()
    for i in range(len(data_source)):
        row = data_source[i]
        seen.update(str(c) for c in row)
        tops.append(_dig(row[parts[0]], parts[1:]) if parts[0] in row else None)
        extra = row.get("extra_info") if look_inside and hasattr(row, "get") else None
        inners.append(_dig(extra, parts) if isinstance(extra, Mapping) else None)
    return (
        tops if parts[0] in seen else None,
        inners if look_inside and "extra_info" in seen else None,
        sorted(seen),
    )


def dataset_field(data_source: Any, path: str) -> list[Any]:
    """`path` of every row of a dataset, without loading the rows.

    Reads whole columns of verl's RLHFDataset (its HF `dataframe`) and falls
    back to `data_source[i]` for other map-style datasets. "index" (and any
    name missing from the top level) is also looked up in `extra_info`,
    where verl's data scripts keep it.
    """
    parts = path.split(".")
    frame = getattr(data_source, "dataframe", None)
    if frame is not None and hasattr(frame, "column_names"):
        columns = frame.column_names
        if parts[0] in columns:
            return [_dig(v, parts[1:]) for v in frame[parts[0]]]
        if "extra_info" in columns:
            return [_dig(v, parts) for v in frame["extra_info"]]
        raise KeyError(f"dataset has no column {parts[0]!r} (columns: {columns}) and no extra_info column")
    values = []
    for i in range(len(data_source)):
        row = data_source[i]
        if parts[0] in row:
            values.append(_dig(row, parts))
        elif "extra_info" in row:
            values.append(_dig(row["extra_info"], parts))
        else:
            raise KeyError(f"dataset row {i} has no field {path!r}")
    return values


# The dataset-row fields verl 0.7 still has in `update()`'s batch under its
# default agent loop: RayPPOTrainer._get_gen_batch pops every other
# non-tensor column (`index` too) into the generation batch, and the agent
# loop's output does not bring them back.
SURVIVING_FIELDS = ("data_source", "reward_model", "extra_info")


def key_fields(key_field: Any) -> list[str]:
    """`key_field` as a list of field paths: one ("index", "extra_info.uid")
    or several (["data_source", "index"]: the key joins their values with
    ":", e.g. "openai/gsm8k:12", unique across several data files)."""
    if isinstance(key_field, str):
        fields = [key_field]
    else:
        fields = [str(f) for f in key_field]
    if not fields or not all(fields):
        raise ValueError(f"key_field must name at least one field, got {key_field!r}")
    return fields


def join_key(values: Sequence[Any]) -> str | None:
    """The task key of one row from its key fields' values (None if any is missing)."""
    if any(v is None for v in values):
        return None
    return ":".join(str(v) for v in values)


def _batch_field(non_tensor: Mapping[str, Any], path: str, rows: int, *, fallback: bool = True) -> list[Any]:
    """`path` of every row: a top-level non-tensor column, else (with
    `fallback`) inside `extra_info` (where verl's data scripts keep `index`);
    None where absent. The sampler reads the location it fixed at start
    ("extra_info.index", "data_source"), without fallback."""
    parts = path.split(".")
    if parts[0] in non_tensor:
        return [_dig(v, parts[1:]) if len(parts) == 1 or isinstance(v, Mapping) else None for v in non_tensor[parts[0]]]
    if fallback and "extra_info" in non_tensor:
        return [_dig(v, parts) if isinstance(v, Mapping) else None for v in non_tensor["extra_info"]]
    return [None] * rows


def batch_keys(batch: Any, key_field: Any = "index") -> list[str]:
    """The task key of every row of a verl `DataProto` (a field is looked up
    as a top-level non-tensor column, else inside `extra_info`).

    Raises if any row has none: a key the sampler cannot find would leave
    its batch unreported (and its tasks leased) without a trace."""
    return _batch_keys(batch, key_fields(key_field), fallback=True)


def _batch_keys(batch: Any, fields: Sequence[str], *, fallback: bool) -> list[str]:
    non_tensor = batch.non_tensor_batch
    rows = _row_count(batch)
    columns = [_batch_field(non_tensor, f, rows, fallback=fallback) for f in fields]
    keys = [join_key(values) for values in zip(*columns)] if columns else []
    missing = sum(1 for k in keys if k is None)
    if missing:
        raise KeyError(
            f"{missing} of {len(keys)} rollout rows have no task key {list(fields)} (the batch's non-tensor fields: "
            f"{sorted(non_tensor)}). verl 0.7's agent loop keeps only {list(SURVIVING_FIELDS)} of a dataset row "
            "until update(): keep the key inside extra_info (key_field: extra_info.<name>) or use "
            "data_source and extra_info.index"
        )
    return [str(k) for k in keys]


def _row_count(batch: Any) -> int:
    for column in batch.non_tensor_batch.values():
        return len(column)
    return len(batch.batch["token_level_scores"]) if batch.batch is not None else 0


def batch_rewards(batch: Any, reward_key: str = "token_level_scores") -> list[float]:
    """One reward per row of a verl `DataProto`: a [rows, response_len]
    token-level tensor summed over the response (verl puts the sequence score
    on the last response token), a [rows] tensor, or a non-tensor entry."""
    tensors = batch.batch
    if tensors is not None and reward_key in tensors.keys():  # noqa: SIM118 - TensorDict refuses `in`
        value = tensors[reward_key]
        if value.dim() == 2:
            value = value.sum(dim=-1)
        return [float(v) for v in value.detach().float().cpu().tolist()]
    if reward_key in batch.non_tensor_batch:
        return [float(v) for v in batch.non_tensor_batch[reward_key]]
    available = sorted(tensors.keys() if tensors is not None else []) + sorted(batch.non_tensor_batch)
    raise KeyError(f"batch has no reward {reward_key!r} (has {available})")


def outcomes_from_batch(
    batch: Any,
    *,
    key_field: Any = "index",
    reward_key: str = "token_level_scores",
    success_threshold: float | None = 0.5,
) -> dict[str, OutcomeValue]:
    """Per-task (successes, trials) over every rollout row of a `DataProto`
    (the n rollouts of a prompt are n rows sharing its key; row order does
    not matter, so verl's batch balancing is harmless)."""
    return aggregate_outcomes(
        batch_keys(batch, key_field), batch_rewards(batch, reward_key), success_threshold=success_threshold
    )


class _CurriculumSampler(_BotsSampler):
    """BOTS curriculum sampler for verl: `__init__(data_source, data_config)`,
    `__iter__`, `__len__`, `update(batch)`, plus `report(batch)` for trainers
    that filter groups, and `state_dict()` / `load_state_dict()`.

    Options under `data_config.sampler` (or the keyword overrides): address,
    experiment, experiment_config (a dict of ExperimentConfig fields; creates
    the experiment if missing), key_field, feature_fields (feature name ->
    row field, e.g. {"weak": "extra_info.weak_pass_rate"}), group_field (the
    row field naming each task's group for group shares, e.g. "data_source",
    verl's dataset column; default none), reward_key,
    success_threshold, batch_size (default data.gen_batch_size or
    data.train_batch_size), batches_per_epoch (default len(dataset) //
    batch_size), request_prefix, strict (default true: outcomes that cannot
    be attributed to the batch they were drawn in raise
    UnattributedOutcomesError; false: dropped, logged and counted in
    `dropped_outcomes`), resume (default false: continue an experiment that
    already has progress without this run's checkpoint), tracking
    (["tensorboard", "wandb", "console"]: the curriculum signals per step)
    and tensorboard_dir.

    `key_locations` is where each key field is read from, fixed at start and
    used by `update()` (`locate_key_fields`).

    verl saves its checkpoint before it calls `update()` for that step: the
    checkpoint lists that batch as pending, and a resume draws it again only
    if the server never got its report (docs/integrations/verl.md).
    """

    def __init__(self, data_source: Any, data_config: Any, **overrides: Any) -> None:
        options = _plain(_get(data_config, "sampler") or {})
        options.update(overrides)
        address, experiment = address_and_experiment(options, "BotsCurriculumSampler", "data.sampler.")
        loader_batch = _get(data_config, "gen_batch_size") or _get(data_config, "train_batch_size")
        batch_size = options.get("batch_size") or loader_batch
        if not batch_size:
            raise ValueError("set data.train_batch_size (or data.sampler.batch_size)")
        if loader_batch and int(batch_size) != int(loader_batch):
            # verl's loader takes gen_batch_size (else train_batch_size) rows a
            # step: a smaller service batch would be drawn twice a step, the
            # second before the first is reported; a larger one split over steps.
            raise ValueError(
                f"data.sampler.batch_size = {batch_size} but verl's dataloader takes {loader_batch} rows a step "
                "(data.gen_batch_size, else data.train_batch_size): leave data.sampler.batch_size out"
            )
        workers = _get(data_config, "dataloader_num_workers")
        if workers:
            # verl asserts this in create_rl_sampler only; a trainer given the
            # sampler directly (RayPPOTrainer(train_sampler=...)) does not.
            raise ValueError(
                f"data.dataloader_num_workers = {workers}: the workers would draw batches ahead of the reports, "
                "from stale posteriors; set data.dataloader_num_workers=0, as verl requires for curriculum samplers"
            )
        strict = _flag(options, "strict", True)
        resume = _flag(options, "resume", False)
        self.key_field = key_fields(options.get("key_field", "index"))
        self.reward_key = str(options.get("reward_key", "token_level_scores"))
        threshold = options.get("success_threshold", 0.5)
        self.success_threshold = None if threshold is None else float(threshold)
        self.key_locations, keys = locate_key_fields(data_source, self.key_field)
        missing = [i for i, k in enumerate(keys) if k is None]
        if missing:
            raise ValueError(
                f"{len(missing)} of {len(keys)} dataset rows have no task key {self.key_locations} (e.g. row "
                f"{missing[0]}); every row needs one (data.sampler.key_field)"
            )
        if len(set(keys)) < len(keys) and len(self.key_field) == 1:
            raise ValueError(
                f"task keys from {self.key_field[0]!r} repeat ({len(keys) - len(set(keys))} duplicates): "
                "several data files each numbering extra_info.index from 0? Key the rows by data source and "
                "index: data.sampler.key_field=[data_source,index] (or a unique extra_info field)"
            )
        log.info("task keys of experiment %r from %s", experiment, self.key_locations)
        feature_fields: Mapping[str, str] = options.get("feature_fields") or {}
        features = None
        if feature_fields:
            columns = {name: dataset_field(data_source, path) for name, path in feature_fields.items()}
            features = [{name: float(col[i]) for name, col in columns.items()} for i in range(len(keys))]
        group_field = options.get("group_field")
        groups = dataset_field(data_source, str(group_field)) if group_field else None
        config_fields = options.get("experiment_config")
        config = ExperimentConfig(**config_fields) if config_fields is not None else None
        embed_field = options.get("embed_field")
        embed_inputs = dataset_field(data_source, str(embed_field)) if embed_field else None
        curriculum = Curriculum(
            address,
            str(experiment),
            [str(k) for k in keys],
            batch_size=int(batch_size),
            config=config,
            features=features,
            groups=groups,
            request_prefix=str(options.get("request_prefix", "step")),
            rank=0,
            world_size=1,  # verl's single controller owns the dataloader
            resume=resume,
            strict=strict,
            embed_fn=options.get("embed_fn"),
            embed_inputs=embed_inputs,
        )
        expect_rollout_n(curriculum, options, trainer_config(), "data.sampler.")
        super().__init__(curriculum=curriculum, num_batches=options.get("batches_per_epoch"))
        self.data_source = data_source
        self._reported_early: set[str] = set()
        self.tracking = _Tracking(options.get("tracking") or [], options.get("tensorboard_dir"))
        if self.tracking.backends:
            curriculum.add_listener(self.tracking.log)

    @property
    def strict(self) -> bool:
        return self.curriculum.strict

    @property
    def dropped_outcomes(self) -> int:
        """Task outcomes dropped because they could not be attributed
        (only with `strict: false`; a strict sampler raises instead)."""
        return self.curriculum.dropped_outcomes

    def outcomes(self, batch: Any) -> dict[str, OutcomeValue]:
        """Per-task (successes, trials) of a `DataProto`, each key field read
        from the location fixed at start (`key_locations`)."""
        keys = _batch_keys(batch, self.key_locations, fallback=False)
        rewards = batch_rewards(batch, self.reward_key)
        return aggregate_outcomes(keys, rewards, success_threshold=self.success_threshold)

    def report(self, batch: Any, *args: Any, **kwargs: Any) -> list[ReportResult]:  # type: ignore[override]
        """Report a batch's rollouts now (call it before any group filter);
        `update()` then skips these tasks. Accepts a `DataProto` or, like the
        torch sampler, a key -> (s, n) map."""
        if isinstance(batch, Mapping):
            results = super().report(batch, *args, **kwargs)
            self._reported_early.update(str(k) for k in batch)
            return results
        outcomes = self.outcomes(batch)
        results = self._report(outcomes, "report()")
        self._reported_early.update(outcomes)
        return results

    def update(self, batch: Any) -> None:
        """verl's hook after each training step: report the tasks of `batch`,
        except those `report(batch)` reported before a group filter."""
        try:
            outcomes = self.outcomes(batch)
            rest = {k: v for k, v in outcomes.items() if k not in self._reported_early}
            if len(rest) < len(outcomes):
                log.debug("%d tasks of the batch were reported before the filter", len(outcomes) - len(rest))
            if rest:
                self._report(rest, "update()")
            else:
                # Everything went out early: a key -> (s, n) map's report may
                # still run in the background, and on verl's last step no
                # draw follows to raise its error.
                self.wait()
        finally:
            self._reported_early.clear()

    def _report(self, outcomes: Mapping[str, OutcomeValue], where: str) -> list[ReportResult]:
        """Report to the batch the rollouts came from: the batch drawn last
        (what verl trains on, with num_workers=0) when it holds every key,
        else the core's attribution (each key's one open batch)."""
        cur = self.curriculum
        cur.wait()  # a report of a key -> (s, n) map may still run in the background
        last = self.last_batch
        is_open = last is not None and any(b.batch_id == last.batch_id for b in cur.open_batches)
        named = last if is_open and last is not None and set(outcomes) <= set(last.keys) else None
        try:
            return cur.report(outcomes, batch=named)
        except UnattributedOutcomesError as e:
            foreign = [k for k in outcomes if k not in cur.index]
            cause = (
                f" {len(foreign)} of these keys are not in this dataset at all (e.g. {foreign[:3]}): the batch's "
                f"key fields {self.key_locations} hold values that name no row of the dataset the sampler keyed."
                if foreign
                else ""
            )
            raise UnattributedOutcomesError(
                f"{where}: {e}.{cause} In verl each update(batch) must carry the rollouts of the batch the sampler "
                "drew for that step (data.dataloader_num_workers=0), once; a trainer that filters groups reports "
                "them first with sampler.report(batch). To drop and count such outcomes instead of stopping, "
                "set data.sampler.strict=false"
            ) from None


class _Tracking:
    """The curriculum signals into the backends verl's `trainer.logger` names
    (the sampler gets only the data config, so it writes beside verl's own
    logger rather than through it): "tensorboard" (a writer in
    `$TENSORBOARD_DIR`, the directory verl's TensorBoard logger uses, or
    `tensorboard_dir`), "wandb" (the run verl's logger started in this
    process), "console". The step is the batch number + 1, verl's
    `global_steps` of an uninterrupted run."""

    def __init__(self, backends: Sequence[str], tensorboard_dir: str | None = None) -> None:
        self.backends = [str(b) for b in backends]
        unknown = set(self.backends) - {"tensorboard", "wandb", "console"}
        if unknown:
            raise ValueError(f"data.sampler.tracking: unknown backends {sorted(unknown)} (tensorboard, wandb, console)")
        self.tensorboard_dir = tensorboard_dir
        self._writer: Any = None

    def log(self, signals: CurriculumSignals) -> None:
        data = signals.as_dict()
        step = signals.batch_number + 1
        if "tensorboard" in self.backends:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                directory = os.environ.get("TENSORBOARD_DIR") or self.tensorboard_dir or "tensorboard_log/bots"
                self._writer = SummaryWriter(directory)
            for name, value in data.items():
                self._writer.add_scalar(name, value, step)
            self._writer.flush()
        if "wandb" in self.backends:
            wandb = sys.modules.get("wandb")
            if wandb is not None and wandb.run is not None:
                wandb.log(data, step=step)
        if "console" in self.backends:
            log.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in data.items()))


def _flag(options: Mapping[str, Any], name: str, default: bool) -> bool:
    return config_flag(options, name, default, "data.sampler.")


ROLLOUT_N = "actor_rollout_ref.rollout.n"


def trainer_config(*, depth: int = 32) -> Any:
    """The whole config of the verl run building this data pipeline (verl
    passes only its data section to the sampler and the dataset): the first
    of the callers' `config` argument or `self.config` that has
    actor_rollout_ref.rollout.n (verl's `TaskRunner.run(config)`, the v1
    trainer's `_init_dataloader`, `RayPPOTrainer._create_dataloader`). None
    where there is none (a sampler built outside verl's trainer)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        for name in ("config", "self"):
            candidate = frame.f_locals.get(name)
            try:
                if name == "self":
                    candidate = getattr(candidate, "config", None)
                n = _get(_get(_get(candidate, "actor_rollout_ref"), "rollout"), "n")
            except Exception:  # an exotic object's attribute lookup: not verl's config
                continue
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return candidate
        frame = frame.f_back
    return None


def expect_rollout_n(curriculum: Curriculum, options: Mapping[str, Any], trainer: Any, where: str) -> None:
    """Hold the experiment's rollouts_per_task to verl's rollout.n, the
    `rollout_n` option or the `trainer` config's (at once against the
    experiment config given, and at setup against the experiment's own,
    before the first draw); logged at INFO where neither is known (a
    sampler built outside verl's trainer, as in tests)."""
    n = options.get("rollout_n")
    if n is None and trainer is not None:
        n = _get(_get(_get(trainer, "actor_rollout_ref"), "rollout"), "n")
    if n is None:
        log.info(
            "cannot read %s (the sampler was not built by verl's trainer): set %srollout_n to it, so that the "
            "experiment's rollouts_per_task is checked against it",
            ROLLOUT_N,
            where,
        )
        return
    curriculum.expect_group_size(int(n), ROLLOUT_N if options.get("rollout_n") is None else f"{where}rollout_n")


def _get(config: Any, name: str) -> Any:
    if config is None:
        return None
    if hasattr(config, "get"):
        return config.get(name)
    return getattr(config, name, None)


def _sampler_base() -> type:
    try:
        from verl.experimental.dataset.sampler import AbstractCurriculumSampler
    except ImportError:  # verl absent (or >= 0.8): same contract on torch's base
        return torch_sampler()
    return AbstractCurriculumSampler


def __getattr__(name: str) -> Any:
    if name == "BotsCurriculumSampler":
        return lazy_class(__name__, name, _CurriculumSampler, _sampler_base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    BotsCurriculumSampler = _CurriculumSampler
