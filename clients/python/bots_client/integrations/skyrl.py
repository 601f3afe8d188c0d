"""SkyRL 0.3: every training batch from the service, each reported once, off the critical path.

SkyRL's `RayPPOTrainer` builds its train dataloader in a method made for
subclasses (`_build_train_dataloader_and_compute_training_steps`) and rolls
each batch out in `generate`; experiments pick their trainer in
`BasePPOExp.get_trainer`. `BotsRayPPOTrainer` uses both:

- its train dataloader is a `BatchStream`: iteration k is service batch
  number k (`Curriculum.select(k)`, request key "step-<k>", so a redraw
  after a restart gets the same tasks), collated by SkyRL's own
  `PromptDataset`, numbered on across epochs;
- its `generate` reports the batch as soon as SkyRL's generator returns the
  rewards (before dynamic sampling drops a group: a dropped group is
  evidence too), in the background: the report overlaps the training step,
  and the next draw waits for it. Every rollout carries SkyRL's uid, the
  dataset index of its prompt, so a reward is filed under its task exactly.
  With step-wise trajectories (an entry per turn) a trajectory counts once,
  with its last turn's reward, as SkyRL's advantages take it.

The curriculum signals join each step's metrics, through a SkyRL training
callback (`on_step_end`), which also waits for the step's report before
SkyRL saves its checkpoint: a failed report raises there (SkyRL's own
checkpoint code would only log a failing dataloader state).

Run SkyRL's entrypoint with this module as its override, or this module
directly; the `bots.*` options are taken out before SkyRL parses its config
(or BOTS_ADDRESS / BOTS_EXPERIMENT):

    python -m skyrl.train.entrypoints.main_base \\
        trainer.override_entrypoint=bots_client.integrations.skyrl \\
        bots.address=bots.internal:50051 bots.experiment=qwen-math-run-7 ...SkyRL's overrides...

Exactly once across checkpoints: SkyRL saves `state_dict()` in each
checkpoint's `data.pt`: the next batch number, the batch number the epoch
stops before, the batches drawn but not reported and the server step of the
last acknowledged report (`Curriculum.resume_state`).
docs/integrations/skyrl.md has the configuration and the pitfalls.

SkyRL is imported only when a class that needs it is first used.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bots_client.integrations._core import (
    Curriculum,
    SelectedBatch,
    SignalLog,
    address_and_experiment,
    aggregate_outcomes,
    lazy_class,
)
from bots_client.integrations.verl_dataset import DEFAULT_KEY_FIELD, dataframe_keys, frame_column, key_fields
from bots_client.types import ExperimentConfig

__all__ = ["BatchStream", "BotsPPOExp", "BotsRayPPOTrainer", "main", "stream_for"]

OPTIONS = (
    "address",
    "experiment",
    "experiment_config",
    "key_field",
    "success_threshold",
    "request_prefix",
    "resume",
    "embed_fn",
    "embed_field",
)


class BatchStream:
    """SkyRL's train dataloader, drawn from the service: each iteration is
    one service batch of `dataset`'s rows, collated by `dataset.collate_fn`
    (SkyRL's uid of a row is its dataset index). An epoch is
    `batches_per_epoch` batches; numbering goes on across epochs."""

    def __init__(
        self,
        curriculum: Curriculum,
        dataset: Any,
        *,
        batches_per_epoch: int | None = None,
        success_threshold: float | None = 0.5,
    ) -> None:
        self.curriculum = curriculum
        self.dataset = dataset
        per_epoch = len(curriculum.keys) // curriculum.batch_size if batches_per_epoch is None else batches_per_epoch
        if per_epoch <= 0:
            raise ValueError(f"{len(curriculum.keys)} tasks cannot fill a batch of {curriculum.batch_size}")
        self.batches_per_epoch = int(per_epoch)
        self.success_threshold = success_threshold
        self.next_number = 0
        self.current: SelectedBatch | None = None
        self.pass_end = 0  # the batch number this epoch's pass stops before
        # The batch number training stops before (SkyRL's total_training_steps,
        # with max_training_steps): no report draws it ahead. None: none.
        self.last_end: int | None = None
        self._resumed_pass_end: int | None = None
        # Why the checkpoint's state did not load: SkyRL catches that error,
        # logs a warning and goes on from batch 0, so the first draw raises it.
        self._load_error: Exception | None = None
        self.signals = SignalLog(curriculum)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        resumed, self._resumed_pass_end = self._resumed_pass_end, None
        # A checkpoint's pass goes on where it stopped; one that had ended
        # (saved at an epoch's last step) is followed by a new one, as SkyRL
        # counts epochs from its global step.
        self.pass_end = resumed if resumed is not None and resumed > self.next_number else (
            self.next_number + self.batches_per_epoch
        )  # fmt: skip
        while self.next_number < self.pass_end:
            self.current = self._draw(self.next_number)
            yield self.dataset.collate_fn([self.dataset[i] for i in self.current.indices])

    def _draw(self, number: int) -> SelectedBatch:
        if self._load_error is not None:
            raise RuntimeError(
                f"the checkpoint's data.pt did not load into the batch stream ({self._load_error}); SkyRL logged "
                "that as a warning and would start over from batch 0: fix what the error names, or start a new run"
            ) from self._load_error
        self.curriculum.prepare_draw(
            number,
            "In SkyRL: resume from this run's checkpoint (trainer.resume_mode; its data.pt carries this stream's "
            "state), set bots.resume=true to continue without one (with a bots.request_prefix of its own), or name "
            "a new experiment",
        )
        selected = self.curriculum.select(number)
        self.next_number = number + 1
        return selected

    def report(self, uids: Sequence[Any], rewards: Sequence[Any]) -> None:
        """Report the current batch's rollouts (`uids[i]`: SkyRL's uid of
        rollout i's prompt, its dataset index; `rewards[i]`: its reward, a
        number or per-token rewards, summed) in the background: the next draw
        and `pop_signals` wait for it. A uid outside the batch raises before
        anything is sent."""
        batch = self.current
        if batch is None:
            raise RuntimeError("report before any batch was drawn")
        if len(uids) != len(rewards):
            raise ValueError(f"got {len(uids)} uids and {len(rewards)} rewards; one of each per rollout")
        keys = self.curriculum.keys
        bad = [uid for uid in uids if not str(uid).isdigit() or int(uid) >= len(keys)]
        if bad:
            raise ValueError(f"rollout uids {bad[:3]} are not rows of this dataset (SkyRL's uid is a row's index)")
        keys = [keys[int(uid)] for uid in uids]
        totals = [sum(r) if isinstance(r, Sequence) else r for r in rewards]
        outcomes = aggregate_outcomes(keys, totals, success_threshold=self.success_threshold)
        end = self.pass_end if self.last_end is None else min(self.pass_end, self.last_end)
        ahead = 0 if self.next_number < end else None  # the next draw joins the report
        self.curriculum.report_in_background(outcomes, batch=batch.number, lookahead=ahead)

    def pop_signals(self) -> dict[str, float]:
        """The mean of each curriculum signal over the batches reported since
        the last call, after the report running in the background (whose
        failure raises here)."""
        self.curriculum.wait()
        return self.signals.pop_mean()

    # -- checkpoints: SkyRL saves and loads these in data.pt --------------------------

    def state_dict(self) -> dict[str, Any]:
        return {**self.curriculum.checkpoint_state(self.next_number), "pass_end": self.pass_end}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            self.next_number = self.curriculum.resume_from(state, "batch stream")
            self._resumed_pass_end = int(state["pass_end"])
        except Exception as e:
            self._load_error = e
            raise
        self._load_error = None
        self.current = None


def stream_for(dataset: Any, cfg: Any, options: Mapping[str, Any]) -> BatchStream:
    """A BatchStream over SkyRL's `PromptDataset` for the run `cfg`
    describes; refuses at start what would lose or misfile a reward."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown bots options {unknown}; known: {list(OPTIONS)}")
    address, experiment = address_and_experiment(options, "the SkyRL integration", "bots.")
    sampling = cfg.trainer.algorithm.dynamic_sampling.type
    if sampling is not None:
        raise ValueError(
            f"trainer.algorithm.dynamic_sampling.type={sampling}: SkyRL's dynamic sampling merges several batches "
            "into one step and needs each prompt once per step, but the service may select a task again in the "
            "next batch. Leave it unset: the service already steers batches away from groups that all pass or all "
            "fail, and reports them as evidence"
        )
    try:
        keys = dataframe_keys(dataset.dataframe, key_fields(options.get("key_field", list(DEFAULT_KEY_FIELD))))
    except ValueError as e:  # the shared check names verl's option
        raise ValueError(str(e).replace("data.bots.key_field", "bots.key_field")) from None
    config = dict(options.get("experiment_config") or {})
    config.setdefault("rollouts_per_task", int(cfg.generator.n_samples_per_prompt))
    curriculum = Curriculum(
        str(address),
        str(experiment),
        keys,
        batch_size=int(cfg.trainer.train_batch_size),
        config=ExperimentConfig(**config),
        request_prefix=str(options.get("request_prefix", "step")),
        rank=0,
        world_size=1,  # SkyRL's single controller owns the dataloader
        resume=str(options.get("resume", False)).lower() == "true",
        embed_fn=options.get("embed_fn"),
        embed_inputs=frame_column(dataset.dataframe, str(options["embed_field"])) if options.get("embed_field") else None,
    )
    curriculum.expect_group_size(int(cfg.generator.n_samples_per_prompt), "generator.n_samples_per_prompt")
    threshold = options.get("success_threshold", 0.5)
    return BatchStream(
        curriculum,
        dataset,
        success_threshold=None if threshold in (None, "none", "null") else float(threshold),
    )


class _BotsRayPPOTrainer:
    """SkyRL's RayPPOTrainer with the service's batches (see the module)."""

    cfg: Any
    train_dataset: Any
    train_dataloader: Any
    total_training_steps: int

    def __init__(self, *args: Any, bots: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._bots_options = dict(bots or {})
        super().__init__(*args, **kwargs)  # builds the dataloader (below)
        self.add_callback(_skyrl_callback()())  # type: ignore[attr-defined]

    def _build_train_dataloader_and_compute_training_steps(self) -> None:
        if self.train_dataset is None:
            return
        self.train_dataloader = stream_for(self.train_dataset, self.cfg, self._bots_options)
        self.total_training_steps = len(self.train_dataloader) * int(self.cfg.trainer.epochs)
        cap = getattr(self.cfg.trainer, "max_training_steps", None)
        if cap is not None:  # as SkyRL's own: the schedule, the final eval and the last step follow it
            self.total_training_steps = min(self.total_training_steps, int(cap))
        self.train_dataloader.last_end = self.total_training_steps

    async def generate(self, input_batch: Any) -> Any:
        output = await super().generate(input_batch)  # type: ignore[misc]
        metadata = input_batch.get("batch_metadata")
        if metadata is None or str(getattr(metadata, "training_phase", "train")) == "train":
            ids = output.get("trajectory_ids") or input_batch["trajectory_ids"]
            rewards = output["rewards"]
            last_steps = output.get("is_last_step")
            if last_steps is not None:
                # Step-wise trajectories: an entry per turn, each with that
                # turn's reward. A trajectory is one rollout, and its reward
                # is its last turn's, as SkyRL's advantages and metrics take it.
                ids = [t for t, last in zip(ids, last_steps, strict=True) if last]
                rewards = [r for r, last in zip(rewards, last_steps, strict=True) if last]
            self.train_dataloader.report([t.instance_id for t in ids], rewards)
        return output


def _skyrl_callback() -> type:
    from skyrl.train.utils.callbacks import TrainingCallback

    class BotsSignals(TrainingCallback):
        """After each training step, before SkyRL checkpoints and logs it:
        wait for the step's report and add the curriculum signals to the
        step's metrics."""

        def on_step_end(self, trainer: Any, callback_input: Any, control: Any) -> None:
            stream = trainer.train_dataloader
            if isinstance(stream, BatchStream):
                trainer.all_metrics.update(stream.pop_signals())

    return BotsSignals


class _BotsPPOExp:
    """SkyRL's BasePPOExp whose trainer is `BotsRayPPOTrainer`."""

    def __init__(self, cfg: Any, bots: Mapping[str, Any] | None = None) -> None:
        self.bots = dict(bots or {})
        super().__init__(cfg)  # type: ignore[call-arg]

    def get_trainer(self, cfg: Any, tracker: Any, tokenizer: Any, train_dataset: Any, eval_dataset: Any,
                    inference_engine_client: Any, generator: Any, colocate_pg: Any) -> Any:  # fmt: skip
        return __getattr__("BotsRayPPOTrainer")(
            cfg=cfg,
            tracker=tracker,
            tokenizer=tokenizer,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            inference_engine_client=inference_engine_client,
            generator=generator,
            colocate_pg=colocate_pg,
            bots=self.bots,
        )


def _run(cfg: Any, bots: Mapping[str, Any]) -> None:
    __getattr__("BotsPPOExp")(cfg, bots).run()


def bots_options(args: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """The `bots.<name>=<value>` arguments (experiment_config and key_field
    as JSON) and the rest, SkyRL's."""
    options: dict[str, Any] = {}
    rest: list[str] = []
    for arg in args:
        name, has_value, value = arg.partition("=")
        if not name.startswith("bots."):
            rest.append(arg)
            continue
        name = name[len("bots.") :]
        if not has_value or name not in OPTIONS:
            raise SystemExit(f"expected bots.<option>=<value> with an option of {list(OPTIONS)}, got {arg!r}")
        options[name] = json.loads(value) if name in ("experiment_config", "key_field") else value
    return options, rest


def main(argv: Sequence[str] | None = None) -> None:
    """SkyRL's `main_base.main` with `BotsPPOExp` (also reached through
    `trainer.override_entrypoint=bots_client.integrations.skyrl`)."""
    options, rest = bots_options(list(sys.argv[1:] if argv is None else argv))
    address_and_experiment(options, "the SkyRL integration", "bots.")  # fail before Ray starts
    import ray
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg
    from skyrl.train.utils.utils import initialize_ray

    cfg = SkyRLTrainConfig.from_cli_overrides(rest)
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(ray.remote(num_cpus=1)(_run).remote(cfg, options))


def _skyrl_original(name: str) -> type:
    if name == "RayPPOTrainer":
        from skyrl.train.trainer import RayPPOTrainer

        return RayPPOTrainer
    from skyrl.train.entrypoints.main_base import BasePPOExp

    return BasePPOExp


def __getattr__(name: str) -> Any:
    if name == "BotsRayPPOTrainer":
        return lazy_class(__name__, name, _BotsRayPPOTrainer, lambda: _skyrl_original("RayPPOTrainer"))
    if name == "BotsPPOExp":
        return lazy_class(__name__, name, _BotsPPOExp, lambda: _skyrl_original("BasePPOExp"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    BotsRayPPOTrainer = _BotsRayPPOTrainer
    BotsPPOExp = _BotsPPOExp


if __name__ == "__main__":
    main()
