"""bots_client.integrations.openrlhf: the OpenRLHF 0.11 adapter.

The first tests drive `PromptStream` (the framework-free part: numbering,
attribution by prompt and label, reports, checkpoints) against the real
server, in any environment, the way OpenRLHF's `SamplesGenerator` uses its
prompt dataloader. The `test_real_openrlhf_*` tests run OpenRLHF 0.11.2
itself (its own environment, `.venv-openrlhf`,
tests/integrations/openrlhf-constraints.txt): the real `PPOTrainer.fit`
loop on CPU, through `prepare_datasets` (blending_datasets, PromptDataset,
the StatefulDataLoader it replaces), `SamplesGenerator` with and without
dynamic filtering (`_generate_vllm`, `_dispatch_prompts_to_vllm` over Ray,
`_process_response_into_experience`), `train_step` (rollout stats, balance,
`ppo_train`, the KL controller), `save_logs_and_checkpoints` with the
client states and `init_checkpoint_states` on resume, and the real argument
parser of `openrlhf.cli.train_ppo_ray` for every setting. Standing in: the
vLLM engines (Ray actors that echo the prompt and score with a fixed
verifier), the model groups (no model: a recorded fit and a checkpoint of
the client states only) and the experience maker (the rollouts as they
come). vLLM and flash-attn are CUDA builds that do not install here:
tests/integrations/openrlhf_standins/ gives the two names OpenRLHF imports
from them at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import bots_client
from bots_client.integrations import GroupSizeMismatchError
from bots_client.integrations._core import Curriculum
from bots_client.integrations.openrlhf import PromptStream, _bots_options, build_stream, main, task_key
from tests.integrations.conftest import EXACT, counts, need

N_TASKS = 12
N_ROLLOUTS = 3
STANDINS = Path(__file__).parent / "openrlhf_standins"


def rows(n: int = N_TASKS) -> list[tuple[str, str, str, None]]:
    return [("math" if i % 2 else "gsm8k", f"question {i}", str(i), None) for i in range(n)]


def stream(address: str, experiment: str, *, threshold: float | None = 0.5, **kwargs: Any) -> PromptStream:
    data = rows()
    keys = [task_key(ds, p, label) for ds, p, label, _ in data]
    cur = Curriculum(address, experiment, keys, batch_size=4, config=EXACT, rank=0, world_size=1, **kwargs)
    return PromptStream(cur, data, rollouts_per_prompt=N_ROLLOUTS, success_threshold=threshold)


def successes_of(label: str) -> int:
    """The stand-in verifier: the task labelled i succeeds on i % 4 of its 3 rollouts."""
    return min(int(label) % 4, N_ROLLOUTS)


def roll_out(s: PromptStream, it: Iterator[Any], prompts: int) -> list[tuple[str, str]]:
    """Take `prompts` prompts as OpenRLHF's `_collect_prompt_batch` does and
    record their rollouts (in reverse order: Ray returns them as they finish)."""
    taken = []
    for _ in range(prompts):
        try:
            _, (prompt,), (label,), _ = next(it)
        except StopIteration:
            break
        taken.append((prompt, label))
    for prompt, label in reversed(taken):
        for j in range(N_ROLLOUTS):
            s.record(prompt, label, 1.0 if j < successes_of(label) else 0.0)
    return taken


def expected_counts(labels: list[str]) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for label in labels:
        i = int(label)
        key = task_key("math" if i % 2 else "gsm8k", f"question {i}", label)
        s, f = out.get(key, (0.0, 0.0))
        out[key] = (s + successes_of(label), f + N_ROLLOUTS - successes_of(label))
    return out


# -- PromptStream: no framework needed -------------------------------------------------


def test_prompts_are_positions_of_numbered_batches_across_episodes(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    s = stream(address, exp_name)
    assert len(s) == 12 and s.batches_per_epoch == 3
    labels = []
    for _episode in range(2):
        it = iter(s)
        while taken := roll_out(s, it, 4):
            s.report_finished()
            labels += [label for _, label in taken]
    s.curriculum.wait()
    assert len(labels) == 24
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (6, 0)  # the second episode numbers on: batches 0-5, each reported once
    got = counts(client, exp_name)
    want = expected_counts(labels)
    assert {k: got[k] for k in want} == want
    signals = s.pop_signals()  # the mean over the six batches' reports
    assert signals["curriculum/server_step"] == 3.5 and 0.0 < signals["curriculum/informative_fraction"] < 1.0
    assert s.pop_signals() == {}


def test_a_half_drawn_batch_waits_for_its_last_prompt(address: str, client: bots_client.Client, exp_name: str) -> None:
    """Dynamic filtering takes replacement prompts one at a time: a batch is
    reported only when all of its prompts came back."""
    s = stream(address, exp_name)
    it = iter(s)
    roll_out(s, it, 4)
    roll_out(s, it, 1)  # a replacement from batch 1, before batch 0 is reported
    s.report_finished()
    s.curriculum.wait()
    assert client.get_experiment(exp_name).step == 1  # batch 0 only
    assert s.state_dict()["position"] == 1
    roll_out(s, it, 3)
    s.report_finished()
    s.curriculum.wait()
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (2, 1)  # batch 2 was drawn with batch 1's report (ReportAndSelect)
    assert [p for p, _ in roll_out(s, it, 4)] == [f"question {s.rows[i][1].split()[1]}" for i in s.current.indices]


def test_rows_that_differ_only_by_their_images_are_different_tasks(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    """A multimodal dataset asks one question of many images: each image is
    a task of its own, and a rollout is filed under the one it came with
    (OpenRLHF passes the row's images back with each rollout)."""
    data = [("vqa", "<image>What is shown?", "yes", [f"img/{i}.png"]) for i in range(8)]
    keys = [task_key(*row) for row in data]
    assert len(set(keys)) == 8 and task_key("gsm8k", "question 1", "1") == task_key("gsm8k", "question 1", "1", None)
    cur = Curriculum(address, exp_name, keys, batch_size=4, config=EXACT, rank=0, world_size=1)
    s = PromptStream(cur, data, rollouts_per_prompt=N_ROLLOUTS)
    it = iter(s)
    drawn = [next(it) for _ in range(4)]
    for i, (_, (prompt,), (label,), (images,)) in enumerate(drawn):
        for j in range(N_ROLLOUTS):
            s.record(prompt, label, 1.0 if j < i else 0.0, images)
    with pytest.raises(ValueError, match="not in this dataset"):
        s.record("<image>What is shown?", "yes", 1.0, ["img/unknown.png"])
    s.report_finished()
    s.curriculum.wait()
    expected = {}
    for i, (_, (prompt,), (label,), (images,)) in enumerate(drawn):
        won = min(i, N_ROLLOUTS)
        expected[task_key("vqa", prompt, label, images)] = (float(won), float(N_ROLLOUTS - won))
    got = counts(client, exp_name)
    assert {k: got[k] for k in expected} == expected


def test_rollouts_outside_the_dataset_or_beyond_their_count_are_refused(address: str, exp_name: str) -> None:
    s = stream(address, exp_name)
    it = iter(s)
    (prompt, label), *_ = roll_out(s, it, 4)
    with pytest.raises(ValueError, match="not in this dataset"):
        s.record("a prompt of another dataset", "1", 1.0)
    with pytest.raises(ValueError, match="more than --rollout.n_samples_per_prompt = 3 rollouts per prompt"):
        s.record(prompt, label, 1.0)
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        fractional = stream(address, exp_name + "-f", threshold=None)
        fit = iter(fractional)
        _, (p,), (lab,), _ = next(fit)
        fractional.record(p, lab, 1.5)


def test_unscored_rollouts_are_left_out_and_named(
    address: str, client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    s = stream(address, exp_name)
    it = iter(s)
    taken = []
    for _ in range(4):
        _, (prompt,), (label,), _ = next(it)
        taken.append((prompt, label))
    for n, (prompt, label) in enumerate(taken):
        for _ in range(N_ROLLOUTS):
            s.record(prompt, label, None if n == 0 else 1.0)  # the first task's reward function failed
    s.report_finished()
    s.curriculum.wait()
    assert "1 tasks have no scored rollout" in caplog.text
    assert s.skipped_rollouts == N_ROLLOUTS
    assert client.get_experiment(exp_name).step == 1
    got = counts(client, exp_name)
    assert sum(a + b for a, b in got.values()) == 3 * N_ROLLOUTS


def test_rows_that_openrlhf_could_not_tell_apart_are_refused(address: str, exp_name: str) -> None:
    data = rows()
    data[1] = ("other-source", data[0][1], data[0][2], None)  # same prompt and label, another datasource
    keys = [task_key(ds, p, label) for ds, p, label, _ in data]
    cur = Curriculum(address, exp_name, keys, batch_size=4, config=EXACT, rank=0, world_size=1)
    with pytest.raises(ValueError, match="could not be told apart"):
        PromptStream(cur, data, rollouts_per_prompt=N_ROLLOUTS)


@pytest.mark.parametrize("crash", ["before the report", "after the report", "in a half-drawn batch"])
def test_a_checkpoint_resumes_exactly_once(address: str, client: bots_client.Client, exp_name: str, crash: str) -> None:
    """OpenRLHF saves `state_dict()` after each step. Whatever happened after
    the checkpoint, the resumed run reports every batch once and ends where
    an uninterrupted run ends."""
    # Prompts per generate call, over two episodes of 3 batches: 3 + 1 leaves
    # batch 2 half drawn at a checkpoint; the 5 after the first episode's end
    # are the 1 left (exhausted) and 4 of the next.
    steps = [4, 4, 3, 1, 1, 4, 4]

    def run(s: PromptStream, sizes: list[int]) -> None:
        """OpenRLHF's episodes: a new iterator once one is exhausted."""
        for n in sizes:
            if getattr(s, "it", None) is None:
                s.it = iter(s)  # type: ignore[attr-defined]
            if len(roll_out(s, s.it, n)) < n:  # type: ignore[attr-defined]
                s.it = None  # type: ignore[attr-defined]
            s.report_finished()

    whole = stream(address, exp_name + "-whole")
    run(whole, steps)
    whole.curriculum.wait()

    first = stream(address, exp_name)
    cut = {"before the report": 2, "after the report": 2, "in a half-drawn batch": 3}[crash]
    run(first, steps[:cut])
    state = pickle.loads(pickle.dumps(first.state_dict()))
    if crash == "before the report":
        roll_out(first, first.it, steps[cut])  # type: ignore[attr-defined] # rolled out, never reported
    elif crash == "after the report":
        run(first, steps[cut : cut + 1])
        first.curriculum.wait()
    else:
        roll_out(first, first.it, 1)  # type: ignore[attr-defined] # the rest of batch 2, never reported
    resumed = stream(address, exp_name)
    resumed.load_state_dict(state)
    run(resumed, steps[cut:])
    resumed.curriculum.wait()
    for name in (exp_name, exp_name + "-whole"):
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (5, 1), name  # batch 5 drawn with batch 4's report
    assert whole.state_dict()["next_number"] == 5
    assert counts(client, exp_name) == counts(client, exp_name + "-whole")


def test_a_new_run_on_a_used_experiment_is_refused(address: str, exp_name: str) -> None:
    s = stream(address, exp_name)
    roll_out(s, iter(s), 4)
    s.report_finished()
    s.curriculum.wait()
    with pytest.raises(bots_client.ExperimentInUseError, match=r"already has 1 reported steps.*--bots.resume true"):
        next(iter(stream(address, exp_name)))
    with pytest.raises(ValueError, match="request_prefix"):
        stream(address, exp_name, request_prefix="other").load_state_dict(s.state_dict())


def test_the_launcher_takes_out_its_options() -> None:
    argv = ["--bots.address", "h:1", "--rollout.batch_size", "4", '--bots.experiment_config={"seed": 3}']
    options, rest = _bots_options([*argv, "--bots.resume", "true"])
    assert options == {"address": "h:1", "experiment_config": {"seed": 3}, "resume": True}
    assert rest == ["--rollout.batch_size", "4"]
    with pytest.raises(SystemExit, match="unknown option --bots.adress"):
        _bots_options(["--bots.adress", "h:1"])
    with pytest.raises(SystemExit, match="needs a value"):
        _bots_options(["--bots.experiment"])


# -- OpenRLHF 0.11.2 itself (.venv-openrlhf) -------------------------------------------


class _Parsed(Exception):
    pass


def openrlhf_args(argv: list[str]) -> Any:
    """`argv` through the real parser of `openrlhf.cli.train_ppo_ray` (built
    in its `__main__` block: run it, and stop at its `parse_args`)."""
    from openrlhf.utils.config import hierarchize

    parsers: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        parsers.append(self)
        raise _Parsed

    argparse.ArgumentParser.parse_args = stop  # type: ignore[method-assign]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    except _Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return hierarchize(original(parsers[0], argv))


@pytest.fixture(scope="module")
def openrlhf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """OpenRLHF with the stand-ins importable, on a local Ray whose workers
    import this repository and the stand-ins too."""
    sys.path.insert(0, str(STANDINS))
    try:
        need("openrlhf.trainer.ppo_trainer")
        ray = need("ray")
        root = str(Path(__file__).parents[2])
        paths = os.pathsep.join([root, str(STANDINS), os.environ.get("PYTHONPATH", "")])
        ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": paths}})
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        sys.path.remove(str(STANDINS))


class ModelGroup:
    """Stands in for OpenRLHF's actor model group (no model): zero log-probs
    for the experience maker, a recorded `fit` (which can crash), and a
    checkpoint of the client states. It keeps its records in files, so it
    works the same in this process and in OpenRLHF's asynchronous training
    actor."""

    def __init__(self, path: Path, crash_at_fit: int | None = None) -> None:
        self.ckpt, self.log, self.crash_at_fit = path / "ckpt" / "_actor", path / "trained.jsonl", crash_at_fit

    @property
    def trained(self) -> list[list[str]]:
        """The prompts of every rollout each training step appended."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [json.loads(line) for line in lines]

    def async_run_method_batch(self, method_name: str, **kwargs: Any) -> list[Any]:
        import ray
        import torch

        if method_name == "forward":  # action log-probs, one tensor a sample
            return [ray.put([torch.zeros(m.shape, dtype=torch.float32) for m in kwargs["action_mask"]])]
        assert method_name == "append"
        with self.log.open("a") as f:
            f.write(json.dumps(sorted(p for e in kwargs["experience"] for p in e.prompts)) + "\n")
        return []

    def async_run_method(self, method_name: str, **kwargs: Any) -> list[Any]:
        import ray

        result: Any = None
        if method_name == "fit":
            fits = self.ckpt.parent / "fits"
            fits.parent.mkdir(parents=True, exist_ok=True)
            n = int(fits.read_text()) + 1 if fits.exists() else 1
            fits.write_text(str(n))
            if n == self.crash_at_fit:
                raise RuntimeError("crash after the report, before the checkpoint")
            result = {"policy_loss": 0.0}
        elif method_name == "save_checkpoint":
            self.ckpt.mkdir(parents=True, exist_ok=True)
            (self.ckpt / "states.pkl").write_bytes(pickle.dumps(kwargs["client_states"]))
        elif method_name == "get_checkpoint_states":
            result = pickle.loads((self.ckpt / "states.pkl").read_bytes())
        return [ray.put(result)]


def engine_class(ray: Any) -> Any:
    @ray.remote(num_cpus=0)
    class Engine:
        """Stands in for OpenRLHF's vLLM engine actor: echoes the prompt and
        scores rollout j of the task labelled i by the fixed verifier."""

        def get_num_unfinished_requests(self) -> int:
            return 0

        async def generate_responses(
            self, prompt: str, label: str, sampling_params: Any, max_length: int, hf_tokenizer: Any,
            num_samples: int = 1, images: Any = None,
        ) -> list[dict[str, Any]]:  # fmt: skip
            won = min(int(label) % 4, num_samples)
            return [
                {"prompt": prompt, "label": label, "images": images, "mm_train_inputs": None,
                 "observation_tokens": [3, 4, 5, 6], "action_ranges": [(2, 4)], "rollout_log_probs": None,
                 "truncated": False, "reward": float(j < won), "scores": float(j < won), "extra_logs": {}}
                for j in range(num_samples)
            ]  # fmt: skip

    return Engine


def data_files(tmp_path: Path, n: int = 24) -> str:
    """Two JSONL files (two datasources), as `--data.prompt_dataset a,b`."""
    paths = []
    for source, part in (("gsm8k", range(0, n, 2)), ("math", range(1, n, 2))):
        path = tmp_path / f"{source}.jsonl"
        path.write_text("".join(json.dumps({"input": f"{source} {i}", "label": str(i), "datasource": source}) + "\n"
                                for i in part))  # fmt: skip
        paths.append(str(path))
    return ",".join(paths)


def run_openrlhf(
    ray: Any, path: Path, experiment: str, address: str, *, filtering: bool = False, resume: bool = False,
    asynchronous: bool = False, crash_at_fit: int | None = None, crash_at_report: int | str | None = None,
) -> ModelGroup:  # fmt: skip
    """OpenRLHF's trainer, built and run as `train_ppo_ray` builds and runs
    it, with the launcher's options (in this process instead of a Ray actor;
    the asynchronous trainer starts its own generator and training actors)."""
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    from bots_client.integrations import openrlhf as bots_openrlhf
    from tests.integrations.test_verl import tiny_tokenizer_dir

    path.mkdir(parents=True, exist_ok=True)
    model = path / "model"
    if not model.exists():
        tiny_tokenizer_dir(model)
    argv = [
        "--actor.model_name_or_path", str(model), "--data.prompt_dataset", data_files(path),
        "--data.input_key", "input", "--data.label_key", "label", "--reward.remote_url", "reward.py",
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", str(N_ROLLOUTS), "--train.batch_size", "12",
        "--algo.advantage.estimator", "group_norm", "--ckpt.path", str(path / "ckpt"), "--ckpt.save_steps", "1",
        "--logger.tensorboard_dir", str(path / "tb"),
    ]  # fmt: skip
    if filtering:
        # Six prompts a vLLM call (OpenRLHF keeps the surplus for the next
        # step), so calls end inside batches of four.
        argv += ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "1",
                 "--rollout.vllm_generate_batch_size", "6"]  # fmt: skip
    if resume:
        argv += ["--ckpt.load_enable"]
    if asynchronous:
        argv += ["--train.async_enable", "--train.async_queue_size", "2"]
    args = openrlhf_args(argv)
    config = {"strategy": EXACT.strategy, "forgetting": 0.0, "implicit_weight": 0.0, "seed": 7}
    options = {"address": address, "experiment": experiment, "experiment_config": config}
    group = ModelGroup(path, crash_at_fit)
    engine = engine_class(ray)
    trainer_class = bots_openrlhf.BotsPPOTrainerAsync if asynchronous else bots_openrlhf.BotsPPOTrainer
    strategy = DeepspeedStrategy(seed=args.train.seed, args=args)
    trainer = bots_openrlhf._WithOptions(SimpleNamespace(remote=trainer_class), options).remote(
        str(model), strategy, group, None, None, None, [engine.remote(), engine.remote()],
        do_sample=True, max_len=64, max_new_tokens=8, temperature=1.0, top_p=1.0,
    )  # fmt: skip
    if asynchronous:
        try:
            trainer.fit()
        finally:  # a crashed run's generator waits on a full queue
            ray.kill(trainer.generator_actor)
            ray.kill(trainer.trainer_actor)
        return group
    stream = trainer.prompts_dataloader
    if crash_at_report is not None:
        report, calls, half = stream.report_finished, [0], [False]

        def crash() -> None:
            calls[0] += 1
            # "half": the first step after a checkpoint that holds a half-drawn batch.
            if calls[0] == crash_at_report or (crash_at_report == "half" and half[0]):
                raise RuntimeError("crash after the rollouts, before the report")
            report()
            half[0] = stream._half_drawn()

        stream.report_finished = crash
    try:
        trainer.fit()  # which waits for its last report itself
    except BaseException:
        with contextlib.suppress(Exception):
            stream.curriculum.wait()  # a crashed run's report still in flight lands before the next run
        raise
    assert stream.curriculum._background is None
    return group


def trained_counts(group: ModelGroup) -> dict[str, tuple[float, float]]:
    """What the server holds when it got exactly the trained rollouts:
    key -> (successes, failures) under the stand-in verifier."""
    out: dict[str, tuple[float, float]] = {}
    for step in group.trained:
        for prompt in set(step):
            source, i = prompt.split()
            rollouts = step.count(prompt)
            won = rollouts // N_ROLLOUTS * successes_of(i)
            key = task_key(source, prompt, i)
            s, f = out.get(key, (0.0, 0.0))
            out[key] = (s + won, f + rollouts - won)
    return out


@pytest.mark.parametrize("asynchronous", [False, True], ids=["PPOTrainer", "PPOTrainerAsync"])
def test_real_openrlhf_draws_and_reports_every_batch_once(
    openrlhf: Any, tmp_path: Path, address: str, client: bots_client.Client, exp_name: str, asynchronous: bool
) -> None:
    group = run_openrlhf(openrlhf, tmp_path, exp_name, address, asynchronous=asynchronous)
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (6, 0)  # 24 prompts / 4 a batch, one episode; the last draws nothing ahead
    assert len(group.trained) == 6 and all(len(step) == 4 * N_ROLLOUTS for step in group.trained)
    trained = {k: v for k, v in counts(client, exp_name).items() if v != (0.0, 0.0)}
    assert trained == trained_counts(group)  # exactly the rollouts OpenRLHF trained on
    # Each batch was selected after every earlier batch's report, even with
    # the asynchronous generator two batches ahead of training: the server's
    # step at selection (its request key gives the batch back) is its number.
    assert [client.select_batch(exp_name, 4, request_key=f"step-{k}").step for k in range(6)] == list(range(6))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")}
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    has_signals = any(t.endswith("curriculum/informative_fraction") for t in tags)
    assert has_signals != asynchronous, tags  # in OpenRLHF's own logs (the training actor's, when synchronous)


def test_real_openrlhf_with_dynamic_filtering_reports_the_filtered_groups(
    openrlhf: Any, tmp_path: Path, address: str, client: bots_client.Client, exp_name: str
) -> None:
    """Groups that all pass or all fail are dropped by OpenRLHF before
    training and replaced by prompts of the next batch: they are reported
    all the same, with the batch they were drawn in."""
    group = run_openrlhf(openrlhf, tmp_path, exp_name, address, filtering=True)
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (6, 0)
    got = counts(client, exp_name)
    assert sum(a + b for a, b in got.values()) == 24 * N_ROLLOUTS  # every drawn rollout, once
    trained = trained_counts(group)
    assert trained and all(0 < s < s + f for s, f in trained.values())  # only mixed groups were trained on
    assert sum(a + b for a, b in trained.values()) < 24 * N_ROLLOUTS


def test_real_openrlhf_a_failed_last_report_raises_when_no_step_follows_it(
    openrlhf: Any, tmp_path: Path, address: str, client: bots_client.Client, exp_name: str, monkeypatch: Any
) -> None:
    """When the last vLLM call leaves nothing to train on (every group of
    it filtered), OpenRLHF's fit stops without another step, so nothing
    waited for that call's report: its failure was only logged and its
    outcomes lost while fit returned."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    generate = SamplesGenerator.generate_samples

    def last_call_all_filtered(self: Any, **kwargs: Any) -> Any:
        samples, rate, consumed, exhausted = generate(self, **kwargs)
        stream = self.prompts_dataloader
        last = stream.next_number >= stream.pass_end and not stream._half_drawn()  # it drew the last batch
        return ([] if last else samples), rate, consumed, exhausted

    reports = 0

    def failing_last(send: Any) -> Any:
        def report(self: bots_client.Client, *args: Any, **kwargs: Any) -> Any:
            nonlocal reports
            reports += 1
            if reports == 6:  # the last batch's
                raise bots_client.UnavailableError("injected: the service went away")
            return send(self, *args, **kwargs)

        return report

    monkeypatch.setattr(SamplesGenerator, "generate_samples", last_call_all_filtered)
    for method in ("report_outcomes", "report_and_select"):
        monkeypatch.setattr(bots_client.Client, method, failing_last(getattr(bots_client.Client, method)))
    with pytest.raises(bots_client.UnavailableError, match="injected"):
        run_openrlhf(openrlhf, tmp_path, exp_name, address)
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (5, 1)  # the last batch is still open: its lease brings it back


_UNINTERRUPTED: dict[bool, str] = {}


def uninterrupted(openrlhf: Any, tmp_path_factory: pytest.TempPathFactory, address: str, filtering: bool) -> str:
    """The experiment of an uninterrupted synchronous run (with or without
    dynamic filtering), run the first time it is asked for."""
    if filtering not in _UNINTERRUPTED:
        name = f"openrlhf-whole-{'filtering' if filtering else 'plain'}-{os.getpid()}-{id(openrlhf)}"
        run_openrlhf(openrlhf, tmp_path_factory.mktemp("whole"), name, address, filtering=filtering)
        _UNINTERRUPTED[filtering] = name
    return _UNINTERRUPTED[filtering]


@pytest.mark.parametrize(
    "crash",
    ["after the report", "before the report", "before the report of a half-drawn batch", "async, in training"],
)
def test_real_openrlhf_resumes_from_its_checkpoint_exactly_once(
    openrlhf: Any, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, address: str,
    client: bots_client.Client, exp_name: str, crash: str,
) -> None:  # fmt: skip
    """Crashed, then resumed from OpenRLHF's checkpoint: the server ends with
    an uninterrupted run's counts. Asynchronously the generator ran ahead of
    the crashed step: its batches were reported, and are drawn again (the
    same tasks) and trained on once. The uninterrupted run is synchronous
    (its batches are the asynchronous trainer's: each is selected after every
    earlier report), run once per module."""
    mode = {"filtering": "half-drawn" in crash, "asynchronous": crash.startswith("async")}
    whole = uninterrupted(openrlhf, tmp_path_factory, address, mode["filtering"])
    crashed = tmp_path / "crashed"
    point = {"after the report": {"crash_at_fit": 3}, "before the report": {"crash_at_report": 3},
             "before the report of a half-drawn batch": {"crash_at_report": "half"},
             "async, in training": {"crash_at_fit": 3}}[crash]  # fmt: skip
    with pytest.raises(Exception, match="crash"):
        run_openrlhf(openrlhf, crashed, exp_name, address, **mode, **point)  # type: ignore[arg-type]
    if mode["filtering"]:
        states = pickle.loads((crashed / "ckpt" / "_actor" / "states.pkl").read_bytes())
        assert "position" in states["data_loader_state_dict"]  # the checkpoint holds a half-drawn batch
    group = run_openrlhf(openrlhf, crashed, exp_name, address, resume=True, **mode)
    for name in (exp_name, whole):
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (6, 0), name
    assert counts(client, exp_name) == counts(client, whole)
    if not mode["filtering"]:
        # The crashed step's rollouts reached the model group before its fit crashed.
        assert len(group.trained) == 6 + ("crash_at_fit" in point)


def test_real_openrlhf_settings_that_would_lose_a_reward_are_refused_at_start(
    openrlhf: Any, tmp_path: Path, address: str, exp_name: str
) -> None:
    base = ["--data.prompt_dataset", data_files(tmp_path), "--rollout.batch_size", "4"]
    args = openrlhf_args(base)
    args.bots = {"address": address, "experiment": exp_name}
    with pytest.raises(ValueError, match="needs each rollout's score when it is generated"):
        build_stream([], args)  # a reward model scores after the batch
    args.bots["key"] = "id"
    with pytest.raises(ValueError, match="unknown --bots options"):
        build_stream([], args)
    del args.bots["key"]
    # rollouts_per_task other than the group size, given explicitly.
    scored = openrlhf_args([*base, "--reward.remote_url", "reward.py", "--rollout.n_samples_per_prompt", "3"])
    scored.bots = {**args.bots, "experiment_config": {"rollouts_per_task": 16}}
    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 16 but the trainer runs "
                                                     "--rollout.n_samples_per_prompt = 3"):  # fmt: skip
        build_stream([("src", f"prompt {i}", "label") for i in range(4)], scored)
    with pytest.raises(ValueError, match="needs --bots.address and --bots.experiment"):
        main(["--bots.address", address, "--train.async_enable"])
    with pytest.raises(SystemExit, match="needs each rollout's score when it is generated"):
        main(["--bots.address", address, "--bots.experiment", exp_name, "--rollout.batch_size", "4"])
