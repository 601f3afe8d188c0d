"""Retiring and re-activating tasks in a live experiment: a retired task is
never selected, keeps its posterior and shows as retired in snapshots; a bad
request changes nothing; a task retired inside an open batch stays in it and
its report is applied; forks and restores keep retirements."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import numpy as np
import pytest

import bots_client
from bots_client import ExperimentConfig, Task
from tests.api.conftest import Endpoint

Code = grpc.StatusCode
KEYS = [f"t{i}" for i in range(12)]


def experiment(client: bots_client.Client, **config: object) -> str:
    name = f"retire-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name, ExperimentConfig(weak_feature="weak", strong_feature="strong", seed=1, **config))  # type: ignore[arg-type]
    client.add_tasks(name, [Task(k, {"weak": i / 24, "strong": 0.5 + i / 24}) for i, k in enumerate(KEYS)])
    return name


def retired_keys(snap: bots_client.Snapshot) -> set[str]:
    assert snap.retired is not None
    return {k for k, r in zip(snap.keys, snap.retired.tolist(), strict=True) if r}


def step(client: bots_client.Client, name: str, size: int, key: str) -> bots_client.Batch:
    batch = client.select_batch(name, size, request_key=key)
    client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (3, 8)))
    return batch


def test_retired_tasks_are_never_selected_and_reactivated_ones_are_again(client: bots_client.Client) -> None:
    name = experiment(client)
    step(client, name, 4, "warm-up")
    result = client.retire_tasks(name, KEYS[:5])
    assert (result.changed, result.num_retired, result.num_tasks) == (5, 5, 12)
    # The 7 active tasks are exactly what is selectable: batches of 7 take all of them.
    for i in range(6):
        assert set(step(client, name, 7, f"s{i}").keys) == set(KEYS[5:])
    with pytest.raises(bots_client.FailedPreconditionError, match="5 are retired"):
        client.select_batch(name, 8, request_key="too-big")

    assert client.reactivate_tasks(name, KEYS[:2]).num_retired == 3
    assert set(step(client, name, 9, "back").keys) == set(KEYS[:2] + KEYS[5:])
    assert retired_keys(client.snapshot(name)) == set(KEYS[2:5])


def test_retiring_keeps_the_posterior_and_an_idempotent_repeat_changes_nothing(client: bots_client.Client) -> None:
    name = experiment(client)
    step(client, name, 6, "one")
    before = client.snapshot(name)
    assert not before.retired.any()  # type: ignore[union-attr]
    client.retire_tasks(name, ["t3", "t7"])
    again = client.retire_tasks(name, ["t7", "t3"])
    assert (again.changed, again.num_retired) == (0, 2)
    after = client.snapshot(name)
    assert after.alpha.tobytes() == before.alpha.tobytes() and after.beta.tobytes() == before.beta.tobytes()
    assert after.step == before.step
    assert retired_keys(after) == {"t3", "t7"}
    assert client.reactivate_tasks(name, ["t0"]).changed == 0  # was not retired


def test_a_retired_task_keeps_being_updated_as_an_unselected_one(client: bots_client.Client) -> None:
    # rho 0, lambda 0.5, prior (1, 1), m 16. Step 1 reports every task 16 of 16:
    #   alpha = 0.5 * 1 + 0.5 * 1 + 16 = 17, beta = 0.5 + 0.5 + 0 = 1.
    # t0 is then retired; each later step moves it halfway to the prior:
    #   alpha 0.5 * 17 + 0.5 = 9, then 0.5 * 9 + 0.5 = 5; beta stays 1.
    name = experiment(client, implicit_weight=0.0, forgetting=0.5)
    batch = client.select_batch(name, 12, request_key="all")
    client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (16, 16)))
    client.retire_tasks(name, ["t0"])
    for s in range(2):
        assert "t0" not in step(client, name, 3, f"s{s}").keys
    snap = client.snapshot(name)
    i = snap.keys.index("t0")
    assert (snap.alpha[i], snap.beta[i]) == (5.0, 1.0)
    client.reactivate_tasks(name, ["t0"])
    assert "t0" in step(client, name, 12, "all-again").keys


def test_retiring_a_task_of_an_open_batch_keeps_the_batch_and_applies_its_report(client: bots_client.Client) -> None:
    name = experiment(client)
    batch = client.select_batch(name, 4, request_key="open")
    victim = batch.keys[0]
    i = client.snapshot(name).keys.index(victim)
    client.retire_tasks(name, [victim])
    # A retry of the request key returns the batch unchanged, retired task included.
    assert client.select_batch(name, 4, request_key="open") == batch
    before = client.snapshot(name)
    client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (16, 16)))
    after = client.snapshot(name)
    # BOTS explicit evidence: alpha <- (1 - lambda) alpha + lambda a0 + rho-part + rate * n; here rate 1, n 16.
    assert after.alpha[i] > before.alpha[i] + 15
    for s in range(4):
        assert victim not in step(client, name, 11, f"after-{s}").keys


def test_bad_retirements_are_rejected_and_change_nothing(client: bots_client.Client) -> None:
    name = experiment(client)
    client.retire_tasks(name, ["t1"])
    before = client.snapshot(name)
    cases = [
        (Code.INVALID_ARGUMENT, "has no tasks 'nope'", lambda: client.retire_tasks(name, ["t2", "nope", "t3"])),
        (Code.INVALID_ARGUMENT, "has no tasks 'x0', 'x1', 'x2', 'x3', 'x4' and 2 more",
         lambda: client.retire_tasks(name, [f"x{i}" for i in range(7)])),
        (Code.INVALID_ARGUMENT, "has no tasks 'gone'", lambda: client.reactivate_tasks(name, ["t1", "gone"])),
        (Code.INVALID_ARGUMENT, "appears more than once", lambda: client.retire_tasks(name, ["t2", "t2"])),
        (Code.INVALID_ARGUMENT, "no task keys given", lambda: client.retire_tasks(name, [])),
        (Code.INVALID_ARGUMENT, "task key is empty", lambda: client.retire_tasks(name, [""])),
        (Code.INVALID_ARGUMENT, "NUL", lambda: client.retire_tasks(name, ["a\x00b"])),
        (Code.INVALID_ARGUMENT, "longer than 1024", lambda: client.retire_tasks(name, ["k" * 1025])),
        (Code.NOT_FOUND, "not found", lambda: client.retire_tasks("no-such-experiment", ["t1"])),
        (Code.INVALID_ARGUMENT, "experiment name", lambda: client.reactivate_tasks("bad name!", ["t1"])),
    ]  # fmt: skip
    for code, fragment, call in cases:
        with pytest.raises(bots_client.BotsError) as info:
            call()
        assert info.value.code == code, (fragment, info.value)
        assert fragment in info.value.message, info.value.message
    after = client.snapshot(name)
    assert retired_keys(after) == {"t1"}
    assert after.alpha.tobytes() == before.alpha.tobytes() and after.step == before.step


def test_forks_and_restores_keep_retirements(client: bots_client.Client) -> None:
    name = experiment(client)
    step(client, name, 5, "one")
    client.retire_tasks(name, ["t4", "t9"])
    fork = f"{name}-fork"
    client.fork_experiment(name, fork)
    assert retired_keys(client.snapshot(fork)) == {"t4", "t9"}
    restored = f"{name}-restored"
    client.restore_experiment(restored, client.snapshot(name, include_features=True))
    snap = client.snapshot(restored)
    assert retired_keys(snap) == {"t4", "t9"}
    for target in (fork, restored):
        assert not {"t4", "t9"} & set(step(client, target, 10, "next").keys)
        client.reactivate_tasks(target, ["t4"])
        assert "t4" in step(client, target, 11, "all-but-one").keys


def test_the_async_client_retires_and_reactivates(client: bots_client.Client, endpoint: Endpoint) -> None:
    name = experiment(client)

    async def run() -> tuple[bots_client.RetireResult, bots_client.RetireResult]:
        async with endpoint.connect_async(retry_timeout=5) as aclient:
            retired = await aclient.retire_tasks(name, ["t0", "t1", "t2"])
            back = await aclient.reactivate_tasks(name, ["t1"])
            return retired, back

    retired, back = asyncio.run(run())
    assert (retired.changed, retired.num_retired, back.changed, back.num_retired) == (3, 3, 1, 2)
    assert retired_keys(client.snapshot(name)) == {"t0", "t2"}
    assert np.count_nonzero(client.snapshot(name).retired) == 2  # type: ignore[arg-type]
