"""OpenRLHF 0.11: the prompts of every rollout batch from the service, each batch reported once.

OpenRLHF has no hook for a sampler or a curriculum: its trainers build the
prompt dataloader themselves (`prepare_datasets`) and pull prompts from it
one at a time (`SamplesGenerator`, batch size 1). This module swaps two
objects in OpenRLHF's own trainers and changes nothing else:

- the prompt dataloader becomes a `PromptStream`: prompt i of a block of
  `rollout.batch_size` prompts is position i of service batch number k
  (`Curriculum.select(k)`, request key "step-<k>", so a redraw after a
  restart gets the same tasks), numbered on across episodes;
- the samples generator becomes `BotsSamplesGenerator`, which records the
  score of every rollout as vLLM returns it (before dynamic filtering drops
  a group: a dropped group is evidence too) and, at the end of each vLLM
  call, reports each batch whose rollouts are all back in the background,
  so the report overlaps the training step and the next `select` waits for
  it. (A call larger than a batch, or dynamic filtering's replacements,
  take the next batch's prompts inside the call: those draws come before
  the call's reports. Reporting at the end of the call keeps the batches
  independent of the order vLLM's answers arrive in.)

Both trainers get them. `BotsPPOTrainer` (synchronous) also adds the
curriculum signals to each step's logs. Under `BotsPPOTrainerAsync`
(`--train.async_enable`) the generator actor owns the stream and runs up to
`--train.async_queue_size` batches ahead of the training actor. It reports
each batch as soon as it is generated and before it draws the next, so
every selection is made from the posterior after every earlier batch. What
is stale is the policy that rolls a batch out, by at most
`async_queue_size` steps, a bound the user sets.

Run OpenRLHF through this module's launcher: the same arguments, plus the
service's (or BOTS_ADDRESS / BOTS_EXPERIMENT). The options reach every
actor in `strategy.args.bots`:

    python -m bots_client.integrations.openrlhf \\
        --bots.address bots.internal:50051 --bots.experiment qwen-math-run-7 \\
        --reward.remote_url reward.py ...every train_ppo_ray argument...

A rollout is attributed to its task by what OpenRLHF carries with it: the
prompt, the label and a multimodal row's images. The task key is a digest
of the row's datasource, prompt, label and images, so rows with the same
four are one task; keys need no
column and always arrive, across several data files. Scores must be known
when a rollout is generated: a reward function or an agent
(`--reward.remote_url` or `--train.agent_func_path`), not a reward model.

Exactly once across checkpoints: `state_dict()` (saved by OpenRLHF with
every checkpoint, as `data_loader_state_dict`) holds the next batch number,
the position in a batch that dynamic filtering left half drawn, that
batch's outcomes so far, and the server step of the last acknowledged
report (`Curriculum.resume_state`). docs/integrations/openrlhf.md has the
configuration and the pitfalls.

OpenRLHF is imported only when a class that needs it is first used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bots_client.integrations._core import (
    Curriculum,
    OutcomeValue,
    SelectedBatch,
    SignalLog,
    address_and_experiment,
    lazy_class,
)
from bots_client.types import ExperimentConfig

__all__ = [
    "BotsGenerateSamplesActor",
    "BotsPPOTrainer",
    "BotsPPOTrainerAsync",
    "BotsSamplesGenerator",
    "PromptStream",
    "main",
    "task_key",
]

log = logging.getLogger("bots_client.integrations.openrlhf")

HOW_TO_CONTINUE = (
    "In OpenRLHF: resume from this run's checkpoint (--ckpt.load_enable; its client states carry this stream's "
    "state), pass --bots.resume true to continue without one (with a --bots.request_prefix of its own), or name a "
    "new experiment"
)
SCORES_AT_GENERATION = (
    "the OpenRLHF integration needs each rollout's score when it is generated: set --reward.remote_url "
    "(a reward function or a reward server) or --train.agent_func_path; a reward model scores too late"
)
OPTIONS = ("address", "experiment", "experiment_config", "success_threshold", "request_prefix", "resume", "embed_fn")


def task_key(datasource: Any, prompt: Any, label: Any, images: Any = None) -> str:
    """A row's task key: a digest of what OpenRLHF carries with each rollout
    (a multimodal row's images too: rows that share a prompt and a label,
    "What is shown?", are different tasks when their images differ)."""
    text = json.dumps([str(datasource), *_fields(prompt, label, images)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _plain(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool | type(None) | list | dict) else repr(value)


def _fields(prompt: Any, label: Any, images: Any) -> list[Any]:
    # Without images, the fields as before images counted: text-only keys stay.
    return [_plain(prompt), _plain(label)] + ([] if images is None else [_plain(images)])


def _content(prompt: Any, label: Any, images: Any = None) -> str:
    return json.dumps(_fields(prompt, label, images), sort_keys=True, default=str)


class PromptStream:
    """OpenRLHF's prompt dataloader, drawn from the service.

    Iterating yields one prompt at a time, as OpenRLHF's own loader does
    (`(datasources, prompts, labels, images)`, lists of one): the positions
    of batch `next_number`, then of the next, until the episode's
    `len(self) // batch_size` batches are handed out. `record` files each
    rollout's score under the batch its prompt was handed out in;
    `report_finished` reports every batch whose prompts have all come back.
    """

    def __init__(
        self,
        curriculum: Curriculum,
        rows: Sequence[tuple[Any, Any, Any, Any]],
        *,
        rollouts_per_prompt: int,
        success_threshold: float | None = 0.5,
    ) -> None:
        self.curriculum = curriculum
        self.batch_size = curriculum.batch_size
        self.rows = rows
        self.key_of: dict[str, str] = {}
        for i, key in enumerate(curriculum.keys):
            _, prompt, label, images = rows[i]
            if self.key_of.setdefault(_content(prompt, label, images), key) != key:
                raise ValueError(
                    f"two rows of different datasources have the prompt, label and images of row {i} "
                    f"({str(prompt)[:60]!r}); OpenRLHF carries only those with a rollout, so their outcomes could "
                    "not be told apart: keep one of them, or make the prompts differ"
                )
        self.rollouts_per_prompt = int(rollouts_per_prompt)
        self.success_threshold = success_threshold
        self.batches_per_epoch = len(set(curriculum.keys)) // self.batch_size
        if self.batches_per_epoch <= 0:
            raise ValueError(f"{len(set(curriculum.keys))} distinct tasks cannot fill a batch of {self.batch_size}")
        self.next_number = 0
        self.current: SelectedBatch | None = None
        self.position = 0  # prompts of `current` handed out
        # The batch number a pass over the data (one OpenRLHF episode) stops
        # before, and the saved pass a checkpoint's state continues.
        self.pass_end = 0
        self._resumed_pass_end: int | None = None
        # Per open batch: task key -> [rollouts back, scored rollouts,
        # successes, sum of squared successes].
        self.returns: dict[int, dict[str, list[float]]] = {}
        self.handed: dict[int, int] = {}
        self.skipped_rollouts = 0
        self.signals = SignalLog(curriculum)

    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size

    def __iter__(self) -> Iterator[tuple[list[Any], list[Any], list[Any], list[Any]]]:
        if self._resumed_pass_end is not None:
            self.pass_end, self._resumed_pass_end = self._resumed_pass_end, None
        else:
            start = self.current.number if self._half_drawn() and self.current else self.next_number
            self.pass_end = start + self.batches_per_epoch
        while True:
            if not self._half_drawn():
                if self.next_number >= self.pass_end:
                    return
                self._draw(self.next_number)
            batch = self.current
            assert batch is not None
            row = self.rows[batch.indices[self.position]]
            self.position += 1
            self.handed[batch.number] = self.position
            yield [row[0]], [row[1]], [row[2]], [row[3]]

    def _half_drawn(self) -> bool:
        return self.current is not None and self.position < self.batch_size

    def _draw(self, number: int) -> None:
        self.curriculum.prepare_draw(number, HOW_TO_CONTINUE)
        self.current = self.curriculum.select(number)
        self.next_number = number + 1
        self.position = 0
        self.returns.setdefault(number, {})
        self.handed.setdefault(number, 0)

    # -- outcomes ---------------------------------------------------------------------

    def record(self, prompt: Any, label: Any, score: Any, images: Any = None) -> None:
        """File one rollout's score (None: its reward could not be computed)
        under the oldest open batch whose copy of the task still lacks rollouts."""
        key = self.key_of.get(_content(prompt, label, images))
        if key is None:
            raise ValueError(
                f"a rollout's prompt, label and images are not in this dataset (prompt {str(prompt)[:80]!r})"
            )
        for number in sorted(self.returns):
            batch = self.curriculum.open_batch(number)
            if batch is None or key not in batch.keys:
                continue
            slot = self.returns[number].setdefault(key, [0, 0, 0.0, 0.0])
            if slot[0] >= self.rollouts_per_prompt:
                continue
            slot[0] += 1
            if score is None:
                self.skipped_rollouts += 1
                return
            slot[1] += 1
            success = self._success(key, score)
            slot[2] += success
            slot[3] += success * success
            return
        raise ValueError(
            f"a rollout of task {key!r} came back, but no open batch that handed its prompt out still lacks "
            f"rollouts: more than --rollout.n_samples_per_prompt = {self.rollouts_per_prompt} rollouts per prompt"
        )

    def _success(self, key: str, score: Any) -> float:
        value = float(score.item() if hasattr(score, "item") else score)
        if value != value:
            raise ValueError(f"score of task {key!r} is NaN")
        if self.success_threshold is not None:
            return 1.0 if value >= self.success_threshold else 0.0
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"score {value} of task {key!r} is outside [0, 1] (--bots.success_threshold none)")
        return value

    def report_finished(self) -> None:
        """Report, in order and in the background, every batch whose prompts
        were all handed out and whose rollouts have all come back."""
        for number in sorted(self.returns):
            if self.handed.get(number, 0) < self.batch_size:
                break
            batch = self.curriculum.open_batch(number)
            returns = self.returns[number]
            missing = [k for k in (batch.keys if batch else ()) if returns.get(k, [0])[0] < self.rollouts_per_prompt]
            if missing:
                break  # rollouts still out (not under OpenRLHF's generator, which waits for all)
            del self.returns[number], self.handed[number]
            if batch is None:
                continue
            outcomes: dict[str, OutcomeValue] = {
                k: (s, int(n)) if self.success_threshold is not None else (s, int(n), squares)
                for k, (_, n, s, squares) in returns.items()
                if n > 0
            }
            unscored = [k for k in batch.keys if k not in outcomes]
            if unscored:
                log.warning(
                    "batch %d: %d tasks have no scored rollout (the reward function failed or returned none): "
                    "reported as not rolled out, e.g. %s",
                    number,
                    len(unscored),
                    unscored[:3],
                )
            # The next batch is drawn in the same call (ReportAndSelect) while
            # this pass goes on; at its end, training may end too.
            ahead = 0 if self.next_number < self.pass_end else None
            self.curriculum.report_in_background(outcomes, batch=number, lookahead=ahead)

    def pop_signals(self) -> dict[str, float]:
        """The mean of each curriculum signal over the batches reported since
        the last call (after the report running in the background)."""
        self.curriculum.wait()
        return self.signals.pop_mean()

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {**self.curriculum.checkpoint_state(self.next_number), "pass_end": self.pass_end}
        if self._half_drawn():
            assert self.current is not None
            state["position"] = self.position
            state["returns"] = {k: list(v) for k, v in self.returns.get(self.current.number, {}).items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return  # OpenRLHF's empty state: a fresh run
        saved = int(state["next_number"])
        number = self.curriculum.resume_from(state, "prompt stream")
        self.current = None
        self.returns.clear()
        self.handed.clear()
        self.next_number = number
        self._resumed_pass_end = int(state["pass_end"])
        if "position" in state and number == saved - 1:
            # The half-drawn batch was never reported: go on where it stopped.
            self._draw(number)
            self.position = int(state["position"])
            self.handed[number] = self.position
            # A checkpoint from before the sum of squares was kept: as if the
            # rewards were 0 or 1 (the service's rule before it saw variances).
            self.returns[number] = {
                k: [int(v[0]), int(v[1]), float(v[2]), float(v[3] if len(v) > 3 else v[2])]
                for k, v in state["returns"].items()
            }


# -- OpenRLHF --------------------------------------------------------------------------


def build_stream(dataset: Any, args: Any) -> PromptStream:
    """A PromptStream over OpenRLHF's `PromptDataset` for the run `args`
    describes (the service's options in `args.bots`, which the launcher
    sets); refuses at start what would lose or misfile a reward."""
    options: Mapping[str, Any] = getattr(args, "bots", None) or {}
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown --bots options {unknown}; known: {list(OPTIONS)}")
    address, experiment = address_and_experiment(options, "the OpenRLHF integration", "--bots.")
    if not (getattr(args.reward, "remote_url", None) or getattr(args.train, "agent_func_path", None)):
        raise ValueError(SCORES_AT_GENERATION)
    n = int(args.rollout.n_samples_per_prompt)
    config = dict(options.get("experiment_config") or {})
    config.setdefault("rollouts_per_task", n)
    rows = [dataset[i] for i in range(len(dataset))]
    keys = [task_key(*row) for row in rows]
    unique = sorted({k: i for i, k in reversed(list(enumerate(keys)))}.values())  # first row of each key
    curriculum = Curriculum(
        str(address),
        str(experiment),
        [keys[i] for i in unique],
        batch_size=int(args.rollout.batch_size),
        config=ExperimentConfig(**config),
        groups=[str(rows[i][0]) for i in unique],
        request_prefix=str(options.get("request_prefix", "step")),
        resume=bool(options.get("resume", False)),
        embed_fn=options.get("embed_fn"),
        embed_inputs=[rows[i][1] for i in unique],  # each row's prompt
    )
    curriculum.expect_group_size(n, "--rollout.n_samples_per_prompt")
    threshold = options.get("success_threshold", 0.5)
    return PromptStream(
        curriculum,
        [rows[i] for i in unique],
        rollouts_per_prompt=n,
        success_threshold=None if threshold in (None, "none") else float(threshold),
    )


class _BotsSamplesGenerator:
    """OpenRLHF's SamplesGenerator, recording every training rollout's score
    in the PromptStream and reporting each batch once all of it is back."""

    prompts_dataloader: PromptStream
    _bots_recording = False

    def generate_samples(self, **generate_kwargs: Any) -> Any:
        self._bots_recording = True
        try:
            produced = super().generate_samples(**generate_kwargs)  # type: ignore[misc]
        finally:
            self._bots_recording = False
        self.prompts_dataloader.report_finished()
        return produced

    def _process_response_into_experience(self, response: Mapping[str, Any], **generate_kwargs: Any) -> Any:
        experience = super()._process_response_into_experience(response, **generate_kwargs)  # type: ignore[misc]
        if self._bots_recording:  # not evaluation
            self.prompts_dataloader.record(
                response["prompt"], response["label"], response.get("scores"), response.get("images")
            )
        return experience


def _use_stream(owner: Any, strategy: Any, tokenizer: Any, vllm_engines: Any) -> None:
    """Swap `owner`'s prompt dataloader and samples generator for the service's."""
    stream = build_stream(owner.prompts_dataloader.dataset, strategy.args)
    owner.prompts_dataloader = stream
    owner.samples_generator = __getattr__("BotsSamplesGenerator")(
        strategy=strategy,
        prompts_dataloader=stream,
        eval_dataloader=owner.eval_dataloader,
        tokenizer=tokenizer,
        vllm_engines=vllm_engines,
    )


class _BotsPPOTrainer:
    """OpenRLHF's synchronous PPOTrainer with the service's prompt stream;
    the curriculum signals join each step's logs."""

    # Set by OpenRLHF's constructor.
    tokenizer: Any
    vllm_engines: Any
    prompts_dataloader: Any

    def __init__(self, pretrain: str, strategy: Any, *groups: Any, **generate_kwargs: Any) -> None:
        super().__init__(pretrain, strategy, *groups, **generate_kwargs)  # type: ignore[call-arg]
        _use_stream(self, strategy, self.tokenizer, self.vllm_engines)

    def train_step(self, rollout_samples: Any, global_step: int) -> Any:
        status, step = super().train_step(rollout_samples, global_step)  # type: ignore[misc]
        status.update(self.prompts_dataloader.pop_signals())
        return status, step

    def fit(self, *args: Any, **kwargs: Any) -> None:
        super().fit(*args, **kwargs)  # type: ignore[misc]
        # The last report, whose error no step raised if the last vLLM call
        # left nothing to train on (OpenRLHF then stops without a step).
        self.prompts_dataloader.curriculum.wait()


class _BotsGenerateSamplesActor:
    """OpenRLHF's asynchronous generator actor with the service's prompt
    stream: it reports each batch right after generating it, before it
    draws the next, so the training actor's queue holds reported batches."""

    samples_generator: Any
    prompts_dataloader: Any

    def __init__(self, pretrain: str, strategy: Any, vllm_engines: Any, **kwargs: Any) -> None:
        super().__init__(pretrain, strategy, vllm_engines, **kwargs)  # type: ignore[call-arg]
        _use_stream(self, strategy, self.samples_generator.tokenizer, vllm_engines)

    def fit(self, *args: Any, **kwargs: Any) -> None:
        super().fit(*args, **kwargs)  # type: ignore[misc]
        # As the synchronous trainer's: a last call that produced nothing
        # queued no batch, so no checkpoint state waited for its report.
        self.prompts_dataloader.curriculum.wait()


class _BotsPPOTrainerAsync:
    """OpenRLHF's PPOTrainerAsync with `BotsGenerateSamplesActor` as its
    generator. PPOTrainerAsync names the generator's class as a global of its
    module; this sets it, in the process that builds the trainer, first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import ray
        from openrlhf.trainer import ppo_trainer_async

        ppo_trainer_async.GenerateSamplesActor = ray.remote(__getattr__("BotsGenerateSamplesActor"))
        super().__init__(*args, **kwargs)


def _openrlhf_original(name: str) -> type:
    """OpenRLHF's class `name` (the plain class under its @ray.remote)."""
    from openrlhf.trainer import ppo_trainer, ppo_trainer_async
    from openrlhf.trainer.ppo_utils import samples_generator

    for module in (samples_generator, ppo_trainer, ppo_trainer_async):
        if hasattr(module, name):
            found = getattr(module, name)
            return getattr(found, "__ray_actor_class__", found)
    raise AttributeError(name)


class _WithOptions:
    """A trainer's Ray actor class that hands the --bots.* options to the
    trainer inside `strategy.args.bots`: the strategy travels to every actor
    OpenRLHF starts (the asynchronous generator too), on any Ray cluster."""

    def __init__(self, actor_class: Any, options: Mapping[str, Any]) -> None:
        self.actor_class, self.options = actor_class, dict(options)

    def remote(self, pretrain: str, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        strategy.args.bots = self.options
        return self.actor_class.remote(pretrain, strategy, *args, **kwargs)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m openrlhf.cli.train_ppo_ray`, with the service's trainers
    and the --bots.* options taken out of the arguments."""
    import runpy

    import ray
    from openrlhf.trainer import ppo_trainer, ppo_trainer_async

    args = list(sys.argv[1:] if argv is None else argv)
    options, rest = _bots_options(args)
    address_and_experiment(options, "the OpenRLHF integration", "--bots.")  # fail before Ray starts
    if not any(a.split("=")[0] in ("--reward.remote_url", "--train.agent_func_path") for a in rest):
        raise SystemExit(SCORES_AT_GENERATION)
    ppo_trainer.PPOTrainer = _WithOptions(ray.remote(__getattr__("BotsPPOTrainer")), options)
    ppo_trainer_async.PPOTrainerAsync = _WithOptions(ray.remote(__getattr__("BotsPPOTrainerAsync")), options)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


def _bots_options(args: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    options: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--bots."):
            rest.append(arg)
            i += 1
            continue
        name, has_value, value = arg[len("--bots.") :].partition("=")
        if not has_value:
            if i + 1 >= len(args):
                raise SystemExit(f"--bots.{name} needs a value")
            value, i = args[i + 1], i + 1
        i += 1
        if name not in OPTIONS:
            raise SystemExit(f"unknown option --bots.{name}; known: {', '.join('--bots.' + o for o in OPTIONS)}")
        if name == "experiment_config":
            options[name] = json.loads(value)
        elif name == "resume":
            options[name] = value.strip().lower() == "true"
        else:
            options[name] = value
    return options, rest


_CLASSES = {
    "BotsSamplesGenerator": (_BotsSamplesGenerator, "SamplesGenerator"),
    "BotsPPOTrainer": (_BotsPPOTrainer, "PPOTrainer"),
    "BotsGenerateSamplesActor": (_BotsGenerateSamplesActor, "GenerateSamplesActor"),
    "BotsPPOTrainerAsync": (_BotsPPOTrainerAsync, "PPOTrainerAsync"),
}


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        implementation, base = _CLASSES[name]
        return lazy_class(__name__, name, implementation, lambda: _openrlhf_original(base))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    BotsSamplesGenerator = _BotsSamplesGenerator
    BotsPPOTrainer = _BotsPPOTrainer
    BotsGenerateSamplesActor = _BotsGenerateSamplesActor
    BotsPPOTrainerAsync = _BotsPPOTrainerAsync


if __name__ == "__main__":
    main()
