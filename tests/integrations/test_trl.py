"""bots_client.integrations.trl: the sampler pattern against TRL's
RepeatSampler, and a real GRPOTrainer run (a tiny GPT-2 and a word-level
tokenizer built in code, on CPU) whose prompts come from the service and
whose rewards are reported once per generation batch."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import time
from typing import Any

import pytest

import bots_client
from tests.integrations.conftest import EXACT, counts, need

torch = need("torch")

from bots_client.integrations._core import Curriculum, GroupSizeMismatchError, UnattributedOutcomesError
from bots_client.integrations.trl import BotsGRPO, BotsRepeatSampler

N_TASKS = 12
# The runs below make num_generations = 4 completions per prompt.
GRPO_EXACT = dataclasses.replace(EXACT, rollouts_per_task=4)


def test_repeat_pattern_matches_trl_repeat_sampler(client: bots_client.Client, exp_name: str) -> None:
    cur = Curriculum(client, exp_name, [f"k{i}" for i in range(N_TASKS)], batch_size=3, config=EXACT)
    sampler = BotsRepeatSampler(cur, mini_repeat_count=2, batch_size=3, repeat_count=2, num_batches=2)
    assert len(sampler) == 2 * 3 * 2 * 2
    it = iter(sampler)
    first = list(itertools.islice(it, 12))
    chunk = list(cur.select(0, batch_size=3).indices)
    # RepeatSampler's layout: each index mini_repeat_count times, the chunk repeat_count times.
    assert first == [i for _ in range(2) for i in chunk for _ in range(2)]
    cur.report(dict.fromkeys(cur.select(0, batch_size=3).keys, (1, 2)))
    second = list(itertools.islice(it, 12))
    assert second[:6] == second[6:] and len(set(second)) == 3
    assert sampler.state_dict() == {"experiment": exp_name, "step": 2}
    trl_utils = pytest.importorskip("trl.trainer.utils")
    reference = list(trl_utils.RepeatSampler(list(range(N_TASKS)), mini_repeat_count=2, batch_size=3,
                                             repeat_count=2, shuffle=False))[:12]  # fmt: skip
    assert [i - reference[0] for i in reference] == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]


def test_group_column_puts_each_task_in_its_dataset(client: bots_client.Client, exp_name: str) -> None:
    dataset = {"task_key": [f"k{i}" for i in range(N_TASKS)], "source": ["code"] * 4 + ["math"] * 8}
    bots = BotsGRPO(client, exp_name, dataset=dataset, group_column="source", config=EXACT)
    bots.curriculum.ensure_ready()
    assert [(g.name, g.num_tasks) for g in client.list_groups(exp_name)] == [("code", 4), ("math", 8)]
    client.set_group_shares(exp_name, {"code": 0.25, "math": 0.75})
    keys = bots.curriculum.select(0, batch_size=4).keys
    assert sorted(dataset["source"][int(k[1:])] for k in keys) == ["code", "math", "math", "math"]
    with pytest.raises(TypeError, match="pass dataset= too"):
        BotsGRPO(client, exp_name, keys=["k0"], group_column="source")


def _tiny_model_and_tokenizer() -> tuple[Any, Any]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]", "solve", "task", "yes", "no"] + [str(i) for i in range(N_TASKS)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]", padding_side="left"
    )
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(vocab), n_positions=32, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=vocab["[EOS]"], eos_token_id=vocab["[EOS]"], pad_token_id=vocab["[PAD]"],
    )  # fmt: skip
    return GPT2LMHeadModel(config), tokenizer


def _train_dataset() -> Any:
    """N_TASKS prompts "solve task i", keyed "task-i"."""
    import datasets

    return datasets.Dataset.from_dict({
        "prompt": [f"solve task {i}" for i in range(N_TASKS)],
        "task_key": [f"task-{i}" for i in range(N_TASKS)],
    })  # fmt: skip


def test_real_grpo_trainer_draws_prompts_from_the_service_and_reports_once_per_step(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    need("trl")
    from trl import GRPOConfig, GRPOTrainer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, tokenizer = _tiny_model_and_tokenizer()
    train = _train_dataset()
    seen_keys: list[list[str]] = []

    def correct(prompts: list[str], completions: list[str], task_key: list[str], **kwargs: Any) -> list[float]:
        seen_keys.append(list(task_key))
        # A verifier whose answer depends only on the task: even tasks pass.
        return [1.0 if int(k.split("-")[1]) % 2 == 0 else 0.0 for k in task_key]

    bots = BotsGRPO(address, exp_name, dataset=train, key_column="task_key", config=GRPO_EXACT)
    trainer_cls = bots.trainer_class(GRPOTrainer)
    assert issubclass(trainer_cls, GRPOTrainer)
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=3,
        max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=["tensorboard"], save_strategy="no",
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = trainer_cls(model=model, processing_class=tokenizer, reward_funcs=[bots.reward(correct)],
                          args=args, train_dataset=train)  # fmt: skip
    trainer.train()

    # One generation batch per optimizer step: 8 completions = 2 prompts x 4 generations.
    assert len(seen_keys) == 3 and all(len(keys) == 8 and len(set(keys)) == 2 for keys in seen_keys)
    assert client.get_experiment(exp_name).step == 3  # one report per generation batch
    assert len(bots.reports) == 3
    # The prompts trained on are the service's batches, in order.
    drawn = [bots.curriculum.select(i, batch_size=2).keys for i in range(3)]
    assert [sorted(set(keys)) for keys in seen_keys] == [sorted(keys) for keys in drawn]
    expected: dict[str, tuple[float, float]] = {}
    for keys in drawn:
        for key in keys:
            s = 4.0 if int(key.split("-")[1]) % 2 == 0 else 0.0
            prev = expected.get(key, (0.0, 0.0))
            expected[key] = (prev[0] + s, prev[1] + 4.0 - s)
    got = counts(client, exp_name)
    assert {k: got[k] for k in expected} == expected

    # The curriculum's signals went through report_to into TensorBoard,
    # beside the loss, one point per optimizer step.
    from tests.integrations.test_torch import read_scalars

    scalars = read_scalars(tmp_path)  # output_dir/runs/...
    rate = [sum(int(k.split("-")[1]) % 2 == 0 for k in keys) / len(keys) for keys in drawn]  # even tasks pass
    assert [v for _, v in scalars["train/curriculum/batch_success_rate"]] == pytest.approx(rate)
    assert [s for s, _ in scalars["train/curriculum/batch_success_rate"]] == [1, 2, 3]
    assert [v for _, v in scalars["train/curriculum/server_step"]] == [1.0, 2.0, 3.0]
    assert [v for _, v in scalars["train/curriculum/informative_fraction"]] == [0.0, 0.0, 0.0]  # all-or-nothing
    assert "train/loss" in scalars


def test_reward_wrapper_reports_only_while_training(client: bots_client.Client, exp_name: str) -> None:
    bots = BotsGRPO(client, exp_name, [f"task-{i}" for i in range(4)], config=EXACT)
    bots.curriculum.batch_size = 2
    batch = bots.curriculum.select(0)

    def reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
        return [1.0, None, 0.0, 1.0]

    wrapped = bots.reward(reward)
    assert wrapped.__name__ == "reward"  # TRL logs rewards under the function's name
    keys = [batch.keys[0], batch.keys[0], batch.keys[1], batch.keys[1]]

    class Model(torch.nn.Module):
        pass

    bots.trainer = type("T", (), {"model": Model().eval()})()
    assert wrapped(prompts=["p"] * 4, completions=["c"] * 4, task_key=keys) == [1.0, None, 0.0, 1.0]
    assert client.get_experiment(exp_name).step == 0  # evaluation: nothing reported
    bots.trainer.model.train()
    wrapped(prompts=["p"] * 4, completions=["c"] * 4, task_key=keys)
    bots.wait()  # the report goes out in the background by default
    got = counts(client, exp_name)
    assert got[batch.keys[0]] == (1.0, 0.0) and got[batch.keys[1]] == (1.0, 1.0)  # None skipped
    with pytest.raises(KeyError, match="task_key"):
        wrapped(prompts=["p"], completions=["c"])


def test_reward_wrapper_takes_numpy_nans_and_async_functions(client: bots_client.Client, exp_name: str) -> None:
    """TRL reads a NaN of any numeric type as "no reward", and awaits a
    reward function that is a coroutine function: so does the wrapper."""
    import asyncio

    import numpy as np

    bots = BotsGRPO(client, exp_name, [f"task-{i}" for i in range(4)], config=EXACT)
    bots.curriculum.batch_size = 2
    bots.trainer = type("T", (), {"model": torch.nn.Module().train()})()
    first, second = bots.curriculum.select(0), bots.curriculum.select(1)

    def numpy_rewards(prompts: list[str], completions: list[str], **kwargs: Any) -> Any:
        return np.array([1.0, np.nan, 0.0, 1.0], dtype=np.float32)

    async def async_rewards(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        await asyncio.sleep(0)
        return [1.0, 1.0, 0.0, 0.0]

    keys = [first.keys[0], first.keys[0], first.keys[1], first.keys[1]]
    bots.reward(numpy_rewards)(prompts=["p"] * 4, completions=["c"] * 4, task_key=keys)
    class AsyncScorer:
        async def __call__(self, scale: float, **kwargs: Any) -> list[float]:
            return [scale] * 4

    need("trl")
    from trl.trainer.utils import is_async_callable

    for fn in (async_rewards, AsyncScorer(), functools.partial(AsyncScorer(), 1.0)):
        assert is_async_callable(fn) and is_async_callable(bots.reward(fn))  # TRL awaits it, wrapped or not
    wrapped = bots.reward(async_rewards)
    assert inspect.iscoroutinefunction(wrapped)
    keys = [second.keys[0], second.keys[0], second.keys[1], second.keys[1]]
    assert asyncio.run(wrapped(prompts=["p"] * 4, completions=["c"] * 4, task_key=keys)) == [1.0, 1.0, 0.0, 0.0]
    bots.wait()
    got = counts(client, exp_name)
    assert got[first.keys[0]] == (1.0, 0.0) and got[first.keys[1]] == (1.0, 1.0)  # the NaN skipped
    assert got[second.keys[0]] == (2.0, 0.0) and got[second.keys[1]] == (0.0, 2.0)


# -- resume ----------------------------------------------------------------------------


class _Crash(Exception):
    pass


def _grpo_run(
    address: str, experiment: str, output_dir: Any, *, max_steps: int, crash_at: int | None = None,
    resume: str | None = None, steps_per_generation: int = 1, num_iterations: int = 1,
    gradient_accumulation_steps: int = 1, bots: BotsGRPO | None = None, saved: list[tuple[int, int]] | None = None,
    logging_steps: int = 1,
) -> tuple[list[tuple[str, int, tuple[str, ...]]], BotsGRPO]:
    """A real GRPOTrainer run of 8 completions x 4 generations per micro-step
    (2 prompts; 2 x steps_per_generation per generation batch), 3
    generation batches per epoch, a checkpoint after every optimizer step;
    it raises right after saving checkpoint `crash_at`. `bots`: go on with
    this BotsGRPO (a retry in the same process); `saved` gets (global step,
    server step) at each checkpoint. Returns every selection it made:
    (request key, server step at selection, task keys), in order."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, tokenizer = _tiny_model_and_tokenizer()
    train = _train_dataset()
    selections: list[tuple[str, int, tuple[str, ...]]] = []
    if bots is None:
        bots = BotsGRPO(address, experiment, dataset=train, key_column="task_key", config=GRPO_EXACT, num_batches=3)
        select = bots.curriculum.select

        def recording_select(*args: Any, **kwargs: Any) -> Any:
            batch = select(*args, **kwargs)
            bots.selections.append((batch.request_key, batch.step, batch.keys))  # type: ignore[union-attr]
            return batch

        bots.curriculum.select = recording_select  # type: ignore[method-assign]
    bots.selections = selections  # type: ignore[attr-defined]

    class CrashAfterSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if saved is not None:
                saved.append((state.global_step, bots.curriculum.client.get_experiment(experiment).step))
            if state.global_step == crash_at:
                raise _Crash(state.global_step)

    def correct(prompts: list[str], completions: list[str], task_key: list[str], **kwargs: Any) -> list[float]:
        return [1.0 if int(k.split("-")[1]) % 3 == 0 else 0.0 for k in task_key]

    args = GRPOConfig(
        output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=3,
        max_steps=max_steps, learning_rate=1e-3, logging_steps=logging_steps, report_to=[], save_strategy="steps",
        save_steps=1,
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        steps_per_generation=steps_per_generation, num_iterations=num_iterations,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )  # fmt: skip
    trainer = bots.trainer_class(GRPOTrainer)(
        model=model, processing_class=tokenizer, reward_funcs=[bots.reward(correct)], args=args, train_dataset=train,
        callbacks=[CrashAfterSave()],
    )  # fmt: skip
    with contextlib.suppress(_Crash):
        trainer.train(resume_from_checkpoint=resume)
    return selections, bots


def test_real_grpo_trainer_resumes_exactly_once_at_any_step_and_epoch(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    need("trl")
    max_steps = 7  # epochs of 3 steps: 0-2, 3-5, 6
    reference, _ = _grpo_run(address, exp_name + "-ref", tmp_path / "ref", max_steps=max_steps)
    ref_exp = client.get_experiment(exp_name + "-ref")
    assert ref_exp.step == max_steps
    # The sequence every run must follow: request keys in order, each
    # selected at the server step an uninterrupted run selected it at.
    assert [key for key, _, _ in reference][:max_steps] == [f"step-{i}" for i in range(max_steps)]
    ref_snap = client.snapshot(exp_name + "-ref")
    for crash_at in (3, 4, 6):  # an epoch boundary, inside epoch 1, the next boundary
        name = f"{exp_name}-c{crash_at}"
        out = tmp_path / f"crash{crash_at}"
        before, _ = _grpo_run(address, name, out, max_steps=max_steps, crash_at=crash_at)
        assert client.get_experiment(name).step == crash_at and before == reference[: len(before)]
        after, bots = _grpo_run(address, name, out, max_steps=max_steps, resume=str(out / f"checkpoint-{crash_at}"))
        # A new process starts at the resumed epoch's first batch (its own
        # request key) and replays the batches it skips: the same batches.
        epoch_start = crash_at // 3 * 3
        assert after == reference[epoch_start : epoch_start + len(after)], crash_at
        assert after[-1] == reference[-1]
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (ref_exp.step, ref_exp.open_batches), crash_at
        assert [r.step for r in bots.reports if not r.duplicate] == list(range(crash_at + 1, max_steps + 1))
        snap = client.snapshot(name)  # every outcome applied exactly once: the same posterior
        assert snap.keys == ref_snap.keys
        assert list(snap.alpha) == list(ref_snap.alpha) and list(snap.beta) == list(ref_snap.beta), crash_at


@pytest.mark.parametrize(("steps_per_generation", "num_iterations"), [(2, 1), (1, 2)])
def test_real_grpo_trainer_resumes_inside_a_generation_cycle(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any, steps_per_generation: int,
    num_iterations: int,
) -> None:
    """A generation batch spans several optimizer steps; TRL resumed inside
    one generates it again (its step counter restarts at 0). The batches,
    their reports and the posterior must still be an uninterrupted run's."""
    need("trl")
    cycle = steps_per_generation * num_iterations
    max_steps = 4 * cycle  # 4 generation batches; epochs of 3
    kw = {"steps_per_generation": steps_per_generation, "num_iterations": num_iterations}
    reference, _ = _grpo_run(address, exp_name + "-ref", tmp_path / "ref", max_steps=max_steps, **kw)
    ref_exp = client.get_experiment(exp_name + "-ref")
    assert ref_exp.step == 4
    ref_snap = client.snapshot(exp_name + "-ref")
    for crash_at in (1, cycle + 1, 3 * cycle):  # inside cycles 0 and 1; the epoch boundary
        name = f"{exp_name}-c{crash_at}"
        out = tmp_path / f"crash{crash_at}"
        _grpo_run(address, name, out, max_steps=max_steps, crash_at=crash_at, **kw)
        after, _ = _grpo_run(
            address, name, out, max_steps=max_steps, resume=str(out / f"checkpoint-{crash_at}"), **kw
        )
        # Every selection, replayed or new, is the uninterrupted run's batch
        # under the same request key, drawn at the same server step.
        by_key = {key: (step, keys) for key, step, keys in reference}
        assert all(by_key[key] == (step, keys) for key, step, keys in after), crash_at
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (ref_exp.step, ref_exp.open_batches), crash_at
        snap = client.snapshot(name)
        assert snap.keys == ref_snap.keys
        assert list(snap.alpha) == list(ref_snap.alpha) and list(snap.beta) == list(ref_snap.beta), crash_at


def test_real_grpo_trainer_resumes_after_an_epoch_that_ended_with_a_partial_accumulation(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    """Epochs of 6 micro-steps under gradient_accumulation_steps=7 are one
    optimizer step of 6: TRL's micro-step counter, restored from the global
    step, must count that shorter step as an uninterrupted run did (not as
    7), or every later generation comes one micro-step late (a batch drawn
    before the last report, the posterior another)."""
    need("trl")
    kw: dict[str, Any] = {"steps_per_generation": 2, "gradient_accumulation_steps": 7}
    max_steps = 3  # epochs of one optimizer step of 6 micro-steps (3 generation batches)
    reference, _ = _grpo_run(address, exp_name + "-ref", tmp_path / "ref", max_steps=max_steps, **kw)
    ref_exp, ref_snap = client.get_experiment(exp_name + "-ref"), client.snapshot(exp_name + "-ref")
    out = tmp_path / "crash"
    _grpo_run(address, exp_name, out, max_steps=max_steps, crash_at=1, **kw)
    after, _ = _grpo_run(address, exp_name, out, max_steps=max_steps, resume=str(out / "checkpoint-1"), **kw)
    by_key = {key: (step, keys) for key, step, keys in reference}
    assert all(by_key[key] == (step, keys) for key, step, keys in after)
    exp, snap = client.get_experiment(exp_name), client.snapshot(exp_name)
    assert (exp.step, exp.open_batches) == (ref_exp.step, ref_exp.open_batches)
    assert list(snap.alpha) == list(ref_snap.alpha) and list(snap.beta) == list(ref_snap.beta)


@pytest.mark.parametrize("same_trainer", [False, True], ids=["a new trainer", "the same trainer"])
def test_real_grpo_trainer_resumed_in_the_same_process_follows_the_uninterrupted_run(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any, same_trainer: bool
) -> None:
    """A retry loop: the run fails inside a generation cycle, and a trainer
    resumes from a checkpoint: a new one from the same BotsGRPO, or the same
    one trained again (its micro-step counter then the failed run's, one
    step past its checkpoint's). The counter is restored as a new process's is."""
    need("trl")
    kw: dict[str, Any] = {"steps_per_generation": 2}
    reference, _ = _grpo_run(address, exp_name + "-ref", tmp_path / "ref", max_steps=8, **kw)
    ref_exp, ref_snap = client.get_experiment(exp_name + "-ref"), client.snapshot(exp_name + "-ref")
    out = tmp_path / "crash"
    if not same_trainer:
        _, bots = _grpo_run(address, exp_name, out, max_steps=8, crash_at=1, **kw)
        after, _ = _grpo_run(address, exp_name, out, max_steps=8, resume=str(out / "checkpoint-1"), bots=bots, **kw)
    else:
        _, bots = _grpo_run(address, exp_name, out, max_steps=8, crash_at=4, **kw)
        bots.selections = after = []  # type: ignore[attr-defined]
        trainer = bots.trainer
        for callback in list(trainer.callback_handler.callbacks):
            if type(callback).__name__ == "CrashAfterSave":  # the failure is fixed: no crash this time
                trainer.remove_callback(callback)
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    by_key = {key: (step, keys) for key, step, keys in reference}
    assert after and all(by_key[key] == (step, keys) for key, step, keys in after)
    exp, snap = client.get_experiment(exp_name), client.snapshot(exp_name)
    assert (exp.step, exp.open_batches) == (ref_exp.step, ref_exp.open_batches)
    assert list(snap.alpha) == list(ref_snap.alpha) and list(snap.beta) == list(ref_snap.beta)


def test_real_grpo_trainer_checkpoints_only_acknowledged_reports(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume skips the batches trained before its checkpoint: a
    checkpoint written while a batch's report was still in flight (a slow
    server, the client's retries) would lose that batch's outcomes for good
    if the process were killed then. Every checkpoint is written after the
    server acknowledged every trained step's report."""
    need("trl")
    def slow(send: Any) -> Any:
        def report(self: bots_client.Client, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return send(self, *args, **kwargs)

        return report

    for method in ("report_outcomes", "report_and_select"):
        monkeypatch.setattr(bots_client.Client, method, slow(getattr(bots_client.Client, method)))
    saved: list[tuple[int, int]] = []
    # No log line per step: the training log waits for the report too.
    _grpo_run(address, exp_name, tmp_path, max_steps=3, saved=saved, logging_steps=10)
    assert saved == [(1, 1), (2, 2), (3, 3)]


def _trainer(bots: BotsGRPO, train: Any, output_dir: Any, **config: Any) -> Any:
    from trl import GRPOConfig, GRPOTrainer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, tokenizer = _tiny_model_and_tokenizer()

    def correct(prompts: list[str], completions: list[str], task_key: list[str], **kwargs: Any) -> list[float]:
        return [1.0] * len(task_key)

    args = GRPOConfig(
        output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=3,
        max_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, **config,
    )  # fmt: skip
    return bots.trainer_class(GRPOTrainer)(
        model=model, processing_class=tokenizer, reward_funcs=[bots.reward(correct)], args=args, train_dataset=train
    )


def test_real_grpo_trainer_refuses_mismatches_at_start(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    need("trl")
    import datasets

    keys = [f"task-{i}" for i in range(N_TASKS)]
    train = datasets.Dataset.from_dict({"prompt": [f"solve task {i}" for i in range(N_TASKS)], "task_key": keys})
    # Rows in another order than the keys: every index would name another task.
    bots = BotsGRPO(address, exp_name, keys=keys[::-1], config=GRPO_EXACT)
    with pytest.raises(ValueError, match="not in the order of BotsGRPO's keys.*row 0 is 'task-0', key 0 is 'task-11'"):
        _trainer(bots, train, tmp_path).train()
    # A rollouts_per_task other than the group size: in the config given ...
    bots = BotsGRPO(address, exp_name, dataset=train, config=EXACT)
    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 16 but the trainer runs num_generations = 4"):
        _trainer(bots, train, tmp_path).train()
    assert exp_name not in {e.name for e in client.list_experiments()}  # refused before setup
    # ... or in an existing experiment's own config, continued without one: refused before the first draw.
    client.create_experiment(f"{exp_name}-16", EXACT)
    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 16 but the trainer runs num_generations"):
        _trainer(BotsGRPO(address, f"{exp_name}-16", dataset=train), train, tmp_path).train()
    assert client.get_experiment(f"{exp_name}-16").open_batches == 0
    # Dataloader workers would draw batches ahead, from stale posteriors.
    bots = BotsGRPO(address, exp_name, dataset=train, config=GRPO_EXACT)
    with pytest.raises(ValueError, match="dataloader_num_workers = 2"):
        _trainer(bots, train, tmp_path, dataloader_num_workers=2).train()
    assert exp_name not in {e.name for e in client.list_experiments()}  # refused before setup
    # One real step, then a new run under the same name: refused until it resumes.
    trainer = _trainer(BotsGRPO(address, exp_name, dataset=train, config=GRPO_EXACT), train, tmp_path)
    trainer.train()
    assert client.get_experiment(exp_name).step == 1
    # The same trainer trained again would start over at batch 0 (every report a duplicate).
    with pytest.raises(bots_client.ExperimentInUseError, match=r"already drew \d+ batches"):
        trainer.train()
    # A resume that would train the checkpoint's epoch again, its outcomes dropped as duplicates.
    with pytest.raises(ValueError, match="ignore_data_skip=True"):
        _trainer(BotsGRPO(address, exp_name, dataset=train, config=GRPO_EXACT), train, tmp_path,
                 ignore_data_skip=True).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))  # fmt: skip
    assert client.get_experiment(exp_name).step == 1
    with pytest.raises(bots_client.ExperimentInUseError, match="1 reported steps"):
        _trainer(BotsGRPO(address, exp_name, dataset=train, config=GRPO_EXACT), train, tmp_path).train()
    other = dataclasses.replace(GRPO_EXACT, target_success=0.3)
    with pytest.raises(bots_client.ConfigMismatchError, match="target_success"):
        _trainer(BotsGRPO(address, exp_name, dataset=train, config=other, resume=True), train, tmp_path).train()
    assert client.get_experiment(exp_name).step == 1


def test_reward_calls_are_filed_under_their_generation_batch(client: bots_client.Client, exp_name: str) -> None:
    keys = [f"task-{i}" for i in range(6)]
    trainer = type("T", (), {"model": None, "num_generations": 2})()
    bots = BotsGRPO(client, exp_name, keys, config=dataclasses.replace(EXACT, rollouts_per_task=2), overlap=False)
    bots.attach(trainer)
    bots.curriculum.batch_size = 2
    b0, b1 = bots.curriculum.select(0), bots.curriculum.select(1)  # one generation batch ahead
    def reward(prompts: list[str], completions: list[str], task_key: list[str], **kwargs: Any) -> list[float]:
        return [1.0 if k == b1.keys[1] or i % 2 == 0 else 0.0 for i, k in enumerate(task_key)]

    wrapped = bots.reward(reward)
    # A group shorter than num_generations: refused, nothing reported.
    with pytest.raises(ValueError, match="other than num_generations = 2"):
        wrapped(prompts=["p"] * 3, completions=["c"] * 3, task_key=[b1.keys[0], b1.keys[1], b1.keys[1]])
    # Completions that are no open generation batch's tasks: refused, nothing reported.
    mixed = [b0.keys[0], b0.keys[0], b1.keys[0], b1.keys[0]]
    with pytest.raises(UnattributedOutcomesError):
        wrapped(prompts=["p"] * 4, completions=["c"] * 4, task_key=mixed)
    assert client.get_experiment(exp_name).step == 0
    # Batch 1 scored first: filed under batch 1, and batch 0, which the
    # trainer passed over, is closed.
    wrapped(prompts=["p"] * 4, completions=["c"] * 4, task_key=[k for k in b1.keys for _ in range(2)])
    assert bots.curriculum.open_batches == [] and client.get_experiment(exp_name).step == 1
    got = counts(client, exp_name)
    assert (got[b1.keys[0]], got[b1.keys[1]]) == ((1.0, 1.0), (2.0, 0.0))
    # Lenient: what cannot be attributed is dropped and counted.
    lenient = BotsGRPO(client, exp_name + "-l", keys, config=dataclasses.replace(EXACT, rollouts_per_task=2),
                       strict=False, overlap=False)  # fmt: skip
    lenient.attach(trainer)
    lenient.curriculum.batch_size = 2
    drawn = lenient.curriculum.select(0)
    stray = next(k for k in keys if k not in drawn.keys)
    lenient.reward(reward)(prompts=["p"] * 2, completions=["c"] * 2, task_key=[stray, stray])
    assert lenient.curriculum.dropped_outcomes == 1 and client.get_experiment(exp_name + "-l").step == 0


def _two_ranks(address: str, experiment: str, tmp_path: Any, *, overlap: bool, **env: str) -> list[dict[str, Any]]:
    """A real GRPOTrainer on two processes (trl_ranks.py under torchrun)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = Path(tmp_path) / f"{experiment}-{int(overlap)}"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__).with_name("trl_ranks.py")), address, experiment, str(int(overlap)), str(out)]  # fmt: skip
    root = str(Path(__file__).parents[2])
    environment = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run(command, check=True, env=environment, timeout=300, capture_output=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_overlapped_draw_the_synchronous_batches_under_a_slow_report(
    address: str, exp_name: str, tmp_path: Any
) -> None:
    """With the reporting rank's report slower than the rest of a step, the
    other rank reached its next draw first and selected the batch from the
    posterior one report older (before every rank waited for it)."""
    need("trl")
    slow = {"REPORT_DELAY": "0.4"}
    sync = _two_ranks(address, f"{exp_name}-sync", tmp_path, overlap=False, **slow)
    overlapped = _two_ranks(address, f"{exp_name}-overlap", tmp_path, overlap=True, **slow)
    assert all(r["error"] is None for r in sync + overlapped)
    for rank in range(2):
        # The same request keys, chosen at the same server steps, the same tasks.
        sync_drawn = [tuple(d[:2]) + (tuple(d[2]),) for d in sync[rank]["drawn"]]
        overlapped_drawn = [tuple(d[:2]) + (tuple(d[2]),) for d in overlapped[rank]["drawn"]]
        assert overlapped_drawn[: len(sync_drawn)] == sync_drawn
    assert [step for _, step, _ in sync[1]["drawn"]][:5] == [0, 0, 1, 2, 3]  # each draw saw the report before
    assert (overlapped[0]["alpha"], overlapped[0]["beta"], overlapped[0]["step"]) == (
        sync[0]["alpha"], sync[0]["beta"], sync[0]["step"]
    )


def test_two_ranks_a_failed_background_report_raises_on_every_rank(address: str, exp_name: str, tmp_path: Any) -> None:
    need("trl")
    ranks = _two_ranks(address, exp_name, tmp_path, overlap=True, FAIL_REPORT="2")
    assert "injected: the service went away" in ranks[0]["error"]
    assert ranks[1]["error"].startswith("ReportingRankError: rank 0's report to the service failed")
    assert "injected" in ranks[1]["error"]
