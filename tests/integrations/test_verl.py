"""bots_client.integrations.verl.

verl cannot join the project's test environment (every verl release pins
numpy < 2), so most tests drive the sampler with verl's data shapes, taken
from verl 0.7.1's sources: a DataProto has `.batch` (a TensorDict of
[rows, ...] tensors; "token_level_scores" is [rows, response_len] with the
sequence score on the last response token) and `.non_tensor_batch` (numpy
object arrays; "index" is extra_info.index, copied by RLHFDataset); rollouts
are `repeat(n, interleave=True)` and `balance_batch` reorders rows. The last
tests run verl itself (create_rl_sampler, RLHFDataset, StatefulDataLoader,
DataProto) where verl is installed.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import bots_client
from tests.integrations.conftest import EXACT, counts, need

torch = need("torch")
from torch.utils.data import DataLoader

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
    """verl's RLHFDataset rows: prompt, data_source, reward_model, extra_info."""

    def __init__(self, n: int = N_ROWS, index_offset: int = 1000) -> None:
        rows = []
        for i in range(n):
            rows.append({
                "data_source": "synthetic/add",
                "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                "extra_info": {"index": index_offset + i, "uid": f"u-{i}", "weak": 0.1, "strong": 0.05 * i},
            })  # fmt: skip
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
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    sampler = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    index_values = first_batch_indices(sampler)
    successes = dict(zip(index_values, [0, 4, 1, 3]))  # one all-wrong, one all-correct group
    batch = rollout_batch(index_values, successes, n=4)
    sampler.report(batch)  # right after the reward, before the filter
    kept = filter_groups(batch)
    assert len(kept.non_tensor_batch["index"]) == 8  # the filter dropped two groups
    sampler.update(kept)  # verl's hook after the step: nothing left to report
    assert client.get_experiment(exp_name).step == 1
    got = counts(client, exp_name)
    all_wrong, all_right = index_values[0], index_values[1]
    assert got[str(all_wrong)] == (0.0, 4.0) and got[str(all_right)] == (4.0, 0.0)


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
    assert all(got[f"u-{k - 1000}"] == (1.0, 1.0) for k in index_values)  # 2 x 0.5 fractional


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


def test_state_dict_resumes_at_the_right_batch(address: str, exp_name: str) -> None:
    first = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    it = iter(first)
    for _ in range(8):
        next(it)
    batches = [b.keys for b in first.curriculum.open_batches]
    state = first.state_dict()
    assert state["experiment"] == exp_name and state["step"] == 2
    resumed = BotsCurriculumSampler(RLHFLike(), data_config(address, exp_name))
    resumed.load_state_dict(state)
    next(iter(resumed))
    assert resumed.last_batch.number == 2 and resumed.last_batch.keys not in batches


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

    # verl's checkpoint path: a new dataloader loads data.pt and goes on at batch 2.
    again = create_rl_sampler(cfg, dataset)
    loader2 = StatefulDataLoader(dataset, batch_size=4, sampler=again, num_workers=0, drop_last=True,
                                 collate_fn=collate_fn)  # fmt: skip
    loader2.load_state_dict(state)
    next(iter(loader2))
    assert again.last_batch.number == 2
    expected: dict[str, tuple[float, float]] = {}
    for key in reported:
        s, f = expected.get(key, (0.0, 0.0))
        expected[key] = (s + n, f) if int(key) % 2 == 0 else (s, f + n)
    got = counts(client, exp_name)
    assert {k: v for k, v in got.items() if v != (0.0, 0.0)} == expected


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
