"""Trinity-RFT: a data selector backed by the BOTS service.

Trinity-RFT builds a taskset's selector from `data_selector.selector_type`,
which may be a dotted class path, as `cls(data_source, config)` where
`data_source` is its `_HFBatchReader` (`.dataset`, `.dataset_size`) and
`config` its `DataSelectorConfig` (`selector_type`, `seed`, `feature_keys`,
`kwargs`). It then calls `load_state_dict()` (with `{"current_index": 0}` on
a fresh start), `get_indices(batch_size)` once per explore step,
`feedback(indices, values)` with each task's mean reward over its rollouts
(from the `pass_rate_calculator` experience operator) once per finished
step, in step order, and `state_dict()` at checkpoints. In the explorer
config:

    algorithm:
      repeat_times: 16                 # rollouts per task: the trials reported per task
    buffer:
      explorer_input:
        taskset:
          data_selector:
            selector_type: bots_client.integrations.trinity.BotsSelector
            feature_keys: [qwen2.5_7b_pass_rate, qwen3_30b_pass_rate]  # weak, strong (optional)
            kwargs:
              address: bots.internal:50051
              experiment: math-run-3
              key_field: id          # optional: a unique column; default the row position
              m: 16                  # optional: must equal algorithm.repeat_times
              lamb: 0.1              # Trinity's BOTS knobs map onto ExperimentConfig
              rho: 0.1
              target_reward: 0.5
              do_sample: true
              tau: 0
              # strict: false        # drop (and count) unattributable feedback instead of raising
              # resume: true         # continue a used experiment without this run's checkpoint
    data_processor:
      experience_pipeline:
        operators:
          - name: pass_rate_calculator

Feedback is a mean reward, so the selector reports `mean * n` successes of
`n` trials with `n` the taskset's `repeat_times` (Trinity copies
`algorithm.repeat_times` into it). The selector's own arguments do not carry
it; in trinity-rft 0.6 the selector is built inside the taskset reader, whose
`StorageConfig` does, and the selector reads it from there. An `m` (or
`experiment_config.rollouts_per_task`) that differs raises ValueError at
start; where `repeat_times` cannot be found (another Trinity version, a
selector built by hand) `m` is required.

Every feedback is filed under the batches the explore step drew (the indices
Trinity passes back are those of one `get_indices` call), so a task in two
open batches never mixes their outcomes. Feedback that fits no batch drawn
and not yet reported (a second feedback for a step, tasks never drawn)
raises `UnattributedOutcomesError`; with `strict: false` it is dropped,
logged and counted (`selector.dropped_outcomes`). A batch whose feedback the
explorer lost before a checkpoint was restored is drawn again with the first
step after the restore, together with that step's own batch: Trinity's
explorer restores its own step count and reads no extra step, so the run
reports every batch of an uninterrupted run once (the same request keys) and
ends at the same server step.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

import numpy as np

from bots_client.errors import NotFoundError
from bots_client.integrations._core import (
    MAX_OPEN_BATCHES,
    Curriculum,
    OutcomeValue,
    SelectedBatch,
    address_and_experiment,
    config_flag,
)
from bots_client.types import ExperimentConfig, ReportResult

__all__ = ["BotsSelector", "experiment_config_from_trinity", "trinity_repeat_times"]

log = logging.getLogger("bots_client.integrations.trinity")

_OWN_KWARGS = {
    "address",
    "experiment",
    "key_field",
    "experiment_config",
    "request_prefix",
    "batch_size",
    "strict",
    "resume",
    "embed_fn",
    "embed_field",
}
_TRINITY_KWARGS = {"m", "lamb", "rho", "target_reward", "do_sample", "tau", "adaptive_rho"}

# Mean rewards this far outside [0, 1] are rounding, not a reward on another scale.
_RATE_TOLERANCE = 1e-6


def experiment_config_from_trinity(
    kwargs: Mapping[str, Any], *, seed: int = 0, with_features: bool = False
) -> ExperimentConfig:
    """Trinity's BOTS selector knobs (examples/bots/bots.yaml) as an
    ExperimentConfig: m -> rollouts_per_task, lamb -> forgetting, rho ->
    implicit_weight, target_reward -> target_success; do_sample picks
    Thompson draws (else posterior means); tau > 0 samples from a softmax.
    (BotsSelector sets rollouts_per_task to the taskset's repeat_times.)"""
    tau = float(kwargs.get("tau", 0.0))
    do_sample = bool(kwargs.get("do_sample", True))
    if tau > 0:
        mode = "softmax"
        if not do_sample:
            log.warning("tau > 0 with do_sample = false: the service's softmax scores Thompson draws")
    else:
        mode = "thompson" if do_sample else "mean"
    if kwargs.get("adaptive_rho"):
        log.warning("adaptive_rho is not supported by the service; rho stays fixed")
    return ExperimentConfig(
        strategy="bots",
        target_success=float(kwargs.get("target_reward", 0.5)),
        forgetting=float(kwargs.get("lamb", 0.1)),
        implicit_weight=float(kwargs.get("rho", 0.1)) if with_features else 0.0,
        rollouts_per_task=int(kwargs.get("m", 16)),
        selection_mode=mode,
        temperature=tau if tau > 0 else 1.0,
        weak_feature="weak" if with_features else "",
        strong_feature="strong" if with_features else "",
        seed=int(seed),
    )


def trinity_repeat_times(selector_config: Any, *, depth: int = 16) -> int | None:
    """The rollouts per task of the taskset whose selector is being built
    from `selector_config` (its `DataSelectorConfig`), or None.

    Trinity's `DataSelectorConfig` and `_HFBatchReader` do not carry
    `repeat_times`; the taskset's `StorageConfig` does (set from
    `algorithm.repeat_times` by Trinity's config validator). trinity-rft
    0.6 builds the selector in `_DatasetFileReader._init_selector(config)`,
    with `config.data_selector` the very object the selector gets: this
    looks for that `StorageConfig` among the callers' `config` arguments
    (matched by identity, so nothing else can match). None where the
    selector is built another way; ValueError where that taskset config
    has no repeat_times (Trinity's config validator sets it from
    algorithm.repeat_times), rather than a count of trials guessed."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        for name in ("config", "storage_config", "taskset_config"):
            candidate = frame.f_locals.get(name)
            try:
                if candidate is None or getattr(candidate, "data_selector", None) is not selector_config:
                    continue
                repeat = getattr(candidate, "repeat_times", None)
            except Exception:  # an exotic object's attribute lookup: not Trinity's config
                continue
            if isinstance(repeat, int) and not isinstance(repeat, bool) and repeat > 0:
                return repeat
            raise ValueError(
                f"BotsSelector: the taskset {getattr(candidate, 'name', '')!r} has repeat_times = {repeat!r}, not "
                "the rollouts per task it runs: Trinity's config validator sets the taskset's repeat_times from "
                "algorithm.repeat_times, and each task's mean reward is reported over that many trials. Build the "
                "config through Trinity's validator (trinity run does), or set the taskset's repeat_times to "
                "algorithm.repeat_times"
            )
        frame = frame.f_back
    return None


def _flag(kwargs: Mapping[str, Any], name: str, default: bool) -> bool:
    return config_flag(kwargs, name, default, "BotsSelector kwargs.")


def _trials(kwargs: Mapping[str, Any], repeat_times: int | None) -> int:
    """The trials reported per task: the taskset's repeat_times, which an
    explicit m / experiment_config.rollouts_per_task must equal."""
    given: dict[str, int] = {}
    if kwargs.get("m") is not None:
        given["kwargs.m"] = int(kwargs["m"])
    if kwargs.get("experiment_config") is not None:
        rollouts = dict(kwargs["experiment_config"]).get("rollouts_per_task")
        if rollouts is not None:
            given["kwargs.experiment_config.rollouts_per_task"] = int(rollouts)
    if len(set(given.values())) > 1:
        raise ValueError(
            f"BotsSelector: {' and '.join(f'{k} = {v}' for k, v in given.items())} disagree; both are the "
            "rollouts per task (algorithm.repeat_times): give one, equal to repeat_times"
        )
    explicit = next(iter(given.items()), None)
    if repeat_times is not None:
        if explicit is not None and explicit[1] != repeat_times:
            raise ValueError(
                f"BotsSelector: {explicit[0]} = {explicit[1]} but the taskset runs repeat_times = {repeat_times} "
                f"rollouts per task (algorithm.repeat_times); each task's mean reward would be reported as "
                f"mean * {explicit[1]} successes of {explicit[1]} trials instead of {repeat_times}. Set "
                f"{explicit[0]} = {repeat_times}, or leave it out (the selector takes repeat_times)"
            )
        return repeat_times
    if explicit is None:
        raise ValueError(
            "BotsSelector cannot read the taskset's repeat_times (Trinity does not pass it to selectors) and "
            "neither kwargs.m nor kwargs.experiment_config.rollouts_per_task is given: set kwargs.m to "
            "algorithm.repeat_times, the rollouts per task, so each mean reward is reported over that many trials"
        )
    if explicit[1] <= 0:
        raise ValueError(f"BotsSelector: {explicit[0]} = {explicit[1]} must be positive")
    return explicit[1]


@dataclass(frozen=True)
class _Read:
    """One `get_indices` call: the batches it handed out (batches drawn again
    after a restore first, then the step's own) and the batch each task key
    reports to."""

    batches: tuple[SelectedBatch, ...]
    owner: Mapping[str, SelectedBatch]


class BotsSelector:
    """A Trinity-RFT selector (`get_indices`, `feedback` / `update`,
    `state_dict`, `load_state_dict`) whose choices come from the service.

    kwargs: address (or env BOTS_ADDRESS), experiment (or env
    BOTS_EXPERIMENT), key_field (a unique column; default the row position),
    experiment_config (a dict of ExperimentConfig fields) or Trinity's own
    knobs (m, lamb, rho, target_reward, do_sample, tau), request_prefix,
    strict (default true: feedback that cannot be filed under the batch it
    came from raises UnattributedOutcomesError; false: dropped, logged and
    counted in `dropped_outcomes`), resume (continue an experiment that has
    progress without loading this run's checkpoint).
    `feature_keys`, if given, name two columns: the weaker and the stronger
    reference model's pass rate (the implicit-evidence plug-in).

    The trials reported per task are the taskset's `repeat_times`
    (`rollouts_per_task`), read from Trinity's taskset config where the
    selector is built by Trinity's reader; `m` or
    `experiment_config.rollouts_per_task` must equal it, and is required
    where it cannot be read.
    """

    def __init__(self, data_source: Any, config: Any) -> None:
        kwargs = dict(getattr(config, "kwargs", None) or {})
        unknown = set(kwargs) - _OWN_KWARGS - _TRINITY_KWARGS
        if unknown:
            raise ValueError(f"unknown BotsSelector kwargs {sorted(unknown)}")
        address, experiment = address_and_experiment(kwargs, "BotsSelector", "kwargs.")
        strict = _flag(kwargs, "strict", True)
        resume = _flag(kwargs, "resume", False)
        self.repeat_times = trinity_repeat_times(config)
        trials = _trials(kwargs, self.repeat_times)
        self.data_source = data_source
        self.config = config
        dataset = data_source.dataset
        self.dataset_size = int(data_source.dataset_size)
        key_field = kwargs.get("key_field")
        keys: Sequence[Any] = list(dataset[key_field]) if key_field else [str(i) for i in range(self.dataset_size)]
        feature_keys = list(getattr(config, "feature_keys", None) or [])
        features = None
        if feature_keys:
            if len(feature_keys) != 2:
                raise ValueError(f"feature_keys names the weak and the strong pass-rate columns; got {feature_keys}")
            weak, strong = (list(dataset[k]) for k in feature_keys)
            features = [{"weak": float(w), "strong": float(s)} for w, s in zip(weak, strong)]
        seed = int(getattr(config, "seed", 0) or 0)
        if kwargs.get("experiment_config") is not None:
            exp_config = ExperimentConfig(**dict(kwargs["experiment_config"]))
        else:
            exp_config = experiment_config_from_trinity(kwargs, seed=seed, with_features=features is not None)
        exp_config = replace(exp_config, rollouts_per_task=trials)
        self.rollouts_per_task = trials  # the trials reported per task
        self.curriculum = Curriculum(
            address,
            str(experiment),
            keys,
            batch_size=int(kwargs.get("batch_size") or 1),
            config=exp_config,
            features=features,
            request_prefix=str(kwargs.get("request_prefix", "step")),
            rank=0,
            world_size=1,  # the explorer owns the taskset
            resume=resume,
            strict=strict,
            embed_fn=kwargs.get("embed_fn"),
            embed_inputs=list(dataset[kwargs["embed_field"]]) if kwargs.get("embed_field") else None,
        )
        self.current_index = 0  # samples handed out, as Trinity's selectors count
        self.step = 0  # the number of the next batch: one per get_indices call
        self.last_batch: SelectedBatch | None = None  # the step's own batch of the last get_indices call
        self._reads: list[_Read] = []  # get_indices calls whose feedback has not arrived, oldest first
        # Batches drawn before the restored checkpoint whose feedback never
        # reached the server: (number, batch size), drawn again with the next step.
        self._redraw: list[tuple[int, int | None]] = []

    @property
    def strict(self) -> bool:
        return self.curriculum.strict

    @property
    def dropped_outcomes(self) -> int:
        """Task outcomes dropped so far because they fit no open batch (only
        with `strict: false`; a strict selector raises instead)."""
        return self.curriculum.dropped_outcomes

    # -- selection --------------------------------------------------------------------

    def get_indices(self, batch_size: int, return_extra_info: bool = False) -> Any:
        """The next batch's dataset indices (and, if asked, its keys and ids).

        After a restore, the first call also hands out the tasks of the
        batches whose feedback was lost (the same request keys: the same
        tasks), ahead of the step's own batch: the step then has more tasks
        than `batch_size`, and the run reports as many batches as an
        uninterrupted one."""
        self._check_in_flight()
        batches = []
        for number, size in self._redraw:
            batches.append(self.curriculum.select(number, batch_size=size or batch_size))
        if self._redraw:
            log.warning(
                "drawing again batch(es) %s, whose feedback the explorer lost before the checkpoint, together "
                "with this step's batch %d: this step has %d extra tasks",
                [n for n, _ in self._redraw],
                self.step,
                sum(len(b.keys) for b in batches),
            )
            self._redraw = []
        batch = self.curriculum.select(self.step, batch_size=batch_size)
        self.step += 1
        self.last_batch = batch
        batches.append(batch)
        owner: dict[str, SelectedBatch] = {}
        for b in batches:
            for key in b.keys:
                owner[key] = b  # a task in two of them reports to the newer
        if len(owner) < sum(len(b.keys) for b in batches):
            log.warning(
                "a batch drawn again shares tasks with batch %d (its lease expired meanwhile): each shared task is "
                "handed out once and its rollouts are reported with batch %d",
                batch.number,
                batch.number,
            )
        self._reads.append(_Read(tuple(batches), owner))
        keys = list(owner)
        indices = [self.curriculum.index[k] for k in keys]
        self.current_index += len(indices)
        array = np.asarray(indices, dtype=np.int64)
        if not return_extra_info:
            return array
        extra = {
            "indices": indices,
            "keys": keys,
            "batch_id": batch.batch_id,
            "server_step": batch.step,
            "batches": [
                {"number": b.number, "batch_id": b.batch_id, "request_key": b.request_key, "server_step": b.step}
                for b in batches
            ],
        }
        return array, extra

    def _check_in_flight(self) -> None:
        drawn = sum(len(r.batches) for r in self._reads) + len(self._redraw) + 1
        if drawn <= MAX_OPEN_BATCHES:
            return
        message = (
            f"{drawn - 1} batches of experiment {self.curriculum.experiment!r} were drawn without feedback. "
            "Trinity feeds rewards back to a selector only through the pass_rate_calculator operator "
            "(data_processor.experience_pipeline.operators); if it is there, the explorer runs more than "
            f"{MAX_OPEN_BATCHES} steps ahead of its feedback, more than the selector keeps track of"
        )
        if self.strict:
            raise RuntimeError(message)
        oldest = self._reads.pop(0)
        for b in oldest.batches:
            self.curriculum.close(b)
        log.error("%s; forgetting batch(es) %s (strict: false)", message, [b.number for b in oldest.batches])

    # -- feedback ---------------------------------------------------------------------

    def feedback(self, indices: Sequence[int], values: Sequence[float]) -> list[ReportResult]:
        """Report each task's mean reward over its rollouts (values in [0, 1],
        as Trinity's pass_rate_calculator gives) as mean * n successes of n
        trials, n the taskset's repeat_times, to the batch the explore step
        drew the task in.

        The indices belong to one `get_indices` call: its batches are
        reported (a task of them without feedback counts as not selected).
        Calls drawn earlier that got no feedback (Trinity finalised their step
        without a finished task of this taskset) will get none, as Trinity
        feeds back in step order: their batches are closed unreported, with a
        warning. Feedback that fits no such call goes to the open batches as
        `Curriculum.report` attributes it; what fits none (a second feedback
        for a step, tasks never drawn, a task in two open batches) raises
        UnattributedOutcomesError before anything is sent, or with
        `strict: false` is dropped and counted. A batch the server has
        already (drawn again after a restore although its report had
        arrived) is answered as a duplicate by the server."""
        if len(indices) != len(values):
            raise ValueError(f"got {len(indices)} indices but {len(values)} values")
        trials = self.rollouts_per_task
        outcomes: dict[str, OutcomeValue] = {}
        for index, value in zip(indices, values):
            i = int(index)
            if not 0 <= i < self.dataset_size:
                raise ValueError(f"feedback for index {i}, outside the taskset of {self.dataset_size} rows")
            rate = float(value)
            if math.isnan(rate) or not -_RATE_TOLERANCE <= rate <= 1 + _RATE_TOLERANCE:
                raise ValueError(
                    f"feedback value {value!r} for index {i} is not a mean reward in [0, 1]: BotsSelector reports "
                    "it as that fraction of the task's rollouts succeeding; scale the reward function's rewards "
                    "into [0, 1]"
                )
            key = self.curriculum.keys[i]
            if key in outcomes:
                raise ValueError(f"index {i} is given twice in one feedback")
            outcomes[key] = (min(max(rate, 0.0), 1.0) * trials, trials)
        if not outcomes:
            return []
        read = self._read_of(outcomes)
        if read is None:
            results = self.curriculum.report(outcomes)
            self._forget_closed_reads()
            return results
        position = self._reads.index(read)
        for skipped in self._reads[:position]:
            for b in skipped.batches:
                if self._is_open(b):
                    log.warning(
                        "batch %d (%s) got no feedback and a later step's did: Trinity finished its step without "
                        "a rollout of this taskset; not reported, its lease expires",
                        b.number,
                        b.batch_id,
                    )
                    self.curriculum.close(b)
        del self._reads[: position + 1]
        parts: dict[str, dict[str, OutcomeValue]] = {}
        for key, outcome in outcomes.items():
            parts.setdefault(read.owner[key].batch_id, {})[key] = outcome
        results = []
        for b in read.batches:
            part = parts.get(b.batch_id)
            if part is not None:
                results.extend(self.curriculum.report(part, batch=b))
            elif self._is_open(b):
                log.warning(
                    "batch %d (%s) got no feedback for any of its tasks (unfinished or aborted rollouts); "
                    "not reported, its lease expires",
                    b.number,
                    b.batch_id,
                )
                self.curriculum.close(b)
        return results

    update = feedback  # the name in the issue and in older Trinity releases

    def _read_of(self, outcomes: Mapping[str, Any]) -> _Read | None:
        """The one get_indices call in flight that handed out every task of
        `outcomes`, with all its batches still open; None if none or several."""
        open_ids = {b.batch_id for b in self.curriculum.open_batches}
        candidates = [
            r
            for r in self._reads
            if all(k in r.owner for k in outcomes) and all(r.owner[k].batch_id in open_ids for k in outcomes)
        ]
        return candidates[0] if len(candidates) == 1 else None

    def _is_open(self, batch: SelectedBatch) -> bool:
        return any(b.batch_id == batch.batch_id for b in self.curriculum.open_batches)

    def _forget_closed_reads(self) -> None:
        open_ids = {b.batch_id for b in self.curriculum.open_batches}
        self._reads = [r for r in self._reads if any(b.batch_id in open_ids for b in r.batches)]

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the explorer checkpoints (JSON): the position, and the batches
        drawn whose feedback had not arrived yet (the explorer runs ahead of
        its feedback) with their sizes, and the server step of the last
        acknowledged report."""
        # Trinity saves this before its first explore step (sync_weight): set
        # the experiment up first (with the server step the run starts from),
        # so the state never names an experiment that does not exist yet nor
        # stands for a run that was refused (ExperimentInUseError raises here).
        self.curriculum.ensure_ready()
        resume = self.curriculum.resume_state(self.step)
        sizes = {b.number: len(b.keys) for b in self.curriculum.open_batches}
        sizes.update({n: s for n, s in self._redraw if s is not None})
        pending = sorted(set(resume["pending"]) | {n for n, _ in self._redraw})
        return {
            "current_index": self.current_index,
            "experiment": self.curriculum.experiment,
            "step": self.step,
            "pending": pending,
            "pending_sizes": [sizes.get(n) for n in pending],
            "acknowledged_step": resume["acknowledged_step"],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint of this selector. Trinity also calls it on a
        fresh start, with `{"current_index": 0}`: a state without this
        selector's fields is no checkpoint of it, and the run is a new one
        (ExperimentInUseError at the first batch if the experiment has
        progress, unless `resume: true`)."""
        state = dict(state_dict or {})
        if "step" not in state and "experiment" not in state:
            self.current_index = int(state.get("current_index", 0) or 0)
            if self.current_index:
                log.warning(
                    "the taskset state %r is not a BotsSelector checkpoint (another selector's?); "
                    "starting at batch 0",
                    state,
                )
            return
        experiment = state.get("experiment", self.curriculum.experiment)
        if experiment != self.curriculum.experiment:
            raise ValueError(
                f"checkpoint is of experiment {experiment!r}, this selector uses {self.curriculum.experiment!r}"
            )
        self.current_index = int(state.get("current_index", 0))
        step = int(state.get("step", 0))
        pending = [int(n) for n in state.get("pending") or []]
        size_of: dict[int, int | None] = dict.fromkeys(pending)
        for n, size in zip(pending, state.get("pending_sizes") or []):
            size_of[n] = None if size is None else int(size)
        # A batch drawn before the checkpoint whose feedback never reached the
        # server is drawn again (same request key, same tasks) with the next
        # step's batch rather than instead of it: Trinity's explorer goes on
        # counting its own steps, and would otherwise end one batch early.
        try:
            server_step = self.curriculum.client.get_experiment(self.curriculum.experiment).step
        except NotFoundError:
            raise NotFoundError(
                f"the checkpoint continues experiment {self.curriculum.experiment!r}, which does not exist on "
                f"{self.curriculum.client.target}: point the selector at the server that holds it (or restore the "
                "experiment there from a snapshot); a new experiment would lose the run's posterior"
            ) from None
        first = self.curriculum.resume_number(state, step)
        self._redraw = [(n, size_of.get(n)) for n in sorted(size_of) if first <= n < step]
        self._reads = []
        self.step = step
        self.curriculum.next_number = max(self.curriculum.next_number, self.step)
        # From here on the server step is the reference for the next
        # checkpoint: the batches it will list as pending are unreported now.
        self.curriculum.acknowledge(server_step)
