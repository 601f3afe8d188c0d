"""bots_client.integrations.trinity.

Trinity-RFT (it requires verl, which pins numpy < 2) is not in the project's
test environment. Most tests use its data shapes, from trinity-rft 0.6.0's
sources: the selector is built as `cls(data_source, config)` with
`data_source` an `_HFBatchReader` (`.dataset`, a HF Dataset with column
access; `.dataset_size`) and `config` a `DataSelectorConfig` (selector_type,
seed, feature_keys, kwargs); `feedback(indices, values)` gets each task's
mean reward from the `pass_rate_calculator` operator. The `test_real_trinity_*`
tests run Trinity's own registry, taskset reader, `TasksetScheduler`
(reads, restores from an explorer state, feedback), `Experience` and
operator where trinity-rft is installed (`make test-frameworks`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter, deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import bots_client
from bots_client.integrations import UnattributedOutcomesError
from bots_client.integrations.trinity import BotsSelector, experiment_config_from_trinity
from tests.integrations.conftest import EXACT, counts, need

N = 20
EXACT_4 = dataclasses.asdict(dataclasses.replace(EXACT, rollouts_per_task=4))


def reader(n: int = N) -> SimpleNamespace:
    columns = {
        "question": [f"q{i}" for i in range(n)],
        "answer": [str(i) for i in range(n)],
        "id": [f"id-{i}" for i in range(n)],
        "weak_pr": [0.05 * (i % 4) for i in range(n)],
        "strong_pr": [0.2 + 0.04 * i for i in range(n)],
    }
    return SimpleNamespace(dataset=columns, dataset_size=n)


def selector_config(address: str, experiment: str, **kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(
        selector_type="bots_client.integrations.trinity.BotsSelector",
        seed=42,
        feature_keys=kwargs.pop("feature_keys", []),
        kwargs={"address": address, "experiment": experiment, **kwargs},
    )


def recording(selector: BotsSelector) -> tuple[dict[str, Any], list[tuple[str, dict[str, tuple[float, int]], bool]]]:
    """Record every batch the selector draws (batch id -> SelectedBatch) and
    every report it sends: (request key, outcomes, answered as a duplicate)."""
    drawn: dict[str, Any] = {}
    reports: list[tuple[str, dict[str, tuple[float, int]], bool]] = []
    cur = selector.curriculum
    select, client = cur.select, cur.client
    report_outcomes = client.report_outcomes

    def recording_select(*args: Any, **kwargs: Any) -> Any:
        batch = select(*args, **kwargs)
        drawn[batch.batch_id] = batch
        return batch

    def recording_report(experiment: str, batch_id: str, outcomes: Any) -> Any:
        result = report_outcomes(experiment, batch_id, outcomes)
        reports.append((drawn[batch_id].request_key, dict(outcomes), result.duplicate))
        return result

    cur.select = recording_select
    client.report_outcomes = recording_report
    return drawn, reports


def applied(*report_lists: list[tuple[str, dict[str, tuple[float, int]], bool]]) -> dict[str, tuple[float, float]]:
    """key -> (successes, failures) the reports sent add up to (duplicates
    excluded), to compare with what the server applied (under EXACT)."""
    total: dict[str, list[float]] = {}
    for reports in report_lists:
        for _, outcomes, duplicate in reports:
            if duplicate:
                continue
            for key, (s, n) in outcomes.items():
                slot = total.setdefault(key, [0.0, 0.0])
                slot[0] += s
                slot[1] += n - s
    return {k: (s, f) for k, (s, f) in total.items()}


def assert_posterior_is(client: bots_client.Client, experiment: str, expected: dict[str, tuple[float, float]]) -> None:
    got = counts(client, experiment)
    for key, value in got.items():
        assert value == pytest.approx(expected.get(key, (0.0, 0.0))), key


def test_get_indices_feedback_and_checkpoint(address: str, client: bots_client.Client, exp_name: str) -> None:
    config = selector_config(address, exp_name, key_field="id", experiment_config=EXACT_4)
    selector = BotsSelector(reader(), config)
    selector.load_state_dict({"current_index": 0})  # what Trinity passes on a fresh start
    indices, extra = selector.get_indices(5, return_extra_info=True)
    assert len(indices) == 5 and extra["keys"] == [f"id-{i}" for i in indices]
    assert [b["request_key"] for b in extra["batches"]] == ["step-0"]
    # Trinity passes each task's mean reward (pass rate over its rollouts).
    values = [0.0, 0.25, 0.5, 1.0, 0.75]
    results = selector.feedback(indices.tolist(), values)
    assert [r.step for r in results] == [1]
    got = counts(client, exp_name)
    assert selector.rollouts_per_task == 4
    for i, v in zip(indices, values):
        assert got[f"id-{i}"] == (v * 4, (1 - v) * 4)

    # A second feedback for a step already reported is a loss, not a no-op:
    # it raises before anything is sent.
    with pytest.raises(UnattributedOutcomesError, match="in no open batch"):
        selector.update(indices.tolist(), values)
    assert client.get_experiment(exp_name).step == 1 and selector.dropped_outcomes == 0
    # Feedback that is not a mean reward in [0, 1] is refused, not clamped.
    second = selector.get_indices(5)
    with pytest.raises(ValueError, match=r"not a mean reward in \[0, 1\]"):
        selector.feedback(second.tolist(), [-1.0, 1.0, 0.0, 0.5, 0.5])
    with pytest.raises(ValueError, match="2 indices but 1 values"):
        selector.feedback([0, 1], [0.5])

    state = selector.state_dict()
    assert json.loads(json.dumps(state)) == state == {
        "current_index": 10, "experiment": exp_name, "step": 2, "pending": [1], "pending_sizes": [5],
        "acknowledged_step": 1,
    }  # fmt: skip
    with pytest.raises(ValueError, match="checkpoint is of experiment"):
        BotsSelector(reader(), config).load_state_dict({**state, "experiment": "other"})
    # A checkpoint whose experiment the server does not have: no silent fresh start.
    gone = selector_config(address, exp_name + "-gone", key_field="id", experiment_config=EXACT_4)
    with pytest.raises(bots_client.NotFoundError, match="does not exist on"):
        BotsSelector(reader(), gone).load_state_dict({**state, "experiment": exp_name + "-gone"})


def test_an_explorer_that_never_feeds_back_is_stopped(address: str, client: bots_client.Client, exp_name: str) -> None:
    """Without the pass_rate_calculator operator Trinity never calls
    feedback: the posterior would never move. The selector stops the run
    before it forgets batches (strict), or forgets the oldest with an error."""
    from bots_client.integrations._core import MAX_OPEN_BATCHES

    for strict in (True, False):
        name = f"{exp_name}-{int(strict)}"
        selector = BotsSelector(reader(MAX_OPEN_BATCHES + 2),
                                selector_config(address, name, experiment_config=EXACT_4, strict=strict))  # fmt: skip
        drawn = [selector.get_indices(1) for _ in range(MAX_OPEN_BATCHES)]
        if strict:
            with pytest.raises(RuntimeError, match="without feedback.*pass_rate_calculator"):
                selector.get_indices(1)
        else:
            selector.get_indices(1)
            assert len(selector.curriculum.open_batches) == MAX_OPEN_BATCHES
            with pytest.raises(UnattributedOutcomesError):  # the forgotten batch
                selector.curriculum.report({selector.curriculum.keys[int(drawn[0][0])]: (1.0, 4)}, strict=True)


def test_trinity_knobs_and_feature_keys_configure_the_experiment(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    config = selector_config(
        address, exp_name, feature_keys=["weak_pr", "strong_pr"], m=8, lamb=0.2, rho=0.3, target_reward=0.4,
        do_sample=True, tau=0,
    )  # fmt: skip
    selector = BotsSelector(reader(), config)
    selector.get_indices(4)
    exp = client.get_experiment(exp_name)
    assert exp.config.rollouts_per_task == 8 and exp.config.forgetting == pytest.approx(0.2)
    assert exp.config.implicit_weight == pytest.approx(0.3) and exp.config.target_success == pytest.approx(0.4)
    assert exp.config.selection_mode == "thompson" and exp.config.seed == 42
    assert (exp.config.weak_feature, exp.config.strong_feature) == ("weak", "strong")
    assert selector.curriculum.features[3] == {"weak": pytest.approx(0.15), "strong": pytest.approx(0.32)}
    assert selector.curriculum.keys[:2] == ["0", "1"]  # no key_field: the row position
    assert selector.strict and selector.repeat_times is None  # built by hand: no Trinity taskset config

    assert experiment_config_from_trinity({"tau": 0.5}).selection_mode == "softmax"
    assert experiment_config_from_trinity({"do_sample": False}).selection_mode == "mean"
    assert experiment_config_from_trinity({"rho": 0.3}).implicit_weight == 0.0  # no features, no plug-in
    with pytest.raises(ValueError, match="unknown"):
        BotsSelector(reader(), selector_config(address, exp_name, m=8, lambda_=0.1))
    with pytest.raises(ValueError, match="weak and the strong"):
        BotsSelector(reader(), selector_config(address, exp_name, m=8, feature_keys=["weak_pr"]))
    with pytest.raises(ValueError, match="strict must be true or false"):
        BotsSelector(reader(), selector_config(address, exp_name, m=8, strict="no"))


def test_trials_are_the_rollouts_per_task_never_a_silent_default(address: str, exp_name: str) -> None:
    """Built outside Trinity's taskset reader, repeat_times cannot be read:
    the rollouts per task must be given, once, and agree."""
    with pytest.raises(ValueError, match=r"cannot read the taskset's repeat_times.*set kwargs.m"):
        BotsSelector(reader(), selector_config(address, exp_name))
    without = {k: v for k, v in dataclasses.asdict(EXACT).items() if k != "rollouts_per_task"}
    with pytest.raises(ValueError, match="cannot read the taskset's repeat_times"):
        BotsSelector(reader(), selector_config(address, exp_name, experiment_config=without))
    with pytest.raises(ValueError, match=r"kwargs.m = 8 and kwargs.experiment_config.rollouts_per_task = 4 disagree"):
        BotsSelector(reader(), selector_config(address, exp_name, m=8, experiment_config=EXACT_4))
    assert BotsSelector(reader(), selector_config(address, exp_name, m=8, experiment_config=without)).rollouts_per_task == 8


def test_a_fresh_selector_on_a_used_experiment_raises_unless_it_resumes(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    config = selector_config(address, exp_name, key_field="id", experiment_config=EXACT_4)
    first = BotsSelector(reader(), config)
    indices = first.get_indices(4)
    first.feedback(indices.tolist(), [0.5] * 4)
    checkpoint = first.state_dict()
    # A new run under the same name, started the way Trinity starts one:
    # refused at its first batch, before it draws anything.
    fresh = BotsSelector(reader(), config)
    fresh.load_state_dict({"current_index": 0})
    with pytest.raises(bots_client.ExperimentInUseError, match="1 reported steps"):
        fresh.get_indices(4)
    # Trinity checkpoints before its first explore step (sync_weight): the
    # refusal comes there, so no state is written that a relaunch would
    # take for this run's own checkpoint (and resume the other run with).
    with pytest.raises(bots_client.ExperimentInUseError, match="1 reported steps"):
        fresh.state_dict()
    other = selector_config(address, exp_name, key_field="id", experiment_config={**EXACT_4, "rollouts_per_task": 8})
    with pytest.raises(bots_client.ConfigMismatchError, match="rollouts_per_task: requested 8, existing 4"):
        BotsSelector(reader(), other).get_indices(4)
    assert (client.get_experiment(exp_name).step, client.get_experiment(exp_name).open_batches) == (1, 0)
    # Continuing it is explicit: the run's checkpoint ...
    restored = BotsSelector(reader(), config)
    restored.load_state_dict(checkpoint)
    _, extra = restored.get_indices(4, return_extra_info=True)
    assert [b["request_key"] for b in extra["batches"]] == ["step-1"]
    # ... or `resume: true` (and then a request prefix of its own, or it
    # gets the first run's batches back: continuing that run is the user's to mean).
    resumed = BotsSelector(reader(), selector_config(address, exp_name, key_field="id", experiment_config=EXACT_4,
                                                     resume=True, request_prefix="run2"))  # fmt: skip
    resumed.load_state_dict({"current_index": 0})
    indices, extra = resumed.get_indices(4, return_extra_info=True)
    assert [b["request_key"] for b in extra["batches"]] == ["run2-0"]


def test_a_checkpoint_before_the_first_step_relaunches(address: str, client: bots_client.Client, exp_name: str) -> None:
    """Trinity saves the selector's state before its first explore step; a
    run whose first step then fails, relaunched from that state, starts at
    batch 0 (the state names an experiment that exists)."""
    config = selector_config(address, exp_name, key_field="id", experiment_config=EXACT_4)
    first = BotsSelector(reader(), config)
    first.load_state_dict({"current_index": 0})
    state = json.loads(json.dumps(first.state_dict()))
    assert (state["step"], state["pending"], state["acknowledged_step"]) == (0, [], 0)
    again = BotsSelector(reader(), config)
    again.load_state_dict(state)
    _, extra = again.get_indices(4, return_extra_info=True)
    assert [b["request_key"] for b in extra["batches"]] == ["step-0"]
    assert client.get_experiment(exp_name).open_batches == 1


def test_feedback_is_filed_under_the_step_it_came_from(address: str, client: bots_client.Client, exp_name: str) -> None:
    """Two steps in flight that share tasks (a step outlived the lease):
    each feedback goes to its own step's batch; one that both steps could
    have produced raises (strict) or is dropped and counted (lenient)."""
    short = {**EXACT_4, "lease_ttl_seconds": 0.5}
    for strict in (True, False):
        name = f"{exp_name}-{int(strict)}"
        selector = BotsSelector(reader(5), selector_config(address, name, key_field="id", experiment_config=short,
                                                           strict=strict))  # fmt: skip
        a = selector.get_indices(4).tolist()
        time.sleep(1.0)
        b = selector.get_indices(4).tolist()
        shared = sorted(set(a) & set(b))
        assert len(shared) >= 3 and set(a) != set(b)  # 4 of 5 tasks twice
        # A part both steps handed out: nothing tells which step it is from.
        if strict:
            with pytest.raises(UnattributedOutcomesError, match="several open batches"):
                selector.feedback(shared, [1.0] * len(shared))
            assert client.get_experiment(name).step == 0
        else:
            assert selector.feedback(shared, [1.0] * len(shared)) == []
            assert selector.dropped_outcomes == len(shared)
        # Whole steps are unambiguous: each goes to its own batch, unmixed.
        assert [r.step for r in selector.feedback(a, [1.0] * 4)] == [1]
        assert [r.step for r in selector.feedback(b, [0.0] * 4)] == [2]
        got = counts(client, name)
        for i in range(5):
            assert got[f"id-{i}"] == ((4.0 if i in a else 0.0), (4.0 if i in b else 0.0)), (strict, i)
        assert client.get_experiment(name).open_batches == 0
        # Feedback for a step already reported raises, or is dropped and counted.
        if strict:
            with pytest.raises(UnattributedOutcomesError, match="in no open batch"):
                selector.feedback(b, [0.0] * 4)
            assert selector.dropped_outcomes == 0
        else:
            signals = selector.curriculum.last_signals  # the lenient drops are in every report's signals
            assert signals is not None and signals.as_dict()["curriculum/dropped_outcomes"] == len(shared)
            assert selector.feedback(b, [0.0] * 4) == [] and selector.dropped_outcomes == len(shared) + 4
        assert client.get_experiment(name).step == 2


def test_a_checkpoint_replayed_after_its_reports_gets_duplicates_not_new_evidence(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    """Restoring a checkpoint older than the last reports (the explorer's
    state file and the server out of step) replays reported batches: the
    server answers their reports as duplicates, and nothing is applied twice."""
    config = selector_config(address, exp_name, key_field="id", experiment_config=EXACT_4)
    selector = BotsSelector(reader(), config)
    old = selector.state_dict()
    batches = [selector.get_indices(4) for _ in range(2)]
    for indices in batches:
        selector.feedback(indices.tolist(), [0.25 * (i % 5) for i in indices.tolist()])
    before = counts(client, exp_name)
    replay = BotsSelector(reader(), config)
    replay.load_state_dict(old)
    for indices in batches:
        again = replay.get_indices(4)
        assert again.tolist() == indices.tolist()
        [result] = replay.feedback(again.tolist(), [0.25 * (i % 5) for i in again.tolist()])
        assert result.duplicate
    assert client.get_experiment(exp_name).step == 2 and counts(client, exp_name) == before


def explore(
    selector: BotsSelector,
    *,
    start: int,
    total: int,
    checkpoint_at: int | None = None,
    crash_after_feedback: bool = False,
) -> dict[str, Any] | None:
    """Trinity's explorer one step off-policy: explore step k draws a batch
    (TasksetScheduler.read -> get_indices), then the feedback of step k - 1
    arrives (pass_rate_calculator -> update). Like Trinity's scheduler it
    counts its own steps and stops after step `total - 1`, whatever the
    selector did. After step `checkpoint_at` the explorer checkpoints the
    selector's state_dict and crashes: at once, or after the next step's
    draw and the feedback of step `checkpoint_at`."""

    def feedback(indices: Any) -> None:
        selector.update(indices.tolist(), [0.25 * (i % 5) for i in indices.tolist()])

    in_flight: list[Any] = []
    for step in range(start, total):
        in_flight.append(selector.get_indices(4))
        if len(in_flight) > 1:
            feedback(in_flight.pop(0))
        if step == checkpoint_at:
            state = json.loads(json.dumps(selector.state_dict()))
            if crash_after_feedback:
                selector.get_indices(4)
                feedback(in_flight.pop(0))
            return state
    while in_flight:
        feedback(in_flight.pop(0))
    return None


def test_resume_from_explorer_checkpoints_reports_each_batch_once_and_ends_at_the_same_step(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    total = 10  # 20 tasks, 4 per batch: epochs of 5 steps
    config = lambda name: selector_config(address, name, key_field="id", experiment_config=EXACT_4)  # noqa: E731
    ref = BotsSelector(reader(), config(exp_name + "-ref"))
    ref_drawn, ref_reports = recording(ref)
    explore(ref, start=0, total=total)
    reference = [(b.request_key, b.step, b.keys) for b in ref_drawn.values()]
    ref_exp = client.get_experiment(exp_name + "-ref")
    assert (ref_exp.step, ref_exp.open_batches) == (total, 0)
    assert_posterior_is(client, exp_name + "-ref", applied(ref_reports))
    assert [k for k, _, _ in reference] == [f"step-{i}" for i in range(total)]
    for at, after_feedback in ((0, False), (4, False), (5, False), (5, True), (7, True), (8, False)):
        name = f"{exp_name}-{at}-{int(after_feedback)}"
        first = BotsSelector(reader(), config(name))
        first_drawn, first_reports = recording(first)
        state = explore(first, start=0, total=total, checkpoint_at=at, crash_after_feedback=after_feedback)
        assert state is not None and state["pending"] == [at] and state["step"] == at + 1
        resumed = BotsSelector(reader(), config(name))
        drawn, reports = recording(resumed)
        resumed.load_state_dict(state)
        explore(resumed, start=at + 1, total=total)  # Trinity restores its step count: steps at+1 .. total-1
        before = [(b.request_key, b.step, b.keys) for b in first_drawn.values()]
        after = [(b.request_key, b.step, b.keys) for b in drawn.values()]
        assert before == reference[: at + 1 + int(after_feedback)]
        exp = client.get_experiment(name)
        # The same server step as the uninterrupted run, every batch reported once.
        assert (exp.step, exp.open_batches) == (total, 0), (at, after_feedback)
        sent = [key for key, _, duplicate in first_reports + reports if not duplicate]
        assert Counter(sent) == Counter(f"step-{i}" for i in range(total)), (at, after_feedback)
        assert_posterior_is(client, name, applied(first_reports, reports))
        if after_feedback:
            # Batch `at` was reported before the crash: the run goes on as if
            # uninterrupted, with the same batches and posterior.
            assert after == reference[at + 1 : total], (at, after_feedback)
            assert counts(client, name) == counts(client, exp_name + "-ref")
        else:
            # Batch `at` lost its feedback: drawn again (the same tasks) with
            # the first step after the restore, together with that step's own
            # batch, which the server chooses as the uninterrupted run did.
            assert after[:2] == reference[at : at + 2], at
            assert [k for k, _, _ in after] == [f"step-{i}" for i in range(at, total)]


# -- against trinity-rft itself ---------------------------------------------------------


def test_real_trinity_registry_reader_and_pass_rate_operator(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    need("trinity.buffer.selector")
    import datasets
    from trinity.buffer.operators.mappers.pass_rate_calculator import PassRateCalculator
    from trinity.buffer.reader.file_reader import _HFBatchReader
    from trinity.buffer.selector import SELECTORS
    from trinity.common.config import DataSelectorConfig
    from trinity.common.constants import SELECTOR_METRIC
    from trinity.common.experience import Experience

    dataset = datasets.Dataset.from_dict(reader().dataset)
    data_source = _HFBatchReader(dataset, name="taskset", default_batch_size=4, total_epochs=3,
                                 enable_progress_bar=False)  # fmt: skip
    config = DataSelectorConfig(
        selector_type="bots_client.integrations.trinity.BotsSelector",
        feature_keys=[],
        kwargs={"address": address, "experiment": exp_name, "key_field": "id",
                "experiment_config": dataclasses.asdict(dataclasses.replace(EXACT, rollouts_per_task=2))},
    )  # fmt: skip
    selector = SELECTORS.get(config.selector_type)(data_source, config)
    assert selector.repeat_times is None  # built by hand, not by a taskset reader: rollouts_per_task counts
    indices = selector.get_indices(4)
    tasks = data_source.select_batch(list(indices))
    assert [t["id"] for t in tasks] == [f"id-{i}" for i in indices]
    # Explorer -> experiences (2 rollouts per task) -> pass_rate_calculator -> feedback.
    exps = []
    for i in indices:
        for j in range(2):
            exps.append(Experience(tokens=[1, 2, 3], prompt_length=1, reward=float(j == 0 and i % 2 == 0),
                                   info={"task_index": {"taskset_id": 0, "index": int(i)}}))  # fmt: skip
    _, metrics = PassRateCalculator().process(exps)
    selector.feedback(**metrics[SELECTOR_METRIC][0])
    got = counts(client, exp_name)
    for i in indices:
        assert got[f"id-{i}"] == ((1.0, 1.0) if i % 2 == 0 else (0.0, 2.0))
    assert np.asarray(indices).dtype.kind == "i"


def trinity_config(tmp_path: Path, kwargs: dict[str, Any], *, repeat_times: int, total_steps: int) -> Any:
    """A Trinity `Config` with one taskset (a JSONL file of `reader()`'s
    rows) selected by BotsSelector, filled in as Trinity's config validator
    fills it (`taskset.repeat_times` from `algorithm.repeat_times`, the
    batch size and step count from `buffer`)."""
    from trinity.common.config import Config, DataSelectorConfig, FormatConfig, TasksetConfig

    data = tmp_path / "taskset"
    data.mkdir(exist_ok=True)
    columns = reader().dataset
    with open(data / "train.jsonl", "w") as f:
        for i in range(N):
            f.write(json.dumps({k: columns[k][i] for k in ("id", "question", "answer")}) + "\n")
    config = Config()
    config.algorithm.repeat_times = repeat_times
    config.buffer.batch_size = 4
    config.buffer.total_steps = total_steps
    config.buffer.explorer_input.tasksets = [
        TasksetConfig(
            name="math", path=str(data), default_workflow_type="math_workflow",
            format=FormatConfig(prompt_key="question", response_key="answer"),
            data_selector=DataSelectorConfig(selector_type="bots_client.integrations.trinity.BotsSelector",
                                             seed=42, kwargs=kwargs),
            repeat_times=repeat_times, batch_size=4, total_steps=total_steps,
        )
    ]  # fmt: skip
    return config


def successes_of(index: int, repeat_times: int) -> int:
    """How many of a task's rollouts succeed (deterministic per task)."""
    return index % (repeat_times + 1)


class TrinityExplorer:
    """Trinity's explore loop around its real TasksetScheduler: each step
    reads a batch (`TasksetScheduler.read` -> `get_indices`), runs each task
    `task.repeat_times` times (the `Experience`s carry Trinity's task index)
    and, `lag` steps later, finishes the oldest step in flight through
    `PassRateCalculator` into `TasksetScheduler.feedback`. The checkpoint is
    Trinity's explorer state file (`latest_iteration`, `taskset_states`),
    through JSON; a restored explorer counts on from `latest_iteration`."""

    def __init__(self, config: Any, state: dict[str, Any] | None = None, lag: int = 1) -> None:
        from trinity.buffer.task_scheduler import get_taskset_scheduler

        self.state = json.loads(json.dumps(state or {}))
        self.scheduler = get_taskset_scheduler(self.state, config)
        self.step = int(self.state.get("latest_iteration", 0))
        self.lag = lag
        self.in_flight: deque[list[Any]] = deque()
        self.sizes: list[int] = []

    @property
    def selector(self) -> BotsSelector:
        selector = self.scheduler.tasksets[0].reader.selector
        assert isinstance(selector, BotsSelector)
        return selector

    def explore_step(self) -> bool:
        import asyncio

        try:
            tasks = asyncio.run(self.scheduler.read())
        except StopAsyncIteration:
            return False
        self.step += 1
        self.sizes.append(len(tasks))
        self.in_flight.append(tasks)
        if len(self.in_flight) > self.lag:
            self.finish_oldest()
        return True

    def finish_oldest(self) -> None:
        from trinity.buffer.operators.mappers.pass_rate_calculator import PassRateCalculator
        from trinity.common.experience import Experience

        exps = []
        for task in self.in_flight.popleft():
            index = int(task.index["index"])
            for j in range(task.repeat_times):
                reward = float(j < successes_of(index, task.repeat_times))
                exps.append(Experience(tokens=[1, 2, 3], prompt_length=1, reward=reward,
                                       info={"task_index": dict(task.index)}))  # fmt: skip
        _, metrics = PassRateCalculator().process(exps)
        self.scheduler.feedback(metrics)

    def checkpoint(self) -> dict[str, Any]:
        state = {"latest_iteration": self.step, "taskset_states": self.scheduler.state_dict()}
        return dict(json.loads(json.dumps(state)))

    def run(self, checkpoint_at: int | None = None) -> dict[str, Any] | None:
        """Explore to the end; or checkpoint after step `checkpoint_at` (1 =
        after the first read) and crash with the steps in flight lost."""
        while self.explore_step():
            if self.step == checkpoint_at:
                return self.checkpoint()
        while self.in_flight:
            self.finish_oldest()
        return None


def test_real_trinity_reports_repeat_times_trials_and_refuses_another_m(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    need("trinity.buffer.task_scheduler")
    without = {k: v for k, v in dataclasses.asdict(EXACT).items() if k != "rollouts_per_task"}
    kwargs = {"address": address, "key_field": "id", "experiment_config": without}
    # m = 4 with repeat_times = 8 used to report 3 successes of 8 rollouts
    # as 1.5 of 4: now Trinity cannot even build the taskset reader.
    with pytest.raises(ValueError, match=r"kwargs.m = 4 but the taskset runs repeat_times = 8.*Set kwargs.m = 8"):
        TrinityExplorer(trinity_config(tmp_path, {**kwargs, "experiment": exp_name, "m": 4},
                                       repeat_times=8, total_steps=3))  # fmt: skip
    with pytest.raises(ValueError, match="experiment_config.rollouts_per_task = 16 but the taskset runs repeat_times = 8"):
        TrinityExplorer(trinity_config(tmp_path, {**kwargs, "experiment": exp_name,
                                                  "experiment_config": dataclasses.asdict(EXACT)},
                                       repeat_times=8, total_steps=3))  # fmt: skip
    assert exp_name not in {e.name for e in client.list_experiments()}
    # Without m the selector takes repeat_times; with m = 8 it is the same run.
    for name, extra in ((exp_name, {}), (exp_name + "-m8", {"m": 8})):
        explorer = TrinityExplorer(trinity_config(tmp_path, {**kwargs, "experiment": name, **extra},
                                                  repeat_times=8, total_steps=3))  # fmt: skip
        assert explorer.selector.repeat_times == 8 and explorer.selector.rollouts_per_task == 8
        _, reports = recording(explorer.selector)
        explorer.run()
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches, exp.config.rollouts_per_task) == (3, 0, 8)
        for request_key, outcomes, _ in reports:
            for key, (s, n) in outcomes.items():
                assert (s, n) == (successes_of(int(key.split("-")[1]), 8), 8), (request_key, key)
        assert_posterior_is(client, name, applied(reports))
    assert counts(client, exp_name) == counts(client, exp_name + "-m8")


def test_real_trinity_taskset_without_repeat_times_is_refused_before_drawing(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    """A taskset config whose repeat_times was never filled in (Trinity's
    validator sets it from algorithm.repeat_times) used to report m trials
    per task whatever the rollouts were: refused with the setting named,
    even with m given, before the experiment is touched."""
    need("trinity.buffer.task_scheduler")
    kwargs = {"address": address, "experiment": exp_name, "key_field": "id", "m": 4,
              "experiment_config": EXACT_4}  # fmt: skip
    config = trinity_config(tmp_path, kwargs, repeat_times=8, total_steps=3)
    config.buffer.explorer_input.tasksets[0].repeat_times = None
    with pytest.raises(ValueError, match=r"taskset 'math' has repeat_times = None.*algorithm.repeat_times"):
        TrinityExplorer(config)
    assert exp_name not in {e.name for e in client.list_experiments()}


def test_real_trinity_restore_after_lost_feedback_ends_at_the_same_step(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    """Trinity's scheduler restores its own step count from the explorer
    state, so a batch drawn again after a restore must not take a step: it
    rides along with the first step's batch, and the run reports every batch
    of an uninterrupted run once and ends at the same server step."""
    need("trinity.buffer.task_scheduler")
    total = 8

    def config(name: str) -> Any:
        kwargs = {"address": address, "experiment": name, "key_field": "id", "experiment_config": EXACT_4}
        return trinity_config(tmp_path, kwargs, repeat_times=4, total_steps=total)

    ref = TrinityExplorer(config(exp_name + "-ref"))
    ref_drawn, ref_reports = recording(ref.selector)
    ref.run()
    reference = [(b.request_key, b.step, b.keys) for b in ref_drawn.values()]
    assert client.get_experiment(exp_name + "-ref").step == total and ref.sizes == [4] * total
    assert_posterior_is(client, exp_name + "-ref", applied(ref_reports))
    for at in (1, 5):  # checkpoint after the first read (nothing acknowledged yet) and mid-run
        name = f"{exp_name}-{at}"
        first = TrinityExplorer(config(name))
        first_drawn, first_reports = recording(first.selector)
        state = first.run(checkpoint_at=at)
        assert state is not None and state["taskset_states"][0]["pending"] == [at - 1]
        restored = TrinityExplorer(config(name), state)
        drawn, reports = recording(restored.selector)
        restored.run()
        after = [(b.request_key, b.step, b.keys) for b in drawn.values()]
        assert [(b.request_key, b.step, b.keys) for b in first_drawn.values()] == reference[:at]
        # Steps at .. total-1 as Trinity counts them; the first carries the lost batch too.
        assert restored.sizes == [8] + [4] * (total - at - 1), at
        assert after[:2] == reference[at - 1 : at + 1], at
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (client.get_experiment(exp_name + "-ref").step, 0), at
        sent = [key for key, _, duplicate in first_reports + reports if not duplicate]
        assert Counter(sent) == Counter(f"step-{i}" for i in range(total)), at
        assert_posterior_is(client, name, applied(first_reports, reports))


def test_real_trinity_explorer_killed_at_a_random_moment_reports_every_batch_once(
    address: str, client: bots_client.Client, exp_name: str, tmp_path: Path
) -> None:
    """The explore loop in a child process (tests/integrations/trinity_explorer.py),
    killed with SIGKILL a random moment (up to 10 ms) after a random step
    (writing its explorer state, reading the next batch, inside the
    previous step's feedback report) and restarted from its last explorer
    state: the server
    ends at the uninterrupted run's step with no batch open, every request
    key's batch reported once, and the posterior is, bit for bit, the sum of
    those batches' rollouts. (The tasks of the batches drawn after the
    restart may differ from an uninterrupted run's: the batch drawn again
    rides along with the next read, so later reads meet the server at
    other steps.)"""
    need("trinity.buffer.task_scheduler")
    import random
    import subprocess
    import sys
    import time

    total = 6
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    # Killed a random moment (up to 10 ms) after a random step of the first run printed itself.
    kill_at, kill_after = f"step {rng.randint(1, total - 1)}", rng.uniform(0.0, 0.01)

    def run(kill: bool) -> bool:
        """One explorer process; True if it finished, False if killed."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.trinity_explorer", address, exp_name, str(tmp_path / "data"),
             str(tmp_path / "explorer.json"), str(total)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # Trinity logs to stdout too
                if line.strip() == (kill_at if kill else "ready"):
                    break
            if kill:
                time.sleep(kill_after)
                proc.kill()  # SIGKILL: no handler, no finally, a report in flight is cut off
            return proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    (tmp_path / "data").mkdir()
    assert not run(kill=True), (seed, kill_at, kill_after)  # killed before it finished
    assert run(kill=False), seed
    exp = client.get_experiment(exp_name)
    assert (exp.step, exp.open_batches) == (total, 0), (seed, kill_at, kill_after)
    drawn = [client.select_batch(exp_name, 4, request_key=f"step-{i}") for i in range(total)]  # the stored batches
    assert sorted(b.reported_step or 0 for b in drawn) == list(range(1, total + 1)), (seed, kill_at, kill_after)
    expected = {key: [1.0, 1.0] for key in client.snapshot(exp_name).keys}  # EXACT: prior 1, no forgetting
    for batch in drawn:
        for key in batch.keys:
            won = successes_of(int(key.split("-")[1]), 4)
            expected[key][0] += won
            expected[key][1] += 4 - won
    snap = client.snapshot(exp_name)
    assert list(snap.alpha) == [expected[k][0] for k in snap.keys], (seed, kill_at, kill_after)
    assert list(snap.beta) == [expected[k][1] for k in snap.keys], (seed, kill_at, kill_after)
