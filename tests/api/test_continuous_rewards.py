"""Continuous rewards over the API: a report that carries the sum of squared
rewards updates the posterior by the group's variance (engine/rewards.py),
on both backends; a retry must carry the same sums."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
from grpc import StatusCode as Code

import bots_client
from bots_client import ExperimentConfig, Task

# No forgetting and no plug-in: the posterior is the prior plus the evidence,
# rollouts_per_task times the rate the report counts as.
PLAIN = ExperimentConfig(forgetting=0.0, implicit_weight=0.0, rollouts_per_task=4, seed=1)


def reported(rewards: list[float]) -> tuple[float, int, float]:
    return math.fsum(rewards), len(rewards), math.fsum(r * r for r in rewards)


def test_the_posterior_takes_the_bernoulli_rate_of_the_groups_variance(client: bots_client.Client) -> None:
    name = f"continuous-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name, PLAIN)
    client.add_tasks(name, [Task(k) for k in ("flat", "spread", "binary")])
    batch = client.select_batch(name, 3, request_key="s0")
    spread = [0.0, 1.0, 0.5, 0.5]
    client.report_outcomes(
        name, batch.batch_id, {"flat": reported([0.5] * 4), "spread": reported(spread), "binary": (2.0, 4)}
    )
    snap = client.snapshot(name)
    got = {k: (float(a), float(b)) for k, a, b in zip(snap.keys, snap.alpha, snap.beta)}
    # flat: mean 1/2 without spread teaches nothing (rate 1); binary: 2 of 4.
    assert got["flat"] == (5.0, 1.0)
    assert got["binary"] == (3.0, 3.0)
    # spread: variance 1/8; the rate p with p (1 - p) = 1/8 above 1/2.
    p = max(float(r.real) for r in np.roots([1.0, -1.0, float(np.var(spread))]))
    assert got["spread"] == (pytest.approx(1 + 4 * p), pytest.approx(1 + 4 * (1 - p)))


def test_a_retry_must_carry_the_same_sums(client: bots_client.Client) -> None:
    name = f"continuous-retry-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name, PLAIN)
    client.add_tasks(name, [Task("t")])
    batch = client.select_batch(name, 1, request_key="s0")
    first = client.report_outcomes(name, batch.batch_id, {"t": (2.0, 4, 1.5)})
    again = client.report_outcomes(name, batch.batch_id, {"t": (2.0, 4, 1.5)})
    assert again.duplicate and again.step == first.step == 1
    with pytest.raises(bots_client.BotsError) as info:
        client.report_outcomes(name, batch.batch_id, {"t": (2.0, 4, 1.0)})
    assert info.value.code == Code.FAILED_PRECONDITION and "other outcomes" in info.value.message
