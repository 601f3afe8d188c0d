"""TRL: let `GRPOTrainer` draw its prompts from the BOTS service.

Two pieces, both from one `BotsGRPO` object:

- `bots.trainer_class(GRPOTrainer)`: a subclass whose `_get_train_sampler`
  returns a `BotsRepeatSampler`. It repeats indices exactly like TRL's
  `RepeatSampler` (each prompt `num_generations` times, each generation batch
  `num_iterations * steps_per_generation` times), but every generation batch
  of `generation_batch_size // num_generations` prompts is one SelectBatch,
  with request key "step-k" so that every process gets the same prompts.
- `bots.reward(fn)`: wraps your correctness reward function. It returns
  fn's rewards unchanged and, during training, turns them into per-task
  (successes, trials), all-gathers them across processes and reports them
  from the main process only.

    from trl import GRPOConfig, GRPOTrainer
    from bots_client.integrations.trl import BotsGRPO

    bots = BotsGRPO("127.0.0.1:50051", "grpo-run-1", dataset=train_dataset, key_column="task_key",
                    config=bots_client.ExperimentConfig(rollouts_per_task=8))
    Trainer = bots.trainer_class(GRPOTrainer)
    trainer = Trainer(model=model, args=GRPOConfig(num_generations=8, ...), train_dataset=train_dataset,
                      reward_funcs=[bots.reward(accuracy_reward), format_reward])
    trainer.train()

The dataset needs a column of stable, unique task keys (`key_column`); TRL
passes it to reward functions. Prompts are selected one generation batch
ahead (accelerate prefetches a batch): the lease keeps the two batches
disjoint. Each reward call is filed under the generation batch whose tasks
it scored (the open batch with exactly its task keys), never by task key
alone. On `resume_from_checkpoint`, the Trainer replays the sampler to the
saved step; the request keys give back the same batches, the ones already
reported are not reported again, and TRL's regeneration of a batch it
resumed inside (its generation counter restarts) keeps the first report.

Strict by default: a reward call that matches no generation batch, a group
of completions that is not `num_generations` long, a train dataset whose
rows are not in the keys' order, an experiment config whose
rollouts_per_task is not `num_generations`, or a new run on an experiment
that already has reported steps (ExperimentInUseError: resume from the
checkpoint, or pass `resume=True`) raises. `strict=False` drops outcomes it
cannot attribute and counts them (`curriculum/dropped_outcomes`).

TRL is imported only by `trainer_class()` (and torch by the sampler).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from bots_client._calls import outcome_value
from bots_client.errors import ExperimentInUseError
from bots_client.integrations._core import (
    Curriculum,
    EmbedFn,
    OutcomeValue,
    SelectedBatch,
    SignalLog,
    UnattributedOutcomesError,
    aggregate_outcomes,
    lazy_class,
    merge_outcomes,
    torch_sampler,
)
from bots_client.integrations.torch import _process_group, await_background_report
from bots_client.types import ExperimentConfig, ReportResult

if TYPE_CHECKING:
    from bots_client.client import Client

__all__ = ["BotsGRPO", "BotsRepeatSampler"]

log = logging.getLogger("bots_client.integrations.trl")


class _RepeatSampler:
    """TRL's RepeatSampler index pattern, with each chunk of `batch_size`
    prompts drawn from the service."""

    def __init__(
        self,
        curriculum: Curriculum,
        *,
        mini_repeat_count: int,
        batch_size: int,
        repeat_count: int = 1,
        num_batches: int | None = None,
        before_draw: Callable[[], Any] | None = None,
    ) -> None:
        self.curriculum = curriculum
        # BotsGRPO.wait: under torch.distributed no rank draws before the
        # reporting rank's background report is applied (a collective).
        self.before_draw = before_draw
        self.mini_repeat_count = int(mini_repeat_count)
        self.batch_size = int(batch_size)
        self.repeat_count = int(repeat_count)
        self.num_batches = int(num_batches) if num_batches else max(1, len(curriculum.keys) // self.batch_size)
        self.step = 0

    def __iter__(self) -> Iterator[int]:
        end = (self.step // self.num_batches + 1) * self.num_batches
        while self.step < end:
            if self.before_draw is not None:
                self.before_draw()
            batch = self.curriculum.select(self.step, batch_size=self.batch_size)
            self.step += 1
            for _ in range(self.repeat_count):
                for index in batch.indices:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        return self.num_batches * self.batch_size * self.mini_repeat_count * self.repeat_count

    def set_epoch(self, epoch: int) -> None:
        """Go on at epoch `epoch`'s first generation batch unless past it.

        transformers' Trainer resumes a checkpoint by epoch: in a new process
        it calls `set_epoch(epochs_trained)` on a fresh sampler (through
        accelerate's dataloader) and then skips the batches already trained.
        Without this the skipped batches would be drawn with epoch 0's
        request keys, and epoch 2's batches would be drawn again."""
        self.step = max(self.step, int(epoch) * self.num_batches)

    def state_dict(self) -> dict[str, Any]:
        return {"experiment": self.curriculum.experiment, "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["experiment"] != self.curriculum.experiment:
            raise ValueError(f"checkpoint is of experiment {state['experiment']!r}")
        self.step = int(state["step"])


class BotsGRPO:
    """The glue between one GRPOTrainer run and one experiment.

    Args:
        client: a `bots_client.Client` or the server address.
        experiment: the experiment (one per training run).
        keys: the task key of every train-dataset row; or give `dataset`
            and `key_column` to read them.
        config: create the experiment with this config if it is missing
            (set rollouts_per_task = num_generations).
        features: per-row task features (reference pass rates), optional.
        groups: per-row task group (e.g. the dataset a prompt came from), for
            group shares; or give `dataset` and `group_column` to read them.
        success_threshold: a rollout succeeds when the wrapped reward is >=
            this (None: rewards in [0, 1] count fractionally).
        num_batches: generation batches per epoch (default: dataset size //
            prompts per generation batch, as TRL's RepeatSampler).
        log_signals: add the curriculum's signals of the batches reported
            since the last log (their mean) to the trainer's training logs,
            named "curriculum/...": they reach every `report_to` backend.
        resume: this run continues the experiment without a checkpoint
            (`trainer.train(resume_from_checkpoint=...)` sets it by itself).
        strict: unattributable rewards raise (default); False drops and
            counts them.
        overlap: report in the background (default): the reward function
            returns at once, the report and the selection of the batch after
            next run while the trainer computes advantages and steps, and
            the next draw waits for them (the same batches and posterior as
            a synchronous report). `reports` fills as they are acknowledged;
            `train()` waits for the last one.
    """

    def __init__(
        self,
        client: Client | str,
        experiment: str,
        keys: Sequence[Any] | None = None,
        *,
        dataset: Any = None,
        key_column: str = "task_key",
        config: ExperimentConfig | None = None,
        features: Sequence[Mapping[str, float]] | None = None,
        groups: Sequence[Any] | None = None,
        group_column: str | None = None,
        success_threshold: float | None = 0.5,
        num_batches: int | None = None,
        request_prefix: str = "step",
        log_signals: bool = True,
        resume: bool = False,
        strict: bool = True,
        overlap: bool = True,
        embed_fn: EmbedFn | str | None = None,
        embed_column: str | None = None,
    ) -> None:
        if keys is None:
            if dataset is None:
                raise TypeError("pass keys= or dataset= (with key_column)")
            keys = list(dataset[key_column])
        if groups is None and group_column is not None:
            if dataset is None:
                raise TypeError("group_column= reads the dataset: pass dataset= too")
            groups = list(dataset[group_column])
        embed_inputs = None
        if embed_column is not None:
            if dataset is None:
                raise TypeError("embed_column= reads the dataset: pass dataset= too")
            embed_inputs = list(dataset[embed_column])
        self.key_column = key_column
        self.success_threshold = success_threshold
        self.num_batches = num_batches
        # The batch size is the trainer's (generation_batch_size // num_generations),
        # known once the trainer exists; _get_train_sampler sets it.
        self.curriculum = Curriculum(
            client,
            experiment,
            keys,
            batch_size=1,
            config=config,
            features=features,
            groups=groups,
            request_prefix=request_prefix,
            resume=resume,
            strict=strict,
            embed_fn=embed_fn,
            embed_inputs=embed_inputs,
        )
        self.trainer: Any = None
        self.overlap = overlap
        self._step_restored = False
        self._acknowledgement_due = False  # a collective broadcast owed before the next draw
        self.sampler: _RepeatSampler | None = None
        self.reports: list[ReportResult] = []
        self.log_signals = log_signals
        self._signals = SignalLog(self.curriculum)

    # -- the trainer ------------------------------------------------------------------

    def attach(self, trainer: Any) -> None:
        """Bind to a GRPOTrainer: ranks come from its accelerator, and rewards
        are reported only while its model trains (not during evaluation)."""
        self.trainer = trainer
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            self.curriculum.rank = int(accelerator.process_index)
            self.curriculum.world_size = int(accelerator.num_processes)

    def make_sampler(self, trainer: Any, dataset: Any = None) -> Any:
        """The sampler GRPOTrainer._get_train_sampler should return."""
        if self.trainer is not trainer:
            self.attach(trainer)
        if dataset is not None:
            self._check_dataset(dataset)
        # Also an existing experiment's own rollouts_per_task, at setup.
        self.curriculum.expect_group_size(int(trainer.num_generations), "num_generations")
        args = trainer.args
        workers = int(getattr(args, "dataloader_num_workers", 0) or 0)
        if workers:
            raise ValueError(
                f"dataloader_num_workers = {workers}: the DataLoader would draw {workers} x prefetch_factor "
                "generation batches ahead, each from a posterior that misses the reports since; BotsGRPO draws each "
                "batch when the trainer asks for it. Set dataloader_num_workers=0"
            )
        prompts = args.generation_batch_size // trainer.num_generations
        self.curriculum.batch_size = prompts
        self.sampler = lazy_class(__name__, "BotsRepeatSampler", _RepeatSampler, torch_sampler)(
            self.curriculum,
            mini_repeat_count=trainer.num_generations,
            batch_size=prompts,
            repeat_count=trainer.num_iterations * args.steps_per_generation,
            num_batches=self.num_batches,
            before_draw=self.wait,
        )
        return self.sampler

    def _check_dataset(self, dataset: Any) -> None:
        """The sampler hands out row indices: row i must be task keys[i]."""
        keys = self.curriculum.keys
        if len(dataset) != len(keys):
            raise ValueError(f"the train dataset has {len(dataset)} rows but BotsGRPO was given {len(keys)} keys")
        columns = getattr(dataset, "column_names", None)
        if columns is not None and self.key_column not in columns:
            raise KeyError(
                f"the train dataset has no {self.key_column!r} column (columns: {columns}); the reward function "
                "needs it to name each completion's task"
            )
        if columns is not None:
            rows = [str(k) for k in dataset[self.key_column]]
            moved = [i for i, (row, key) in enumerate(zip(rows, keys)) if row != key]
            if moved:
                i = moved[0]
                raise ValueError(
                    f"the train dataset's rows are not in the order of BotsGRPO's keys ({len(moved)} differ; row {i} "
                    f"is {rows[i]!r}, key {i} is {keys[i]!r}): build BotsGRPO from the same dataset object "
                    "(dataset=, key_column=) after any shuffle, filter or sort"
                )

    def trainer_class(self, base: type | None = None) -> type:
        """A subclass of `base` (default trl.GRPOTrainer) drawing its train
        prompts through this object."""
        if base is None:
            from trl import GRPOTrainer

            base = GRPOTrainer
        bots = self

        class BotsGRPOTrainer(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                bots.attach(self)

            def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
                # A resumed trainer continues its experiment: say so before setup.
                if resume_from_checkpoint:
                    if self.args.ignore_data_skip:
                        raise ValueError(
                            "ignore_data_skip=True: the resumed Trainer would train the epoch's batches before the "
                            "checkpoint again, and the service applies each batch's outcomes once, so their new "
                            "rollouts would be dropped as duplicates; resume with ignore_data_skip=False (skipping "
                            "a batch costs one select)"
                        )
                    bots.curriculum.resume = True
                    # Trained again after a failure: TRL's micro-step counter
                    # and buffered generation are the failed run's, not the
                    # checkpoint's; cleared, the first step restores them.
                    self._step = 0
                    self._buffered_inputs = None
                elif bots.curriculum.next_number > 0:
                    # A new sampler starts at batch 0: the same request keys,
                    # the first call's batches back, every report a duplicate.
                    raise ExperimentInUseError(
                        f"this BotsGRPO already drew {bots.curriculum.next_number} batches of experiment "
                        f"{bots.curriculum.experiment!r}: train again with resume_from_checkpoint=..., or with a new "
                        "BotsGRPO (a new experiment, or resume=True and a request_prefix of its own)"
                    )
                bots._step_restored = False  # this trainer's step counter is restored at its first step
                output = super().train(resume_from_checkpoint, *args, **kwargs)
                bots.wait()  # the last report, acknowledged (or its error raised) before train() returns
                return output

            def _prepare_inputs(self, generation_batch: Any) -> Any:
                # TRL counts its micro-steps (`_step`, which decides when to
                # generate) from 0 in a new process. Resumed inside a
                # generation cycle, it would generate from the cycle's next
                # copy and shift every later generation by the steps already
                # trained: the next batch would be drawn before the last one
                # was reported, from another posterior. Count them as an
                # uninterrupted run would; the cycle's own batch is generated
                # again (its completions were not checkpointed) and its
                # second report is a no-op on the server.
                if self.model.training and not bots._step_restored:
                    bots._step_restored = True
                    if getattr(self, "_step", None) == 0 and self.state.global_step > 0:
                        self._step = _micro_steps_trained(self, len(bots.sampler or ()))
                return super()._prepare_inputs(generation_batch)

            def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
                # A checkpoint never covers a batch whose report is still in
                # flight: a resume skips the batches trained before it, so a
                # report lost after it (the process killed) would be lost for good.
                bots.wait()
                return super()._save_checkpoint(*args, **kwargs)

            def _get_train_sampler(self, dataset: Any = None) -> Any:
                return bots.make_sampler(self, self.train_dataset if dataset is None else dataset)

            def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
                # The curriculum's signals join the trainer's own log line, so
                # every `report_to` backend (TensorBoard, W&B, ...) gets them
                # beside the loss, at the same global step. The step's report
                # went out in the background before its backward pass and
                # has long finished; waiting pins its signals to this step.
                if bots.log_signals and "loss" in logs:
                    bots.wait()
                    logs = {**logs, **bots.pop_signals()}
                super().log(logs, *args, **kwargs)

        BotsGRPOTrainer.__qualname__ = BotsGRPOTrainer.__name__ = f"Bots{base.__name__}"
        return BotsGRPOTrainer

    def pop_signals(self) -> dict[str, float]:
        """The mean of each curriculum signal over the batches reported since
        the last call (empty when none was)."""
        return self._signals.pop_mean()

    # -- rewards ----------------------------------------------------------------------

    def _training(self) -> bool:
        model = getattr(self.trainer, "model", None)
        return True if model is None else bool(getattr(model, "training", True))

    def report_rewards(self, keys: Sequence[Any], rewards: Sequence[Any]) -> list[ReportResult]:
        """Report this process's per-completion rewards of one generation
        batch (a collective under torch.distributed: every process calls it;
        the main one reports), filed under the batch they came from."""
        clean = [None if _no_reward(r) else r for r in rewards]
        local_keys = [str(k) for k in keys]
        outcomes = aggregate_outcomes(local_keys, clean, success_threshold=self.success_threshold)
        all_keys, merged = _all_gather_keys_and_outcomes(local_keys, outcomes)
        self.wait()  # the previous generation batch's report (long done: a training step ago)
        batch = self._generation_batch(all_keys)
        if self.overlap:
            # TRL reports inside a step, before it draws again. accelerate
            # draws one batch ahead, so a trainer that generates every step
            # has drawn the next generation batch already (lookahead 1); one
            # that generates every few steps draws it later (lookahead 0).
            args = getattr(self.trainer, "args", None)
            cycle = 1 if args is None else args.steps_per_generation * self.trainer.num_iterations
            lookahead = 1 if cycle == 1 else 0
            future = self.curriculum.report_in_background(merged, batch=batch, lookahead=lookahead)
            future.add_done_callback(self._acknowledged)
            # Every rank calls this; the other ranks' next draw must wait for
            # the reporting rank's report, or they would select the batch
            # after next from the posterior before it (a wrong batch).
            self._acknowledgement_due = _process_group() is not None
            return []
        results = self.curriculum.report(merged, batch=batch)
        self.reports.extend(results)
        return results

    def _acknowledged(self, done: Future[list[ReportResult]]) -> None:
        if done.exception() is None:
            self.reports.extend(done.result())

    def wait(self) -> list[ReportResult]:
        """Wait for the report running in the background and return its
        answers (they join `reports` as they arrive); raises its error. Under
        torch.distributed a collective after a background report: every rank
        waits until the reporting rank's report is acknowledged, and its
        error raises on every rank. Every rank calls it at the same points
        (the next draw, the next report, the training log, the end of
        train())."""
        collective, self._acknowledgement_due = self._acknowledgement_due, False
        return await_background_report(self.curriculum, collective)

    def _generation_batch(self, keys: Sequence[str]) -> SelectedBatch | None:
        """The open batch this generation scored: the newest one whose tasks
        are exactly `keys` (a stale replayed batch can share its tasks; the
        batch being generated is the newest). Older open batches are ones the
        trainer skipped on resume (reported before its checkpoint): closed.
        When no batch matches: UnattributedOutcomesError, or None when
        lenient (the curriculum files what it can and counts the rest)."""
        groups = Counter(keys)
        size = getattr(self.trainer, "num_generations", None)
        wrong = {k: n for k, n in groups.items() if size is not None and n != size}
        if wrong:
            raise ValueError(
                f"{len(wrong)} tasks got a group of completions other than num_generations = {size} "
                f"(e.g. {dict(list(wrong.items())[:3])}): the reward function must see every completion of "
                "the generation batch, once"
            )
        exact = [b for b in self.curriculum.open_batches if set(b.keys) == set(groups)]
        if not exact:
            if self.curriculum.strict:
                raise UnattributedOutcomesError(
                    f"the reward call scored {len(groups)} tasks (e.g. {list(groups)[:3]}) that are no open "
                    f"generation batch's tasks (open: {[b.number for b in self.curriculum.open_batches]}): "
                    "the reward function must see every completion of one generation batch, once"
                )
            return None
        batch = max(exact, key=lambda b: b.number)
        for older in self.curriculum.open_batches:
            if older.number < batch.number:
                log.info("batch %d was drawn but not generated (skipped on resume); closing it", older.number)
                self.curriculum.close(older)
        return batch

    def reward(self, fn: Callable[..., Any], *, key_column: str | None = None) -> Callable[..., Any]:
        """Wrap a TRL reward function: same rewards out, and during training
        the outcomes of this generation batch reported to the service. An
        async function stays async (TRL awaits it)."""
        column = key_column or self.key_column

        def report(rewards: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            if self._training():
                if column not in kwargs:
                    raise KeyError(
                        f"reward function got no {column!r} column; keep the task-key column in the train dataset"
                    )
                self.report_rewards(kwargs[column], list(rewards))

        if _is_async(fn):
            # TRL awaits a reward function it finds to be async (is_async_callable).

            @functools.wraps(fn)
            async def awaited(*args: Any, **kwargs: Any) -> Any:
                rewards = await fn(*args, **kwargs)
                report(rewards, kwargs)
                return rewards

            return awaited

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            rewards = fn(*args, **kwargs)
            report(rewards, kwargs)
            return rewards

        return wrapped


def _is_async(fn: Any) -> bool:
    """A coroutine function, an object whose __call__ is one, or a partial
    of either: what TRL's is_async_callable awaits."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _no_reward(reward: Any) -> bool:
    """None or NaN, of any numeric type (TRL's "this function does not
    apply"; a numpy or torch NaN as much as a float one)."""
    if reward is None:
        return True
    try:
        return math.isnan(float(reward))
    except (TypeError, ValueError):
        return False  # not a number: aggregate_outcomes names it


def _micro_steps_trained(trainer: Any, sampler_length: int) -> int:
    """TRL's micro-step count (`_step`) after the trainer's global steps, as
    an uninterrupted run reaches it: an epoch is len(dataloader) micro-steps
    in ceil(len / gradient_accumulation_steps) optimizer steps, the last of
    them shorter when the accumulation does not divide it (transformers)."""
    args = trainer.args
    accumulation = args.gradient_accumulation_steps
    batches = math.ceil(sampler_length / (trainer._train_batch_size * args.steps_per_generation))
    # accelerate deals the sampler's batches out to the processes in turn.
    processes = int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1))
    per_epoch = max(1, math.ceil(batches / processes))
    updates = math.ceil(per_epoch / accumulation)
    done = trainer.state.global_step
    return (done // updates) * per_epoch + (done % updates) * accumulation


def _all_gather_keys_and_outcomes(
    keys: list[str], outcomes: Mapping[str, OutcomeValue]
) -> tuple[list[str], dict[str, OutcomeValue]]:
    """Every process's completion keys and merged outcomes (a collective
    under torch.distributed; without a process group: these)."""
    dist = _process_group()
    if dist is None:
        return keys, {k: outcome_value(v, k) for k, v in outcomes.items()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (keys, dict(outcomes)))
    return [k for part_keys, _ in parts for k in part_keys], merge_outcomes(o for _, o in parts)


def __getattr__(name: str) -> Any:
    if name == "BotsRepeatSampler":
        return lazy_class(__name__, name, _RepeatSampler, torch_sampler)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    BotsRepeatSampler = _RepeatSampler
