"""The API contract, end to end: the Python client over a real socket to a
real server process, once on SQLite and once on PostgreSQL."""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid

import numpy as np
import pytest

import bots_client
from bots_client import ExperimentConfig, Task
from tests.api.conftest import Endpoint

_names = itertools.count()


def new_name() -> str:
    return f"exp-{next(_names)}-{uuid.uuid4().hex[:6]}"


def make_tasks(n: int, prefix: str = "t") -> list[Task]:
    rng = np.random.default_rng(0)
    weak = rng.uniform(0, 0.5, n)
    return [Task(f"{prefix}{i}", {"weak": float(weak[i]), "strong": float(weak[i] + 0.4)}) for i in range(n)]


def experiment(client: bots_client.Client, n: int = 50, **config: object) -> str:
    name = new_name()
    client.create_experiment(name, ExperimentConfig(weak_feature="weak", strong_feature="strong", **config))
    client.add_tasks(name, make_tasks(n))
    return name


def test_create_fills_defaults_and_round_trips_config(client: bots_client.Client) -> None:
    name = new_name()
    config = ExperimentConfig(
        strategy="mopps", target_success=0.3, forgetting=0.2, implicit_weight=0.0, rollouts_per_task=8,
        selection_mode="softmax", temperature=0.5, prior_alpha=2.0, prior_beta=3.0, seed=7, lease_ttl_seconds=60.0,
    )  # fmt: skip
    created = client.create_experiment(name, config)
    assert created.config == config
    fetched = client.get_experiment(name)
    assert (fetched.name, fetched.config, fetched.step, fetched.num_tasks) == (name, config, 0, 0)
    # Unset fields get the paper's reference defaults.
    default = client.create_experiment(new_name())
    assert default.config == ExperimentConfig()
    assert (default.config.target_success, default.config.forgetting, default.config.implicit_weight) == (0.5, 0.1, 0.1)
    assert default.config.rollouts_per_task == 16


def test_list_pages_through_every_experiment_and_delete_removes(client: bots_client.Client) -> None:
    names = {experiment(client, n=3) for _ in range(5)}
    listed = {e.name for e in client.list_experiments(page_size=2)}
    assert names <= listed
    victim = sorted(names)[0]
    client.delete_experiment(victim)
    with pytest.raises(bots_client.NotFoundError, match=victim):
        client.get_experiment(victim)
    assert victim not in {e.name for e in client.list_experiments()}
    # The name is free again, with a fresh state.
    client.create_experiment(victim)
    assert client.get_experiment(victim).num_tasks == 0


def test_same_request_key_returns_the_same_batch(client: bots_client.Client, endpoint: Endpoint) -> None:
    name = experiment(client)
    first = client.select_batch(name, 8, request_key="step-0")
    again = client.select_batch(name, 8, request_key="step-0")
    assert again == first
    assert len(set(first.keys)) == 8
    # Another rank asking with another client also gets it.
    other = endpoint.connect()
    assert other.select_batch(name, 8, request_key="step-0") == first
    other.close()
    assert first.reported_step is None
    # Once reported, the same key still gets the batch, with the step of its
    # report: a trainer resumed from a checkpoint learns that it need not
    # draw it again.
    before = client.select_batch(name, 8, request_key="before")
    client.report_outcomes(name, before.batch_id, dict.fromkeys(before.keys, (0, 2)))
    client.report_outcomes(name, first.batch_id, dict.fromkeys(first.keys, (1, 2)))
    reported = client.select_batch(name, 8, request_key="step-0")
    assert reported == dataclasses.replace(first, reported_step=2)
    assert client.get_experiment(name).step == 2  # and selects nothing


def test_open_batches_lease_their_tasks(client: bots_client.Client) -> None:
    name = experiment(client, n=20)
    a = client.select_batch(name, 8, request_key="a")
    b = client.select_batch(name, 8, request_key="b")
    assert not set(a.keys) & set(b.keys)
    assert client.get_experiment(name).open_batches == 2
    with pytest.raises(bots_client.FailedPreconditionError, match="only 4 of 20 tasks are free"):
        client.select_batch(name, 5, request_key="c")
    client.report_outcomes(name, a.batch_id, dict.fromkeys(a.keys, (1, 2)))
    c = client.select_batch(name, 12, request_key="c")
    assert not set(c.keys) & set(b.keys)  # b is still open


def test_expired_lease_frees_its_tasks(client: bots_client.Client) -> None:
    name = experiment(client, n=10, lease_ttl_seconds=0.5)
    first = client.select_batch(name, 10, request_key="first")
    with pytest.raises(bots_client.FailedPreconditionError):
        client.select_batch(name, 1, request_key="too-soon")
    time.sleep(0.7)
    assert client.get_experiment(name).open_batches == 0
    second = client.select_batch(name, 10, request_key="second")
    assert set(second.keys) == set(first.keys)
    # A report that arrives after its lease expired is still applied.
    result = client.report_outcomes(name, first.batch_id, {first.keys[0]: (4, 16)})
    assert result.step == 1 and not result.duplicate


def test_report_advances_step_and_retry_is_idempotent(client: bots_client.Client) -> None:
    name = experiment(client)
    batch = client.select_batch(name, 4, request_key="s0")
    outcomes = {k: (i, 16) for i, k in enumerate(batch.keys)}
    first = client.report_outcomes(name, batch.batch_id, outcomes)
    assert (first.step, first.duplicate) == (1, False)
    before = client.snapshot(name)
    retry = client.report_outcomes(name, batch.batch_id, dict(reversed(list(outcomes.items()))))
    assert (retry.step, retry.duplicate, retry.capability) == (1, True, first.capability)
    after = client.snapshot(name)
    assert after.step == 1
    np.testing.assert_array_equal(after.alpha, before.alpha)
    changed = dict(outcomes, **{batch.keys[0]: (5, 16)})
    with pytest.raises(bots_client.FailedPreconditionError, match="already reported at step 1"):
        client.report_outcomes(name, batch.batch_id, changed)


def test_batches_carry_the_step_they_were_selected_at(client: bots_client.Client) -> None:
    name = experiment(client)
    for step in range(3):
        batch = client.select_batch(name, 4, request_key=f"s{step}")
        assert batch.step == step
        assert client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (8, 16))).step == step + 1
    assert client.get_experiment(name).step == 3


def _reference_bots_step(
    alpha: dict[str, float], beta: dict[str, float], weak: dict[str, float], strong: dict[str, float],
    capability: float | None, reported: dict[str, tuple[float, int]], lam: float, rho: float, m: int,
) -> float:  # fmt: skip
    """DESIGN.md section 2 restated with plain floats; updates alpha/beta in place, returns c."""
    rates = {k: s / n for k, (s, n) in reported.items()}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    c_hat = (mean(list(rates.values())) - mean([weak[k] for k in rates])) / (
        mean([strong[k] for k in rates]) - mean([weak[k] for k in rates]) + 1e-6
    )
    c = c_hat if capability is None else 0.9 * capability + 0.1 * c_hat
    for k in alpha:
        p = rates[k] if k in rates else min(1.0, max(0.0, weak[k] + (strong[k] - weak[k]) * c))
        s_bar = rates[k] * m if k in rates else 0.0
        f_bar = (1 - rates[k]) * m if k in rates else 0.0
        alpha[k] = (1 - lam) * alpha[k] + lam * 1.0 + (1 - rho) * s_bar + rho * m * p
        beta[k] = (1 - lam) * beta[k] + lam * 1.0 + (1 - rho) * f_bar + rho * m * (1 - p)
    return c


def test_posterior_follows_the_bots_update_rule(client: bots_client.Client) -> None:
    """Three steps through the server equal a plain re-statement of the formulas."""
    name = new_name()
    client.create_experiment(name, ExperimentConfig(weak_feature="w", strong_feature="s", implicit_weight=0.3))
    weak = {"a": 0.1, "b": 0.2, "c": 0.5, "d": 0.0, "e": 0.9}
    strong = {"a": 0.6, "b": 0.4, "c": 1.0, "d": 0.3, "e": 1.0}
    client.add_tasks(name, [Task(k, {"w": weak[k], "s": strong[k]}) for k in weak])
    alpha = dict.fromkeys(weak, 1.0)
    beta = dict.fromkeys(weak, 1.0)
    capability = None
    for step in range(3):
        batch = client.select_batch(name, 2, request_key=f"s{step}")
        reported = {batch.keys[0]: (3.5, 16), batch.keys[1]: (16, 16)}  # fractional successes too
        result = client.report_outcomes(name, batch.batch_id, reported)
        capability = _reference_bots_step(alpha, beta, weak, strong, capability, reported, 0.1, 0.3, 16)
        assert result.capability == pytest.approx(capability, rel=1e-12)
    snap = client.snapshot(name)
    assert snap.step == 3
    for i, key in enumerate(snap.keys):
        assert snap.alpha[i] == pytest.approx(alpha[key], rel=1e-12)
        assert snap.beta[i] == pytest.approx(beta[key], rel=1e-12)


def test_mean_selection_picks_tasks_closest_to_target(client: bots_client.Client) -> None:
    name = new_name()
    client.create_experiment(name, ExperimentConfig(selection_mode="mean", strategy="mopps", forgetting=0.0))
    client.add_tasks(name, [Task(k) for k in "abcd"])
    first = client.select_batch(name, 4, request_key="warmup")
    # Posterior means after one MoPPS step: (1 + k) / (2 + 10).
    successes = {"a": 0, "b": 5, "c": 9, "d": 4}
    client.report_outcomes(name, first.batch_id, {k: (successes[k], 10) for k in first.keys})
    # Means 1/12, 6/12, 10/12, 5/12: closeness to 0.5 ranks b, d, c, a.
    assert client.select_batch(name, 2, request_key="pick").keys == ["b", "d"]


def test_snapshot_streams_large_pools_in_chunks(client: bots_client.Client) -> None:
    name = new_name()
    client.create_experiment(name)
    n = 60_000  # keys of ~70 bytes: ~5 MB, more than one gRPC message may carry
    keys = [f"dataset/split/{i:08d}/" + "x" * 50 for i in range(n)]
    assert client.add_tasks(name, (Task(k) for k in keys)) == n
    snap = client.snapshot(name)
    assert snap.keys == keys
    assert snap.alpha.shape == snap.beta.shape == (n,)
    assert np.all(snap.alpha == 1.0)


def test_async_client_mirrors_the_sync_one(endpoint: Endpoint) -> None:
    import asyncio

    async def run() -> None:
        async with endpoint.connect_async() as client:
            name = new_name()
            await client.create_experiment(name, ExperimentConfig(seed=3))
            assert await client.add_tasks(name, make_tasks(10)) == 10
            batch = await client.select_batch(name, 3, request_key="k")
            assert await client.select_batch(name, 3, request_key="k") == batch
            result = await client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 4)))
            assert result.step == 1
            snap = await client.snapshot(name)
            assert snap.step == 1 and len(snap.keys) == 10
            assert name in {e.name for e in await client.list_experiments()}
            await client.delete_experiment(name)
            with pytest.raises(bots_client.NotFoundError):
                await client.get_experiment(name)

    asyncio.run(run())


def test_add_tasks_appends_to_a_running_experiment(client: bots_client.Client) -> None:
    name = experiment(client, n=5)
    batch = client.select_batch(name, 5, request_key="s0")
    client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (8, 16)))
    assert client.add_tasks(name, [Task("late-1"), Task("late-2")]) == 7
    snap = client.snapshot(name)
    assert snap.keys[-2:] == ["late-1", "late-2"]
    assert list(snap.alpha[-2:]) == [1.0, 1.0]  # new tasks start at the prior
    assert client.select_batch(name, 7, request_key="s1").step == 1


def test_strategies_and_selection_modes_all_run(client: bots_client.Client) -> None:
    for strategy, mode in itertools.product(("bots", "mopps", "uniform"), ("thompson", "mean", "softmax")):
        name = experiment(client, n=12, strategy=strategy, selection_mode=mode)
        for step in range(2):
            batch = client.select_batch(name, 4, request_key=f"s{step}")
            assert len(set(batch.keys)) == 4
            client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (2, 4)))
        assert client.get_experiment(name).step == 2


def test_same_state_and_key_give_the_same_batch_on_a_twin_experiment(client: bots_client.Client) -> None:
    """Selection is a function of (seed, step, request key, posterior): a
    replica or a re-run reproduces it."""
    twins = [experiment(client, n=40, seed=11) for _ in range(2)]
    picks = [client.select_batch(name, 8, request_key="same").keys for name in twins]
    assert picks[0] == picks[1]
    other_seed = experiment(client, n=40, seed=12)
    assert client.select_batch(other_seed, 8, request_key="same").keys != picks[0]


def test_config_dataclass_matches_proto_defaults() -> None:
    from bots_client import _convert
    from bots_client.proto import bots_pb2

    assert _convert.config_from_proto(bots_pb2.ExperimentConfig()) == ExperimentConfig()
    every_field = dataclasses.replace(ExperimentConfig(), strategy="uniform", seed=5, weak_feature="w", strong_feature="s")
    assert _convert.config_from_proto(_convert.config_to_proto(every_field)) == every_field
