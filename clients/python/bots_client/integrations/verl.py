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
`key_field` (default "index": verl's `extra_info.index`, which RLHFDataset
copies into every batch row). A dotted path ("extra_info.uid") digs into dict
columns. Rewards: `reward_key` (default "token_level_scores", summed over the
response, i.e. the verifier's sequence score before any KL penalty; a
`non_tensor_batch` entry such as "acc" works too); a rollout succeeds when its
reward is >= `success_threshold` (default 0.5; null counts rewards in [0, 1]
fractionally).

Report before filtering: `update(batch)` sees the batch verl trains on. A
trainer that drops groups first (DAPO-style `filter_groups`, which removes the
all-correct and all-wrong groups the posterior needs most) must call
`sampler.report(batch)` right after the rewards are computed, before the
filter; `update()` then skips the tasks already reported.

verl is imported when `BotsCurriculumSampler` is first accessed; without verl
the class is a plain `torch.utils.data.Sampler` with the same contract.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bots_client.integrations._core import Curriculum, aggregate_outcomes, lazy_class, torch_sampler
from bots_client.integrations.torch import _BotsSampler
from bots_client.types import ExperimentConfig, ReportResult

__all__ = ["BotsCurriculumSampler", "dataset_field", "outcomes_from_batch"]

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


def batch_keys(batch: Any, key_field: str = "index") -> list[str]:
    """The task key of every row of a verl `DataProto`."""
    parts = key_field.split(".")
    non_tensor = batch.non_tensor_batch
    if parts[0] in non_tensor:
        column, rest = non_tensor[parts[0]], parts[1:]
    elif "extra_info" in non_tensor:
        column, rest = non_tensor["extra_info"], parts
    else:
        raise KeyError(f"batch has no non-tensor field {parts[0]!r} (has {sorted(non_tensor)})")
    return [str(_dig(v, rest)) for v in column]


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
    key_field: str = "index",
    reward_key: str = "token_level_scores",
    success_threshold: float | None = 0.5,
) -> dict[str, tuple[float, int]]:
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
    batch_size), request_prefix.
    """

    def __init__(self, data_source: Any, data_config: Any, **overrides: Any) -> None:
        options = _plain(_get(data_config, "sampler") or {})
        options.update(overrides)
        address = options.get("address") or os.environ.get("BOTS_ADDRESS")
        experiment = options.get("experiment") or os.environ.get("BOTS_EXPERIMENT")
        if not address or not experiment:
            raise ValueError(
                "BotsCurriculumSampler needs data.sampler.address and data.sampler.experiment "
                "(or the BOTS_ADDRESS and BOTS_EXPERIMENT environment variables)"
            )
        batch_size = (
            options.get("batch_size") or _get(data_config, "gen_batch_size") or _get(data_config, "train_batch_size")
        )
        if not batch_size:
            raise ValueError("set data.train_batch_size (or data.sampler.batch_size)")
        self.key_field = str(options.get("key_field", "index"))
        self.reward_key = str(options.get("reward_key", "token_level_scores"))
        threshold = options.get("success_threshold", 0.5)
        self.success_threshold = None if threshold is None else float(threshold)
        keys = dataset_field(data_source, self.key_field)
        if any(k is None for k in keys):
            raise ValueError(f"some dataset rows have no {self.key_field!r}; every row needs a task key")
        feature_fields: Mapping[str, str] = options.get("feature_fields") or {}
        features = None
        if feature_fields:
            columns = {name: dataset_field(data_source, path) for name, path in feature_fields.items()}
            features = [{name: float(col[i]) for name, col in columns.items()} for i in range(len(keys))]
        group_field = options.get("group_field")
        groups = dataset_field(data_source, str(group_field)) if group_field else None
        config_fields = options.get("experiment_config")
        config = ExperimentConfig(**config_fields) if config_fields is not None else None
        curriculum = Curriculum(
            address,
            str(experiment),
            keys,
            batch_size=int(batch_size),
            config=config,
            features=features,
            groups=groups,
            request_prefix=str(options.get("request_prefix", "step")),
            rank=0,
            world_size=1,  # verl's single controller owns the dataloader
        )
        super().__init__(curriculum=curriculum, num_batches=options.get("batches_per_epoch"))
        self.data_source = data_source

    def outcomes(self, batch: Any) -> dict[str, tuple[float, int]]:
        return outcomes_from_batch(
            batch, key_field=self.key_field, reward_key=self.reward_key, success_threshold=self.success_threshold
        )

    def report(self, batch: Any, *args: Any, **kwargs: Any) -> list[ReportResult]:  # type: ignore[override]
        """Report a batch's rollouts now (call it before any group filter).
        Accepts a `DataProto` or, like the torch sampler, a key -> (s, n) map."""
        if isinstance(batch, Mapping):
            return super().report(batch, *args, **kwargs)
        return self._report_open(self.outcomes(batch))

    def update(self, batch: Any) -> None:
        """verl's hook after each training step: report the tasks of `batch`
        whose batch was not reported yet."""
        self._report_open(self.outcomes(batch))

    def _report_open(self, outcomes: Mapping[str, tuple[float, int]]) -> list[ReportResult]:
        open_outcomes = {k: v for k, v in outcomes.items() if self.curriculum.batch_of(k) is not None}
        if len(open_outcomes) < len(outcomes):
            log.debug("%d tasks of the batch were already reported", len(outcomes) - len(open_outcomes))
        if not open_outcomes:
            return []
        return self.curriculum.report(open_outcomes)


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
