"""bots_client.integrations.torch against real torch and a real server:
DataLoader batches, DDP (simulated ranks in threads, and two real gloo
processes), checkpoint/resume."""

from __future__ import annotations

import json
import logging
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import bots_client
from tests.integrations.conftest import EXACT, counts, need

torch = need("torch")
from torch.utils.data import DataLoader

from bots_client.integrations.torch import BotsBatchSampler, BotsSampler

KEYS = [f"task-{i:02d}" for i in range(16)]


class KeyedDataset(torch.utils.data.Dataset):
    """Rows carry their own task key, as a real dataset would."""

    def __len__(self) -> int:
        return len(KEYS)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"key": KEYS[i], "x": torch.tensor([float(i)])}


def outcome_of(key: str) -> tuple[float, int]:
    """A deterministic verifier result: task i solves i % 5 of 4 rollouts."""
    i = int(key.split("-")[1])
    return (float(min(i % 5, 4)), 4)


def test_sampler_is_a_torch_sampler_and_drives_a_dataloader(client: bots_client.Client, exp_name: str) -> None:
    sampler = BotsSampler(client, exp_name, KEYS, batch_size=4, num_batches=3, config=EXACT)
    assert isinstance(sampler, torch.utils.data.Sampler)
    loader = DataLoader(KeyedDataset(), batch_size=sampler.local_batch_size, sampler=sampler)
    assert len(loader) == 3 and len(sampler) == 12
    reported: dict[str, tuple[float, int]] = {}
    for step, rows in enumerate(loader):
        batch = sampler.last_batch
        assert batch is not None and batch.number == step
        assert rows["key"] == list(batch.keys)  # the rows are exactly the service's batch
        outcomes = {k: outcome_of(k) for k in rows["key"]}
        assert sampler.report(outcomes) == []  # running in the background, with the next selection
        results = sampler.wait()
        assert [r.step for r in results] == [step + 1]
        for k, (s, n) in outcomes.items():
            prev = reported.get(k, (0.0, 0))
            reported[k] = (prev[0] + s, prev[1] + n)
    assert client.get_experiment(exp_name).step == 3
    got = counts(client, exp_name)
    for key, (s, n) in reported.items():
        assert got[key] == (s, n - s)
    # A second epoch continues the batch numbering (request keys stay unique).
    next(iter(loader))
    assert sampler.last_batch.number == 3


def test_report_rewards_aggregates_per_rollout_rewards(client: bots_client.Client, exp_name: str) -> None:
    sampler = BotsSampler(client, exp_name, KEYS, batch_size=2, config=EXACT)
    indices = list(iter(sampler))[:2]
    # 3 rollouts per task, rewards -1/+1, tasks named by dataset index.
    tasks = [indices[0]] * 3 + [indices[1]] * 3
    rewards = [1, 1, -1, -1, -1, -1]
    sampler.report_rewards(torch.tensor(tasks), torch.tensor(rewards), success_threshold=0.0)
    sampler.wait()  # reported in the background
    got = counts(client, exp_name)
    assert got[KEYS[indices[0]]] == (2.0, 1.0) and got[KEYS[indices[1]]] == (0.0, 3.0)


def test_ranks_in_threads_get_the_same_batch_and_only_rank0_reports(address: str, exp_name: str) -> None:
    world, num_batches = 2, 3
    seen: dict[int, list[Any]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(world)

    def rank_main(rank: int) -> None:
        try:
            sampler = BotsSampler(
                address, exp_name, KEYS, batch_size=4, num_batches=num_batches, config=EXACT,
                rank=rank, world_size=world, gather=False,
            )  # fmt: skip
            assert sampler.local_batch_size == 2
            out = []
            for rows in DataLoader(KeyedDataset(), batch_size=sampler.local_batch_size, sampler=sampler):
                batch = sampler.last_batch
                barrier.wait()
                # Every rank reports the whole batch, each with its own numbers:
                # only rank 0's may be applied.
                sampler.report({k: (float(rank + 1), 4) for k in batch.keys})
                results = sampler.wait()  # the ranks are threads: the barrier stands in for the collective
                out.append((batch.batch_id, batch.keys, rows["key"], len(results)))
                barrier.wait()
            seen[rank] = out
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for (id0, keys0, local0, n0), (id1, keys1, local1, n1) in zip(seen[0], seen[1]):
        assert id0 == id1 and keys0 == keys1  # same batch on both ranks
        assert local0 == list(keys0[0::2]) and local1 == list(keys0[1::2])  # disjoint strided shares
        assert (n0, n1) == (1, 0)  # one report, from rank 0
    assert client_step(address, exp_name) == num_batches
    expected: dict[str, tuple[float, float]] = {}
    for _, keys, _, _ in seen[0]:
        for k in keys:  # rank 0's outcomes: 1 success of 4, per batch the task was in
            s, f = expected.get(k, (0.0, 0.0))
            expected[k] = (s + 1.0, f + 3.0)
    got = counts(bots_client.Client(address), exp_name)
    assert {k: got[k] for k in expected} == expected


def client_step(address: str, experiment: str) -> int:
    with bots_client.Client(address) as c:
        return c.get_experiment(experiment).step


DDP_BATCHES = 6


def _ddp_worker(
    rank: int, world: int, address: str, experiment: str, init_file: str, out_dir: str, wait_for_report: bool
) -> None:
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sampler = BotsSampler(
            address, experiment, KEYS, batch_size=4, num_batches=DDP_BATCHES, config=EXACT,
            wait_for_report=wait_for_report,
        )  # fmt: skip
        assert (sampler.curriculum.rank, sampler.curriculum.world_size) == (rank, world)
        out = []
        for rows in DataLoader(KeyedDataset(), batch_size=sampler.local_batch_size, sampler=sampler):
            batch = sampler.last_batch
            # The previous batch's report ran in the background; drawing this
            # batch waited for it on every rank (a broadcast from rank 0).
            acknowledged_before = sampler.curriculum.acknowledged_step
            if rank == 0:
                time.sleep(0.05)  # a slower reporter: the other rank reaches the next select first
            # Each rank rolled out only its share; report() all-gathers and rank 0 reports.
            results = sampler.report({k: (float(rank + 1), 3) for k in rows["key"]})
            out.append({"batch_id": batch.batch_id, "keys": list(batch.keys), "number": batch.number,
                        "step": batch.step, "local": list(rows["key"]), "reports": len(results),
                        "acknowledged_before": acknowledged_before})  # fmt: skip
        sampler.wait()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _run_ddp(address: str, experiment: str, tmp_path: Path, *, wait_for_report: bool) -> list[list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    world = 2
    init = str(tmp_path / f"init-{wait_for_report}")
    mp.spawn(_ddp_worker, args=(world, address, experiment, init, str(tmp_path), wait_for_report), nprocs=world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def test_real_ddp_two_gloo_processes(address: str, exp_name: str, tmp_path: Path) -> None:
    world = 2
    r0, r1 = _run_ddp(address, exp_name, tmp_path, wait_for_report=True)
    assert len(r0) == len(r1) == DDP_BATCHES
    for a, b in zip(r0, r1):
        assert a["batch_id"] == b["batch_id"] and a["keys"] == b["keys"]
        assert a["local"] == a["keys"][0::2] and b["local"] == a["keys"][1::2]
        assert (a["reports"], b["reports"]) == (0, 0)  # report() returns at once; the answers come later
        # No rank selected before the previous report was applied: batch k
        # was selected at server step k, on both ranks; both know the ack.
        assert a["step"] == b["step"] == a["number"]
        # (Before the first report: the server step the run started from.)
        assert a["acknowledged_before"] == b["acknowledged_before"] == a["number"]
    assert client_step(address, exp_name) == DDP_BATCHES
    expected: dict[str, tuple[float, float]] = {}
    for batch in r0:  # the merged outcomes of both ranks, applied once per batch
        for j, key in enumerate(batch["keys"]):
            rank = j % world
            s, f = expected.get(key, (0.0, 0.0))
            expected[key] = (s + rank + 1, f + 3 - (rank + 1))
    got = counts(bots_client.Client(address), exp_name)
    assert {k: got[k] for k in expected} == expected


def test_real_ddp_pipelined_reports_lag_at_most_one_step(address: str, exp_name: str, tmp_path: Path) -> None:
    # wait_for_report=False: for trainers that overlap the next selection
    # with the report. A batch may then be selected one step early, and both
    # ranks still get the same batch (the request key decides).
    r0, r1 = _run_ddp(address, exp_name, tmp_path, wait_for_report=False)
    for a, b in zip(r0, r1):
        assert a["batch_id"] == b["batch_id"]
        assert a["number"] - 1 <= a["step"] <= a["number"]
    assert client_step(address, exp_name) == DDP_BATCHES


def _ddp_resume_worker(rank: int, world: int, address: str, experiment: str, init_file: str, out_dir: str) -> None:
    """A prefetching loader under DDP: batch k + 1 is drawn when batch k is
    reported in the background, and each rank checkpoints right after
    report() returns, then resumes a new sampler from its own checkpoint."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sampler = BotsBatchSampler(address, experiment, KEYS, batch_size=4, num_batches=4, config=EXACT)
        it = iter(sampler)
        first = next(it)
        next(it)
        second = sampler.last_batch
        assert second is not None
        sampler.report({sampler.key_of(i): (1.0, 2) for i in first}, batch=0)
        next(it)  # the prefetch: batch 2, drawn before batch 1 is reported
        sampler.report(dict.fromkeys(second.keys[rank::world], (1.0, 2)), batch=second)
        state = pickle.loads(pickle.dumps(sampler.state_dict()))
        dist.barrier()  # then the trainer dies on every rank
        resumed = BotsBatchSampler(address, experiment, KEYS, batch_size=4, num_batches=4, config=EXACT)
        resumed.load_state_dict(state)
        next(iter(resumed))
        assert resumed.last_batch is not None
        Path(out_dir, f"resume{rank}.json").write_text(
            json.dumps({"pending": state["pending"], "number": resumed.last_batch.number,
                        "keys": list(resumed.last_batch.keys)})
        )  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_real_ddp_ranks_resume_at_the_same_batch_after_an_overlapped_report(
    address: str, exp_name: str, tmp_path: Path
) -> None:
    # Rank 1 learns of rank 0's background report only at its next draw, so
    # its checkpoint holds the acknowledged step before it; resumed alone it
    # skipped batch 2, which rank 0 (rightly) draws again: the ranks trained
    # on different batches. Loading is a collective: both follow rank 0.
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_ddp_resume_worker, args=(world, address, exp_name, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    r0, r1 = (json.loads((tmp_path / f"resume{r}.json").read_text()) for r in range(world))
    assert r0["pending"] == r1["pending"] == [2]  # drawn, never reported
    assert r0["number"] == r1["number"] == 2 and r0["keys"] == r1["keys"]
    assert client_step(address, exp_name) == 2


def _failing_second_call(method: Any, calls: list[str]) -> Any:
    """`method`, except that the second call of any method sharing `calls` fails."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(method.__name__)
        if len(calls) == 2:
            raise bots_client.UnavailableError("injected: the service went away")
        return method(*args, **kwargs)

    return call


def _ddp_failing_report_worker(
    rank: int, world: int, address: str, experiment: str, init_file: str, out_dir: str, overlap: bool
) -> None:
    """Rank 0's second report fails; each rank records what it raised."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    error = None
    try:
        sampler = BotsSampler(address, experiment, KEYS, batch_size=4, num_batches=4, config=EXACT, overlap=overlap)
        client = sampler.curriculum.client
        calls: list[str] = []
        for name in ("report_and_select", "report_outcomes"):
            setattr(client, name, _failing_second_call(getattr(client, name), calls))
        for rows in DataLoader(KeyedDataset(), batch_size=sampler.local_batch_size, sampler=sampler):
            sampler.report(dict.fromkeys(rows["key"], (1.0, 2)))
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        Path(out_dir, f"failed{rank}-{overlap}.json").write_text(json.dumps(error))
        dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [True, False])
def test_real_ddp_a_failed_report_raises_on_every_rank(
    address: str, exp_name: str, tmp_path: Path, overlap: bool
) -> None:
    # The reporting rank raised before the broadcast its other ranks were
    # waiting in; they learned of it only as "Connection closed by peer" once
    # rank 0's process was gone (or waited until gloo's timeout while it lived).
    import torch.multiprocessing as mp

    init = str(tmp_path / "init")
    mp.spawn(_ddp_failing_report_worker, args=(2, address, exp_name, init, str(tmp_path), overlap), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"failed{r}-{overlap}.json").read_text()) for r in range(2))
    assert r0 == "UnavailableError: UNAVAILABLE: injected: the service went away"
    assert r1 == "ReportingRankError: rank 0's report to the service failed: " + r0


def test_gather_without_a_process_group_raises_instead_of_losing_other_ranks_outcomes(
    client: bots_client.Client, exp_name: str
) -> None:
    sampler = BotsSampler(client, exp_name, KEYS, batch_size=4, config=EXACT, rank=0, world_size=2)
    it = iter(sampler)
    rows = [sampler.key_of(next(it)) for _ in range(sampler.local_batch_size)]
    with pytest.raises(RuntimeError, match="no process group"):
        sampler.report(dict.fromkeys(rows, (1.0, 2)))
    assert client.get_experiment(exp_name).step == 0  # nothing half-sent: rank 1's half was never asked for


def _draw(sampler: Any, n_batches: int) -> list[tuple[str, ...]]:
    """Draw n batches through the flat index stream and report each."""
    out = []
    it = iter(sampler)
    for _ in range(n_batches):
        indices = [next(it) for _ in range(sampler.local_batch_size)]
        batch = sampler.last_batch
        assert [sampler.index_of(k) for k in batch.keys] == indices
        sampler.report({k: outcome_of(k) for k in batch.keys})
        out.append(batch.keys)
    sampler.wait()  # the end of training: the last report acknowledged
    return out


def test_resume_from_state_dict_continues_with_the_same_batches(address: str, exp_name: str) -> None:
    config = bots_client.ExperimentConfig(seed=11, rollouts_per_task=4)  # BOTS, forgetting on
    reference = BotsSampler(address, exp_name + "-ref", KEYS, batch_size=4, num_batches=50, config=config)
    expected = _draw(reference, 5)

    first = BotsSampler(address, exp_name, KEYS, batch_size=4, num_batches=50, config=config)
    got = _draw(first, 2)
    state = pickle.loads(pickle.dumps(first.state_dict()))  # as a checkpoint would store it
    assert state["experiment"] == exp_name and state["step"] == 2 and state["offset"] == 0

    resumed = BotsSampler(address, exp_name, KEYS, batch_size=4, num_batches=50, config=config)
    resumed.load_state_dict(state)
    got += _draw(resumed, 3)
    assert got == expected
    assert resumed.last_batch.number == 4 and client_step(address, exp_name) == 5

    with pytest.raises(ValueError, match="experiment"):
        BotsSampler(address, "other-exp", KEYS, batch_size=4, config=config).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        BotsSampler(address, exp_name, KEYS, batch_size=2, config=config).load_state_dict(state)


def test_resume_mid_batch_yields_the_rest_of_that_batch(client: bots_client.Client, exp_name: str) -> None:
    sampler = BotsSampler(client, exp_name, KEYS, batch_size=4, num_batches=10, config=EXACT)
    it = iter(sampler)
    first_two = [next(it) for _ in range(2)]
    state = sampler.state_dict()
    assert (state["step"], state["offset"]) == (0, 2)
    batch = sampler.last_batch
    resumed = BotsSampler(client, exp_name, KEYS, batch_size=4, num_batches=10, config=EXACT)
    resumed.load_state_dict(state)
    it = iter(resumed)
    rest = [next(it) for _ in range(2)]
    assert first_two + rest == list(batch.indices)
    assert resumed.state_dict()["step"] >= 1


def test_batch_sampler_yields_one_service_batch_per_step(client: bots_client.Client, exp_name: str) -> None:
    sampler = BotsBatchSampler(client, exp_name, KEYS, batch_size=5, num_batches=2, config=EXACT)
    loader = DataLoader(KeyedDataset(), batch_sampler=sampler)
    assert len(loader) == 2
    for rows in loader:
        assert rows["key"] == list(sampler.last_batch.keys)
        sampler.report(dict.fromkeys(rows["key"], (1.0, 2)))
    assert client.get_experiment(exp_name).step == 2
    assert sampler.state_dict()["step"] == 2


def test_sampler_pickles(client: bots_client.Client, exp_name: str) -> None:
    sampler = BotsSampler(client, exp_name, KEYS, batch_size=4, config=EXACT)
    first = next(iter(sampler))
    copy = pickle.loads(pickle.dumps(sampler))
    assert type(copy) is type(sampler) and copy.state_dict() == sampler.state_dict()
    copy.load_state_dict({**sampler.state_dict(), "step": 0, "offset": 0})
    assert next(iter(copy)) == first


# -- exactly once across resume --------------------------------------------------------

Selection = tuple[str, int, tuple[str, ...]]
PER_EPOCH = 3  # batches of 4 per epoch in the resume tests


def recorded(sampler: Any) -> list[Selection]:
    """Record (request key, server step at selection, task keys) of every
    batch the sampler draws."""
    selections: list[Selection] = []
    select = sampler.curriculum.select

    def recording_select(*args: Any, **kwargs: Any) -> Any:
        batch = select(*args, **kwargs)
        selections.append((batch.request_key, batch.step, batch.keys))
        return batch

    sampler.curriculum.select = recording_select
    return selections


def train(sampler: Any, done: int, until: int, *, checkpoint_at: int | None = None) -> dict[str, Any] | None:
    """A plain epoch loop (set_epoch, then the loader) from batch `done` to
    `until`, reporting every batch; returns the sampler's state after batch
    `checkpoint_at` was reported."""
    loader = DataLoader(KeyedDataset(), batch_size=sampler.local_batch_size, sampler=sampler)
    state = None
    epoch = done // PER_EPOCH
    while done < until:
        sampler.set_epoch(epoch)
        for rows in loader:
            sampler.report({k: outcome_of(k) for k in rows["key"]})
            done += 1
            if done == checkpoint_at:
                state = pickle.loads(pickle.dumps(sampler.state_dict()))
            if done == until:
                break
        epoch += 1
    sampler.wait()  # the end of training: the last report acknowledged
    return state


def new_sampler(address: str, experiment: str, **kwargs: Any) -> Any:
    return BotsSampler(address, experiment, KEYS, batch_size=4, num_batches=PER_EPOCH, config=EXACT, **kwargs)


def test_resume_at_any_step_and_epoch_boundary_draws_each_batch_once(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    total = 8
    ref = new_sampler(address, exp_name + "-ref")
    reference = recorded(ref)
    train(ref, 0, total)
    assert [(k, s) for k, s, _ in reference] == [(f"step-{i}", i) for i in range(total)]
    ref_snap = client.snapshot(exp_name + "-ref")
    for at in (3, 4, 6):  # epoch boundaries and inside an epoch
        name = f"{exp_name}-{at}"
        first = new_sampler(address, name)
        first_selections = recorded(first)
        state = train(first, 0, at + 1, checkpoint_at=at)  # crash one batch after the checkpoint
        assert state is not None and state["step"] == at and state["pending"] == []
        resumed = new_sampler(address, name)
        selections = recorded(resumed)
        resumed.load_state_dict(state)
        train(resumed, at, total)
        # Batch `at` was reported before the crash: drawn again (same request
        # key, same tasks), its report an identical retry; then the rest.
        assert first_selections + selections[1:] == reference, at
        assert selections == reference[at:], at
        exp = client.get_experiment(name)
        # The last report drew the batch after it (ReportAndSelect), as the
        # uninterrupted run's did: one open batch, whose lease expires.
        assert (exp.step, exp.open_batches) == (total, 1)
        assert client.get_experiment(exp_name + "-ref").open_batches == 1
        snap = client.snapshot(name)
        assert list(snap.alpha) == list(ref_snap.alpha) and list(snap.beta) == list(ref_snap.beta), at


def test_a_batch_drawn_before_the_checkpoint_is_drawn_again_only_if_never_reported(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    # verl's order: draw batch k, save the checkpoint, then report batch k.
    for crash_before_report in (True, False):
        name = f"{exp_name}-{int(crash_before_report)}"
        first = new_sampler(address, name)
        train(first, 0, 4)
        it = iter(first)
        [next(it) for _ in range(4)]  # batch 4 drawn (rows handed to the trainer) ...
        state = pickle.loads(pickle.dumps(first.state_dict()))  # ... checkpoint ...
        assert (state["step"], state["pending"], state["acknowledged_step"]) == (5, [4], 4)
        if not crash_before_report:
            first.report({k: outcome_of(k) for k in first.last_batch.keys})  # ... report, acknowledged ...
            first.wait()  # ... crash
        resumed = new_sampler(address, name)
        selections = recorded(resumed)
        resumed.load_state_dict(state)
        train(resumed, 5 if not crash_before_report else 4, 6)
        drawn = [key for key, _, _ in selections]
        assert drawn == (["step-4", "step-5"] if crash_before_report else ["step-5"])
        assert selections[-1][1] == 5  # batch 5 selected at server step 5, as in an uninterrupted run
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (6, 1)  # batch 6, drawn with the last report


def test_an_epoch_left_early_leaves_no_batch_for_a_resume_to_go_back_to(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    sampler = new_sampler(address, exp_name)
    loader = DataLoader(KeyedDataset(), batch_size=sampler.local_batch_size, sampler=sampler)
    for rows in loader:
        # The report of batch 1 also draws batch 2 (overlap); the loop then
        # leaves the epoch (an evaluation, a time budget) and set_epoch
        # skips past batch 2, which the trainer never got.
        sampler.report({k: outcome_of(k) for k in rows["key"]})
        if sampler.last_batch.number == 1:
            break
    sampler.set_epoch(1)
    train(sampler, PER_EPOCH, PER_EPOCH + 2)
    sampler.wait()
    state = sampler.state_dict()
    assert (state["step"], state["pending"]) == (PER_EPOCH + 2, [])
    resumed = new_sampler(address, exp_name)
    selections = recorded(resumed)
    resumed.load_state_dict(state)
    train(resumed, PER_EPOCH + 2, PER_EPOCH + 3)
    # It goes on at the checkpoint's batch: nothing trained before it is trained again.
    assert [key for key, _, _ in selections] == [f"step-{PER_EPOCH + 2}"]
    assert client.get_experiment(exp_name).step == 5


def test_resume_with_another_world_size(address: str, client: bots_client.Client, exp_name: str) -> None:
    total = 6
    ref = new_sampler(address, exp_name + "-ref")
    reference = recorded(ref)
    train(ref, 0, total)
    # Two ranks (threads); rank 0 reports, the other waits for it.
    world, states = 2, {}
    barrier = threading.Barrier(world)
    first_selections: dict[int, list[Selection]] = {}

    def rank_main(rank: int) -> None:
        sampler = new_sampler(address, exp_name, rank=rank, world_size=world, gather=False)
        first_selections[rank] = recorded(sampler)
        loader = DataLoader(KeyedDataset(), batch_size=sampler.local_batch_size, sampler=sampler)
        done, epoch = 0, 0
        while done < 4:
            sampler.set_epoch(epoch)
            for _rows in loader:
                barrier.wait()
                sampler.report({k: outcome_of(k) for k in sampler.last_batch.keys})
                sampler.wait()
                barrier.wait()  # no rank selects before rank 0's report landed
                done += 1
                if done == 4:
                    break
            epoch += 1
        states[rank] = pickle.loads(pickle.dumps(sampler.state_dict()))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert first_selections[0][:4] == reference[:4] and first_selections[1][:4] == reference[:4]
    state = states[0]
    assert (state["step"], state["offset"], state["world_size"]) == (4, 0, 2)
    state = {**state, "offset": 1}  # as if one row of rank 0's share was out
    resumed = new_sampler(address, exp_name, rank=0, world_size=1)
    selections = recorded(resumed)
    resumed.load_state_dict(state)
    assert (resumed.step, resumed.offset) == (4, 0)  # the share moved: batch 4 from its start
    train(resumed, 4, total)
    assert selections == reference[4:]
    assert client.get_experiment(exp_name).step == total


# -- curriculum signals in the trainer's logger ----------------------------------------


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the TensorBoard event files under log_dir."""
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in sorted({p.parent for p in log_dir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars


def test_curriculum_signals_reach_tensorboard(client: bots_client.Client, exp_name: str, tmp_path: Path) -> None:
    need("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    from bots_client.integrations.torch import tensorboard_listener

    writer = SummaryWriter(str(tmp_path))
    sampler = BotsSampler(client, exp_name, KEYS, batch_size=4, num_batches=3, config=EXACT,
                          on_report=tensorboard_listener(writer), posterior_means=True)  # fmt: skip
    expected: dict[str, list[tuple[int, float]]] = {}
    totals: dict[str, tuple[float, int]] = {}
    for step, rows in enumerate(DataLoader(KeyedDataset(), batch_size=4, sampler=sampler), start=1):
        outcomes = {k: outcome_of(k) for k in rows["key"]}
        sampler.report(outcomes)
        for k, (s, n) in outcomes.items():
            totals[k] = (totals.get(k, (0.0, 0))[0] + s, totals.get(k, (0.0, 0))[1] + n)
        # By hand: successes over trials; tasks with 0 < s < n; Beta(1 + s, 1 + f) means (MoPPS, no forgetting).
        rate = sum(s for s, _ in outcomes.values()) / sum(n for _, n in outcomes.values())
        informative = sum(0 < s < n for s, n in outcomes.values()) / len(outcomes)
        mean = sum((1 + totals[k][0]) / (2 + totals[k][1]) for k in outcomes) / len(outcomes)
        for tag, value in (("batch_success_rate", rate), ("informative_fraction", informative),
                           ("posterior_mean", mean), ("server_step", step)):  # fmt: skip
            expected.setdefault(f"curriculum/{tag}", []).append((step, value))
    writer.close()
    got = read_scalars(tmp_path)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag


def test_a_new_sampler_never_takes_over_an_old_experiment(client: bots_client.Client, exp_name: str) -> None:
    import dataclasses

    config = dataclasses.replace(EXACT, rollouts_per_task=4)
    first = BotsSampler(client, exp_name, KEYS, batch_size=4, config=config)
    loader = DataLoader(KeyedDataset(), batch_size=4, sampler=first)
    rows = next(iter(loader))
    first.report({k: outcome_of(k) for k in rows["key"]})
    first.wait()
    # A new run reusing the name with another config: refused at its first
    # batch, before it draws anything (it used to hand out the old batches
    # and drop every new outcome as "already reported").
    eight = dataclasses.replace(EXACT, rollouts_per_task=8)
    with pytest.raises(bots_client.ConfigMismatchError, match="rollouts_per_task: requested 8, existing 4"):
        next(iter(DataLoader(KeyedDataset(), batch_size=4, sampler=BotsSampler(client, exp_name, KEYS,
                                                                                 batch_size=4, config=eight))))  # fmt: skip
    with pytest.raises(bots_client.ExperimentInUseError, match="1 reported steps"):
        next(iter(DataLoader(KeyedDataset(), batch_size=4,
                             sampler=BotsSampler(client, exp_name, KEYS, batch_size=4, config=config))))  # fmt: skip
    assert client.get_experiment(exp_name).step == 1
    # Continuing it is explicit: the first run's state, or resume=True.
    resumed = BotsSampler(client, exp_name, KEYS, batch_size=4, config=config)
    resumed.load_state_dict(first.state_dict())
    rows = next(iter(DataLoader(KeyedDataset(), batch_size=4, sampler=resumed)))
    assert resumed.last_batch is not None and resumed.last_batch.number == 1
    resumed.report({k: outcome_of(k) for k in rows["key"]}, batch=resumed.last_batch)
    assert resumed.wait()[0].step == 2


def test_reports_name_their_batch_under_a_prefetching_loader(client: bots_client.Client, exp_name: str) -> None:
    sampler = BotsBatchSampler(client, exp_name, KEYS, batch_size=4, num_batches=4, config=EXACT)
    loader = DataLoader(KeyedDataset(), batch_sampler=sampler, num_workers=1, prefetch_factor=2)
    drawn = []
    for rows in loader:
        # The sampler has drawn ahead: its last batch is not this one.
        batch = next(b for b in sampler.curriculum.open_batches if list(b.keys) == rows["key"])
        drawn.append(batch.number)
        sampler.report({k: outcome_of(k) for k in rows["key"]}, batch=batch)
    sampler.wait()
    assert drawn == [0, 1, 2, 3] and client.get_experiment(exp_name).step == 4
    # Only the last report came after the loader's last draw: it alone drew
    # the next batch (the next epoch's first), at the step a synchronous run
    # draws it. The others left the selection to the loader.
    assert [(b.number, b.step) for b in sampler.curriculum.open_batches] == [(4, 4)]


# -- the report off the critical path ----------------------------------------------------


def _loop(sampler: Any, batches: int, rewards: Any) -> list[tuple[str, int, tuple[str, ...]]]:
    seen = []
    loader = DataLoader(KeyedDataset(), batch_size=sampler.local_batch_size, sampler=sampler)

    def epochs() -> Any:
        while True:
            yield from loader

    it = epochs()
    for _ in range(batches):
        rows = next(it)
        batch = sampler.last_batch
        seen.append((batch.request_key, batch.step, batch.keys))
        sampler.report({k: rewards(k, batch.number) for k in rows["key"]})
    sampler.wait()
    return seen


def test_overlapped_reports_give_the_synchronous_batches_and_posterior_bit_for_bit(
    client: bots_client.Client, exp_name: str
) -> None:
    # The paper's engine with forgetting, implicit evidence off: every
    # selection depends on the whole posterior so far.
    config = bots_client.ExperimentConfig(seed=5, rollouts_per_task=4)

    def rewards(key: str, number: int) -> tuple[float, int]:
        return (float((int(key.split("-")[1]) * 7 + number * 3) % 5), 4)

    runs = {}
    for overlap in (False, True):
        sampler = BotsSampler(client, f"{exp_name}-{overlap}", KEYS, batch_size=4, num_batches=4, config=config,
                              overlap=overlap)  # fmt: skip
        runs[overlap] = _loop(sampler, 10, rewards)  # two and a half epochs
    assert runs[True] == runs[False]
    assert [step for _, step, _ in runs[True]] == list(range(10))  # each drawn after the previous report
    sync, overlapped = client.snapshot(f"{exp_name}-False"), client.snapshot(f"{exp_name}-True")
    assert overlapped.keys == sync.keys
    assert overlapped.alpha.tobytes() == sync.alpha.tobytes() and overlapped.beta.tobytes() == sync.beta.tobytes()


def test_a_background_report_failure_surfaces_at_the_next_batch(
    client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    sampler = BotsSampler(client, exp_name, KEYS, batch_size=4, config=EXACT)
    it = iter(DataLoader(KeyedDataset(), batch_size=4, sampler=sampler))
    rows = next(it)
    client.delete_experiment(exp_name)  # e.g. an operator deletes it while the trainer runs
    with caplog.at_level(logging.ERROR, logger="bots_client.integrations"):
        assert sampler.report({k: outcome_of(k) for k in rows["key"]}) == []  # returns at once
        with pytest.raises(bots_client.NotFoundError):
            next(it)  # the next batch raises the report's error
        # The failure is logged by the future's done-callback, on the
        # reporting thread, which may run just after the error was raised here.
        deadline = time.monotonic() + 10
        while "the report of batch 0, running in the background, failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "the report of batch 0, running in the background, failed" in caplog.text
    assert sampler.wait() == []  # raised once; nothing left behind


def test_a_background_report_failure_under_a_prefetching_loader_loses_no_batch(
    client: bots_client.Client, exp_name: str
) -> None:
    # DataLoader workers draw batches ahead: the loader asks the sampler for
    # the next batch while it holds the rows of the one the trainer gets
    # next, and drops those rows when the sampler raises. The report's error
    # waits for the trainer's next call of the sampler instead.
    sampler = BotsBatchSampler(client, exp_name, KEYS, batch_size=4, num_batches=4, config=EXACT)
    loader = DataLoader(KeyedDataset(), batch_sampler=sampler, num_workers=1, prefetch_factor=2)
    trained, errors = [], []
    for rows in loader:
        batch = next(b for b in sampler.curriculum.open_batches if list(b.keys) == rows["key"])
        trained.append(batch.number)
        successes = 3.0 if batch.number == 1 else 1.0  # more successes than trials: batch 1's report is refused
        try:
            sampler.report(dict.fromkeys(rows["key"], (successes, 2)), batch=batch)
        except bots_client.InvalidArgumentError as e:
            errors.append((batch.number, str(e)))
            if batch.number != 1:  # the error was an earlier report's: this one was not sent
                sampler.report(dict.fromkeys(rows["key"], (successes, 2)), batch=batch)
    sampler.wait()
    assert trained == [0, 1, 2, 3]  # every batch reached the trainer
    # Batch 1's error was raised by the next report, before anything was sent.
    assert [(n, "successes = 3.0" in e) for n, e in errors] == [(2, True)]
    assert [b.number for b in sampler.curriculum.open_batches] == [1, 4]  # 1: to report again; 4: drawn ahead
    assert client.get_experiment(exp_name).step == 3


def test_a_checkpoint_taken_during_the_overlap_records_the_report(
    client: bots_client.Client, exp_name: str
) -> None:
    sampler = BotsSampler(client, exp_name, KEYS, batch_size=4, config=EXACT)
    it = iter(DataLoader(KeyedDataset(), batch_size=4, sampler=sampler))
    for number in range(3):
        rows = next(it)
        sampler.report({k: outcome_of(k) for k in rows["key"]})
        # The checkpoint right after report() returns: it waits for the
        # report, so it never lists an acknowledged batch as pending (which
        # a resume would draw and report again) nor misses one.
        state = sampler.state_dict()
        assert (state["step"], state["pending"], state["acknowledged_step"]) == (number + 1, [], number + 1)
    assert client.get_experiment(exp_name).step == 3


def test_overlapped_reports_survive_trainer_crashes_at_any_moment(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    """SIGKILL a trainer that reports in the background and checkpoints after
    every step, at random moments (drawing, reporting, in the stand-in
    gradient step while the report runs, writing the checkpoint), resume it
    from its last checkpoint each time: the server ends with an
    uninterrupted run's step, batches and posterior, bit for bit."""
    import random
    import subprocess
    import sys
    import time

    from tests.support.servers import REPO

    steps = 24

    def run(name: str, checkpoint: Path, kill_after: float | None) -> bool:
        """One trainer process; True if it finished (before the kill, if
        any), False if it was killed. A run that is not killed must finish:
        its error fails the test (instead of another resume, for ever)."""
        stderr = tmp_path / "stderr"
        with stderr.open("w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.overlap_trainer", address, name, str(checkpoint), str(steps)],
                cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", stderr.read_text()[-3000:]
        if kill_after is not None:
            time.sleep(kill_after)
            proc.kill()
        code = proc.wait(120)
        assert kill_after is not None or code == 0, stderr.read_text()[-3000:]
        return code == 0

    assert run(exp_name + "-ref", tmp_path / "ref.json", None)
    rng = random.Random(20261125)
    kills = 0
    while not run(exp_name, tmp_path / "crash.json", rng.uniform(0.0, 0.3) if kills < 8 else None):
        kills += 1
    assert kills >= 3  # most kills land mid-run (the last ones may come after a short rest of it)
    ref, got = client.snapshot(exp_name + "-ref"), client.snapshot(exp_name)
    assert got.step == ref.step == steps
    assert got.keys == ref.keys
    assert got.alpha.tobytes() == ref.alpha.tobytes() and got.beta.tobytes() == ref.beta.tobytes()
