"""Priors from reference pass rates (warm start): a task starts from
warm_start_scale pseudo-rollouts at the rate its reference features give,
whether it is added before the first step or to a running experiment; the
values are computed by hand below, and survive a crash bit for bit."""

from __future__ import annotations

import uuid

import pytest

import bots_client
from bots_client import ExperimentConfig, Task
from tests.support.servers import ServerProcess

# Scale 8, position 0.5, prior (1, 2): a task starts at
#   alpha = 1 + 8 * p0, beta = 2 + 8 * (1 - p0), p0 = w + (s - w) / 2.
CONFIG = ExperimentConfig(
    weak_feature="weak",
    strong_feature="strong",
    prior_alpha=1.0,
    prior_beta=2.0,
    warm_start_scale=8.0,
    warm_start_position=0.5,
    implicit_weight=0.0,  # unreported tasks then only feel forgetting: easy to follow by hand
    forgetting=0.25,
    seed=3,
)


def test_tasks_start_from_their_reference_rate_also_when_added_to_a_running_experiment(client: bots_client.Client) -> None:
    name = f"warm-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name, CONFIG)
    client.add_tasks(
        name,
        [
            Task("a", {"weak": 0.25, "strong": 0.75}),  # p0 0.5: (1 + 4, 2 + 4) = (5, 6)
            Task("b", {"weak": 0.0, "strong": 0.5}),  # p0 0.25: (1 + 2, 2 + 6) = (3, 8)
            Task("plain", {}),  # no reference features: the prior (1, 2)
        ],
    )
    snap = client.snapshot(name)
    assert snap.alpha.tolist() == [5.0, 3.0, 1.0]
    assert snap.beta.tolist() == [6.0, 8.0, 2.0]

    batch = client.select_batch(name, 1, request_key="one")
    client.report_outcomes(name, batch.batch_id, {batch.keys[0]: (4, 4)})
    # Added after step 1: starts at its own warm start, untouched by step 1.
    client.add_tasks(name, [Task("late", {"weak": 0.5, "strong": 1.0})])  # p0 0.75: (1 + 6, 2 + 2) = (7, 4)
    snap = client.snapshot(name)
    assert snap.keys[-1] == "late"
    assert (snap.alpha[-1], snap.beta[-1]) == (7.0, 4.0)
    # The tasks not reported at step 1 were pulled a quarter of the way to the
    # global prior (1, 2) (lambda 0.25, rho 0): 0.75 * x + 0.25 * x0.
    start = {"a": (5.0, 6.0), "b": (3.0, 8.0), "plain": (1.0, 2.0)}
    for key, (a0, b0) in start.items():
        if key == batch.keys[0]:
            continue
        i = snap.keys.index(key)
        assert snap.alpha[i] == pytest.approx(0.75 * a0 + 0.25 * 1.0, abs=1e-12)
        assert snap.beta[i] == pytest.approx(0.75 * b0 + 0.25 * 2.0, abs=1e-12)
    client.delete_experiment(name)


def test_warm_started_tasks_added_mid_run_replay_bit_identically_after_a_crash(tmp_path) -> None:
    db = f"sqlite:///{tmp_path / 'warm.db'}"
    args = ["--checkpoint-every-steps", "3", "--checkpoint-every-seconds", "3600"]
    server = ServerProcess(db, extra_args=args).start()
    try:
        with bots_client.Client(server.address) as client:
            client.create_experiment("warm", CONFIG)
            client.add_tasks("warm", [Task(f"t{i}", {"weak": i / 20, "strong": 0.5 + i / 40}) for i in range(12)])
            for step in range(5):  # checkpoint at 3, events 4-5 after it
                if step == 4:
                    client.add_tasks("warm", [Task("late", {"weak": 0.1, "strong": 0.9}), Task("bare", {})])
                batch = client.select_batch("warm", 4, request_key=f"s{step}")
                client.report_outcomes("warm", batch.batch_id, dict.fromkeys(batch.keys, (step % 3, 2)))
            before = client.snapshot("warm")
        server.kill()
        server = ServerProcess(db, extra_args=args).start()
        with bots_client.Client(server.address) as client:
            after = client.snapshot("warm")
        assert after.keys == before.keys
        assert after.alpha.tobytes() == before.alpha.tobytes()
        assert after.beta.tobytes() == before.beta.tobytes()
    finally:
        server.kill()
