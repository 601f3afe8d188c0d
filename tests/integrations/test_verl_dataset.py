"""bots_client.integrations.verl_dataset: the verl 0.9 adapter.

The first tests drive `DatasetBatches` (the framework-free part: numbering,
drawing, reporting, checkpoints) against the real server, in any
environment. The `test_real_verl_*` tests run verl 0.9.1 itself (its own
environment: `.venv-verl09`, tests/integrations/verl09-constraints.txt):
the v1 trainer's real `PPOTrainerSync.fit` loop on CPU, through
`create_rl_dataset` (data.custom_cls -> BotsRLDataset), `create_rl_sampler`,
`StatefulDataLoader`, `_next_train_batch` / `_submit_batch_to_rollout`, verl's
`AgentLoopWorkerTQ` with the default single-turn agent loop, the reward loop
(`RewardLoopWorker`, verl's gsm8k and MATH scorers), a real TransferQueue
(on a local Ray), `_build_replay_buffer` (trainer.v1.sampler.custom_sampler ->
BotsReplayBuffer), `_balance_batch`, `_compute_advantage`, `_compute_metrics`,
`_save_checkpoint` / `_load_checkpoint` (data.pt) and verl's Tracking
(TensorBoard). Standing in: the inference server (`RolloutServer`), the
actor worker group (no model: zero log-probs, no update) and the weight sync;
the agent loop worker runs in this process instead of a Ray actor.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import pickle
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import bots_client
from bots_client.integrations import GroupSizeMismatchError, UnattributedOutcomesError
from bots_client.integrations._core import Curriculum
from bots_client.integrations.verl_dataset import (
    BATCH_FIELD,
    KEY_FIELD,
    LEGACY_TRAINER,
    DatasetBatches,
    UnreportedBatchError,
    dataframe_keys,
    trajectory_sessions,
)
from tests.integrations.conftest import EXACT, counts, need
from tests.integrations.test_verl import RayHandle, tiny_tokenizer_dir

N_TASKS = 12
N_ROLLOUTS = 3
# The experiment of a run of N_ROLLOUTS rollouts per prompt (actor_rollout_ref.rollout.n).
EXACT_N = dataclasses.replace(EXACT, rollouts_per_task=N_ROLLOUTS)


def curriculum(address: str, experiment: str, **kwargs: Any) -> Curriculum:
    keys = kwargs.pop("keys", [f"t{i}" for i in range(N_TASKS)])
    return Curriculum(address, experiment, keys, batch_size=4, config=EXACT, rank=0, world_size=1, **kwargs)


def successes_of(key: str) -> int:
    """The stand-in verifier: task i succeeds on i % 4 of its 3 rollouts."""
    return min(int(key.rsplit(":", 1)[-1].lstrip("t")) % 4, N_ROLLOUTS)


def rollouts(selected: Any) -> tuple[list[int], list[str], list[float]]:
    numbers, keys, rewards = [], [], []
    for key in selected.keys:
        for j in range(N_ROLLOUTS):
            numbers.append(selected.number)
            keys.append(key)
            rewards.append(1.0 if j < successes_of(key) else 0.0)
    return numbers, keys, rewards


def run_items(batches: DatasetBatches, items: range, *, report: bool = True) -> list[Any]:
    """Fetch items in order like verl's sequential sampler; report each
    batch once its last item was fetched (the sync trainer's order)."""
    drawn = []
    for i in items:
        selected, position = batches.item(i)
        if position == batches.batch_size - 1:
            drawn.append(selected)
            if report:
                batches.report_rollouts(*rollouts(selected))
    return drawn


# -- DatasetBatches: no framework needed ----------------------------------------------


def test_items_are_positions_of_numbered_batches_across_epochs(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    batches = DatasetBatches(curriculum(address, exp_name))
    assert len(batches) == 12 and batches.batches_per_epoch == 3
    drawn = run_items(batches, range(12)) + run_items(batches, range(12))  # two epochs (passes)
    assert [b.number for b in drawn] == list(range(6))  # the second pass goes on numbering
    assert [b.request_key for b in drawn] == [f"step-{n}" for n in range(6)]
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (6, 0)
    expected: dict[str, tuple[float, float]] = {}
    for b in drawn:
        for key in b.keys:
            s, f = expected.get(key, (0.0, 0.0))
            expected[key] = (s + successes_of(key), f + N_ROLLOUTS - successes_of(key))
    got = counts(client, exp_name)
    assert {k: got[k] for k in expected} == expected
    # An epoch of a single batch: every pass is a new batch.
    single = DatasetBatches(curriculum(address, exp_name + "-1"), batches_per_epoch=1)
    assert [b.number for b in run_items(single, range(4)) + run_items(single, range(4))] == [0, 1]


def test_a_batch_left_unreported_stops_the_next_draw(address: str, client: bots_client.Client, exp_name: str) -> None:
    batches = DatasetBatches(curriculum(address, exp_name))
    run_items(batches, range(4), report=False)  # the v1 trainer without BotsReplayBuffer
    with pytest.raises(UnreportedBatchError, match=r"batch 0 \(request key 'step-0'\).*BotsReplayBuffer"):
        batches.item(4)
    assert client.get_experiment(exp_name).open_batches == 1  # batch 1 was never drawn


def test_reports_are_strict_and_once_per_batch(address: str, client: bots_client.Client, exp_name: str) -> None:
    batches = DatasetBatches(curriculum(address, exp_name))
    (first,) = run_items(batches, range(4), report=False)
    numbers, keys, rewards = rollouts(first)
    stray = next(k for k in batches.curriculum.keys if k not in first.keys)
    with pytest.raises(UnattributedOutcomesError, match=r"not in batch 0.*extra_info.bots_batch"):
        batches.report_rollouts(numbers + [0], keys + [stray], rewards + [1.0])
    assert client.get_experiment(exp_name).step == 0  # nothing was sent
    (signals,) = batches.report_rollouts(numbers, keys, rewards)
    assert signals.batch_number == 0 and signals.tasks == 4
    assert signals.as_dict()["curriculum/server_step"] == 1.0
    with pytest.raises(UnattributedOutcomesError, match="batch 0 is not open"):
        batches.report_rollouts(numbers, keys, rewards)  # the same batch again
    assert client.get_experiment(exp_name).step == 1
    lenient = DatasetBatches(curriculum(address, exp_name + "-lenient", strict=False))
    (b,) = run_items(lenient, range(4))
    assert lenient.report_rollouts(*rollouts(b)) == [] and lenient.curriculum.dropped_outcomes == 4


def test_a_new_run_on_a_used_experiment_is_refused(address: str, client: bots_client.Client, exp_name: str) -> None:
    run_items(DatasetBatches(curriculum(address, exp_name)), range(4))
    assert client.get_experiment(exp_name).step == 1
    with pytest.raises(bots_client.ExperimentInUseError, match=r"already has 1 reported steps.*data.bots.resume=true"):
        DatasetBatches(curriculum(address, exp_name)).item(0)
    with pytest.raises(bots_client.ConfigMismatchError, match="target_success"):
        other = bots_client.ExperimentConfig(**{**EXACT.__dict__, "target_success": 0.3})
        DatasetBatches(Curriculum(address, exp_name, [f"t{i}" for i in range(N_TASKS)], batch_size=4, config=other,
                                  rank=0, world_size=1)).item(0)  # fmt: skip
    # Continuing on purpose without a checkpoint (data.bots.resume), under a request prefix of its own.
    going_on = DatasetBatches(curriculum(address, exp_name, resume=True, request_prefix="run2"))
    (b,) = run_items(going_on, range(4))
    assert b.request_key == "run2-0" and client.get_experiment(exp_name).step == 2
    # A run whose first batch was drawn but never reported (it crashed at
    # step 1, before any checkpoint) may start again: it draws the same batch.
    crashed = DatasetBatches(curriculum(address, exp_name + "-c"))
    (drawn,) = run_items(crashed, range(4), report=False)
    again = DatasetBatches(curriculum(address, exp_name + "-c"))
    (redrawn,) = run_items(again, range(4))
    assert redrawn.keys == drawn.keys and client.get_experiment(exp_name + "-c").step == 1


@pytest.mark.parametrize("crash", ["before_report", "after_report"])
def test_checkpoints_resume_exactly_once(address: str, client: bots_client.Client, exp_name: str, crash: str) -> None:
    """verl's v1 order: draw, roll out, report, train, save. A crash before
    the report resumes at the checkpoint and draws the batch again (same
    tasks), reported once; a crash after it draws it again too (the model
    lost that step), and its second report is an identical retry."""
    ref = DatasetBatches(curriculum(address, exp_name + "-ref"))
    reference = run_items(ref, range(12)) + run_items(ref, range(12))
    first = DatasetBatches(curriculum(address, exp_name))
    run_items(first, range(12))
    state = pickle.loads(pickle.dumps(first.state_dict()))  # saved at the epoch boundary
    assert state["pending"] == [] and state["next_number"] == 3
    run_items(first, range(4), report=crash == "after_report")  # batch 3, then the crash
    resumed = DatasetBatches(curriculum(address, exp_name))
    resumed.load_state_dict(state)
    drawn = run_items(resumed, range(12))
    assert [b.keys for b in drawn] == [b.keys for b in reference[3:]]
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (6, 0)
    assert counts(client, exp_name) == counts(client, exp_name + "-ref")
    with pytest.raises(ValueError, match="experiment"):
        DatasetBatches(curriculum(address, exp_name + "-other")).load_state_dict(state)


def test_legacy_order_checkpoint_before_report_draws_the_pending_batch_again(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    # The legacy RayPPOTrainer saves before on_batch_end: a checkpoint with a
    # pending batch. Crashed before the report: that batch again, reported once.
    first = DatasetBatches(curriculum(address, exp_name))
    run_items(first, range(4))
    (pending,) = run_items(first, range(4, 8), report=False)
    state = first.state_dict()
    assert state["pending"] == [1] and state["next_number"] == 2
    resumed = DatasetBatches(curriculum(address, exp_name))
    resumed.load_state_dict(state)
    (again,) = run_items(resumed, range(8, 12))
    assert (again.number, again.keys) == (1, pending.keys)
    assert client.get_experiment(exp_name).step == 2
    # Crashed after the report: the run goes on with the next batch.
    resumed = DatasetBatches(curriculum(address, exp_name))
    resumed.load_state_dict(state)
    assert resumed.next_number == 2


def test_keys_from_the_dataframe() -> None:
    rows = [{"data_source": s, "extra_info": {"index": i, "uid": f"u{i}"}} for s in ("a", "b") for i in range(3)]
    frame = Frame(rows)
    assert dataframe_keys(frame)[:4] == ["a:0", "a:1", "a:2", "b:0"]  # data_source + extra_info.index
    with pytest.raises(ValueError, match=r"repeat.*key_field=\[data_source,index\]"):
        dataframe_keys(frame, "index")
    with pytest.raises(ValueError, match="no dataset row has the key field 'task'"):
        dataframe_keys(frame, "task")
    frame.rows[4]["extra_info"].pop("uid")
    with pytest.raises(ValueError, match=r"1 of 6 dataset rows have no key field 'uid' \(e.g. row 4\)"):
        dataframe_keys(frame, ["data_source", "uid"])
    with pytest.raises(ValueError, match="no column 'task' and no extra_info column"):
        dataframe_keys(Frame([{"data_source": "a"}]), "task")


def test_one_trial_per_rollout_session() -> None:
    keys = ["u1_0_0", "u1_1_0", "u1_1_1", "u2_0_0", "u1_2_0"]  # session 1 of u1 had two outputs
    assert trajectory_sessions(keys) == [0, 2, 3, 4]


class Frame:
    """The part of a HF `datasets.Dataset` dataframe_keys reads."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.column_names = list(rows[0])

    def __getitem__(self, column: str) -> list[Any]:
        return [r.get(column) for r in self.rows]


# -- verl 0.9.1 itself: the v1 sync trainer's fit loop --------------------------------


class RolloutServer:
    """Stands in for the inference server behind the agent loop (its
    `generate` is all verl calls). The prompt is "<tag> <i>"; the answer is
    in that data source's format (gsm8k "#### 2i", MATH "\\boxed{2i}"), right
    on i % 4 of each prompt's 3 rollouts, wrong (2i+1) on the rest."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: collections.Counter[tuple[str, int]] = collections.Counter()
        self.global_steps: int | None = None  # the weights' version, set by the weight sync

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:  # fmt: skip
        from verl.workers.rollout.replica import TokenOutput

        tag, i = self.tokenizer.decode(prompt_ids).split()[:2]
        rollout = self.calls[(tag, int(i))] % N_ROLLOUTS
        self.calls[(tag, int(i))] += 1
        answer = 2 * int(i) + (0 if rollout < int(i) % 4 else 1)
        text = f"#### {answer}" if tag == "gsm8k" else f"\\boxed{{{answer}}}"
        return TokenOutput(token_ids=self.tokenizer.encode(text), stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})  # fmt: skip


class AgentLoops:
    """verl's agent loop workers in this process, on one event loop (the
    reward worker keeps the loop it was made in), behind verl's
    LLMServerClient and load balancer in front of RolloutServer.

    `generate_sequences` is AgentLoopManagerTQ's (the v1 trainer): its
    AgentLoopWorkerTQ spawns a task per prompt that runs n rollouts through
    the agent loop and the reward loop and puts them into the TransferQueue;
    here they run to their end before the call returns (the sync trainer
    waits for all of them anyway). `legacy_generate` is AgentLoopManager's
    (the legacy RayPPOTrainer): a DataProto in, the rollouts out."""

    def __init__(self, cfg: Any, server: RolloutServer) -> None:
        from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker
        from verl.experimental.reward_loop import RewardLoopWorker
        from verl.workers.rollout.llm_server import LLMServerClient
        from verl.workers.rollout.router import GlobalRequestLoadBalancer

        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.reward_handles = [RayHandle(RewardLoopWorker(cfg))]
        balancer = RayHandle(GlobalRequestLoadBalancer(servers={"server-0": RayHandle(server)}))
        self.client = LLMServerClient(cfg, load_balancer_handle=balancer)
        self.manager = AgentLoopManager.__new__(AgentLoopManager)  # without starting servers: only its dispatch
        self.manager.agent_loop_workers = [RayHandle(AgentLoopWorker(cfg, self.client, None, self.reward_handles))]
        self.worker: Any = None

    def generate_sequences(self, prompts: Any) -> None:
        from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

        if self.worker is None:
            self.worker = AgentLoopWorkerTQ.__ray_actor_class__(self.cfg, self.client, None, self.reward_handles)

        async def run() -> None:
            await self.worker.generate_sequences(prompts)
            await asyncio.gather(*list(self.worker.background_tasks))

        self.loop.run_until_complete(run())

    def legacy_generate(self, prompts: Any) -> Any:
        async def run() -> Any:
            return await self.manager.generate_sequences(prompts)

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        asyncio.set_event_loop(None)
        self.loop.close()


class ActorWorkers:
    """Stands in for the actor worker group: no model. Log-probs are zero;
    checkpoints record what they were asked."""

    def __init__(self) -> None:
        self._dispatch_info = {"actor": [0]}  # one data-parallel rank
        self.saved: list[int] = []
        self.loaded: list[str] = []

    def compute_log_prob(self, batch: Any) -> Any:
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
        zeros = torch.nested.as_nested_tensor(
            [torch.zeros(len(t)) for t in data["input_ids"].unbind()], layout=torch.jagged
        )
        fields = TensorDict({"log_probs": zeros, "entropy": zeros.clone()}, batch_size=len(batch))
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        return batch

    def update_actor(self, batch: Any) -> dict[str, Any]:
        return {"metrics": {"mfu": 0.0, "pg_loss": 0.0}}

    def save_checkpoint(self, local_path: str, remote_path: Any, global_steps: int, max_ckpt_to_keep: Any) -> None:
        self.saved.append(global_steps)

    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self.loaded.append(local_path)


class WeightSync:
    """Stands in for verl's CheckpointEngineManager (weights to the rollout replicas)."""

    def __init__(self, server: RolloutServer) -> None:
        self.server = server

    def update_weights(self, global_steps: int | None = None) -> None:
        self.server.global_steps = global_steps

    def sleep_replicas(self) -> None:
        pass


@pytest.fixture(scope="module")
def transfer_queue() -> Iterator[Any]:
    """A local Ray and a TransferQueue (controller and one storage unit) for the module."""
    need("verl.trainer.ppo.v1")
    ray = need("ray")
    tq = need("transfer_queue")
    from omegaconf import OmegaConf

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    ray.shutdown()


def data_files(path: Path, sources: dict[str, str], n: int = 6) -> list[str]:
    """One parquet file per data source (source -> prompt tag), each
    numbering extra_info.index from 0, as verl's gsm8k/MATH scripts do."""
    import datasets

    files = []
    for source, tag in sources.items():
        rows = [{"data_source": source, "prompt": [{"role": "user", "content": f"{tag} {i}"}],
                 "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                 "extra_info": {"index": i, "split": "train"}} for i in range(n)]  # fmt: skip
        files.append(str(path / f"{tag}.parquet"))
        datasets.Dataset.from_list(rows).to_parquet(files[-1])
    return files


SOURCES = {"openai/gsm8k": "gsm8k", "lighteval/MATH": "math"}  # 12 tasks, two files both indexed from 0


def trainer_config(
    tmp_path: Path, address: str, experiment: str, *, epochs: int = 2, logger: str = "console", **bots: Any
) -> Any:
    """verl 0.9.1's default PPO config (trainer.use_v1, trainer_mode=sync)
    with the BOTS dataset and replay buffer, GRPO, 4 prompts x 3 rollouts
    per step, a checkpoint after every step (in tmp_path/checkpoints/<experiment>)."""
    from omegaconf import OmegaConf
    from verl.experimental.reward_loop import migrate_legacy_reward_impl

    verl = need("verl")
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    model = tmp_path / "model"
    if not model.exists():
        tiny_tokenizer_dir(model)
        data_files(tmp_path, SOURCES)
        (tmp_path / "val").mkdir()
        data_files(tmp_path / "val", {"openai/gsm8k": "gsm8k"}, n=2)
    overrides = {
        "actor_rollout_ref": {
            "model": {"path": str(model)},
            # name: the server it would start (RolloutServer stands in); no rollout log-probs from it
            "rollout": {"name": "vllm", "n": N_ROLLOUTS, "calculate_log_probs": False},
            "actor": {"ppo_mini_batch_size": 4, "use_kl_loss": False},
        },
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {
            "train_files": [str(tmp_path / f"{tag}.parquet") for tag in SOURCES.values()],
            "val_files": [str(tmp_path / "val" / "gsm8k.parquet")],
            "train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 4, "shuffle": False,
            "dataloader_num_workers": 0, "filter_overlong_prompts": False, "cache_dir": str(tmp_path / "cache"),
            "custom_cls": {"path": "pkg://bots_client.integrations.verl_dataset", "name": "BotsRLDataset"},
            "bots": {"address": address, "experiment": experiment, "experiment_config": EXACT_N.__dict__, **bots},
        },
        "trainer": {
            "total_epochs": epochs, "save_freq": 1, "test_freq": -1, "val_before_train": False,
            "logger": [logger], "default_local_dir": str(tmp_path / "checkpoints" / experiment),
            "project_name": "bots", "experiment_name": experiment, "n_gpus_per_node": 1, "device": "cpu",
            "v1": {"trainer_mode": "sync", "sampler": {
                "custom_sampler": {"path": "pkg://bots_client.integrations.verl_dataset", "name": "BotsReplayBuffer"},
                "sampler_kwargs": {"poll_interval": 0.05}}},
        },
        "transfer_queue": {"enable": True},
    }  # fmt: skip
    cfg = OmegaConf.merge(cfg, overrides)
    return migrate_legacy_reward_impl(cfg)


class Run:
    """One training run: verl's PPOTrainerSync, set up the way its `init()`
    does, with the worker groups, the weight sync and the agent loops
    standing in (no model, no inference server)."""

    def __init__(self, cfg: Any) -> None:
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

        self.trainer = trainer = PPOTrainerSync(cfg)  # builds the replay buffer (trainer.v1.sampler.custom_sampler)
        trainer._init_tokenizer()
        trainer._init_dataloader()  # create_rl_dataset (data.custom_cls), create_rl_sampler, StatefulDataLoader
        trainer._init_dump_executor()
        trainer.actor_rollout_wg = self.workers = ActorWorkers()
        trainer.ref_in_actor = False
        self.server = RolloutServer(trainer.tokenizer)
        trainer.checkpoint_manager = WeightSync(self.server)
        trainer.resource_pool_manager = SimpleNamespace(get_n_gpus=lambda: 1)
        trainer.teacher_model_manager, trainer.distillation_config = None, None
        self.loops = AgentLoops(cfg, self.server)
        trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=self.loops.reward_handles)
        trainer._load_checkpoint()  # resume_mode=auto: the latest global_step_* of default_local_dir, data.pt
        trainer.on_init_end()
        self.drawn: list[tuple[int, list[str]]] = []  # (batch number, keys) of each row block the trainer fetched
        fetch = trainer._next_train_batch

        def next_train_batch(num_prompts: int | None = None) -> Any:
            batch = fetch(num_prompts)
            extra = [e for e in batch["extra_info"] if BATCH_FIELD in e]
            if extra:
                self.drawn.append(({int(e[BATCH_FIELD]) for e in extra}.pop(), [e[KEY_FIELD] for e in extra]))
            return batch

        trainer._next_train_batch = next_train_batch

    @property
    def dataset(self) -> Any:
        return self.trainer.train_dataset

    def fit(self) -> None:
        try:
            self.trainer.fit(self.loops)
        finally:
            self.loops.close()


def expected_counts(drawn: list[tuple[int, list[str]]]) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for _, keys in drawn:
        for key in keys:
            s, f = out.get(key, (0.0, 0.0))
            out[key] = (s + successes_of(key), f + N_ROLLOUTS - successes_of(key))
    return out


def test_real_verl_sync_trainer_draws_and_reports_every_batch(
    transfer_queue: Any, address: str, client: bots_client.Client, exp_name: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from tests.integrations.test_torch import read_scalars

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    from omegaconf import OmegaConf

    cfg = trainer_config(tmp_path, address, exp_name, epochs=2, logger="tensorboard")
    run = Run(OmegaConf.merge(cfg, {"trainer": {"val_before_train": True}}))  # the plain val dataset, through it too
    assert type(run.dataset).__name__ == "BotsRLDataset"  # data.custom_cls
    assert type(run.trainer.replay_buffer).__name__ == "BotsReplayBuffer"  # trainer.v1.sampler.custom_sampler
    assert type(run.trainer.val_dataset).__name__ == "BotsRLDataset" and run.trainer.val_dataset.batches is None
    assert run.trainer.total_training_steps == 6  # 12 tasks / 4 per step, 2 epochs
    run.fit()
    assert [n for n, _ in run.drawn] == list(range(6))  # epoch 2 goes on numbering
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (6, 0)
    got = counts(client, exp_name)
    expected = expected_counts(run.drawn)
    assert {k: got[k] for k in expected} == expected  # verl's scorers' verdicts, 3 trials per draw
    assert any(0 < s < N_ROLLOUTS for s, _ in expected.values())
    assert {k.split(":")[0] for k in expected} == set(SOURCES)  # keys data_source:index, both files
    scalars = read_scalars(tmp_path / "tb")  # verl's own Tracking wrote them, at verl's steps
    # Each step's report runs while the step trains: its signals reach the
    # metrics of the step in which it is done, the next one. The last
    # step's report is made before it trains (nothing would wait for it
    # after), so that step's metrics hold its own report's signals.
    assert [step for step, _ in scalars["curriculum/server_step"]] == list(range(2, 7))
    assert [v for _, v in scalars["curriculum/server_step"]] == [1.0, 2.0, 3.0, 4.0, 6.0]
    assert "curriculum/batch_success_rate" in scalars and "critic/score/mean" in scalars
    assert [step for step, _ in scalars["val-core/openai/gsm8k/acc/mean@1"]] == [0]  # validation ran, not drawn
    assert run.workers.saved == list(range(1, 7))


class Crash(Exception):
    """The trainer process dies here."""


def crash_at(run: Run, step: int, where: str) -> None:
    """Make `run` die at global step `step`: "before_report" after the
    step's rollouts finished, before the report reached the service;
    "after_report" after the report, before the step's checkpoint."""
    trainer = run.trainer
    if where == "before_report":
        report = run.dataset.report_rollouts

        def report_rollouts(*args: Any, **kwargs: Any) -> Any:
            if trainer.global_steps == step:
                raise Crash(where)
            return report(*args, **kwargs)

        run.dataset.report_rollouts = report_rollouts
    else:
        save = trainer._save_checkpoint

        def save_checkpoint() -> None:
            if trainer.global_steps == step:
                raise Crash(where)
            save()

        trainer._save_checkpoint = save_checkpoint


def test_real_verl_resume_reports_every_batch_exactly_once(
    transfer_queue: Any, address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    """verl's checkpoint (data.pt: the dataloader's and the dataset's state)
    and its resume (trainer.resume_mode=auto), crashed inside an epoch and at
    the epoch boundary, between the rollout and the report or between the
    report and the checkpoint. Every run ends where an uninterrupted run
    ends: the same batches in the same order, each reported once, the same
    posterior."""
    reference = Run(trainer_config(tmp_path, address, exp_name + "-ref"))
    reference.fit()
    ref_keys = dict(reference.drawn)
    ref_counts = counts(client, exp_name + "-ref")
    # step: the global step that crashes; its checkpoint is that of the step before
    # (3: the end of epoch 1, 6 steps of 4 tasks in 2 epochs).
    for step, where in [(2, "before_report"), (4, "before_report"), (5, "after_report")]:
        name = f"{exp_name}-{step}-{where}"
        first = Run(trainer_config(tmp_path, address, name))
        crash_at(first, step, where)
        with pytest.raises(Crash):
            first.fit()
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == ((step, 0) if where == "after_report" else (step - 1, 1))
        resumed = Run(trainer_config(tmp_path, address, name))
        assert resumed.workers.loaded and resumed.trainer.global_steps == step - 1  # verl loaded the checkpoint
        resumed.fit()
        # The crashed step's batch again (same request key: the same tasks), then the rest.
        assert [n for n, _ in resumed.drawn] == list(range(step - 1, 6)), (step, where)
        assert all(keys == ref_keys[n] for n, keys in first.drawn + resumed.drawn), (step, where)
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (6, 0), (step, where)
        assert counts(client, name) == ref_counts, (step, where)
    # A new run under the used name without the checkpoint is refused at its first batch.
    fresh = Run(trainer_config(tmp_path / "elsewhere", address, exp_name + "-ref"))
    with pytest.raises(bots_client.ExperimentInUseError, match="already has 6 reported steps"):
        fresh.fit()


def test_real_verl_misconfigurations_fail_at_start(
    transfer_queue: Any, address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync

    def config(checkpoints: str = "none", **changes: Any) -> Any:
        cfg = OmegaConf.merge(trainer_config(tmp_path, address, exp_name), changes)
        cfg.trainer.default_local_dir = str(tmp_path / "checkpoints" / checkpoints)
        return cfg

    with pytest.raises(ValueError, match=r"data.shuffle=true.*Set data.shuffle=false"):
        Run(config(data={"shuffle": True}))  # verl's default
    with pytest.raises(ValueError, match=r"data.dataloader_num_workers=8.*Set data.dataloader_num_workers=0"):
        Run(config(data={"dataloader_num_workers": 8}))  # verl's default
    with pytest.raises(ValueError, match="no dataset row has the key field 'task_id'"):
        Run(config(data={"bots": {"key_field": ["data_source", "task_id"]}}))
    with pytest.raises(ValueError, match=r"repeat.*key_field=\[data_source,index\]"):
        Run(config(data={"bots": {"key_field": "index"}}))  # two files, both indexed from 0
    with pytest.raises(ValueError, match="supports trainer.v1.trainer_mode=sync, not 'colocate_async'"):
        PPOTrainerColocateAsync(config(trainer={"v1": {"trainer_mode": "colocate_async"}}))
    with pytest.raises(ValueError, match="algorithm.filter_groups.enable=true"):
        Run(config(algorithm={"filter_groups": {"enable": True, "metric": "acc"}}))
    # The dataset without the replay buffer: nothing reports; the second draw says so.
    no_buffer = {"v1": {"sampler": {"custom_sampler": {"path": None, "name": None}}}}
    unreported = Run(config("unreported", trainer=no_buffer))
    with pytest.raises(UnreportedBatchError, match=r"batch 0 \(request key 'step-0'\).*BotsReplayBuffer"):
        unreported.fit()
    assert client.get_experiment(exp_name).step == 0
    # The replay buffer without the dataset: refused at the first step, before anything is drawn.
    plain = Run(config("plain", data={"custom_cls": {"path": None, "name": None}}))
    with pytest.raises(TypeError, match="the train dataset is RLHFDataset: set data.custom_cls.path"):
        plain.fit()
    # A reward the rollouts do not carry: the first report says which (nothing is reported).
    with pytest.raises(KeyError, match=r"has no reward_extra_info\['pass_rate'\].*it has \[.*'acc'"):
        Run(config("pass_rate", data={"bots": {"reward_key": "pass_rate"}})).fit()
    assert client.get_experiment(exp_name).step == 0
    # rollouts_per_task other than rollout.n: the config given is refused when the trainer is built ...
    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 3 but the trainer runs "
                                                     "actor_rollout_ref.rollout.n = 4 rollouts per task"):  # fmt: skip
        Run(config(actor_rollout_ref={"rollout": {"n": 4}}))
    # ... and an existing experiment's own at the first draw, before anything is drawn.
    client.create_experiment(f"{exp_name}-16", EXACT)
    other = Run(config("sixteen", data={"bots": {"experiment": f"{exp_name}-16", "experiment_config": None}}))
    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 16 but the trainer runs "
                                                     "actor_rollout_ref.rollout.n = 3"):  # fmt: skip
        other.fit()
    assert client.get_experiment(f"{exp_name}-16").open_batches == 0
    # Validation on the train files: verl's own is_train tells the two datasets apart.
    same = Run(config(data={"val_files": list(trainer_config(tmp_path, address, exp_name).data.train_files)}))
    assert same.dataset.batches is not None and same.trainer.val_dataset.batches is None


def test_real_verl_legacy_trainer_is_refused_at_start(
    transfer_queue: Any, address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    """The legacy RayPPOTrainer (trainer.use_v1=false) calls on_batch_end
    after every step but the last: its last step would never be reported,
    and a resume would continue one batch short. Its own dataloader
    construction (`_create_dataloader`, as its __init__ calls it) refuses
    the dataset before anything is drawn or set up, pointing at the v1
    trainer."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import hf_tokenizer

    cfg = OmegaConf.merge(trainer_config(tmp_path, address, exp_name), {"trainer": {"use_v1": False}})
    legacy = SimpleNamespace(config=cfg, tokenizer=hf_tokenizer(cfg.actor_rollout_ref.model.path), processor=None)
    with pytest.raises(ValueError, match="trainer.use_v1=false") as refused:
        RayPPOTrainer._create_dataloader(legacy, None, None, None, None)
    assert str(refused.value) == LEGACY_TRAINER and "trainer.use_v1=true" in LEGACY_TRAINER
    assert exp_name not in {e.name for e in client.list_experiments()}


def test_real_verl_background_reports_draw_the_batches_of_synchronous_ones(
    transfer_queue: Any, address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    """The report off the critical path (the default) changes nothing the
    trainer sees: the same batches in the same order, the same posterior,
    bit for bit, as reporting before the step trains."""
    runs = {}
    for background in (True, False):
        name = f"{exp_name}-{background}"
        run = Run(trainer_config(tmp_path / name, address, name, background_report=background))
        run.fit()
        runs[background] = run
    assert [keys for _, keys in runs[True].drawn] == [keys for _, keys in runs[False].drawn]
    assert len(runs[True].drawn) == 6
    background, synchronous = (client.snapshot(f"{exp_name}-{b}") for b in (True, False))
    assert background.keys == synchronous.keys
    assert background.alpha.tobytes() == synchronous.alpha.tobytes()
    assert background.beta.tobytes() == synchronous.beta.tobytes()


@pytest.mark.parametrize("total_training_steps", [None, 10])
def test_real_verl_a_failed_report_of_the_last_step_stops_the_run(
    transfer_queue: Any, address: str, client: bots_client.Client, exp_name: str, tmp_path: Path,
    total_training_steps: int | None,
) -> None:  # fmt: skip
    """After verl's last step no batch is drawn and, with save_freq=-1, no
    checkpoint is saved: a background report of that step that failed was
    only logged, and its outcomes were lost while fit() returned. With
    total_training_steps above 2 epochs' 6 steps, the epochs end the run."""
    from omegaconf import OmegaConf

    cfg = trainer_config(tmp_path, address, exp_name, background_report=True)
    trainer = {"save_freq": -1, "total_training_steps": total_training_steps}  # verl's default: no checkpoints
    run = Run(OmegaConf.merge(cfg, {"trainer": trainer}))
    assert run.trainer.total_training_steps == (total_training_steps or 6)
    service = run.dataset.curriculum.client
    reports = 0
    send = service.report_outcomes

    def failing_last(*args: Any, **kwargs: Any) -> Any:
        nonlocal reports
        reports += 1
        if reports == 6:
            raise bots_client.UnavailableError("injected: the service went away")
        return send(*args, **kwargs)

    service.report_outcomes = failing_last
    with pytest.raises(bots_client.UnavailableError, match="injected"):
        run.fit()
    assert run.workers.saved == []
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (5, 1)  # the last batch is still open: its lease brings it back
