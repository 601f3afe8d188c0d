"""bots_client.integrations.trinity.

Trinity-RFT (it requires verl, which pins numpy < 2) is not in the project's
test environment. The first tests use its data shapes, from trinity-rft
0.6.0's sources: the selector is built as `cls(data_source, config)` with
`data_source` an `_HFBatchReader` (`.dataset`, a HF Dataset with column
access; `.dataset_size`) and `config` a `DataSelectorConfig` (selector_type,
seed, feature_keys, kwargs); `feedback(indices, values)` gets each task's
mean reward from the `pass_rate_calculator` operator. The last test runs
Trinity's own registry, reader and operator where trinity-rft is installed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import bots_client
from bots_client.integrations.trinity import BotsSelector, experiment_config_from_trinity
from tests.integrations.conftest import EXACT, counts, need

N = 20


def reader(n: int = N) -> SimpleNamespace:
    columns = {
        "question": [f"q{i}" for i in range(n)],
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


def test_get_indices_feedback_and_resume(address: str, client: bots_client.Client, exp_name: str) -> None:
    import dataclasses

    config = selector_config(address, exp_name, key_field="id", experiment_config=dataclasses.asdict(EXACT), m=4)
    selector = BotsSelector(reader(), config)
    indices, extra = selector.get_indices(5, return_extra_info=True)
    assert len(indices) == 5 and extra["keys"] == [f"id-{i}" for i in indices]
    # Trinity passes each task's mean reward (pass rate over its rollouts).
    values = [0.0, 0.25, 0.5, 1.0, 0.75]
    results = selector.feedback(indices.tolist(), values)
    assert [r.step for r in results] == [1]
    got = counts(client, exp_name)
    rollouts = selector.rollouts_per_task
    for i, v in zip(indices, values):
        assert got[f"id-{i}"] == (v * rollouts, (1 - v) * rollouts)
    # Feedback for tasks whose batch was already reported is dropped, not re-applied.
    selector.update(indices.tolist(), values)
    assert client.get_experiment(exp_name).step == 1

    second = selector.get_indices(5)
    state = selector.state_dict()
    assert state == {"current_index": 10, "experiment": exp_name, "step": 2, "pending": [1], "acknowledged_step": 1}
    # Batch 1 got no feedback before the restart: drawn again, the same tasks.
    restarted = BotsSelector(reader(), config)
    restarted.load_state_dict(state)
    assert list(restarted.get_indices(5)) == list(second)
    restarted.feedback(second.tolist(), [1.0] * 5)
    third = restarted.get_indices(5)
    assert client.get_experiment(exp_name).step == 2
    # Had the feedback arrived after the checkpoint, the restart goes on at batch 2.
    again = BotsSelector(reader(), config)
    again.load_state_dict(state)
    assert list(again.get_indices(5)) == list(third)


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

    assert experiment_config_from_trinity({"tau": 0.5}).selection_mode == "softmax"
    assert experiment_config_from_trinity({"do_sample": False}).selection_mode == "mean"
    assert experiment_config_from_trinity({"rho": 0.3}).implicit_weight == 0.0  # no features, no plug-in
    with pytest.raises(ValueError, match="unknown"):
        BotsSelector(reader(), selector_config(address, exp_name, lambda_=0.1))
    with pytest.raises(ValueError, match="weak and the strong"):
        BotsSelector(reader(), selector_config(address, exp_name, feature_keys=["weak_pr"]))


def test_real_trinity_registry_reader_and_pass_rate_operator(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    need("trinity.buffer.selector")
    import dataclasses

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
                "experiment_config": dataclasses.asdict(EXACT)},
    )  # fmt: skip
    selector = SELECTORS.get(config.selector_type)(data_source, config)
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
    selector.rollouts_per_task = 2
    selector.feedback(**metrics[SELECTOR_METRIC][0])
    got = counts(client, exp_name)
    for i in indices:
        assert got[f"id-{i}"] == ((1.0, 1.0) if i % 2 == 0 else (0.0, 2.0))
    assert np.asarray(indices).dtype.kind == "i"


def explore(
    selector: BotsSelector, *, start: int, total: int, checkpoint_at: int | None = None, crash_after_feedback: bool = False
) -> dict[str, Any] | None:
    """Trinity's explorer one step off-policy: at step k it draws batch k
    (TasksetScheduler.read_async -> get_indices), then the feedback of batch
    k - 1 arrives (pass_rate_calculator -> update). After step
    `checkpoint_at` the explorer checkpoints the selector's state_dict and
    crashes: at once, or after the next step's draw and the feedback of
    batch `checkpoint_at`."""

    def feedback(indices: Any) -> None:
        selector.update(indices.tolist(), [0.25 * (i % 5) for i in indices.tolist()])

    in_flight: list[Any] = []
    for step in range(start, total):
        in_flight.append(selector.get_indices(4))
        if len(in_flight) > 1:
            feedback(in_flight.pop(0))
        if step == checkpoint_at:
            state = selector.state_dict()
            if crash_after_feedback:
                selector.get_indices(4)
                feedback(in_flight.pop(0))
            return state
    while in_flight:
        feedback(in_flight.pop(0))
    return None


def test_resume_from_explorer_checkpoints_draws_and_reports_each_batch_once(
    address: str, client: bots_client.Client, exp_name: str
) -> None:
    import dataclasses

    from tests.integrations.test_torch import recorded

    need("torch")  # only for the recording helper's module
    total = 10  # 20 tasks, 4 per batch: the scheduler's epochs are 5 steps
    config = lambda name: selector_config(  # noqa: E731
        address, name, key_field="id", experiment_config=dataclasses.asdict(EXACT)
    )
    ref = BotsSelector(reader(), config(exp_name + "-ref"))
    reference = recorded(ref)
    explore(ref, start=0, total=total)
    ref_exp = client.get_experiment(exp_name + "-ref")
    assert ref_exp.step == total and [k for k, _, _ in reference] == [f"step-{i}" for i in range(total)]
    for at, after_feedback in ((4, False), (5, False), (5, True), (7, True)):  # epoch boundary at step 5
        name = f"{exp_name}-{at}-{int(after_feedback)}"
        first = BotsSelector(reader(), config(name))
        first_selections = recorded(first)
        state = explore(first, start=0, total=total, checkpoint_at=at, crash_after_feedback=after_feedback)
        assert state is not None and state["pending"] == [at]
        resumed = BotsSelector(reader(), config(name))
        selections = recorded(resumed)
        resumed.load_state_dict(state)
        explore(resumed, start=at + 1, total=total + (0 if after_feedback else 1))
        assert first_selections == reference[: at + 1 + int(after_feedback)]
        # Without its feedback batch `at` is drawn again, with it the next one.
        assert selections == reference[(at if not after_feedback else at + 1) : total], (at, after_feedback)
        exp = client.get_experiment(name)
        assert (exp.step, exp.open_batches) == (total, 0), (at, after_feedback)
