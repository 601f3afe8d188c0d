"""verl 0.9: a curriculum dataset for `data.custom_cls`, and the replay buffer that reports it.

verl 0.8 removed the `data.sampler` hook the verl 0.5 - 0.7 adapter uses
(`bots_client.integrations.verl`). verl 0.9 still loads a custom dataset
class (`data.custom_cls.path` / `.name`, `get_dataset_class`) and iterates it
with a plain sequential sampler when `data.shuffle=false`. `BotsRLDataset`
numbers the batches the dataloader asks for: the items of each block of
`batch_size` consecutive dataset indices are the positions of the next
service batch, drawn with `Curriculum.select(number)` (request key
"step-<number>", so a redraw after a restart gets the same tasks), and each
row is verl's own `RLHFDataset` row of the selected task, with the task key
and the batch number in `extra_info` (`bots_task_key`, `bots_batch`).

The report needs the rewards, which only the trainer sees:

- verl 0.9's default trainer (`trainer.use_v1=true`, `trainer_mode=sync`):
  `BotsReplayBuffer`, a `trainer.v1.sampler.custom_sampler`. verl's replay
  buffer hands each step's finished rollout groups to the trainer; this one
  reads their rewards (`rm_scores`) and `extra_info` from the TransferQueue
  first and reports each batch, once, before the step trains and before its
  checkpoint is saved. The curriculum signals go into the step's metrics,
  i.e. into verl's own logger (every `trainer.logger` backend).
- the legacy `RayPPOTrainer` (`trainer.use_v1=false`): verl calls
  `train_dataset.on_batch_end(batch)` after every step but the last, so the
  last step's outcomes are never reported there (the v1 trainer reports it).
- the asynchronous v1 modes (`colocate_async`, `separate_async`) are refused:
  a training step there mixes prompts fetched over several steps.

    data.custom_cls.path=pkg://bots_client.integrations.verl_dataset
    data.custom_cls.name=BotsRLDataset
    data.shuffle=false
    data.dataloader_num_workers=0
    +data.bots.address=bots.internal:50051        # or env BOTS_ADDRESS
    +data.bots.experiment=qwen-math-run-7         # or env BOTS_EXPERIMENT
    +data.bots.experiment_config.rollouts_per_task=16   # = actor_rollout_ref.rollout.n
    trainer.v1.sampler.custom_sampler.path=pkg://bots_client.integrations.verl_dataset
    trainer.v1.sampler.custom_sampler.name=BotsReplayBuffer

Exactly once across checkpoints: the dataset's `state_dict()` (saved by
torchdata's `StatefulDataLoader` in verl's `data.pt`) holds the next batch
number, the batches drawn but not reported and the server step of the last
acknowledged report (`Curriculum.resume_state`); loading it continues with
the batch an uninterrupted run would draw next, or draws a pending batch
again if the server never got its report (`Curriculum.resume_number`).
docs/integrations/verl09.md has the configuration, the hooks per trainer
mode and the pitfalls.

verl is imported when `BotsRLDataset` or `BotsReplayBuffer` is first
accessed; `DatasetBatches`, the part that numbers, draws and reports, needs
no framework.
"""

from __future__ import annotations

import importlib
import logging
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from bots_client.integrations._core import (
    Curriculum,
    CurriculumSignals,
    SelectedBatch,
    SignalLog,
    UnattributedOutcomesError,
    address_and_experiment,
    aggregate_outcomes,
    config_flag,
    lazy_class,
)
from bots_client.integrations.verl import _dig, _plain, batch_rewards, expect_rollout_n, key_fields, trainer_config
from bots_client.types import ExperimentConfig

__all__ = [
    "BATCH_FIELD",
    "KEY_FIELD",
    "BotsRLDataset",
    "BotsReplayBuffer",
    "DatasetBatches",
    "UnreportedBatchError",
    "dataframe_keys",
    "trajectory_sessions",
]

log = logging.getLogger("bots_client.integrations.verl_dataset")

# What every row carries in extra_info (verl keeps extra_info with each
# rollout: in the TransferQueue under the v1 trainer, in the DataProto under
# the legacy one).
KEY_FIELD = "bots_task_key"
BATCH_FIELD = "bots_batch"

DEFAULT_KEY_FIELD = ("data_source", "index")
REPLAY_BUFFER = (
    "trainer.v1.sampler.custom_sampler.path=pkg://bots_client.integrations.verl_dataset and "
    "trainer.v1.sampler.custom_sampler.name=BotsReplayBuffer"
)


class UnreportedBatchError(RuntimeError):
    """The dataloader asked for the next batch while an earlier batch this
    process drew was still unreported: nothing reports this dataset's batches
    (the v1 trainer without `BotsReplayBuffer`), or a step's report failed."""


# -- the framework-free part -----------------------------------------------------------


class DatasetBatches:
    """Dataset item `i` -> position `i % batch_size` of a service batch.

    A block of `batch_size` consecutive items is one batch: its first item
    fetched draws batch number `next_number` (`Curriculum.select`, request key
    "<prefix>-<number>"), the rest reuse it. A new block (or an index at or
    below the last one: the sampler started another pass) draws the next
    number, so epochs continue the numbering. Items must be fetched in order,
    by one process (verl's sequential sampler, `dataloader_num_workers=0`).

    Before it draws batch k it checks that every batch this process drew
    before k was reported (`UnreportedBatchError` otherwise): the trainers
    this module supports report each batch before they ask for the next.
    """

    def __init__(self, curriculum: Curriculum, *, batches_per_epoch: int | None = None) -> None:
        self.curriculum = curriculum
        self.batch_size = curriculum.batch_size
        per_epoch = len(curriculum.keys) // self.batch_size if batches_per_epoch is None else int(batches_per_epoch)
        if per_epoch <= 0:
            raise ValueError(f"batches_per_epoch must be positive, got {per_epoch}")
        self.batches_per_epoch = per_epoch
        self.next_number = 0
        self.current: SelectedBatch | None = None
        self._last_item: int | None = None

    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size

    def item(self, index: int) -> tuple[SelectedBatch, int]:
        """The batch and the position in it of dataset item `index`."""
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"dataset index {i} out of range [0, {len(self)})")
        last = self._last_item
        if self.current is None or last is None or i <= last or i // self.batch_size != last // self.batch_size:
            self.current = self.draw(self.next_number)
        self._last_item = i
        return self.current, i % self.batch_size

    def draw(self, number: int) -> SelectedBatch:
        """Draw batch `number` (and make it the next block's batch)."""
        cur = self.curriculum
        cur.wait()  # the report running in the background closes its batch
        earlier = [b.number for b in cur.open_batches if b.number < number]
        if earlier:
            raise UnreportedBatchError(
                f"batch {earlier[0]} (request key {cur.request_key(earlier[0])!r}) of experiment {cur.experiment!r} "
                f"was drawn but never reported, and the dataloader now asks for batch {number}: nothing reports "
                f"this dataset's batches. Under verl 0.9's v1 trainer set {REPLAY_BUFFER}; under the legacy "
                "RayPPOTrainer verl reports through on_batch_end (docs/integrations/verl09.md)"
            )
        cur.prepare_draw(
            number,
            "In verl: let verl load this run's checkpoint (trainer.resume_mode=auto or resume_path; its data.pt "
            "carries this dataset's state), set +data.bots.resume=true to continue without one (with a "
            "request_prefix of its own), or name a new experiment",
        )
        selected = cur.select(number)
        self.next_number = number + 1
        log.debug("batch %d: %s", number, selected.keys)
        return selected

    # -- reporting --------------------------------------------------------------------

    def report_rollouts(
        self,
        numbers: Sequence[Any],
        keys: Sequence[Any],
        rewards: Sequence[Any],
        *,
        success_threshold: float | None = 0.5,
        where: str = "report",
        background: bool = False,
    ) -> list[CurriculumSignals]:
        """Report rollouts, one per element: `numbers[i]` is the batch rollout
        i's prompt came from (its row's `bots_batch`), `keys[i]` its task key,
        `rewards[i]` its reward. Each batch named is reported once, strictly:
        a key outside its batch, or a batch that is not open in this process
        (reported already, or never drawn here), raises
        UnattributedOutcomesError before anything is sent (with `strict`
        off, the curriculum drops and counts such outcomes instead).
        Returns the signals of each batch reported (not of duplicates).

        With `background`, the report runs off the caller's critical path
        (`Curriculum.report_in_background`: attribution is checked now, the
        next draw and the next checkpoint wait for the report, a failure
        raises there) and no signals are returned: the curriculum's listeners
        get them when the report is done."""
        if not (len(numbers) == len(keys) == len(rewards)):
            raise ValueError(f"got {len(numbers)} batch numbers, {len(keys)} task keys and {len(rewards)} rewards")
        by_batch: dict[int, tuple[list[str], list[Any]]] = {}
        for number, key, reward in zip(numbers, keys, rewards):
            slot = by_batch.setdefault(int(number), ([], []))
            slot[0].append(str(key))
            slot[1].append(reward)
        cur = self.curriculum
        parts = {
            n: aggregate_outcomes(k, r, success_threshold=success_threshold) for n, (k, r) in sorted(by_batch.items())
        }
        drawn = {b.number for b in cur.open_batches}
        signals: list[CurriculumSignals] = []
        for number, outcomes in parts.items():
            if number not in drawn and not cur.strict:
                log.error(
                    "%s: batch %d is not open in this process (reported already, or drawn elsewhere); "
                    "dropping its %d task outcomes (strict=false)",
                    where,
                    number,
                    len(outcomes),
                )
                cur.dropped_outcomes += len(outcomes)
                continue
            try:
                if background:
                    cur.report_in_background(outcomes, batch=number, lookahead=None)
                    continue
                results = cur.report(outcomes, batch=number)
            except UnattributedOutcomesError as e:
                raise UnattributedOutcomesError(
                    f"{where}: {e}. In verl 0.9 every rollout carries the batch its prompt was drawn in "
                    f"(extra_info.{BATCH_FIELD}) and each batch is reported once, by the step that trained on it; "
                    "a batch reported twice, a batch of another run, or a row whose task is not in its batch "
                    "means the rows did not come from this BotsRLDataset (or extra_info was rewritten). "
                    "+data.bots.strict=false drops and counts such outcomes instead"
                ) from None
            if results and not results[0].duplicate and cur.last_signals is not None:
                signals.append(cur.last_signals)
        return signals

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.curriculum.checkpoint_state(self.next_number)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_number = self.curriculum.resume_from(state, "dataset state")
        self.current = None
        self._last_item = None


def _log_reported(signals: CurriculumSignals) -> None:
    values = " ".join(f"{k}={v:.4g}" for k, v in signals.as_dict().items())
    log.info("batch %d reported: %s", signals.batch_number, values)


def frame_column(frame: Any, path: str) -> list[Any]:
    """`path` of every row of a HF dataset (verl's `RLHFDataset.dataframe`):
    a top-level column (dotted paths dig into it), else a field of
    `extra_info`; None where a row lacks it. A path found in neither raises."""
    parts = path.split(".")
    columns = list(frame.column_names)
    if parts[0] in columns:
        return [_dig(v, parts[1:]) if len(parts) == 1 or isinstance(v, Mapping) else None for v in frame[parts[0]]]
    if "extra_info" in columns:
        return [_dig(v, parts) if isinstance(v, Mapping) else None for v in frame["extra_info"]]
    raise ValueError(
        f"key field {path!r}: the dataset has no column {parts[0]!r} and no extra_info column (columns: {columns}); "
        "every row needs a task key (data.bots.key_field)"
    )


def dataframe_keys(frame: Any, key_field: Any = DEFAULT_KEY_FIELD) -> list[str]:
    """The task key of every row: the values of `key_field`'s fields joined
    with ":" (default data_source and index, e.g. "openai/gsm8k:12", unique
    across several data files). A field missing from any row, or keys that
    repeat, raise ValueError."""
    fields = key_fields(key_field)
    columns = [frame_column(frame, f) for f in fields]
    n = len(columns[0])
    for field, values in zip(fields, columns):
        missing = [i for i, v in enumerate(values) if v is None]
        if len(missing) == n:
            raise ValueError(
                f"no dataset row has the key field {field!r} (neither a top-level column nor a field of extra_info; "
                f"columns: {list(frame.column_names)}). Every row needs a task key: set data.bots.key_field"
            )
        if missing:
            raise ValueError(
                f"{len(missing)} of {n} dataset rows have no key field {field!r} (e.g. row {missing[0]}); "
                "every row needs a task key (data.bots.key_field)"
            )
    keys = [":".join(str(v) for v in row) for row in zip(*columns)]
    seen: set[str] = set()
    repeats = []
    for key in keys:
        if key in seen:
            repeats.append(key)
        seen.add(key)
    if repeats:
        raise ValueError(
            f"task keys from {fields} repeat ({len(repeats)} duplicates, e.g. {repeats[:3]}): several data files each "
            "numbering extra_info.index from 0, or rows without extra_info.index? Key the rows by fields that are "
            "unique together: data.bots.key_field=[data_source,index] or a unique extra_info field"
        )
    return keys


def trajectory_sessions(keys: Sequence[str]) -> list[int]:
    """The positions of the trajectories that stand for a rollout: verl's
    TransferQueue keys are "{uid}_{session}_{index}", one session per
    rollout, and an agent loop with several outputs per session gives each
    the session's reward; one rollout is one trial, so keep the session's
    last output."""
    last: dict[tuple[str, str], tuple[int, int]] = {}
    for position, key in enumerate(keys):
        parts = str(key).rsplit("_", 2)
        session = (parts[0], parts[1]) if len(parts) == 3 else (str(key), "")
        index = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else 0
        if session not in last or index >= last[session][0]:
            last[session] = (index, position)
    return sorted(position for _, position in last.values())


def _get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if hasattr(config, "get"):
        value = config.get(name, default)
        return default if value is None else value
    return getattr(config, name, default)


def _extra(value: Any) -> Any:
    """One row's extra_info as stored (a TransferQueue NonTensorData wraps it)."""
    value = getattr(value, "data", value)
    return value if isinstance(value, Mapping) else None


def _files(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _is_train(data_files: Any, config: Any) -> bool:
    """Whether this dataset is the train dataset (verl builds the validation
    dataset with the same class). By the files; when data.val_files names
    the train files, by verl's own `is_train` argument of the caller,
    `create_rl_dataset`."""
    files = _files(data_files)
    train, val = _files(_get(config, "train_files")), _files(_get(config, "val_files"))
    if files != val or not files:
        return True  # the train files, or a dataset built outside verl's trainer
    if files != train:
        return False
    frame: FrameType | None = sys._getframe(2)  # __init__ <- type.__call__ (no frame) <- the caller
    for _ in range(3):
        if frame is None:
            break
        if frame.f_code.co_name == "create_rl_dataset" and "is_train" in frame.f_locals:
            return bool(frame.f_locals["is_train"])
        frame = frame.f_back
    raise ValueError(
        "data.val_files names the same files as data.train_files and this dataset was not built by verl's "
        "create_rl_dataset, so BotsRLDataset cannot tell whether it is the train dataset (which draws batches from "
        "the service) or the validation dataset; use other files for validation"
    )


LEGACY_TRAINER = (
    "trainer.use_v1=false: verl's legacy RayPPOTrainer calls on_batch_end after every step but the last, so the "
    "last step's outcomes would never reach the service, and a resume from its checkpoints continues one batch "
    "short. BotsRLDataset reports through the v1 trainer: set trainer.use_v1=true and "
    "trainer.v1.sampler.custom_sampler.path=pkg://bots_client.integrations.verl_dataset, "
    "trainer.v1.sampler.custom_sampler.name=BotsReplayBuffer (docs/integrations/verl09.md)"
)

# The train datasets of this process, for a replay buffer whose trainer it cannot reach.
_TRAIN_DATASETS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class _BotsRLDataset:
    """verl's `RLHFDataset`, its train rows drawn from a BOTS experiment.

    `BotsRLDataset(data_files, tokenizer, config, processor, max_samples)`,
    as verl's `create_rl_dataset` builds it. Options under `config.bots`:
    address, experiment (or BOTS_ADDRESS / BOTS_EXPERIMENT), experiment_config
    (ExperimentConfig fields; creates the experiment if missing), key_field
    (default [data_source, index]; a field is a top-level column or, if there
    is none, a field of extra_info; dotted paths dig into dicts), feature_fields
    (feature name -> row field), group_field (e.g. data_source),
    reward_key (default rm_scores: the verifier's score on the last response
    token; or a reward_extra_info name such as acc), success_threshold
    (default 0.5; null counts rewards in [0, 1] fractionally), batch_size
    (default data.train_batch_size), batches_per_epoch (default
    rows // batch_size), request_prefix (default step), strict (default
    true), resume (default false).

    The validation dataset (`data.val_files`) is verl's plain RLHFDataset.
    """

    curriculum: Curriculum | None
    batches: DatasetBatches | None
    dataframe: Any  # RLHFDataset's HF dataset of the rows

    def __init__(
        self,
        data_files: Any,
        tokenizer: Any,
        config: Any,
        processor: Any = None,
        max_samples: int = -1,
        **kwargs: Any,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            data_files, tokenizer, config, processor=processor, max_samples=max_samples, **kwargs
        )
        self.curriculum = None
        self.batches = None
        self.is_train = _is_train(data_files, config)
        if not self.is_train:
            return
        options = _plain(_get(config, "bots", {}))
        address, experiment = address_and_experiment(options, "BotsRLDataset", "+data.bots.")
        if config_flag({"shuffle": _get(config, "shuffle", False)}, "shuffle", False, "data."):
            raise ValueError(
                "data.shuffle=true: verl then feeds the dataset random indices, but BotsRLDataset's index i is "
                "position i % batch_size of the i // batch_size-th batch the service selects (the service does the "
                "choosing). Set data.shuffle=false"
            )
        workers = int(_get(config, "dataloader_num_workers", 0))
        if workers != 0:
            raise ValueError(
                f"data.dataloader_num_workers={workers}: BotsRLDataset draws each batch when the trainer asks for it "
                "(after the previous batch's report, so it comes from the updated posterior) and numbers the batches "
                "in the order it is asked; dataloader workers would draw batches ahead, from stale posteriors, in "
                "copies of the dataset. Set data.dataloader_num_workers=0"
            )
        train_batch_size = _get(config, "train_batch_size")
        batch_size = int(options.get("batch_size") or train_batch_size or 0)
        if batch_size <= 0:
            raise ValueError("set data.train_batch_size (or +data.bots.batch_size)")
        gen_batch_size = _get(config, "gen_batch_size")
        if gen_batch_size is not None and int(gen_batch_size) != batch_size:
            raise ValueError(
                f"data.gen_batch_size={gen_batch_size} differs from the batch size {batch_size}: a training step "
                "would then hold parts of several service batches. Leave data.gen_batch_size unset"
            )
        self.key_field = key_fields(options.get("key_field", list(DEFAULT_KEY_FIELD)))
        keys = dataframe_keys(self.dataframe, self.key_field)
        feature_fields: Mapping[str, str] = options.get("feature_fields") or {}
        features = None
        if feature_fields:
            columns = {name: frame_column(self.dataframe, path) for name, path in feature_fields.items()}
            features = [{name: float(col[i]) for name, col in columns.items()} for i in range(len(keys))]
        group_field = options.get("group_field")
        groups = frame_column(self.dataframe, str(group_field)) if group_field else None
        self.reward_key = str(options.get("reward_key", "rm_scores"))
        threshold = options.get("success_threshold", 0.5)
        self.success_threshold = None if threshold is None else float(threshold)
        config_fields = options.get("experiment_config")
        embed_field = options.get("embed_field")
        self.curriculum = Curriculum(
            str(address),
            str(experiment),
            keys,
            batch_size=batch_size,
            config=ExperimentConfig(**config_fields) if config_fields is not None else None,
            features=features,
            groups=groups,
            request_prefix=str(options.get("request_prefix", "step")),
            rank=0,
            world_size=1,  # verl's single controller owns the dataloader
            resume=config_flag(options, "resume", False, "data.bots."),
            strict=config_flag(options, "strict", True, "data.bots."),
            embed_fn=options.get("embed_fn"),
            embed_inputs=frame_column(self.dataframe, str(embed_field)) if embed_field else None,
        )
        trainer = trainer_config()
        if trainer is not None and not config_flag(
            {"use_v1": _get(_get(trainer, "trainer"), "use_v1", True)}, "use_v1", True, "trainer."
        ):
            raise ValueError(LEGACY_TRAINER)
        expect_rollout_n(self.curriculum, options, trainer, "+data.bots.")
        self.batches = DatasetBatches(self.curriculum, batches_per_epoch=options.get("batches_per_epoch"))
        # Reports run off the trainer's critical path unless asked otherwise;
        # their signals are logged with the step in which they finish.
        self.background = config_flag(options, "background_report", True, "data.bots.")
        self._finished = SignalLog(self.curriculum)
        self.curriculum.add_listener(_log_reported)
        _TRAIN_DATASETS[str(experiment)] = self
        log.info(
            "experiment %r: %d tasks keyed by %s, batches of %d, %d per epoch",
            experiment,
            len(keys),
            self.key_field,
            batch_size,
            self.batches.batches_per_epoch,
        )

    def __len__(self) -> int:
        if self.batches is None:
            return super().__len__()  # type: ignore[misc]
        return len(self.batches)

    def __getitem__(self, item: int) -> Any:
        if self.batches is None:
            return super().__getitem__(item)  # type: ignore[misc]
        selected, position = self.batches.item(item)
        row = super().__getitem__(selected.indices[position])  # type: ignore[misc]
        extra = dict(row.get("extra_info") or {})
        extra[KEY_FIELD] = selected.keys[position]
        extra[BATCH_FIELD] = selected.number
        row["extra_info"] = extra
        return row

    @property
    def dropped_outcomes(self) -> int:
        return 0 if self.curriculum is None else self.curriculum.dropped_outcomes

    # -- reporting --------------------------------------------------------------------

    def report_rollouts(
        self,
        numbers: Sequence[Any],
        keys: Sequence[Any],
        rewards: Sequence[Any],
        *,
        where: str = "report",
        background: bool | None = None,
    ) -> list[CurriculumSignals]:
        """Report rollouts (one element each: the batch number and task key of
        its row, its reward); see `DatasetBatches.report_rollouts`. Returns
        the signals of the reports finished since the last call: with
        `background_report` (the default), those of earlier batches.
        `background` overrides that setting for this report."""
        if self.batches is None:
            raise RuntimeError("the validation dataset draws no batches and reports nothing")
        self.batches.report_rollouts(
            numbers,
            keys,
            rewards,
            success_threshold=self.success_threshold,
            where=where,
            background=self.background if background is None else background,
        )
        return self._finished.pop()

    def report_extra_infos(
        self,
        extra_infos: Iterable[Any],
        rewards: Sequence[Any],
        *,
        where: str = "report",
        background: bool | None = None,
    ) -> list[CurriculumSignals]:
        """Report rollouts given each one's `extra_info` (which carries the
        task key and the batch number) and reward."""
        numbers, keys = [], []
        infos = [_extra(e) for e in extra_infos]
        for i, extra in enumerate(infos):
            if extra is None or KEY_FIELD not in extra or BATCH_FIELD not in extra:
                raise KeyError(
                    f"{where}: rollout {i} has no extra_info.{KEY_FIELD} / extra_info.{BATCH_FIELD}: its prompt "
                    "did not come from BotsRLDataset (set data.custom_cls.path="
                    "pkg://bots_client.integrations.verl_dataset and data.custom_cls.name=BotsRLDataset), or "
                    "something replaced extra_info"
                )
            numbers.append(extra[BATCH_FIELD])
            keys.append(extra[KEY_FIELD])
        return self.report_rollouts(numbers, keys, rewards, where=where, background=background)

    def on_batch_end(self, batch: Any) -> None:
        """The legacy RayPPOTrainer's hook (`trainer.use_v1=false`), called
        after every training step but the last: report the step's batch."""
        if self.batches is None:
            return
        extra = batch.non_tensor_batch.get("extra_info")
        if extra is None:
            fields = sorted(batch.non_tensor_batch)
            raise KeyError(f"on_batch_end: the batch has no extra_info (non-tensor fields: {fields})")
        self.report_extra_infos(list(extra), _proto_rewards(batch, self.reward_key), where="on_batch_end")

    # -- checkpoints: torchdata's StatefulDataLoader saves and loads these ---------------

    def state_dict(self) -> dict[str, Any]:
        return {} if self.batches is None else self.batches.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.batches is not None and state:
            self.batches.load_state_dict(state)


def _proto_rewards(batch: Any, reward_key: str) -> list[float]:
    """One reward per row of a legacy-trainer DataProto: rm_scores (else
    verl's token_level_scores: the same score before any KL penalty) summed
    over the response, or another tensor or non-tensor field (a
    reward_extra_info entry such as acc)."""
    name = reward_key
    if reward_key == "rm_scores" and (batch.batch is None or "rm_scores" not in batch.batch.keys()):  # noqa: SIM118
        name = "token_level_scores"
    try:
        return batch_rewards(batch, name)
    except KeyError as e:
        raise KeyError(f"on_batch_end: {e.args[0]} (data.bots.reward_key)") from None


class _BotsReplayBuffer:
    """verl 0.9's sync v1 replay buffer (`trainer.v1.sampler.custom_sampler`)
    that reports each training batch to the service as it hands it over.

    `sample()` is verl's; after it, the finished rollouts of the train
    partition (keys "{uid}_{session}_{index}") are read from the
    TransferQueue: their extra_info (task key and batch number) and reward
    (`rm_scores`, or `extra_fields.reward_extra_info[reward_key]`). One
    trial per session. The train dataset reports them (`report_rollouts`),
    and the curriculum signals are returned with the step's metrics, which
    verl logs with its own logger. `sampler_kwargs.poll_interval` sets how
    often verl's buffer polls the TransferQueue (default verl's 2 s).
    """

    trainer_mode: str
    refill_fn: Any
    sampler_kwargs: Any
    poll_interval: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.trainer_mode != "sync":
            raise ValueError(
                f"BotsReplayBuffer supports trainer.v1.trainer_mode=sync, not {self.trainer_mode!r}: the asynchronous "
                "modes fetch prompts one at a time over several steps (warm-up batches, refills), train on whichever "
                "groups finish first and drop stale ones, so a training step does not hold one service batch "
                "(docs/integrations/verl09.md). Use trainer_mode=sync"
            )
        options = _plain(self.sampler_kwargs or {})
        if options.get("poll_interval") is not None:
            self.poll_interval = float(options["poll_interval"])
        self._trainer = getattr(self.refill_fn, "__self__", None)
        config = getattr(self._trainer, "config", None)
        if config is not None:
            filter_groups = _get(_get(config, "algorithm"), "filter_groups")
            if config_flag({"enable": _get(filter_groups, "enable", False)}, "enable", False, ""):
                raise ValueError(
                    "algorithm.filter_groups.enable=true: verl applies no group filter with a custom replay buffer "
                    "(it passes the filter settings only to its own), and DAPO's refills would spread a service batch "
                    "over several steps. BotsReplayBuffer reports every group (the all-correct and all-wrong ones "
                    "are the posterior's best evidence); disable filter_groups"
                )
            sampler = _get(_get(_get(config, "trainer"), "v1"), "sampler")
            if config_flag({"r": _get(sampler, "sync_refill_failed_groups", False)}, "r", False, ""):
                raise ValueError(
                    "trainer.v1.sampler.sync_refill_failed_groups=true refills failed groups with new prompts, "
                    "which spreads a service batch over several steps; leave it false (a failed group's finished "
                    "rollouts are still reported)"
                )

    def _dataset(self) -> Any:
        dataset = getattr(self._trainer, "train_dataset", None)
        if dataset is None and len(_TRAIN_DATASETS) == 1:
            dataset = next(iter(_TRAIN_DATASETS.values()))
        if dataset is None or getattr(dataset, "batches", None) is None:
            raise TypeError(
                f"BotsReplayBuffer reports the batches of BotsRLDataset, but the train dataset is "
                f"{type(dataset).__name__}: set data.custom_cls.path=pkg://bots_client.integrations.verl_dataset and "
                "data.custom_cls.name=BotsRLDataset"
            )
        return dataset

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict[str, Any]]:
        batch, metrics = super().sample(  # type: ignore[misc]
            global_steps=global_steps, partition_id=partition_id, batch_size=batch_size
        )
        if partition_id == "val":
            return batch, metrics
        dataset = self._dataset()
        keys = [batch.keys[i] for i in trajectory_sessions(batch.keys)]
        extra_infos, rewards = _read_rollouts(keys, batch.partition_id, dataset.reward_key)
        where = f"BotsReplayBuffer.sample (step {global_steps})"
        # verl's last step (global_steps counts from 1) is followed by no
        # draw and, with save_freq=-1 (verl's default), by no checkpoint:
        # nothing would wait for a background report, and a failed one would
        # be lost with a log line. That report is made before the step trains.
        final = _is_last_step(self._trainer, int(global_steps))
        signals = dataset.report_extra_infos(extra_infos, rewards, where=where, background=False if final else None)
        metrics = dict(metrics)
        for s in signals:
            metrics.update(s.as_dict())
        return batch, metrics


def _is_last_step(trainer: Any, global_steps: int) -> bool:
    """Whether verl's v1 trainer ends after step `global_steps`: its loop
    runs while global_steps <= total_training_steps and the epoch is below
    trainer.total_epochs, whichever ends first (verl 0.9.1 trainer_base)."""
    total = getattr(trainer, "total_training_steps", None)
    if total is None:
        return False
    last = int(total)
    per_epoch = getattr(trainer, "steps_per_epoch", None)
    epochs = _get(_get(getattr(trainer, "config", None), "trainer"), "total_epochs")
    if per_epoch is not None and epochs is not None:
        last = min(last, int(per_epoch) * int(epochs))
    return global_steps >= last


def _read_rollouts(keys: Sequence[str], partition_id: str, reward_key: str) -> tuple[list[Any], list[float | None]]:
    """extra_info and reward of each trajectory, from the TransferQueue."""
    tq = importlib.import_module("transfer_queue")  # verl's v1 trainer needs it; typed Any here
    if not keys:
        return [], []
    canonical = reward_key == "rm_scores"
    fields = ["extra_info", "rm_scores" if canonical else "extra_fields"]
    try:
        data = tq.kv_batch_get(keys=list(keys), partition_id=partition_id, select_fields=fields)
    except Exception as e:
        if canonical and "rm_scores" in str(e):
            raise KeyError(
                "the finished rollouts carry no rm_scores: the reward is computed after sampling (a colocated reward "
                "model). BotsReplayBuffer reports when verl samples the batch, so it needs the streaming reward path: "
                "a rule-based reward, or reward.reward_model.enable_resource_pool=true"
            ) from e
        raise
    infos = _values(data["extra_info"])
    if canonical:
        rewards: list[float | None] = [float(v.sum().item()) for v in list(data["rm_scores"])]
    else:
        rewards = []
        for i, extra in enumerate(_values(data["extra_fields"])):
            extra = getattr(extra, "data", extra)
            info = extra.get("reward_extra_info", {}) if isinstance(extra, Mapping) else {}
            if reward_key not in info:
                raise KeyError(
                    f"rollout {keys[i]!r} has no reward_extra_info[{reward_key!r}] (data.bots.reward_key; it has "
                    f"{sorted(info)}); the default, rm_scores, is the reward function's score"
                )
            value = info[reward_key]
            rewards.append(None if value is None else float(value))
    if len(infos) != len(keys) or len(rewards) != len(keys):
        raise ValueError(
            f"the TransferQueue returned {len(infos)} extra_info and {len(rewards)} rewards for {len(keys)} rollouts"
        )
    return infos, rewards


def _values(column: Any) -> list[Any]:
    """A TransferQueue non-tensor column as a list of Python values."""
    if hasattr(column, "tolist"):
        return list(column.tolist())
    return [getattr(v, "data", v) for v in column]


def _dataset_base() -> type:
    try:
        from verl.utils.dataset.rl_dataset import RLHFDataset
    except ImportError as e:
        raise ImportError(f"BotsRLDataset needs verl >= 0.9 (verl.utils.dataset.rl_dataset): {e}") from e
    return RLHFDataset


def _replay_buffer_base() -> type:
    try:
        from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    except ImportError as e:
        raise ImportError(
            f"BotsReplayBuffer needs verl >= 0.9 with its v1 trainer (verl.trainer.ppo.v1, TransferQueue): {e}"
        ) from e
    return ReplayBuffer


def __getattr__(name: str) -> Any:
    if name == "BotsRLDataset":
        return lazy_class(__name__, name, _BotsRLDataset, _dataset_base)
    if name == "BotsReplayBuffer":
        return lazy_class(__name__, name, _BotsReplayBuffer, _replay_buffer_base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    BotsRLDataset = _BotsRLDataset
    BotsReplayBuffer = _BotsReplayBuffer
