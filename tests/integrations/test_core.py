"""The framework-free core of the integrations (no torch needed), against a
real server."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any

import pytest

import bots_client
from bots_client.integrations import Curriculum, aggregate_outcomes, merge_outcomes
from bots_client.integrations._core import EmptyReportError, UnattributedOutcomesError, address_and_experiment
from tests.integrations.conftest import EXACT, counts


def test_import_bots_client_does_not_import_frameworks() -> None:
    import subprocess
    import sys

    code = (
        "import sys, bots_client, bots_client.integrations, bots_client.integrations.trinity, "
        "bots_client.integrations.vllm, bots_client.integrations.torch, bots_client.integrations.verl, "
        "bots_client.integrations.trl\n"
        "loaded = [m for m in ('torch', 'verl', 'trl', 'trinity', 'vllm', 'transformers') if m in sys.modules]\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_aggregate_outcomes_counts_every_rollout_without_filtering() -> None:
    keys = ["a", "b", "a", "c", "b", "a", "c", "c"]
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.2, 0.0, 0.0]
    assert aggregate_outcomes(keys, rewards) == {"a": (2.0, 3), "b": (0.0, 2), "c": (0.0, 3)}
    # -1/+1 rewards with threshold 0; None (reward not applicable) is skipped.
    assert aggregate_outcomes(["x", "x", "x", "y"], [1, -1, None, -1], success_threshold=0.0) == {
        "x": (1.0, 2),
        "y": (0.0, 1),
    }
    # Fractional rewards carry their sum of squares: 0.25^2 + 1^2.
    fractional = aggregate_outcomes(["x", "x"], [0.25, 1.0], success_threshold=None)
    assert fractional == {"x": (1.25, 2, 1.0625)}
    with pytest.raises(ValueError, match="outside"):
        aggregate_outcomes(["x"], [2.0], success_threshold=None)
    with pytest.raises(ValueError, match="NaN"):
        aggregate_outcomes(["x"], [math.nan])
    with pytest.raises(ValueError, match="one of each"):
        aggregate_outcomes(["x", "y"], [1.0])
    assert merge_outcomes([{"a": (1, 2)}, {"a": (2, 2), "b": (0, 4)}]) == {"a": (3.0, 4), "b": (0.0, 4)}


def test_merged_outcomes_keep_the_sum_of_squares_only_when_every_rank_has_it() -> None:
    merged = merge_outcomes([{"a": (0.5, 2, 0.25), "b": (1.0, 2, 0.5)}, {"a": (1.5, 2, 1.25), "b": (1, 2)}])
    assert merged == {"a": (2.0, 4, 1.5), "b": (2.0, 4)}


def test_informative_means_rewards_that_differ() -> None:
    from bots_client.integrations._core import rewards_differ

    assert rewards_differ((3, 8)) and not rewards_differ((0, 8)) and not rewards_differ((8, 8))
    # Eight rewards of 0.3: mean 0.3, no spread (the float sums are not exact).
    same = aggregate_outcomes(["t"] * 8, [0.3] * 8, success_threshold=None)["t"]
    assert not rewards_differ(same)
    spread = aggregate_outcomes(["t"] * 2, [0.2, 0.4], success_threshold=None)["t"]
    assert rewards_differ(spread)


def test_address_and_experiment_come_from_the_config_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BOTS_ADDRESS", raising=False)
    monkeypatch.delenv("BOTS_EXPERIMENT", raising=False)
    given = {"address": "h:1", "experiment": "e"}
    assert address_and_experiment(given, "BotsSelector", "kwargs.") == ("h:1", "e")
    with pytest.raises(ValueError, match=r"BotsSelector needs kwargs.address and kwargs.experiment \(or the BOTS_ADDRESS"):
        address_and_experiment({"address": "h:1"}, "BotsSelector", "kwargs.")
    monkeypatch.setenv("BOTS_ADDRESS", "env:2")
    monkeypatch.setenv("BOTS_EXPERIMENT", "from-env")
    assert address_and_experiment({}, "BotsRLDataset", "+data.bots.") == ("env:2", "from-env")
    assert address_and_experiment(given, "BotsRLDataset", "+data.bots.") == ("h:1", "e")  # the config wins


def test_setup_creates_adds_tasks_with_features_and_reattaches(client: bots_client.Client, exp_name: str) -> None:
    keys = [f"k{i}" for i in range(10)]
    features = [{"weak": 0.01 * i, "strong": 0.1 * i} for i in range(10)]
    config = bots_client.ExperimentConfig(weak_feature="weak", strong_feature="strong", seed=3)
    first = Curriculum(client, exp_name, keys, batch_size=4, config=config, features=features)
    batch = first.select()
    assert batch.number == 0 and batch.request_key == "step-0" and len(batch.keys) == 4
    assert [keys[i] for i in batch.indices] == list(batch.keys)
    assert client.get_experiment(exp_name).num_tasks == 10
    # A second curriculum (a restarted trainer, saying it resumes) attaches
    # without adding again, and the same batch number gives the same batch.
    again = Curriculum(client.target, exp_name, keys, batch_size=4, config=config, features=features, resume=True)
    assert again.select(0) == batch
    # A dataset that grew: the missing tasks are added.
    grown = Curriculum(client, exp_name, keys + ["k10", "k11"], batch_size=4, resume=True)
    grown.ensure_ready()
    assert client.get_experiment(exp_name).num_tasks == 12


def test_setup_goes_on_when_a_retried_upload_finds_its_tasks_there(client: bots_client.Client, exp_name: str) -> None:
    # The client retries AddTasks after UNAVAILABLE; when the first attempt
    # was applied and its answer lost (a server restart), the retry gets
    # ALREADY_EXISTS, and the trainer stopped at its start.
    upload = client.add_tasks

    def applied_then_retried(experiment: str, tasks: Any) -> int:
        tasks = list(tasks)
        upload(experiment, tasks)
        return upload(experiment, tasks)  # the retry: the server's real answer to a repeat

    client.add_tasks = applied_then_retried  # type: ignore[method-assign]
    keys = [f"k{i}" for i in range(6)]
    Curriculum(client, exp_name, keys, batch_size=2, config=EXACT).ensure_ready()
    assert client.get_experiment(exp_name).num_tasks == 6
    # A real conflict still raises: the upload is refused and a task is missing.
    client.add_tasks = lambda experiment, tasks: upload(experiment, [bots_client.Task("k0")])  # type: ignore[method-assign]
    with pytest.raises(bots_client.AlreadyExistsError):
        Curriculum(client, exp_name, [*keys, "k6"], batch_size=2, resume=True).ensure_ready()


def test_setup_errors_are_explicit(client: bots_client.Client, exp_name: str) -> None:
    with pytest.raises(ValueError, match="unique"):
        Curriculum(client, exp_name, ["a", "b", "a"], batch_size=1)
    with pytest.raises(ValueError, match="larger than the dataset"):
        Curriculum(client, exp_name, ["a"], batch_size=2)
    with pytest.raises(bots_client.NotFoundError, match="pass config="):
        Curriculum(client, exp_name, ["a", "b"], batch_size=1).ensure_ready()
    Curriculum(client, exp_name, ["a", "b", "c"], batch_size=1, config=EXACT).ensure_ready()
    with pytest.raises(ValueError, match="not in this dataset"):
        Curriculum(client, exp_name, ["a", "b"], batch_size=1).ensure_ready()


def test_non_reporting_rank_waits_for_setup(client: bots_client.Client, exp_name: str) -> None:
    keys = [f"k{i}" for i in range(8)]
    follower = Curriculum(client.target, exp_name, keys, batch_size=2, config=EXACT, rank=1, world_size=2)
    leader = Curriculum(client.target, exp_name, keys, batch_size=2, config=EXACT, rank=0, world_size=2)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("b", follower.select(0)))
    t.start()  # polls: the experiment does not exist yet
    assert leader.select(0) is not None
    t.join(30)
    assert got["b"].batch_id == leader.select(0).batch_id


def test_report_routes_keys_to_their_open_batches(client: bots_client.Client, exp_name: str) -> None:
    keys = [f"k{i}" for i in range(12)]
    cur = Curriculum(client, exp_name, keys, batch_size=3, config=EXACT)
    b0, b1 = cur.select(), cur.select()  # two batches in flight: disjoint (leases)
    assert not set(b0.keys) & set(b1.keys)
    outcomes = dict.fromkeys(b0.keys, (1.0, 4)) | dict.fromkeys(b1.keys, (3.0, 4))
    results = cur.report(outcomes)
    assert len(results) == 2 and client.get_experiment(exp_name).step == 2
    assert cur.open_batches == []
    got = counts(client, exp_name)
    assert all(got[k] == (1.0, 3.0) for k in b0.keys) and all(got[k] == (3.0, 1.0) for k in b1.keys)
    with pytest.raises(ValueError, match="no open batch"):
        cur.report({b0.keys[0]: (1.0, 4)})


def test_non_strict_report_drops_strays_and_non_reporter_never_calls(
    client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [f"k{i}" for i in range(6)]
    cur = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    batch = cur.select()
    with caplog.at_level(logging.WARNING, logger="bots_client.integrations"):
        cur.report({batch.keys[0]: (1, 2), "k-unknown": (1, 2)}, strict=False)
    assert "no open batch" in caplog.text
    assert client.get_experiment(exp_name).step == 1
    # What a lenient report drops is counted, and the count reaches the signals.
    assert cur.dropped_outcomes == 1 and cur.last_signals is not None
    assert cur.last_signals.as_dict()["curriculum/dropped_outcomes"] == 1.0
    other = Curriculum(client, exp_name, keys, batch_size=2, rank=1, world_size=2)
    b = other.select(1)
    assert other.report(dict.fromkeys(b.keys, (1, 2))) == []
    assert client.get_experiment(exp_name).step == 1  # rank 1 never reports
    assert other.open_batches == []  # but it closed the batch locally


def test_a_report_with_no_outcome_raises_instead_of_vanishing(
    client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Every reward None (a reward function that applies to none of the
    # rollouts): nothing can be sent, so the trainer hears of it, in the
    # foreground and in the background alike, and the batch stays open.
    keys = [f"k{i}" for i in range(6)]
    cur = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    batch = cur.select()
    nothing = aggregate_outcomes(list(batch.keys), [None, None])
    assert nothing == {}
    with pytest.raises(EmptyReportError, match=f"no task outcomes to report for batch {batch.number}"):
        cur.report(nothing, batch=batch)
    with pytest.raises(EmptyReportError, match="every reward was None"):
        cur.report_in_background(nothing)
    assert [b.batch_id for b in cur.open_batches] == [batch.batch_id]
    with caplog.at_level(logging.ERROR, logger="bots_client.integrations"):
        assert cur.report(nothing, strict=False) == []
    assert "no task outcomes to report" in caplog.text
    assert client.get_experiment(exp_name).step == 0 and client.get_experiment(exp_name).open_batches == 1
    assert cur.report(dict.fromkeys(batch.keys, (1.0, 2)), batch=batch)[0].step == 1  # the batch is still reportable
    # Another rank's outcomes are never sent (gather=False: only the
    # reporting rank's count), so it has nothing to lose and goes on.
    other = Curriculum(client, exp_name, keys, batch_size=2, rank=1, world_size=2)
    assert other.report(nothing, batch=other.select(1)) == []


def test_replayed_batch_after_a_crash_keeps_the_first_report(
    client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [f"k{i}" for i in range(6)]
    before = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    batch = before.select(0)
    before.report(dict.fromkeys(batch.keys, (2, 2)))
    # The trainer crashed before its checkpoint: the restarted one replays
    # batch 0 (same request key -> same batch) with new rollouts.
    after = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT, resume=True)
    assert after.select(0).batch_id == batch.batch_id
    with caplog.at_level(logging.WARNING, logger="bots_client.integrations"):
        assert after.report(dict.fromkeys(batch.keys, (0, 2))) == []
    assert "already reported" in caplog.text
    assert client.get_experiment(exp_name).step == 1
    assert all(counts(client, exp_name)[k] == (2.0, 0.0) for k in batch.keys)


def test_a_new_run_never_lands_in_an_old_experiment(client: bots_client.Client, exp_name: str) -> None:
    keys = [f"k{i}" for i in range(6)]
    first = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    first.report(dict.fromkeys(first.select().keys, (1, 2)))
    # Another config under the same name: refused, resuming or not.
    for resume in (False, True):
        other = dataclasses.replace(EXACT, rollouts_per_task=8)
        with pytest.raises(bots_client.ConfigMismatchError, match="rollouts_per_task: requested 8, existing 16"):
            Curriculum(client, exp_name, keys, batch_size=2, config=other, resume=resume).ensure_ready()
    # The same config, or none, but a run that did not say it continues: refused.
    for config in (EXACT, None):
        with pytest.raises(bots_client.ExperimentInUseError, match="1 reported steps.*resume=True"):
            Curriculum(client, exp_name, keys, batch_size=2, config=config).ensure_ready()
    assert client.get_experiment(exp_name).step == 1  # nothing was drawn or reported
    # Continuing is explicit: the flag, or a checkpoint's state.
    Curriculum(client, exp_name, keys, batch_size=2, config=EXACT, resume=True).ensure_ready()
    resumed = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    assert resumed.resume_number(first.resume_state(1), 1) == 1
    assert resumed.select(1).number == 1


def test_a_task_in_two_open_batches_never_mixes_their_outcomes(client: bots_client.Client, exp_name: str) -> None:
    keys = [f"k{i}" for i in range(5)]
    # A short lease: batch 0's tasks are free again while it is still open here.
    config = dataclasses.replace(EXACT, lease_ttl_seconds=0.5)
    cur = Curriculum(client, exp_name, keys, batch_size=4, config=config)
    b0 = cur.select()
    time.sleep(1.0)
    b1 = cur.select()
    shared = set(b0.keys) & set(b1.keys)
    assert len(shared) >= 3  # 4 of 5 tasks twice: at least 3 in both
    # Batch 0's rollouts, reported without naming the batch: only batch 0
    # holds all their keys, so all of them go there.
    cur.report(dict.fromkeys(b0.keys, (2.0, 2)))
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (1, 1) and cur.open_batches == [b1]  # batch 1 untouched
    # A part of batch 1 that batch 0 also held is ambiguous once batch 0 is
    # open again; nothing is sent.
    again = cur.select(0)
    assert again.batch_id == b0.batch_id
    part = dict.fromkeys(shared, (0.0, 2))
    with pytest.raises(UnattributedOutcomesError, match="several open batches"):
        cur.report(part)
    # Naming the batch settles it; a key outside the named batch is refused.
    outside = next(k for k in keys if k not in b1.keys)
    with pytest.raises(UnattributedOutcomesError, match="not in batch 1"):
        cur.report({**part, outside: (1.0, 2)}, batch=b1)
    assert client.get_experiment(exp_name).step == 1
    cur.report(dict.fromkeys(b1.keys, (0.0, 2)), batch=b1.number)
    got = counts(client, exp_name)
    for key in keys:
        assert got[key] == ((2.0 if key in b0.keys else 0.0), (2.0 if key in b1.keys else 0.0)), key


def test_a_report_repeated_by_mistake_is_never_filed_under_the_batch_drawn_ahead(
    client: bots_client.Client, exp_name: str
) -> None:
    keys = [f"k{i}" for i in range(4)]
    cur = Curriculum(client, exp_name, keys, batch_size=4, config=EXACT)
    batch = cur.select()
    solved = dict.fromkeys(batch.keys, (2.0, 2))
    cur.report_in_background(solved)  # also draws batch 1 (ReportAndSelect): the same four tasks
    cur.wait()
    # The same report again: batch 1 holds every key, but the trainer has
    # not drawn it yet, so these outcomes cannot be its.
    with pytest.raises(UnattributedOutcomesError, match="in no open batch"):
        cur.report_in_background(solved)
    ahead = cur.select()
    assert ahead.number == 1 and ahead in cur.open_batches
    cur.report(dict.fromkeys(ahead.keys, (0.0, 2)))
    assert client.get_experiment(exp_name).step == 2
    assert all(counts(client, exp_name)[k] == (2.0, 2.0) for k in keys)


def test_a_batch_whose_report_failed_and_was_given_up_is_not_drawn_again_on_resume(
    client: bots_client.Client, exp_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [f"k{i}" for i in range(8)]
    cur = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    cur.report(dict.fromkeys(cur.select().keys, (1.0, 2)))
    failed = cur.select()
    cur.report_in_background(dict.fromkeys(failed.keys, (3.0, 2)))  # successes > trials: the server refuses it
    with pytest.raises(bots_client.InvalidArgumentError):
        cur.wait()
    assert failed in cur.open_batches  # still open: the trainer may report it again
    # The trainer caught the error and went on with batches 2 and 3.
    for _ in range(2):
        cur.report(dict.fromkeys(cur.select().keys, (0.0, 2)))
    with caplog.at_level(logging.WARNING, logger="bots_client.integrations"):
        state = cur.checkpoint_state(4)
    assert state["pending"] == [] and "batch 1's report failed" in caplog.text
    # A resume from that checkpoint goes on at batch 4: batches 2 and 3 are not trained again.
    resumed = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    assert resumed.resume_from(state, "test") == 4
    # A failed report that is still the newest is in flight: a resume draws it again.
    retry = Curriculum(client, f"{exp_name}-newest", keys, batch_size=2, config=EXACT)
    last = retry.select()
    with pytest.raises(bots_client.InvalidArgumentError):
        retry.report(dict.fromkeys(last.keys, (3.0, 2)))
    assert retry.checkpoint_state(1)["pending"] == [0]


def test_a_resume_after_reports_out_of_order_draws_the_batch_never_reported(
    client: bots_client.Client, exp_name: str
) -> None:
    # An asynchronous trainer reports batches as their rollouts finish, not
    # in the order it drew them. Counting the server's steps since the
    # checkpoint cannot tell which pending batch the server got: the server
    # says so for each request key.
    keys = [f"k{i}" for i in range(12)]
    run = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    first, second = run.select(), run.select()
    state = run.checkpoint_state(2)
    assert state["pending"] == [0, 1]
    run.report(dict.fromkeys(second.keys, (1.0, 2)), batch=second)  # batch 1 finished first; then a crash
    resumed = Curriculum(client, exp_name, keys, batch_size=2, config=EXACT)
    assert resumed.resume_from(state, "test") == 0  # batch 0 is drawn again: its report never came
    assert resumed.select(0).batch_id == first.batch_id
    assert resumed.report(dict.fromkeys(first.keys, (2.0, 2))) != []
    assert client.select_batch(exp_name, 2, request_key="step-1").reported_step == 1  # what the server says
    assert resumed.select(1).batch_id == second.batch_id
    assert resumed.report(dict.fromkeys(second.keys, (0.0, 2))) == []  # the first report of batch 1 stands
    assert client.get_experiment(exp_name).step == 2

    # A report of a batch drawn after the checkpoint is no news of the
    # batches pending at it either.
    other = f"{exp_name}-later"
    run = Curriculum(client, other, keys, batch_size=2, config=EXACT)
    pending = run.select()
    state = run.checkpoint_state(1)
    later = run.select()
    run.report(dict.fromkeys(later.keys, (1.0, 2)), batch=later)
    resumed = Curriculum(client, other, keys, batch_size=2, config=EXACT)
    assert resumed.resume_from(state, "test") == 0
    assert resumed.select(0).batch_id == pending.batch_id


def test_curriculum_pickles_without_its_channel(client: bots_client.Client, exp_name: str) -> None:
    import pickle

    with bots_client.Client(client.target, timeout=1.5, retry_timeout=2.0) as patient:
        cur = Curriculum(patient, exp_name, ["a", "b", "c"], batch_size=1, config=EXACT)
        first = cur.select()
        copy = pickle.loads(pickle.dumps(cur))
        assert copy.select(0).batch_id == first.batch_id  # reconnects to the same address
        assert (copy.client.timeout, copy.client.retry_timeout) == (1.5, 2.0)  # with the same timeouts
        copy.client.close()


def test_every_integration_has_a_docs_page_with_a_snippet() -> None:
    from tests.support.servers import REPO

    docs = REPO / "docs" / "integrations"
    index = (docs / "index.md").read_text()
    for page, entry in [
        ("torch.md", "BotsSampler"),
        ("verl.md", "BotsCurriculumSampler"),
        ("trl.md", "BotsGRPO"),
        ("trinity.md", "BotsSelector"),
        ("vllm.md", "rollout_and_report"),
    ]:
        text = (docs / page).read_text()
        assert f"({page})" in index and "```" in text and entry in text, page
    assert (REPO / "examples" / "grpo_curriculum" / "README.md").exists()
