"""bots_client.integrations.skyrl: the SkyRL 0.3 adapter.

The first tests drive `BatchStream` (the framework-free part: numbering,
reports, checkpoints) against the real server, in any environment. The
`test_real_skyrl_*` tests run SkyRL 0.3.0 itself (its own environment,
`.venv-skyrl`, tests/integrations/skyrl-constraints.txt): the real
`RayPPOTrainer.train` loop on CPU, with SkyRL's `PromptDataset` over two
JSONL files, `prepare_generator_input`, `postprocess_generator_output`,
`convert_to_training_input`, GRPO's advantages,
`save_checkpoints` / `load_checkpoints` (data.pt, trainer_state.pt,
resume_mode=latest), SkyRL's callbacks and its `Tracking` logger. Standing
in: the generator (SkyRL's `GeneratorInterface`: a fixed verifier, no
model), the worker dispatch (no model: zero log-probs, a recorded step) and
the inference engine client.

SkyRL 0.3.0 declares Python >= 3.11 but does not import on 3.11: a pydantic
model of `skyrl.tinker.types` uses `typing.TypedDict`, which pydantic takes
only from `typing_extensions` before Python 3.12. The `skyrl` fixture gives
`typing` that `TypedDict` before SkyRL is imported (this machine's CPU
build of torch is for Python 3.11).
"""

from __future__ import annotations

import asyncio
import json
import os
import typing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import bots_client
from bots_client.integrations import GroupSizeMismatchError, UnattributedOutcomesError
from bots_client.integrations._core import Curriculum
from bots_client.integrations.skyrl import BatchStream, bots_options, main
from tests.integrations.conftest import EXACT, counts, need

N_ROLLOUTS = 3
SOURCES = ("gsm8k", "math")


def successes_of(i: int) -> int:
    """The stand-in verifier: the task numbered i succeeds on i % 4 of its rollouts."""
    return min(i % 4, N_ROLLOUTS)


class Rows:
    """What BatchStream needs of SkyRL's PromptDataset: rows and its collate_fn."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return [{"role": "user", "content": f"t {i}"}], None, {}, str(i)

    def collate_fn(self, items: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
        return [{"prompt": p, "env_class": e, "env_extras": x, "uid": u} for p, e, x, u in items]


def stream(address: str, experiment: str, n: int = 12, **kwargs: Any) -> BatchStream:
    cur = Curriculum(address, experiment, [f"t{i}" for i in range(n)], batch_size=4, config=EXACT, rank=0,
                     world_size=1, **kwargs)  # fmt: skip
    return BatchStream(cur, Rows(n))


def roll_out(s: BatchStream, batch: list[dict[str, Any]]) -> None:
    uids, rewards = [], []
    for row in batch:
        for j in range(N_ROLLOUTS):
            uids.append(row["uid"])
            rewards.append([0.0, float(j < successes_of(int(row["uid"])))])  # per-token, summed
    s.report(uids, rewards)


def test_batches_are_numbered_across_epochs_and_reported_once(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    s = stream(address, exp_name)
    assert len(s) == 3
    drawn = []
    for _epoch in range(2):
        for batch in s:
            roll_out(s, batch)
            drawn += [int(row["uid"]) for row in batch]
    s.curriculum.wait()
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (6, 0)  # the last report draws nothing ahead
    expected: dict[str, tuple[float, float]] = {}
    for i in drawn:
        a, b = expected.get(f"t{i}", (0.0, 0.0))
        expected[f"t{i}"] = (a + successes_of(i), b + N_ROLLOUTS - successes_of(i))
    got = counts(client, exp_name)
    assert {k: got[k] for k in expected} == expected
    assert s.pop_signals()["curriculum/server_step"] == 3.5  # the mean over the six reports
    other = stream(address, exp_name + "-other")
    (first, *_) = next(iter(other))
    with pytest.raises(ValueError, match=r"rollout uids \['99'\] are not rows of this dataset"):
        other.report(["99"], [1.0])
    stray = next(str(i) for i in range(12) if f"t{i}" not in other.current.keys)  # type: ignore[union-attr]
    with pytest.raises(UnattributedOutcomesError):
        other.report([first["uid"], stray], [1.0, 1.0])
    assert client.get_experiment(exp_name + "-other").step == 0  # nothing was sent


@pytest.mark.parametrize("saved_after", [1, 3], ids=["mid-epoch", "epoch end"])
@pytest.mark.parametrize("reported", [False, True], ids=["crash before the report", "crash after the report"])
def test_a_checkpoint_resumes_exactly_once(
    address: str, client: bots_client.Client, exp_name: str, saved_after: int, reported: bool
) -> None:
    """SkyRL saves `state_dict()` after a step; the run crashes during the
    next step, before or after its report; the resumed run (a new stream)
    ends where an uninterrupted run ends."""

    def steps(s: BatchStream, epochs: int, stop_after: int | None = None) -> int:
        done = 0
        for _ in range(epochs):
            for batch in s:
                roll_out(s, batch)
                done += 1
                if done == stop_after:
                    return done
        return done

    whole = stream(address, exp_name + "-whole")
    steps(whole, 2)
    whole.curriculum.wait()
    first = stream(address, exp_name)
    steps(first, 2, stop_after=saved_after)
    state = first.state_dict()
    batch = next(iter(first))  # the crashed step draws the next batch
    if reported:
        roll_out(first, batch)
        first.curriculum.wait()
    resumed = stream(address, exp_name)
    resumed.load_state_dict(state)
    epochs_left = 2 - saved_after // 3  # SkyRL's start epoch: global_step // len(dataloader)
    steps(resumed, epochs_left)
    resumed.curriculum.wait()
    for name in (exp_name, exp_name + "-whole"):
        assert client.get_experiment(name).step == 6, name
    assert counts(client, exp_name) == counts(client, exp_name + "-whole")


def test_the_options_are_taken_out_of_skyrls_arguments() -> None:
    options, rest = bots_options(["bots.address=h:1", "trainer.epochs=2", 'bots.experiment_config={"seed": 3}'])
    assert options == {"address": "h:1", "experiment_config": {"seed": 3}} and rest == ["trainer.epochs=2"]
    with pytest.raises(SystemExit, match="expected bots.<option>=<value>"):
        bots_options(["bots.adress=h:1"])
    with pytest.raises(ValueError, match="needs bots.address and bots.experiment"):
        main(["bots.address=h:1", "trainer.epochs=2"])  # before Ray or SkyRL starts


# -- SkyRL 0.3.0 itself (.venv-skyrl) ---------------------------------------------------


@pytest.fixture(scope="module")
def skyrl() -> Iterator[Any]:
    """SkyRL, importable, on a local Ray (its checkpoint clean-up runs a Ray
    task on every node)."""
    typing_extensions = need("typing_extensions")
    original = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    try:
        module = need("skyrl.train.trainer")
        ray = need("ray")
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            yield module
        finally:
            ray.shutdown()
    finally:
        typing.TypedDict = original  # type: ignore[misc]


def data_files(path: Path, n: int = 12) -> list[str]:
    """One JSONL file per data source, each numbering extra_info.index from 0."""
    files = []
    for source in SOURCES:
        file = path / f"{source}.jsonl"
        file.write_text("".join(
            json.dumps({"prompt": [{"role": "user", "content": f"{source} {i}"}], "env_class": "gsm8k",
                        "data_source": source, "extra_info": {"index": i}}) + "\n"
            for i in range(n // 2)
        ))  # fmt: skip
        files.append(str(file))
    return files


class Generator:
    """Stands in for SkyRL's generator (a GeneratorInterface): rollout j of
    the prompt "<source> <i>" succeeds when j < i % 4."""

    async def generate(self, batch: dict[str, Any]) -> dict[str, Any]:
        n = len(batch["prompts"])
        rewards = [
            float(t.repetition_id < successes_of(int(p[0]["content"].split()[1])))
            for p, t in zip(batch["prompts"], batch["trajectory_ids"])
        ]
        return {"prompt_token_ids": [[3, 4]] * n, "response_ids": [[5, 6]] * n, "rewards": rewards,
                "loss_masks": [[1, 1]] * n, "stop_reasons": ["stop"] * n, "rollout_metrics": None,
                "rollout_logprobs": None, "trajectory_ids": batch["trajectory_ids"]}  # fmt: skip


class StepWiseGenerator:
    """SkyRL's step-wise output (generator.step_wise_trajectories), as
    SkyRLGymGenerator builds it: an entry per turn, the trajectory id
    repeated, is_last_step on the last turn, and each turn's per-token
    reward; here two turns, the first rewarded 1 on every rollout, the last
    as Generator's. SkyRL's advantages take the last turn's reward."""

    async def generate(self, batch: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {k: [] for k in ("prompt_token_ids", "response_ids", "rewards", "loss_masks",
                                                     "stop_reasons", "trajectory_ids", "is_last_step")}  # fmt: skip
        for p, t in zip(batch["prompts"], batch["trajectory_ids"]):
            final = float(t.repetition_id < successes_of(int(p[0]["content"].split()[1])))
            for turn, reward in enumerate((1.0, final)):
                out["prompt_token_ids"].append([3, 4])
                out["response_ids"].append([5, 6])
                out["rewards"].append([0.0, reward])
                out["loss_masks"].append([1, 1])
                out["stop_reasons"].append("stop")
                out["trajectory_ids"].append(t)
                out["is_last_step"].append(turn == 1)
        return {**out, "rollout_metrics": None, "rollout_logprobs": None}


class Dispatch:
    """Stands in for SkyRL's WorkerDispatch (no model): zero log-probs, a
    recorded training step (which can crash), checkpoint folders."""

    def __init__(self, crash_at_step: int | None = None) -> None:
        self.crash_at_step, self.steps = crash_at_step, 0

    def forward(self, model: str, data: Any, **kwargs: Any) -> Any:
        width = data.metadata["response_length"]
        return SimpleNamespace(loss_fn_outputs=[{"logprobs": [0.0] * width, "values": [0.0] * width}
                                                for _ in range(data["sequences"].shape[0])], metrics={})  # fmt: skip

    def stage_data(self, model: str, data: Any, boundaries: list[tuple[int, int]]) -> list[list[Any]]:
        return [[data[s:e]] for s, e in boundaries]

    def forward_from_staged(self, model: str, chunks: list[Any], **kwargs: Any) -> Any:
        return self.forward(model, chunks[0])

    def forward_backward_from_staged(self, model: str, chunks: list[Any], **kwargs: Any) -> Any:
        return SimpleNamespace(metrics={"policy_loss": 0.0}, loss_fn_outputs=[])

    def optim_step(self, model: str, **kwargs: Any) -> float:
        self.steps += 1
        if self.steps == self.crash_at_step:
            raise RuntimeError("crash after the report, before the checkpoint")
        return 0.0

    def save_checkpoint(self, model: str, path: str, tokenizer: Any = None, **kwargs: Any) -> None:
        os.makedirs(path, exist_ok=True)

    async def save_weights_for_sampler(self) -> None:
        pass

    def get_lcm_dp_size(self) -> int:
        return 1

    def __getattr__(self, name: str) -> Any:  # init_weight_sync_state, empty_cache, load_checkpoint, ...
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: [] if name == "get_node_ids" else None


class Engines:
    """Stands in for the inference engine client (colocate_all=false: only sleep/wake)."""

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        pass


def run_skyrl(
    path: Path, address: str, experiment: str, *, epochs: int = 2, resume: bool = False,
    crash_at_step: int | None = None, crash_at_report: int | None = None, step_wise: bool = False,
    request_prefix: str = "step", max_training_steps: int | None = None,
) -> Any:  # fmt: skip
    """SkyRL's RayPPOTrainer, built as `BasePPOExp._setup_trainer` builds it
    (with BotsPPOExp.get_trainer's trainer), trained as `run()` trains it."""
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.dataset import PromptDataset
    from skyrl.train.utils.tracking import Tracking

    from bots_client.integrations import skyrl as bots_skyrl
    from tests.integrations.test_verl import tiny_tokenizer_dir

    path.mkdir(parents=True, exist_ok=True)
    model = path / "model"
    tokenizer = tiny_tokenizer_dir(model)
    cfg = SkyRLTrainConfig()
    trainer_cfg = cfg.trainer
    trainer_cfg.train_batch_size = trainer_cfg.policy_mini_batch_size = 4
    trainer_cfg.micro_train_batch_size_per_gpu = trainer_cfg.micro_forward_batch_size_per_gpu = 4
    trainer_cfg.epochs, trainer_cfg.eval_interval, trainer_cfg.ckpt_interval = epochs, -1, 1
    trainer_cfg.max_training_steps = max_training_steps
    trainer_cfg.ckpt_path, trainer_cfg.export_path = str(path / "ckpt"), str(path / "export")
    trainer_cfg.resume_mode = "latest" if resume else "none"
    trainer_cfg.algorithm.advantage_estimator = "grpo"
    trainer_cfg.placement.colocate_all = False
    trainer_cfg.enable_ray_gpu_monitor = False
    trainer_cfg.logger = "tensorboard"
    cfg.generator.n_samples_per_prompt = N_ROLLOUTS
    cfg.generator.step_wise_trajectories = step_wise
    cfg.generator.inference_engine.enable_ray_prometheus_stats = False
    cfg.data.dataloader.num_workers = 0
    dataset = PromptDataset(data_files(path), tokenizer, max_prompt_length=32, num_workers=1)
    os.environ["TENSORBOARD_DIR"] = str(path / "tb")
    tracker = Tracking("bots", experiment, backend="tensorboard", config=cfg)
    bots = {"address": address, "experiment": experiment, "request_prefix": request_prefix,
            "experiment_config": {"strategy": EXACT.strategy, "forgetting": 0.0, "implicit_weight": 0.0, "seed": 7}}  # fmt: skip
    exp = object.__new__(bots_skyrl.BotsPPOExp)  # its __init__ loads a model's tokenizer; get_trainer is what counts
    exp.bots = bots
    generator = StepWiseGenerator() if step_wise else Generator()
    trainer = exp.get_trainer(cfg, tracker, tokenizer, dataset, None, Engines(), generator, None)
    trainer.dispatch = Dispatch(crash_at_step)
    stream = trainer.train_dataloader
    if crash_at_report is not None:
        report, calls = stream.report, [0]

        def crash(*args: Any) -> None:
            calls[0] += 1
            if calls[0] == crash_at_report:
                raise RuntimeError("crash after the rollouts, before the report")
            report(*args)

        stream.report = crash
    try:
        asyncio.run(trainer.train())
    finally:
        stream.curriculum.wait()
        tracker.finish() if hasattr(tracker, "finish") else None
    return trainer


@pytest.mark.parametrize("step_wise", [False, True], ids=["whole trajectories", "step-wise trajectories"])
def test_real_skyrl_draws_and_reports_every_batch_once(
    skyrl: Any, tmp_path: Path, address: str, client: bots_client.Client, exp_name: str, step_wise: bool
) -> None:
    # Step-wise: a trajectory of two turns is one rollout, with its last turn's reward.
    trainer = run_skyrl(tmp_path, address, exp_name, step_wise=step_wise)
    assert type(trainer).__name__ == "BotsRayPPOTrainer" and trainer.total_training_steps == 6
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (6, 0)  # 12 tasks / 4 a batch, 2 epochs numbered on
    got = {k: v for k, v in counts(client, exp_name).items() if v != (0.0, 0.0)}
    assert {k.split(":")[0] for k in got} == set(SOURCES)  # keys data_source:index, both files
    for key, (s, f) in got.items():
        n = int(s + f) // N_ROLLOUTS  # times drawn
        assert s == n * successes_of(int(key.split(":")[1])), key
    # Every batch was selected after every earlier batch's report.
    assert [client.select_batch(exp_name, 4, request_key=f"step-{k}").step for k in range(6)] == list(range(6))
    from tests.integrations.test_torch import read_scalars

    scalars = read_scalars(tmp_path / "tb")
    assert [v for _, v in scalars["curriculum/server_step"]] == [float(s) for s in range(1, 7)]  # SkyRL's own logs


def test_real_skyrl_max_training_steps_ends_the_run_with_nothing_drawn_ahead(
    skyrl: Any, tmp_path: Path, address: str, client: bots_client.Client, exp_name: str
) -> None:
    # SkyRL caps its step count (the learning-rate schedule, the final eval)
    # at max_training_steps; the last step's report draws no batch nobody trains.
    trainer = run_skyrl(tmp_path, address, exp_name, max_training_steps=2)
    assert (trainer.total_training_steps, trainer.global_step) == (2, 2)
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (2, 0)


@pytest.mark.parametrize(
    "crash",
    [{"crash_at_report": 2}, {"crash_at_step": 2}, {"crash_at_report": 4}, {"crash_at_step": 4}],
    ids=["before the report, mid-epoch", "after the report, mid-epoch", "before the report, past the epoch end",
         "after the report, past the epoch end"],
)  # fmt: skip
def test_real_skyrl_resumes_from_its_checkpoint_exactly_once(
    skyrl: Any, tmp_path: Path, address: str, client: bots_client.Client, exp_name: str, crash: dict[str, int]
) -> None:
    with pytest.raises(RuntimeError, match="crash"):
        run_skyrl(tmp_path / "crashed", address, exp_name, **crash)
    whole = run_skyrl(tmp_path / "whole-again", address, exp_name + "-again")
    trainer = run_skyrl(tmp_path / "crashed", address, exp_name, resume=True)
    assert trainer.global_step == whole.global_step
    for name in (exp_name, exp_name + "-again"):
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (6, 0), name
    assert counts(client, exp_name) == counts(client, exp_name + "-again")


def test_real_skyrl_a_checkpoint_that_does_not_load_stops_the_run(
    skyrl: Any, tmp_path: Path, address: str, client: bots_client.Client, exp_name: str
) -> None:
    """SkyRL catches an error of the dataloader's load_state_dict, logs a
    warning and starts the data over: the stream raises that error at its
    first draw instead, before anything is drawn or reported."""
    with pytest.raises(RuntimeError, match="crash"):
        run_skyrl(tmp_path, address, exp_name, crash_at_step=2)
    before = client.get_experiment(exp_name)
    with pytest.raises(RuntimeError, match=r"did not load.*request_prefix = 'step', this run 'other'"):
        run_skyrl(tmp_path, address, exp_name, resume=True, request_prefix="other")
    after = client.get_experiment(exp_name)
    assert (after.step, after.open_batches) == (before.step, before.open_batches)


def test_real_skyrl_a_dataset_without_task_keys_is_refused_at_start(
    skyrl: Any, tmp_path: Path, address: str, exp_name: str
) -> None:
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.dataset import PromptDataset

    from bots_client.integrations.skyrl import stream_for
    from tests.integrations.test_verl import tiny_tokenizer_dir

    tokenizer = tiny_tokenizer_dir(tmp_path / "model")
    dataset = PromptDataset(data_files(tmp_path), tokenizer, max_prompt_length=32, num_workers=1)
    options = {"address": address, "experiment": exp_name}
    with pytest.raises(ValueError, match=r"the key field 'id'.*bots.key_field"):
        stream_for(dataset, SkyRLTrainConfig(), {**options, "key_field": "id"})
    cfg = SkyRLTrainConfig()
    cfg.trainer.algorithm.dynamic_sampling.type = "filter"
    with pytest.raises(ValueError, match="dynamic_sampling.type=filter: SkyRL's dynamic sampling merges"):
        stream_for(dataset, cfg, options)
    with pytest.raises(ValueError, match="unknown bots options"):
        stream_for(dataset, SkyRLTrainConfig(), {**options, "keys": "id"})
    # rollouts_per_task other than n_samples_per_prompt: given, or an existing experiment's own (at the first draw).
    cfg = SkyRLTrainConfig()
    cfg.generator.n_samples_per_prompt, cfg.trainer.train_batch_size = 3, 4
    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 16 but the trainer runs "
                                                     "generator.n_samples_per_prompt = 3"):  # fmt: skip
        stream_for(dataset, cfg, {**options, "experiment_config": {"rollouts_per_task": 16}})
    bots_client.Client(address).create_experiment(exp_name, EXACT)
    stream = stream_for(dataset, cfg, options)  # n_samples_per_prompt for a new experiment, not this one's 16
    with pytest.raises(bots_client.ConfigMismatchError, match="rollouts_per_task"):
        next(iter(stream))
    assert bots_client.Client(address).get_experiment(exp_name).open_batches == 0
