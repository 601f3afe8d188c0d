"""ReportAndSelect: one training step in one call and one transaction. It
must do exactly what ReportOutcomes then SelectBatch do, apply both or
neither, and answer a retry as the first call."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import bots_client
from tests.api.conftest import Endpoint
from tests.api.test_contract import experiment


def outcomes_for(keys: list[str], step: int) -> dict[str, tuple[float, int]]:
    """Outcomes that vary with the task and the step, so that every step moves the posterior."""
    return {k: (float((i * 7 + step * 3) % 17), 16) for i, k in enumerate(keys)}


def assert_same_state(client: bots_client.Client, a: str, b: str) -> None:
    left, right = client.snapshot(a), client.snapshot(b)
    assert (left.step, left.keys) == (right.step, right.keys)
    np.testing.assert_array_equal(left.alpha, right.alpha)
    np.testing.assert_array_equal(left.beta, right.beta)
    assert client.get_experiment(a).open_batches == client.get_experiment(b).open_batches


@pytest.mark.parametrize("strategy", ["bots", "mopps"])
def test_it_gives_the_batches_and_posterior_of_separate_calls(client: bots_client.Client, strategy: str) -> None:
    """Twin experiments, one stepped by ReportOutcomes + SelectBatch, one by
    ReportAndSelect, with the same request keys and outcomes, and a second
    batch kept open throughout (its tasks stay leased): every batch and the
    posterior after every step are the same, bit for bit."""
    separate, combined = (experiment(client, n=60, strategy=strategy, seed=3) for _ in range(2))
    for name in (separate, combined):
        client.select_batch(name, 5, request_key="held-open")
    current = {name: client.select_batch(name, 8, request_key="step-0") for name in (separate, combined)}
    assert current[separate].keys == current[combined].keys
    for step in range(1, 6):
        outcomes = outcomes_for(current[separate].keys, step)
        report = client.report_outcomes(separate, current[separate].batch_id, outcomes)
        current[separate] = client.select_batch(separate, 8, request_key=f"step-{step}")
        result, current[combined] = client.report_and_select(
            combined, current[combined].batch_id, outcomes, 8, request_key=f"step-{step}"
        )
        assert (result.step, result.capability, result.duplicate) == (report.step, report.capability, False)
        assert current[combined].keys == current[separate].keys
        assert current[combined].step == current[separate].step == step
        assert current[combined].request_key == f"step-{step}"
        assert_same_state(client, separate, combined)


def test_a_retry_gets_the_same_answer_and_applies_nothing_again(client: bots_client.Client) -> None:
    name = experiment(client)
    batch = client.select_batch(name, 4, request_key="s0")
    outcomes = outcomes_for(batch.keys, 0)
    first, next_batch = client.report_and_select(name, batch.batch_id, outcomes, 4, request_key="s1")
    before = client.snapshot(name)
    again, same_batch = client.report_and_select(name, batch.batch_id, outcomes, 4, request_key="s1")
    assert (again.step, again.capability, again.duplicate) == (first.step, first.capability, True)
    assert (same_batch.batch_id, same_batch.keys) == (next_batch.batch_id, next_batch.keys)
    after = client.snapshot(name)
    assert after.step == before.step == 1
    np.testing.assert_array_equal(after.alpha, before.alpha)
    assert client.get_experiment(name).open_batches == 1
    with pytest.raises(bots_client.FailedPreconditionError, match="already reported at step 1"):
        client.report_and_select(name, batch.batch_id, dict.fromkeys(batch.keys, (0, 16)), 4, request_key="s1")


def test_a_rejected_select_leaves_the_report_unapplied(client: bots_client.Client) -> None:
    """Both or neither: a batch larger than the free tasks rejects the call,
    and the reported batch stays open, still to be reported."""
    name = experiment(client, n=12)
    held = client.select_batch(name, 6, request_key="held")
    batch = client.select_batch(name, 4, request_key="s0")
    before = client.snapshot(name)
    # After the report, 12 - 6 held = 6 tasks are free.
    with pytest.raises(bots_client.FailedPreconditionError, match="are free"):
        client.report_and_select(name, batch.batch_id, outcomes_for(batch.keys, 0), 7, request_key="s1")
    after = client.snapshot(name)
    assert after.step == before.step == 0
    np.testing.assert_array_equal(after.alpha, before.alpha)
    assert client.get_experiment(name).open_batches == 2
    result, following = client.report_and_select(name, batch.batch_id, outcomes_for(batch.keys, 0), 6, request_key="s1")
    assert (result.step, result.duplicate) == (1, False)
    assert not set(following.keys) & set(held.keys)


def test_a_request_key_with_a_batch_gets_that_batch_or_nothing_is_applied(client: bots_client.Client) -> None:
    """As SelectBatch: a request key that has its batch gets it back (the
    report is applied); for another batch size the call is rejected, and
    then the report is not applied either."""
    name = experiment(client, n=30)
    batch = client.select_batch(name, 4, request_key="s0")
    taken = client.select_batch(name, 3, request_key="taken")
    with pytest.raises(bots_client.FailedPreconditionError, match="already used"):
        client.report_and_select(name, batch.batch_id, outcomes_for(batch.keys, 0), 4, request_key="taken")
    assert client.get_experiment(name).step == 0
    result, same = client.report_and_select(name, batch.batch_id, outcomes_for(batch.keys, 0), 3, request_key="taken")
    assert (result.step, result.duplicate) == (1, False)
    assert (same.batch_id, same.keys, same.step) == (taken.batch_id, taken.keys, 0)


def test_after_a_report_of_its_own_the_select_stands_alone(client: bots_client.Client) -> None:
    """A batch already reported by ReportOutcomes: the report part answers
    as a duplicate, and the select happens."""
    name = experiment(client)
    batch = client.select_batch(name, 4, request_key="s0")
    outcomes = outcomes_for(batch.keys, 0)
    client.report_outcomes(name, batch.batch_id, outcomes)
    result, following = client.report_and_select(name, batch.batch_id, outcomes, 4, request_key="s1")
    assert (result.step, result.duplicate) == (1, True)
    assert following.step == 1
    assert client.get_experiment(name).open_batches == 1


def test_the_async_client_mirrors_the_sync_one(client: bots_client.Client, endpoint: Endpoint) -> None:
    sync_name, async_name = (experiment(client, n=20, seed=1) for _ in range(2))

    def sync_steps() -> list[list[str]]:
        batch = client.select_batch(sync_name, 4, request_key="s0")
        picked = [batch.keys]
        for step in range(1, 4):
            outcomes = outcomes_for(batch.keys, step)
            _, batch = client.report_and_select(sync_name, batch.batch_id, outcomes, 4, request_key=f"s{step}")
            picked.append(batch.keys)
        return picked

    async def async_steps() -> list[list[str]]:
        async with endpoint.connect_async(retry_timeout=5) as aclient:
            batch = await aclient.select_batch(async_name, 4, request_key="s0")
            picked = [batch.keys]
            for step in range(1, 4):
                outcomes = outcomes_for(batch.keys, step)
                _, batch = await aclient.report_and_select(
                    async_name, batch.batch_id, outcomes, 4, request_key=f"s{step}"
                )
                picked.append(batch.keys)
            return picked

    assert asyncio.run(async_steps()) == sync_steps()
    assert_same_state(client, sync_name, async_name)
