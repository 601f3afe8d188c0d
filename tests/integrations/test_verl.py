"""bots_client.integrations.verl.

verl cannot join the project's test environment (verl 0.7.x and 0.8.0 pin
numpy < 2), so most tests drive the sampler with verl's data shapes, taken
from verl 0.7.1's sources: a DataProto has `.batch` (a TensorDict of
[rows, ...] tensors; "token_level_scores" is [rows, response_len] with the
sequence score on the last response token) and `.non_tensor_batch` (numpy
object arrays; "index" is extra_info.index, copied by RLHFDataset); rollouts
are `repeat(n, interleave=True)` and `balance_batch` reorders rows. The
`test_real_verl_*` tests run verl itself where it is installed
(`make test-frameworks`): create_rl_sampler, RLHFDataset, StatefulDataLoader,
DataProto, and the last two verl's default agent loop and reward loop with
only the inference server standing in.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import itertools
import logging
import os
import pickle
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

import bots_client
from tests.integrations.conftest import EXACT, counts, need

torch = need("torch")
from torch.utils.data import DataLoader

from bots_client.integrations import GroupSizeMismatchError, UnattributedOutcomesError
from bots_client.integrations.verl import BotsCurriculumSampler, outcomes_from_batch

N_ROWS = 12


class Frame:
    """The part of a HF `datasets.Dataset` the sampler reads (RLHFDataset.dataframe)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.column_names = list(rows[0])

    def __getitem__(self, column: str) -> list[Any]:
        return [r[column] for r in self.rows]


class RLHFLike(torch.utils.data.Dataset):
    """verl's RLHFDataset rows: prompt, data_source, reward_model, extra_info.
    Several `sources` stand for several data files, each numbering its
    extra_info.index from `index_offset`."""

    def __init__(
        self, n: int = N_ROWS, index_offset: int = 1000, sources: tuple[str, ...] = ("synthetic/add",)
    ) -> None:
        rows = [
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                "extra_info": {"index": index_offset + i, "uid": f"u-{i}", "weak": 0.1, "strong": 0.05 * i},
            }
            for source in sources
            for i in range(n)
        ]
        self.dataframe = Frame(rows)

    def __len__(self) -> int:
        return len(self.dataframe.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = dict(self.dataframe.rows[i])
        row["index"] = row["extra_info"]["index"]
        return row


def data_config(address: str, experiment: str, **sampler: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 4,
        "dataloader_num_workers": 0,
        "sampler": {
            "class_path": "pkg://bots_client.integrations.verl",
            "class_name": "BotsCurriculumSampler",
            "address": address,
            "experiment": experiment,
            "experiment_config": dataclasses.asdict(EXACT),
            **sampler,
        },
    }


def rollout_batch(
    index_values: list[Any], successes: dict[Any, int], n: int, *, seed: int = 0, extra: bool = True
) -> SimpleNamespace:
    """A DataProto after rollout and reward: each prompt repeated n times
    (interleaved), rows then shuffled as balance_batch does; prompt p's first
    successes[p] rollouts score 1, the rest 0."""
    rng = np.random.default_rng(seed)
    rows = [(idx, int(j < successes[idx])) for idx in index_values for j in range(n)]
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]
    response_len = 6
    scores = torch.zeros(len(rows), response_len)
    for r, (_, score) in enumerate(rows):
        last = int(rng.integers(1, response_len))  # the response's last valid token
        scores[r, last] = float(score)
    non_tensor = {
        "index": np.array([idx for idx, _ in rows], dtype=object),
        "uid": np.array([f"uid-{idx}" for idx, _ in rows], dtype=object),
        "data_source": np.array(["synthetic/add"] * len(rows), dtype=object),
    }
    if extra:
        non_tensor["extra_info"] = np.array([{"index": idx, "uid": f"u-{idx - 1000}"} for idx, _ in rows], dtype=object)
    return SimpleNamespace(
        batch={"responses": torch.zeros(len(rows), response_len, dtype=torch.long), "token_level_scores": scores},
        non_tensor_batch=non_tensor,
        meta_info={},
    )


def filter_groups(batch: SimpleNamespace) -> SimpleNamespace:
    """DAPO's dynamic sampling: keep only prompts whose rollouts disagree."""
    keys = batch.non_tensor_batch["index"]
    scores = batch.batch["token_level_scores"].sum(-1)
    by_key: dict[Any, list[float]] = {}
    for k, s in zip(keys, scores.tolist()):
        by_key.setdefault(k, []).append(s)
    keep = [i for i, k in enumerate(keys) if np.std(by_key[k]) > 0]
    return SimpleNamespace(
        batch={name: t[keep] for name, t in batch.batch.items()},
        non_tensor_batch={name: a[keep] for name, a in batch.non_tensor_batch.items()},
        meta_info={},
    )


def first_batch_indices(sampler: Any) -> list[int]:
    loader = DataLoader(RLHFLike(), batch_size=4, sampler=sampler, collate_fn=lambda rows: rows)
    rows = next(iter(loader))
    return [r["index"] for r in rows]


def test_update_reports_per_task_successes_from_repeated_shuffled_rollouts(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    sampler = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    assert len(sampler) == (N_ROWS // 4) * 4  # verl: len(dataloader) * epochs = total steps
    index_values = first_batch_indices(sampler)
    assert [str(v) for v in index_values] == list(sampler.last_batch.keys)
    successes = dict(zip(index_values, [0, 5, 2, 3]))
    batch = rollout_batch(index_values, successes, n=5)
    assert outcomes_from_batch(batch) == {str(k): (float(s), 5) for k, s in successes.items()}
    sampler.update(batch)
    assert client.get_experiment(exp_name).step == 1
    got = counts(client, exp_name)
    assert {k: got[str(k)] for k in index_values} == {k: (float(s), float(5 - s)) for k, s in successes.items()}


def test_report_before_filtering_keeps_all_correct_and_all_wrong_groups(
    address: str, client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "bots_client")
    sampler = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))  # strict by default
    index_values = first_batch_indices(sampler)
    successes = dict(zip(index_values, [0, 4, 1, 3]))  # one all-wrong, one all-correct group
    batch = rollout_batch(index_values, successes, n=4)
    sampler.report(batch)  # right after the reward, before the filter
    kept = filter_groups(batch)
    assert len(kept.non_tensor_batch["index"]) == 8  # the filter dropped two groups
    sampler.update(kept)  # verl's hook after the step: nothing left to report, and that is no loss
    assert not caplog.records  # expected, so quiet: no error, no warning
    assert sampler.dropped_outcomes == 0
    assert (client.get_experiment(exp_name).step, client.get_experiment(exp_name).open_batches) == (1, 0)
    got = counts(client, exp_name)
    all_wrong, all_right = index_values[0], index_values[1]
    assert got[str(all_wrong)] == (0.0, 4.0) and got[str(all_right)] == (4.0, 0.0)


def test_a_failed_early_report_of_a_map_raises_in_update(
    address: str, client: bots_client.Client, exp_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trainer that reports a key -> (s, n) map before its filter: that
    # report runs in the background. On verl's last step no draw follows
    # update(), so update() itself must raise the report's failure.
    sampler = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    index_values = first_batch_indices(sampler)
    batch = rollout_batch(index_values, dict(zip(index_values, [0, 4, 1, 3])), n=4)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise bots_client.UnavailableError("server gone", grpc.StatusCode.UNAVAILABLE)

    for method in ("report_and_select", "report_outcomes"):
        monkeypatch.setattr(sampler.curriculum.client, method, unavailable)
    sampler.report(outcomes_from_batch(batch))
    with pytest.raises(bots_client.UnavailableError):
        sampler.update(filter_groups(batch))
    assert client.get_experiment(exp_name).step == 0


def test_without_the_early_report_the_filter_would_hide_the_evidence(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    # What the early report prevents: update() on a filtered batch only
    # knows the groups that survived.
    sampler = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    index_values = first_batch_indices(sampler)
    batch = rollout_batch(index_values, dict(zip(index_values, [0, 4, 1, 3])), n=4)
    sampler.update(filter_groups(batch))
    got = counts(client, exp_name)
    assert got[str(index_values[0])] == (0.0, 0.0) and got[str(index_values[1])] == (0.0, 0.0)


def test_dotted_key_field_features_and_a_non_tensor_reward(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    config = data_config(
        address, exp_name, key_field="extra_info.uid", reward_key="acc", success_threshold=None,
        feature_fields={"weak": "extra_info.weak", "strong": "extra_info.strong"},
        experiment_config={**dataclasses.asdict(EXACT), "weak_feature": "weak", "strong_feature": "strong"},
    )  # fmt: skip
    sampler = BotsCurriculumSampler(RLHFLike(), config)
    assert sampler.curriculum.keys[3] == "u-3"
    assert sampler.curriculum.features[3] == {"weak": 0.1, "strong": pytest.approx(0.15)}
    index_values = first_batch_indices(sampler)
    batch = rollout_batch(index_values, dict.fromkeys(index_values, 1), n=2)
    batch.non_tensor_batch["acc"] = np.array([0.5] * len(batch.non_tensor_batch["index"]), dtype=object)
    sampler.update(batch)
    got = counts(client, exp_name)
    # 2 x 0.5 fractional: mean 0.5 but no spread, so the posterior takes the
    # group as one that teaches nothing, on the upper side (engine/rewards.py).
    assert all(got[f"u-{k - 1000}"] == (2.0, 0.0) for k in index_values)


def test_configuration_errors_and_environment(address: str, exp_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = data_config(address, exp_name)
    del config["sampler"]["address"], config["sampler"]["experiment"]
    with pytest.raises(ValueError, match="address"):
        BotsCurriculumSampler(RLHFLike(), config)
    monkeypatch.setenv("BOTS_ADDRESS", address)
    monkeypatch.setenv("BOTS_EXPERIMENT", exp_name)
    assert BotsCurriculumSampler(RLHFLike(), config).curriculum.experiment == exp_name
    duplicate = RLHFLike()
    for row in duplicate.dataframe.rows:
        row["extra_info"]["index"] = 0  # verl's default when extra_info.index is missing
    with pytest.raises(ValueError, match="unique"):
        BotsCurriculumSampler(duplicate, data_config(address, exp_name))
    with pytest.raises(ValueError, match=r"data.sampler.strict must be true or false, got 'maybe'"):
        BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, strict="maybe"))
    assert not BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, strict="false")).strict
    # A service batch of another size than the rows verl's loader takes a
    # step: drawn twice a step (the second before the first is reported),
    # or split over steps.
    for size in (2, 8):
        with pytest.raises(ValueError, match=f"data.sampler.batch_size = {size} but verl's dataloader takes 4 rows"):
            BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, batch_size=size))
    assert BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, batch_size=4)).curriculum.batch_size == 4
    # Dataloader workers draw ahead; verl asserts it on its config path only.
    workers = {**data_config(address, exp_name), "dataloader_num_workers": 8}
    with pytest.raises(ValueError, match="data.dataloader_num_workers = 8"):
        BotsCurriculumSampler(RLHFLike(), workers)


def test_a_missing_key_column_is_an_error_at_start(address: str, exp_name: str) -> None:
    with pytest.raises(ValueError, match=r"no dataset row has the key field 'task_key': it is neither a top-level"):
        BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, key_field="task_key"))
    with pytest.raises(ValueError, match=r"12 of 12 dataset rows have no task key \['extra_info.task_key'\]"):
        BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, key_field="extra_info.task_key"))
    patchy = RLHFLike()
    del patchy.dataframe.rows[5]["extra_info"]["uid"]
    with pytest.raises(ValueError, match=r"1 of 12 dataset rows have no task key \['extra_info.uid'\] \(e.g. row 5\)"):
        BotsCurriculumSampler(patchy, data_config(address, exp_name, key_field="uid"))
    # A top-level index without extra_info.index: verl's RLHFDataset sets every
    # row's index to extra_info.index (0 where missing), so it would never arrive.
    moved = RLHFLike()
    for row in moved.dataframe.rows:
        row["index"] = row["extra_info"].pop("index")
    moved.dataframe = Frame(moved.dataframe.rows)
    with pytest.raises(ValueError, match=r"'index' is a top-level dataset column but not in extra_info"):
        BotsCurriculumSampler(moved, data_config(address, exp_name))


def test_state_dict_resumes_at_the_right_batch(address: str, exp_name: str) -> None:
    first = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    it = iter(first)
    for _ in range(8):
        next(it)
    batches = [b.keys for b in first.curriculum.open_batches]
    state = first.state_dict()
    # Before any report: the server step the run started from, so that the
    # two batches drawn and never reported are drawn again on resume.
    assert state["experiment"] == exp_name and (state["step"], state["pending"], state["acknowledged_step"]) == (
        2, [0, 1], 0)  # fmt: skip
    resumed = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    assert not resumed.curriculum.resume
    resumed.load_state_dict(state)  # a checkpoint's state: this run continues the experiment
    assert resumed.curriculum.resume
    next(iter(resumed))
    assert resumed.last_batch.number == 0 and resumed.last_batch.keys == batches[0]


# -- the real verl ---------------------------------------------------------------------


def test_real_verl_create_rl_sampler_dataloader_and_update(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    need("verl.experimental.dataset.sampler")
    need("torchdata")
    import datasets
    from omegaconf import OmegaConf
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl import DataProto
    from verl.experimental.dataset.sampler import AbstractCurriculumSampler
    from verl.trainer.main_ppo import create_rl_sampler
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    path = str(tmp_path / "train.parquet")
    rows = RLHFLike().dataframe.rows
    datasets.Dataset.from_list(rows).to_parquet(path)
    cfg = OmegaConf.create({
        **data_config(address, exp_name), "filter_overlong_prompts": False, "prompt_key": "prompt",
        "max_prompt_length": 64, "shuffle": False, "cache_dir": str(tmp_path / "cache"),
    })  # fmt: skip
    dataset = RLHFDataset(data_files=[path], tokenizer=None, config=cfg, processor=None)
    sampler = create_rl_sampler(cfg, dataset)
    assert isinstance(sampler, AbstractCurriculumSampler) and type(sampler).__name__ == "BotsCurriculumSampler"

    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=0, drop_last=True,
                                collate_fn=collate_fn)  # fmt: skip
    n = 3
    reported: list[str] = []
    for step, batch_dict in enumerate(loader):
        batch = DataProto.from_single_dict(batch_dict)
        assert [str(i) for i in batch.non_tensor_batch["index"]] == list(sampler.last_batch.keys)
        batch = batch.repeat(repeat_times=n, interleave=True)
        # the reward: prompts with an even index succeed on every rollout
        scores = torch.zeros(len(batch), 5)
        scores[:, -1] = torch.tensor([float(int(i) % 2 == 0) for i in batch.non_tensor_batch["index"]])
        batch.batch["token_level_scores"] = scores
        reported += sampler.last_batch.keys
        sampler.update(batch)
        if step == 1:
            state = loader.state_dict()
            break
    assert client.get_experiment(exp_name).step == 2

    # A new run on this experiment that does not load the checkpoint is refused at its first draw.
    fresh = create_rl_sampler(cfg, dataset)
    with pytest.raises(bots_client.ExperimentInUseError, match="already has 2 reported steps"):
        next(iter(StatefulDataLoader(dataset, batch_size=4, sampler=fresh, num_workers=0, collate_fn=collate_fn)))

    # verl's checkpoint path: a new dataloader loads data.pt and goes on at batch 2.
    again = create_rl_sampler(cfg, dataset)
    loader2 = StatefulDataLoader(dataset, batch_size=4, sampler=again, num_workers=0, drop_last=True,
                                 collate_fn=collate_fn)  # fmt: skip
    loader2.load_state_dict(state)
    next(iter(loader2))
    assert again.curriculum.resume  # set by the sampler's load_state_dict, through torchdata's
    assert again.last_batch.number == 2
    expected: dict[str, tuple[float, float]] = {}
    for key in reported:
        s, f = expected.get(key, (0.0, 0.0))
        expected[key] = (s + n, f) if int(key) % 2 == 0 else (s, f + n)
    got = counts(client, exp_name)
    assert {k: v for k, v in got.items() if v != (0.0, 0.0)} == expected


def test_real_verl_rollout_n_other_than_rollouts_per_task_is_refused_before_drawing(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    """verl hands the sampler only its data section; the sampler reads
    actor_rollout_ref.rollout.n from the trainer building it and refuses an
    experiment whose rollouts_per_task differs, naming both, before
    anything is drawn: the config given at once (RayPPOTrainer's own
    _create_dataloader), an existing experiment's at the first draw
    (main_ppo's TaskRunner.run(config) builds the sampler)."""
    need("verl.experimental.dataset.sampler")
    import datasets
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo import create_rl_sampler
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    path = str(tmp_path / "train.parquet")
    datasets.Dataset.from_list(RLHFLike().dataframe.rows).to_parquet(path)
    verl = need("verl")
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    cfg.actor_rollout_ref.rollout.n = 3
    cfg.data = OmegaConf.merge(cfg.data, {
        **data_config(address, exp_name), "filter_overlong_prompts": False, "prompt_key": "prompt",
        "max_prompt_length": 64, "shuffle": False, "cache_dir": str(tmp_path / "cache"),
    })  # fmt: skip
    dataset = RLHFDataset(data_files=[path], tokenizer=None, config=cfg.data, processor=None)
    trainer = SimpleNamespace(config=cfg, tokenizer=None, processor=None)
    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 16 but the trainer runs "
                                                     "actor_rollout_ref.rollout.n = 3 rollouts per task"):  # fmt: skip
        RayPPOTrainer._create_dataloader(trainer, dataset, dataset, None, None)
    assert exp_name not in {e.name for e in client.list_experiments()}

    client.create_experiment(exp_name, EXACT)  # rollouts_per_task = 16, continued without a config
    cfg.data.sampler.experiment_config = None

    def run(config: Any) -> Any:  # as main_ppo's TaskRunner.run(config) builds it
        return create_rl_sampler(config.data, dataset)

    sampler = run(cfg)
    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 16 but the trainer runs"):
        next(iter(sampler))
    assert client.get_experiment(exp_name).open_batches == 0
    # Matching: the run goes on.
    cfg.actor_rollout_ref.rollout.n = 16
    next(iter(run(cfg)))
    assert client.get_experiment(exp_name).open_batches == 1


def test_verl_is_not_needed_for_the_contract() -> None:
    # Without verl the class falls back to torch's Sampler; with it, verl's base.
    cls = BotsCurriculumSampler
    assert issubclass(cls, torch.utils.data.Sampler)
    for name in ("__iter__", "__len__", "update", "state_dict", "load_state_dict"):
        assert callable(getattr(cls, name))
    if os.environ.get("BOTS_EXPECT_VERL"):
        from verl.experimental.dataset.sampler import AbstractCurriculumSampler

        assert issubclass(cls, AbstractCurriculumSampler)


def test_group_field_puts_each_task_in_its_data_source(address: str, client: bots_client.Client, exp_name: str) -> None:
    dataset = RLHFLike()
    for i, row in enumerate(dataset.dataframe.rows):
        row["data_source"] = "gsm8k" if i < 8 else "math"
    sampler = BotsCurriculumSampler(dataset, data_config(address, exp_name, group_field="data_source"))
    assert sampler.curriculum.groups == ["gsm8k"] * 8 + ["math"] * 4
    sampler.curriculum.ensure_ready()
    assert [(g.name, g.num_tasks) for g in client.list_groups(exp_name)] == [("gsm8k", 8), ("math", 4)]
    client.set_group_shares(exp_name, {"gsm8k": 0.5, "math": 0.5})
    keys = sampler.curriculum.select(0, batch_size=4).keys
    by_source = sorted(dataset.dataframe.rows[int(k) - 1000]["data_source"] for k in keys)
    assert by_source == ["gsm8k", "gsm8k", "math", "math"]


# -- exactly once across resume (verl's fit-loop order, torchdata's real loader) --------


def verl_fit(
    sampler: Any,
    *,
    start: int,
    epochs: int,
    checkpoint: dict[str, Any] | None = None,
    save_at: int | None = None,
    crash: str | None = None,
) -> dict[str, Any] | None:
    """RayPPOTrainer.fit's order around the sampler: for each batch of a
    StatefulDataLoader, roll out, save the checkpoint (the dataloader's
    state) when due, *then* call `sampler.update(batch)`. Steps count from 1
    like verl's global_steps, epochs from global_steps // len(loader), and
    the step budget is epochs * len(loader) (ray_trainer.py); `crash`
    ("before_update" or "after_update") stops the run at the checkpoint of
    step `save_at`."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(RLHFLike(), batch_size=4, sampler=sampler, num_workers=0, drop_last=True,
                                collate_fn=lambda rows: rows)  # fmt: skip
    if checkpoint is not None:
        loader.load_state_dict(checkpoint)
    global_steps = start
    total = epochs * len(loader)
    for _epoch in range(start // len(loader), epochs):
        for rows in loader:
            global_steps += 1
            index_values = [r["index"] for r in rows]
            batch = rollout_batch(index_values, {i: i % 3 for i in index_values}, n=3)
            state = None
            if global_steps == save_at:
                state = pickle.loads(pickle.dumps(loader.state_dict()))
                if crash == "before_update":
                    return state
            sampler.update(batch)
            if state is not None and crash == "after_update":
                return state
            if global_steps >= total:
                return None
    return None


def test_resume_from_verl_checkpoints_reports_every_batch_once(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    need("torchdata")
    from tests.integrations.test_torch import recorded

    epochs = 3  # of 3 batches
    total = 9
    ref = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name + "-ref"))
    reference = recorded(ref)
    verl_fit(ref, start=0, epochs=epochs)
    assert [(k, s) for k, s, _ in reference] == [(f"step-{i}", i) for i in range(total)]
    ref_snap = client.snapshot(exp_name + "-ref")
    # Before the update at the first step (no report yet), mid-epoch, and at
    # an epoch's last step (the batch drawn again opens the next epoch).
    cases = [(1, "before_update"), (3, "after_update"), (3, "before_update"), (4, "before_update"),
             (5, "after_update"), (6, "before_update")]  # fmt: skip
    for save_at, crash in cases:
        name = f"{exp_name}-{save_at}-{crash}"
        first = BotsCurriculumSampler(RLHFLike(), data_config(address, name))
        first_selections = recorded(first)
        checkpoint = verl_fit(first, start=0, epochs=epochs, save_at=save_at, crash=crash)
        resumed = BotsCurriculumSampler(RLHFLike(), data_config(address, name))
        selections = recorded(resumed)
        verl_fit(resumed, start=save_at, epochs=epochs, checkpoint=checkpoint)
        if crash == "before_update":
            # Batch save_at - 1 trained, checkpointed, never reported: drawn
            # again (same request key, same tasks) and reported once. verl
            # counts it as one more step, so its step budget ends one batch early.
            assert selections[0] == first_selections[-1] == reference[save_at - 1]
            assert selections == reference[save_at - 1 : total - 1], (save_at, crash)
            expected_step = total - 1
        else:
            assert selections == reference[save_at:], (save_at, crash)
            expected_step = total
        assert first_selections == reference[:save_at]
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (expected_step, 0), (save_at, crash)
        if expected_step == total:
            snap = client.snapshot(name)
            assert list(snap.alpha) == list(ref_snap.alpha) and list(snap.beta) == list(ref_snap.beta)


# -- keys: where verl 0.7 leaves them -------------------------------------------------


def agent_loop_batch(rows: list[dict[str, Any]], successes: list[int], n: int) -> SimpleNamespace:
    """The batch `update()` gets under verl 0.7's default agent loop
    (async rollout): RayPPOTrainer._get_gen_batch moved every non-tensor
    column but data_source, reward_model, extra_info and uid into the
    generation batch, the agent loop returned only its own fields
    (__num_turns__, reward extras), uid is a fresh uuid per prompt."""
    rep = [(r, j < s) for r, s in zip(rows, successes) for j in range(n)]
    scores = torch.zeros(len(rep), 4)
    scores[:, -1] = torch.tensor([float(ok) for _, ok in rep])
    column = lambda values: np.array(values, dtype=object)  # noqa: E731
    return SimpleNamespace(
        batch={"token_level_scores": scores},
        non_tensor_batch={
            "data_source": column([r["data_source"] for r, _ in rep]),
            "reward_model": column([r["reward_model"] for r, _ in rep]),
            "extra_info": column([r["extra_info"] for r, _ in rep]),
            "uid": column([f"uuid-{id(r)}" for r, _ in rep]),
            "__num_turns__": np.array([2] * len(rep), dtype=np.int32),
        },
        meta_info={},
    )


def drawn_rows(sampler: Any, dataset: RLHFLike) -> list[dict[str, Any]]:
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=lambda rows: rows)
    return next(iter(loader))


def test_keys_are_found_where_the_default_agent_loop_leaves_them(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    sampler = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))  # key_field: index
    rows = drawn_rows(sampler, RLHFLike())
    sampler.update(agent_loop_batch(rows, [0, 1, 2, 3], n=3))  # no top-level "index" any more
    got = counts(client, exp_name)
    assert [got[str(r["index"])] for r in rows] == [(0.0, 3.0), (1.0, 2.0), (2.0, 1.0), (3.0, 0.0)]
    assert client.get_experiment(exp_name).step == 1


def test_two_data_files_keyed_by_data_source_and_index(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    mix = RLHFLike(n=6, index_offset=0, sources=("openai/gsm8k", "lighteval/MATH"))  # both index from 0
    with pytest.raises(ValueError, match=r"key_field=\[data_source,index\]"):
        BotsCurriculumSampler(mix, data_config(address, exp_name))
    sampler = BotsCurriculumSampler(mix, data_config(address, exp_name, key_field=["data_source", "index"]))
    assert sampler.curriculum.keys[:2] == ["openai/gsm8k:0", "openai/gsm8k:1"]
    assert sampler.curriculum.keys[6:8] == ["lighteval/MATH:0", "lighteval/MATH:1"]
    expected: dict[str, tuple[float, float]] = {}
    loader = DataLoader(mix, batch_size=4, sampler=sampler, collate_fn=lambda rows: rows)
    for rows in itertools.islice(loader, 3):  # each file's rows reported under their own keys
        keys = [f"{r['data_source']}:{r['extra_info']['index']}" for r in rows]
        assert keys == list(sampler.last_batch.keys)
        sampler.update(agent_loop_batch(rows, [2, 0, 1, 0], n=2))
        for key, s in zip(keys, [2.0, 0.0, 1.0, 0.0]):
            prev = expected.get(key, (0.0, 0.0))
            expected[key] = (prev[0] + s, prev[1] + 2.0 - s)
    got = counts(client, exp_name)
    assert {k: v for k, v in got.items() if v != (0.0, 0.0)} == {k: v for k, v in expected.items() if v != (0, 0)}
    assert client.get_experiment(exp_name).step == 3


def test_a_key_the_batch_does_not_carry_is_an_error_not_a_silent_drop(
    address: str, client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    dataset = RLHFLike()
    for i, row in enumerate(dataset.dataframe.rows):
        row["task_key"] = f"t-{i}"  # a top-level column: the agent loop drops it
    dataset.dataframe = Frame(dataset.dataframe.rows)
    caplog.set_level(logging.WARNING, "bots_client.integrations.verl")
    sampler = BotsCurriculumSampler(dataset, data_config(address, exp_name, key_field="task_key"))
    assert "drops it before update()" in caplog.text  # warned at start-up
    rows = drawn_rows(sampler, dataset)
    with pytest.raises(KeyError, match=r"12 of 12 rollout rows have no task key \['task_key'\].*extra_info"):
        sampler.update(agent_loop_batch(rows, [1, 1, 1, 1], n=3))
    assert client.get_experiment(exp_name).step == 0


def stray_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A batch whose first two rows cannot be attributed: one task of the
    dataset that this run never drew, one task not in the dataset at all."""
    stale = dict(rows[0], extra_info={**rows[0]["extra_info"], "index": 1000 + 11})  # never drawn
    foreign = dict(rows[1], extra_info={**rows[1]["extra_info"], "index": 99})  # not in the dataset
    return [rows[2], rows[3], stale, foreign]


def test_outcomes_that_cannot_be_attributed_raise_by_default(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    sampler = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    rows = drawn_rows(sampler, RLHFLike())
    assert "1011" not in sampler.last_batch.keys
    with pytest.raises(UnattributedOutcomesError) as raised:
        sampler.update(agent_loop_batch(stray_rows(rows), [1, 1, 1, 1], n=2))
    message = str(raised.value)
    assert "update(): 2 of 4 reported task outcomes" in message and "in no open batch" in message
    assert "['1011', '99']" in message  # which tasks
    assert "1 of these keys are not in this dataset at all (e.g. ['99'])" in message  # the cause
    assert "data.sampler.strict=false" in message and "sampler.report(batch)" in message  # the fixes
    # Raised before anything was sent: the batch is still open, and the right rollouts report it.
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (0, 1)
    assert sampler.dropped_outcomes == 0
    sampler.update(agent_loop_batch(rows, [1, 1, 1, 1], n=2))
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (1, 0)


def test_lenient_sampler_drops_and_counts_what_it_cannot_attribute(
    address: str, client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "bots_client")
    config = data_config(address, exp_name, strict=False, tracking=["console"])  # data.sampler.strict: false
    sampler = BotsCurriculumSampler(RLHFLike(), config)
    assert not sampler.strict and not sampler.curriculum.strict
    rows = drawn_rows(sampler, RLHFLike())
    sampler.update(agent_loop_batch(stray_rows(rows), [1, 2, 2, 2], n=2))
    assert sampler.dropped_outcomes == sampler.curriculum.dropped_outcomes == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "2 of 4 reported task outcomes" in errors[0] and "dropped" in errors[0]
    # The rest is reported: rows 2 and 3 of batch 0 (rows 0 and 1 count as not selected).
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (1, 0)
    got = counts(client, exp_name)
    assert [got[str(r["index"])] for r in rows] == [(0.0, 0.0), (0.0, 0.0), (1.0, 1.0), (2.0, 0.0)]
    assert (got["1011"], got["1000"]) == ((0.0, 0.0), (0.0, 0.0))
    # The count reaches the tracking backends with every step's signals.
    signals = sampler.curriculum.last_signals
    assert signals is not None and signals.dropped_outcomes == 2
    assert signals.as_dict()["curriculum/dropped_outcomes"] == 2.0
    assert "curriculum/dropped_outcomes=2" in caplog.text  # the console backend


# -- where a key field is read from: the same place at start and in update() --------


def with_columns(top: Any = None, inner: Any = None) -> RLHFLike:
    """RLHFLike with extra top-level columns `top(i)` and extra_info fields `inner(i)`."""
    dataset = RLHFLike()
    for i, row in enumerate(dataset.dataframe.rows):
        row.update(top(i) if top else {})
        row["extra_info"].update(inner(i) if inner else {})
    dataset.dataframe = Frame(dataset.dataframe.rows)
    return dataset


def test_a_top_level_index_that_differs_from_extra_info_index_raises_at_start(address: str, exp_name: str) -> None:
    # The reported bug: keys from the top-level column at selection, from
    # extra_info in update(), so every step's outcomes matched no open batch.
    dataset = with_columns(top=lambda i: {"index": i})  # extra_info.index is 1000 + i
    with pytest.raises(ValueError) as raised:
        BotsCurriculumSampler(dataset, data_config(address, exp_name))
    message = str(raised.value)
    assert "key field 'index' is both a top-level dataset column and a field of extra_info" in message
    assert "12 of 12 rows differ; e.g. row 0: index = 0 but extra_info.index = 1000" in message
    assert "RLHFDataset replaces each row's top-level index with extra_info.index" in message
    assert "data.sampler.key_field=extra_info.index" in message  # the fix
    sampler = BotsCurriculumSampler(dataset, data_config(address, exp_name, key_field="extra_info.index"))
    assert sampler.key_locations == ["extra_info.index"] and sampler.curriculum.keys[0] == "1000"
    with pytest.raises(ValueError, match=r"key_field=\[data_source,extra_info.index\]"):
        BotsCurriculumSampler(dataset, data_config(address, exp_name, key_field=["data_source", "index"]))


def test_a_task_key_column_that_differs_from_extra_info_raises_at_start(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    dataset = with_columns(top=lambda i: {"task_key": f"t-{i}"}, inner=lambda i: {"task_key": f"e-{i}"})
    with pytest.raises(ValueError) as raised:
        BotsCurriculumSampler(dataset, data_config(address, exp_name, key_field="task_key"))
    message = str(raised.value)
    assert "key field 'task_key' is both a top-level dataset column and a field of extra_info" in message
    assert "row 0: task_key = 't-0' but extra_info.task_key = 'e-0'" in message
    assert "a top-level column other than data_source, reward_model, extra_info does not survive" in message
    assert "data.sampler.key_field=extra_info.task_key" in message
    sampler = BotsCurriculumSampler(dataset, data_config(address, exp_name, key_field="extra_info.task_key"))
    rows = drawn_rows(sampler, dataset)
    sampler.update(agent_loop_batch(rows, [1, 0, 1, 0], n=2))
    assert all(k.startswith("e-") for k in sampler.curriculum.keys)  # the extra_info copy, as named
    assert (client.get_experiment(exp_name).step, client.get_experiment(exp_name).open_batches) == (1, 0)


@pytest.mark.parametrize("key_field", ["index", "task_key"])
def test_key_columns_in_both_places_with_equal_values_report_every_step(
    address: str, client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture, key_field: str
) -> None:
    caplog.set_level(logging.WARNING, "bots_client")
    dataset = with_columns(
        top=lambda i: {"index": 1000 + i, "task_key": f"t-{i}"}, inner=lambda i: {"task_key": f"t-{i}"}
    )
    sampler = BotsCurriculumSampler(dataset, data_config(address, exp_name, key_field=key_field))
    assert sampler.key_locations == [f"extra_info.{key_field}"]  # the copy that survives to update()
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=lambda rows: rows)
    for rows in itertools.islice(loader, 3):
        sampler.update(agent_loop_batch(rows, [0, 1, 2, 2], n=2))  # top-level columns gone, as under verl 0.7
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (3, 0)
    assert not caplog.records and sampler.dropped_outcomes == 0


# -- one experiment per run ------------------------------------------------------------


def test_a_new_run_on_a_used_experiment_raises_unless_it_continues(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    first = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    first.update(agent_loop_batch(drawn_rows(first, RLHFLike()), [1, 1, 0, 0], n=2))
    assert client.get_experiment(exp_name).step == 1
    # A second run on the same experiment without its checkpoint (a copied
    # command line): refused at the first draw, not mixed into the first run.
    fresh = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    with pytest.raises(bots_client.ExperimentInUseError, match="already has 1 reported steps"):
        drawn_rows(fresh, RLHFLike())
    other_config = {**dataclasses.asdict(EXACT), "target_success": 0.3}
    changed = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, experiment_config=other_config))
    with pytest.raises(bots_client.ConfigMismatchError, match="target_success"):
        drawn_rows(changed, RLHFLike())
    assert client.get_experiment(exp_name).step == 1
    # Continuing on purpose without a checkpoint: data.sampler.resume (with a
    # request prefix of its own, so it does not get the first run's batches back).
    going_on = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, resume=True, request_prefix="run2"))
    rows = drawn_rows(going_on, RLHFLike())
    assert going_on.last_batch.request_key == "run2-0"
    going_on.update(agent_loop_batch(rows, [1, 1, 0, 0], n=2))
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (2, 0)


def test_curriculum_signals_go_to_verls_tensorboard_directory(
    address: str, exp_name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integrations.test_torch import read_scalars

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path))  # where verl's own TensorBoard logger writes
    sampler = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, tracking=["tensorboard", "console"]))
    loader = DataLoader(RLHFLike(), batch_size=4, sampler=sampler, collate_fn=lambda rows: rows)
    expected = []
    for rows in itertools.islice(loader, 2):
        successes = [0, 1, 3, 3]
        sampler.update(agent_loop_batch(rows, successes, n=3))
        expected.append((sum(successes) / 12, sum(0 < s < 3 for s in successes) / 4))
    scalars = read_scalars(tmp_path)
    assert scalars["curriculum/batch_success_rate"] == [(1, pytest.approx(expected[0][0])),
                                                        (2, pytest.approx(expected[1][0]))]  # fmt: skip
    assert [v for _, v in scalars["curriculum/informative_fraction"]] == pytest.approx([e[1] for e in expected])
    with pytest.raises(ValueError, match="unknown backends"):
        BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name, tracking=["mlflow"]))


def test_real_verl_two_data_files_keyed_by_data_source_and_index(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    need("verl.experimental.dataset.sampler")
    import datasets
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.main_ppo import create_rl_sampler
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    paths = []
    for source in ("openai/gsm8k", "lighteval/MATH"):  # two files, each numbering extra_info.index from 0
        path = str(tmp_path / f"{source.split('/')[1]}.parquet")
        datasets.Dataset.from_list(RLHFLike(n=6, index_offset=0, sources=(source,)).dataframe.rows).to_parquet(path)
        paths.append(path)

    def config(**sampler: Any) -> Any:
        return OmegaConf.create({
            **data_config(address, exp_name, **sampler), "filter_overlong_prompts": False, "prompt_key": "prompt",
            "max_prompt_length": 64, "shuffle": False, "cache_dir": str(tmp_path / "cache"),
        })  # fmt: skip

    dataset = RLHFDataset(data_files=paths, tokenizer=None, config=config(), processor=None)
    with pytest.raises(ValueError, match="data_source"):
        create_rl_sampler(config(), dataset)
    sampler = create_rl_sampler(config(key_field=["data_source", "index"]), dataset)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=collate_fn)
    rows = DataProto.from_single_dict(next(iter(loader)))
    sources, infos = rows.non_tensor_batch["data_source"], rows.non_tensor_batch["extra_info"]
    keys = [f"{s}:{e['index']}" for s, e in zip(sources, infos)]
    assert keys == list(sampler.last_batch.keys)
    # What update() gets under the agent loop: data_source, reward_model, extra_info (and a fresh uid).
    batch = rows.repeat(repeat_times=2, interleave=True)
    dropped = [k for k in batch.non_tensor_batch if k not in ("data_source", "reward_model", "extra_info")]
    batch.pop(non_tensor_batch_keys=dropped)
    batch.batch["token_level_scores"] = torch.ones(len(batch), 3)
    sampler.update(batch)
    got = counts(client, exp_name)
    assert {k: got[k] for k in keys} == dict.fromkeys(keys, (2.0, 0.0))


# -- verl's default agent loop, run for real: only the inference server stands in -------

N_ROLLOUTS = 3


_ACTORS: dict[int, Any] = {}


def _actor_handle(key: int) -> RayHandle:
    return RayHandle(_ACTORS[key])


class RayHandle:
    """A Ray actor handle's calling convention over a local object:
    `handle.method.remote(...)` is awaitable; arguments and results are
    copied (pickled) as Ray copies them between processes, and a handle
    copies as a handle (to the same actor)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        _ACTORS[id(obj)] = obj

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _actor_handle, (id(self._obj),)

    def __getattr__(self, name: str) -> SimpleNamespace:
        if name.startswith("__"):
            raise AttributeError(name)
        method = getattr(self._obj, name)

        async def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
            result = method(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            return pickle.loads(pickle.dumps(result))

        return SimpleNamespace(remote=lambda *args, **kwargs: asyncio.ensure_future(call(args, kwargs)))


class RolloutServer:
    """Stands in for the vLLM/SGLang server behind the agent loop (its
    `generate` is all verl calls). The prompt is "<tag> <i>"; the answer is
    in that data source's format (gsm8k "#### 2i", MATH "\\boxed{2i}") and
    right on i % 4 of each prompt's 3 rollouts, wrong (2i+1) on the rest."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: collections.Counter[tuple[str, int]] = collections.Counter()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None) -> Any:  # fmt: skip
        from verl.workers.rollout.replica import TokenOutput

        tag, i = self.tokenizer.decode(prompt_ids).split()[:2]
        rollout = self.calls[(tag, int(i))] % N_ROLLOUTS
        self.calls[(tag, int(i))] += 1
        answer = 2 * int(i) + (0 if rollout < int(i) % 4 else 1)
        text = f"#### {answer}" if tag == "gsm8k" else f"\\boxed{{{answer}}}"
        return TokenOutput(token_ids=self.tokenizer.encode(text), stop_reason="completed")


def tiny_tokenizer_dir(path: Any) -> Any:
    """A word-level tokenizer with a chat template and a one-layer model
    config, saved where verl's HFModelConfig loads them from."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]", "####", "gsm8k", "math"]
    words += [str(i) for i in range(40)] + [f"\\boxed{{{i}}}" for i in range(40)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    GPT2Config(vocab_size=len(words), n_positions=64, n_embd=8, n_layer=1, n_head=2, architectures=["GPT2LMHeadModel"],
               bos_token_id=2, eos_token_id=2, pad_token_id=0).save_pretrained(path)  # fmt: skip
    return tokenizer


def agent_loop_files(tmp_path: Any, sources: dict[str, str], top: Any = None, inner: Any = None) -> list[str]:
    """One parquet file per data source (source -> prompt tag), each numbering
    extra_info.index from 0, as verl's gsm8k/MATH preprocessing scripts do;
    `top(i)` and `inner(i)` add top-level columns and extra_info fields."""
    import datasets

    paths = []
    for source, tag in sources.items():
        rows = [{"data_source": source, "prompt": [{"role": "user", "content": f"{tag} {i}"}],
                 "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                 "extra_info": {"index": i, "split": "train", **(inner(i) if inner else {})},
                 **(top(i) if top else {})} for i in range(8)]  # fmt: skip
        paths.append(str(tmp_path / f"{tag}.parquet"))
        datasets.Dataset.from_list(rows).to_parquet(paths[-1])
    return paths


def run_fit_through_agent_loop(
    tmp_path: Any,
    address: str,
    exp_name: str,
    sources: dict[str, str],
    steps: int,
    *,
    top: Any = None,
    inner: Any = None,
    **sampler_config: Any,
) -> list[tuple[list[str], list[str], Any]]:
    """verl 0.7.1's RayPPOTrainer.fit from the data loader to
    `sampler.update(batch)`, with verl's own objects: RLHFDataset,
    create_rl_sampler, _get_gen_batch, AgentLoopManager.generate_sequences ->
    AgentLoopWorker -> the default single_turn_agent loop -> the reward loop
    (RewardLoopWorker, naive manager, default_compute_score: verl's gsm8k
    and MATH scorers), union, extract_reward. Ray is replaced by in-process
    handles and the inference server by RolloutServer. Returns, per step,
    the keys the sampler drew, the keys of the loader's rows, and the batch
    `update()` got. `top` and `inner` add columns (`agent_loop_files`)."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker, GlobalRequestLoadBalancer
    from verl.experimental.reward_loop import RewardLoopWorker, migrate_legacy_reward_impl
    from verl.trainer.main_ppo import create_rl_sampler
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    tokenizer = tiny_tokenizer_dir(tmp_path / "model")
    verl = need("verl")
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    cfg.actor_rollout_ref.model.path = str(tmp_path / "model")
    cfg.actor_rollout_ref.rollout.name = "vllm"  # the server it would start; RolloutServer stands in
    cfg.actor_rollout_ref.rollout.n = N_ROLLOUTS
    cfg.data = OmegaConf.merge(cfg.data, {
        **data_config(address, exp_name, **sampler_config),
        "train_files": agent_loop_files(tmp_path, sources, top, inner),
        "max_prompt_length": 8, "max_response_length": 4, "shuffle": False, "filter_overlong_prompts": False,
        "cache_dir": str(tmp_path / "cache"),
    })  # fmt: skip
    cfg = migrate_legacy_reward_impl(cfg)  # as main_ppo does
    dataset = RLHFDataset(data_files=list(cfg.data.train_files), tokenizer=tokenizer, config=cfg.data, processor=None)
    sampler = create_rl_sampler(cfg.data, dataset)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=collate_fn)

    async def fit() -> list[tuple[list[str], list[str], Any]]:
        # The default trainer has no reward model, so the agent loop streams rewards to the reward loop workers.
        balancer = GlobalRequestLoadBalancer.__ray_actor_class__(server_actor_ids=["server-0"])
        worker = AgentLoopWorker(cfg, [("server-0", RayHandle(RolloutServer(tokenizer)))], RayHandle(balancer),
                                 [RayHandle(RewardLoopWorker(cfg))])  # fmt: skip
        manager = AgentLoopManager.__new__(AgentLoopManager)  # without starting servers: only its dispatch
        manager.agent_loop_workers = [RayHandle(worker)]
        seen = []
        for step, batch_dict in enumerate(itertools.islice(loader, steps), start=1):
            batch = DataProto.from_single_dict(batch_dict)
            rows = [f"{s}:{e['index']}" for s, e in zip(batch.non_tensor_batch["data_source"],
                                                         batch.non_tensor_batch["extra_info"])]  # fmt: skip
            batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
            gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # `self` is not used
            gen_batch.meta_info["global_steps"] = step
            gen_batch_output = await manager.generate_sequences(gen_batch.repeat(N_ROLLOUTS, interleave=True))
            batch = batch.repeat(repeat_times=N_ROLLOUTS, interleave=True).union(gen_batch_output)
            batch.batch["token_level_scores"], _ = extract_reward(batch)
            drawn = list(sampler.last_batch.keys)
            sampler.update(batch=batch)
            seen.append((drawn, rows, batch))
        return seen

    return asyncio.run(fit())


def expected_counts(drawn_per_step: list[list[str]]) -> dict[str, tuple[float, float]]:
    """RolloutServer's outcomes: task i right on i % 4 of its 3 rollouts per draw."""
    expected: dict[str, tuple[float, float]] = {}
    for keys in drawn_per_step:
        for key in keys:
            right = float(int(key.rsplit(":", 1)[-1]) % 4)
            s, f = expected.get(key, (0.0, 0.0))
            expected[key] = (s + right, f + N_ROLLOUTS - right)
    return expected


def test_real_verl_default_agent_loop_keys_reach_update(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    need("verl.experimental.agent_loop")
    seen = run_fit_through_agent_loop(tmp_path, address, exp_name, {"openai/gsm8k": "gsm8k"}, steps=2)
    for drawn, rows, batch in seen:
        assert [f"openai/gsm8k:{k}" for k in drawn] == rows  # default key_field: extra_info.index
        assert "index" not in batch.non_tensor_batch  # the agent loop left it only inside extra_info
        assert len(batch) == 4 * N_ROLLOUTS
    got = counts(client, exp_name)
    expected = expected_counts([[f"x:{k}" for k in drawn] for drawn, _, _ in seen])
    assert {k: got[k.split(":")[1]] for k in expected} == expected
    assert any(0 < s < N_ROLLOUTS for s, _ in expected.values())  # the rewards are not all alike
    assert client.get_experiment(exp_name).step == 2


def test_real_verl_default_agent_loop_two_files_keyed_by_data_source_and_index(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any
) -> None:
    need("verl.experimental.agent_loop")
    sources = {"openai/gsm8k": "gsm8k", "lighteval/MATH": "math"}  # both number extra_info.index from 0
    seen = run_fit_through_agent_loop(tmp_path, address, exp_name, sources, steps=4,
                                      key_field=["data_source", "index"])  # fmt: skip
    for drawn, rows, _ in seen:
        assert drawn == rows
    drawn_sources = {key.split(":")[0] for drawn, _, _ in seen for key in drawn}
    assert drawn_sources == set(sources)  # both files' rows went through the loop
    got = counts(client, exp_name)
    expected = expected_counts([drawn for drawn, _, _ in seen])
    assert {k: got[k] for k in expected} == expected
    assert client.get_experiment(exp_name).step == 4


@pytest.mark.parametrize("key_field", ["index", "task_key"])
def test_real_verl_agent_loop_key_in_two_places(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Any, key_field: str
) -> None:
    # The reported bug, through verl's own dataset, agent loop and reward loop:
    # a top-level column named like an extra_info field, with other values.
    need("verl.experimental.agent_loop")
    sources = {"openai/gsm8k": "gsm8k"}
    differ, same = tmp_path / "differ", tmp_path / "same"
    differ.mkdir()
    same.mkdir()
    top, inner = {  # extra_info.index is i
        "index": (lambda i: {"index": 100 + i}, None),
        "task_key": (lambda i: {"task_key": f"t:{i}"}, lambda i: {"task_key": f"q:{i}"}),
    }[key_field]
    with pytest.raises(ValueError, match=rf"key field '{key_field}' is both a top-level dataset column and a field "
                                         rf"of extra_info.*key_field=extra_info.{key_field}"):  # fmt: skip
        run_fit_through_agent_loop(differ, address, exp_name, sources, steps=2, key_field=key_field, top=top,
                                   inner=inner)  # fmt: skip
    # The same values in both places: read from extra_info, which reaches update(); every step is reported.
    seen = run_fit_through_agent_loop(same, address, exp_name, sources, steps=2, key_field=key_field,
                                      top=lambda i: {"index": i, "task_key": f"q:{i}"},
                                      inner=lambda i: {"task_key": f"q:{i}"})  # fmt: skip
    for _, _, batch in seen:
        assert "index" not in batch.non_tensor_batch and "task_key" not in batch.non_tensor_batch  # dropped
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (2, 0)  # every step reported, no batch left open
    got = counts(client, exp_name)
    expected = expected_counts([drawn for drawn, _, _ in seen])
    assert {k: got[k] for k in expected} == expected
