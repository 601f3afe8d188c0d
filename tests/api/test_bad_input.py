"""Every RPC rejects bad input with the right status and a message naming the
bad value, and a rejected request changes nothing."""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

import bots_client
from bots_client import ExperimentConfig, Task
from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from tests.support.servers import ServerProcess
from tests.support.timing import slack

Code = grpc.StatusCode


@pytest.fixture
def exp(client: bots_client.Client) -> str:
    """An experiment with 10 tasks, one reported step and one open batch."""
    name = f"bad-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name, ExperimentConfig(weak_feature="weak", strong_feature="strong"))
    client.add_tasks(name, [Task(f"t{i}", {"weak": 0.1, "strong": 0.6}) for i in range(10)])
    batch = client.select_batch(name, 3, request_key="reported")
    client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (2, 4)))
    client.select_batch(name, 3, request_key="open")
    return name


def expect(code: Code, fragment: str, call: Callable[[], object]) -> None:
    with pytest.raises(bots_client.BotsError) as info:
        call()
    assert info.value.code == code, info.value
    assert fragment in info.value.message, info.value.message


def expect_rpc(code: Code, fragment: str, call: Callable[[], object]) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details(), info.value.details()


def state(client: bots_client.Client, name: str) -> tuple[object, ...]:
    snap = client.snapshot(name)
    e = snap.experiment
    return (e.step, e.num_tasks, e.open_batches, e.capability, tuple(snap.keys), snap.alpha.tobytes(), snap.beta.tobytes())


def test_create_experiment_rejects_bad_names_and_configs(client: bots_client.Client, stub: pb_grpc.TaskSelectorStub) -> None:
    expect(Code.INVALID_ARGUMENT, "''", lambda: client.create_experiment(""))
    expect(Code.INVALID_ARGUMENT, "'has space'", lambda: client.create_experiment("has space"))
    expect(Code.INVALID_ARGUMENT, "is invalid", lambda: client.create_experiment("x" * 129))
    # Tenant-qualified names (docs/security.md): the tenant must be a DNS
    # label, the plain name valid, and the two together fit the column.
    for name, fragment in (("/x", "tenant of"), ("x/", "is invalid"), ("Team/x", "tenant of"), ("a/b/c", "tenant of"),
                           ("t/" + "x" * 127, "longer than 128")):  # fmt: skip
        expect(Code.INVALID_ARGUMENT, fragment, lambda: client.create_experiment(name))
    # The caller's own tenant, spelled out, is the same experiment.
    spelled = f"spelled-{uuid.uuid4().hex[:8]}"
    client.create_experiment(f"default/{spelled}")
    assert client.get_experiment(spelled).name == spelled
    bad_configs = [
        (dict(target_success=1.5), "target_success = 1.5"),
        (dict(target_success=math.nan), "target_success = nan"),
        (dict(forgetting=-0.1), "forgetting = -0.1"),
        (dict(implicit_weight=2.0), "implicit_weight = 2.0"),
        (dict(rollouts_per_task=0), "rollouts_per_task = 0"),
        (dict(temperature=0.0), "temperature = 0.0"),
        (dict(prior_alpha=math.inf), "prior_alpha = inf"),
        (dict(prior_beta=-1.0), "prior_beta = -1.0"),
        (dict(lease_ttl_seconds=0.0), "lease_ttl_seconds = 0.0"),
        (dict(seed=2**63), "seed = 9223372036854775808"),
        (dict(random_stream=3), "random_stream = 3 is not one of [1, 2]"),
        (dict(weak_feature="w"), "set both"),
        (dict(weak_feature="w", strong_feature="w"), "both 'w'"),
        (dict(weak_feature='w"x', strong_feature="s"), "printable ASCII"),
    ]
    for values, fragment in bad_configs:
        name = f"cfg-{uuid.uuid4().hex[:8]}"
        expect(Code.INVALID_ARGUMENT, fragment, lambda: client.create_experiment(name, ExperimentConfig(**values)))
        expect(Code.NOT_FOUND, name, lambda: client.get_experiment(name))  # nothing was created
    with pytest.raises(ValueError, match="strategy 'bandit'"):
        client.create_experiment("x", ExperimentConfig(strategy="bandit"))  # caught before sending
    unknown_enum = pb.CreateExperimentRequest(name="enum-x", config=pb.ExperimentConfig(strategy=99))
    expect_rpc(Code.INVALID_ARGUMENT, "strategy enum value 99", lambda: stub.CreateExperiment(unknown_enum))


def test_create_existing_experiment_is_already_exists(client: bots_client.Client, exp: str) -> None:
    before = state(client, exp)
    expect(Code.ALREADY_EXISTS, repr(exp), lambda: client.create_experiment(exp, ExperimentConfig(seed=99)))
    assert client.get_experiment(exp).config.seed == 0
    assert state(client, exp) == before


def test_unknown_experiment_is_not_found_everywhere(client: bots_client.Client) -> None:
    ghost = "no-such-experiment"
    for call in (
        lambda: client.get_experiment(ghost),
        lambda: client.delete_experiment(ghost),
        lambda: client.add_tasks(ghost, [Task("a")]),
        lambda: client.select_batch(ghost, 1),
        lambda: client.report_outcomes(ghost, "b", {"a": (1, 1)}),
        lambda: client.snapshot(ghost),
    ):
        expect(Code.NOT_FOUND, repr(ghost), call)


def test_add_tasks_rejects_bad_tasks_atomically(client: bots_client.Client, stub: pb_grpc.TaskSelectorStub, exp: str) -> None:
    before = state(client, exp)
    good = [Task(f"new{i}", {"weak": 0.1, "strong": 0.2}) for i in range(5)]
    cases = [
        (Code.INVALID_ARGUMENT, "appears more than once", good + [Task("new0")]),
        (Code.INVALID_ARGUMENT, "empty key", good + [Task("")]),
        (Code.INVALID_ARGUMENT, "longer than 1024", good + [Task("k" * 1025)]),
        (Code.INVALID_ARGUMENT, "'f' = nan is not finite", good + [Task("z", {"f": math.nan})]),
        (Code.INVALID_ARGUMENT, "'weak' = 1.5 is outside [0, 1]", good + [Task("z", {"weak": 1.5})]),
        (Code.INVALID_ARGUMENT, "'strong' = -0.5 is outside [0, 1]", good + [Task("z", {"strong": -0.5})]),
        (Code.ALREADY_EXISTS, "'t3'", good + [Task("t3")]),
    ]
    for code, fragment, tasks in cases:
        expect(code, fragment, lambda: client.add_tasks(exp, tasks))
    expect_rpc(Code.INVALID_ARGUMENT, "first message must name the experiment", lambda: stub.AddTasks(iter([pb.AddTasksRequest()])))
    mixed = [pb.AddTasksRequest(experiment=exp, tasks=[pb.Task(key="m1")]), pb.AddTasksRequest(experiment="other")]
    expect_rpc(Code.INVALID_ARGUMENT, "'other' after", lambda: stub.AddTasks(iter(mixed)))
    expect_rpc(Code.INVALID_ARGUMENT, "no tasks given", lambda: stub.AddTasks(iter([pb.AddTasksRequest(experiment=exp)])))
    assert state(client, exp) == before


@pytest.mark.parametrize("rpc", ["AddTasks", "RestoreExperiment"])
def test_a_stream_to_a_wrong_name_is_answered_at_its_first_message(server: ServerProcess, rpc: str) -> None:
    """A real server (the in-process stand-in reads whole streams) answers
    NOT_FOUND (AddTasks to a missing experiment) or ALREADY_EXISTS (a
    restore onto a taken name) after the first message, not after
    buffering the stream."""
    taken = f"taken-{uuid.uuid4().hex[:8]}"
    more = threading.Event()

    def chunks() -> Iterator[object]:
        if rpc == "AddTasks":
            yield pb.AddTasksRequest(experiment=f"ghost-{uuid.uuid4().hex[:8]}", tasks=[pb.Task(key="t0")])
        else:
            yield pb.RestoreExperimentRequest(name=taken, keys=["t0"], alpha=[1.0], beta=[1.0], features=[pb.Features()])
        more.wait(30)  # a stream still uploading
        yield pb.AddTasksRequest(tasks=[pb.Task(key="t1")]) if rpc == "AddTasks" else pb.RestoreExperimentRequest(keys=["t1"])

    started = time.monotonic()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TaskSelectorStub(channel)
        stub.CreateExperiment(pb.CreateExperimentRequest(name=taken), timeout=20)
        code, fragment = (Code.NOT_FOUND, "not found") if rpc == "AddTasks" else (Code.ALREADY_EXISTS, "already exists")
        try:
            expect_rpc(code, fragment, lambda: getattr(stub, rpc)(chunks(), timeout=60))
        finally:
            more.set()
    assert time.monotonic() - started < slack(10)


def test_select_batch_rejects_bad_sizes(client: bots_client.Client, exp: str) -> None:
    before = state(client, exp)
    expect(Code.INVALID_ARGUMENT, "batch_size = 0", lambda: client.select_batch(exp, 0))
    expect(Code.INVALID_ARGUMENT, "batch_size = 11 is larger than the pool of 10", lambda: client.select_batch(exp, 11))
    expect(Code.FAILED_PRECONDITION, "only 7 of 10 tasks are free", lambda: client.select_batch(exp, 8))
    expect(Code.INVALID_ARGUMENT, "longer than 256", lambda: client.select_batch(exp, 1, request_key="k" * 257))
    expect(Code.FAILED_PRECONDITION, "already used", lambda: client.select_batch(exp, 2, request_key="open"))
    empty = f"empty-{uuid.uuid4().hex[:8]}"
    client.create_experiment(empty)
    expect(Code.FAILED_PRECONDITION, "has no tasks", lambda: client.select_batch(empty, 1))
    assert state(client, exp) == before


def test_report_rejects_bad_outcomes_and_applies_nothing(
    client: bots_client.Client, stub: pb_grpc.TaskSelectorStub, exp: str
) -> None:
    batch = client.select_batch(exp, 3, request_key="open")
    key = batch.keys[0]
    outside = next(f"t{i}" for i in range(10) if f"t{i}" not in batch.keys)
    before = state(client, exp)
    cases = [
        (Code.NOT_FOUND, "batch 'nope' not found", "nope", {key: (1, 2)}),
        (Code.INVALID_ARGUMENT, "batch_id is empty", "", {key: (1, 2)}),
        (Code.INVALID_ARGUMENT, "has no outcomes", batch.batch_id, {}),
        (Code.INVALID_ARGUMENT, "'ghost' is not in experiment", batch.batch_id, {key: (1, 2), "ghost": (1, 2)}),
        (Code.INVALID_ARGUMENT, f"{outside!r} is not in batch", batch.batch_id, {key: (1, 2), outside: (1, 2)}),
        (Code.INVALID_ARGUMENT, "successes = 3.0 is outside [0, trials = 2]", batch.batch_id, {key: (3, 2)}),
        (Code.INVALID_ARGUMENT, "successes = -1.0", batch.batch_id, {key: (-1, 2)}),
        (Code.INVALID_ARGUMENT, "successes = nan", batch.batch_id, {key: (math.nan, 2)}),
        (Code.INVALID_ARGUMENT, "successes = inf", batch.batch_id, {key: (math.inf, 2)}),
        (Code.INVALID_ARGUMENT, "trials = 0", batch.batch_id, {key: (0, 0)}),
        # The sum of squared rewards in [0, 1] lies in [successes^2 / trials, successes].
        (Code.INVALID_ARGUMENT, "sum_squares = 1.5 is outside [successes^2 / trials, successes] = [0.5, 1]",
         batch.batch_id, {key: (1, 2, 1.5)}),
        (Code.INVALID_ARGUMENT, "sum_squares = 0.25 is outside", batch.batch_id, {key: (1, 2, 0.25)}),
        (Code.INVALID_ARGUMENT, "sum_squares = -1.0", batch.batch_id, {key: (0, 2, -1.0)}),
        (Code.INVALID_ARGUMENT, "sum_squares = nan", batch.batch_id, {key: (1, 2, math.nan)}),
        (Code.INVALID_ARGUMENT, "sum_squares = inf", batch.batch_id, {key: (1, 2, math.inf)}),
    ]  # fmt: skip
    for code, fragment, batch_id, outcomes in cases:
        expect(code, fragment, lambda: client.report_outcomes(exp, batch_id, outcomes))
    twice = pb.ReportOutcomesRequest(
        experiment=exp, batch_id=batch.batch_id,
        outcomes=[pb.Outcome(key=key, successes=1, trials=2), pb.Outcome(key=key, successes=1, trials=2)],
    )  # fmt: skip
    expect_rpc(Code.INVALID_ARGUMENT, f"{key!r} is reported more than once", lambda: stub.ReportOutcomes(twice))
    assert state(client, exp) == before
    # The batch is still reportable after all those rejections.
    assert client.report_outcomes(exp, batch.batch_id, {key: (1, 2)}).step == 2


def test_oversized_request_is_resource_exhausted(client: bots_client.Client, stub: pb_grpc.TaskSelectorStub, exp: str) -> None:
    before = state(client, exp)
    big = pb.ReportOutcomesRequest(
        experiment=exp, batch_id="x", outcomes=[pb.Outcome(key="k" * 1000, successes=1, trials=1)] * 5000
    )
    assert big.ByteSize() > 4 * 1024 * 1024
    expect_rpc(Code.RESOURCE_EXHAUSTED, "", lambda: stub.ReportOutcomes(big))
    assert state(client, exp) == before


def test_list_rejects_oversized_pages(client: bots_client.Client) -> None:
    expect(Code.INVALID_ARGUMENT, "page_size = 5000", lambda: client.list_experiments(page_size=5000))


def test_client_raises_typed_errors_with_code_and_message(client: bots_client.Client) -> None:
    with pytest.raises(bots_client.NotFoundError) as info:
        client.get_experiment("missing")
    assert info.value.code == Code.NOT_FOUND
    assert "experiment 'missing' not found" in str(info.value)
    assert isinstance(info.value, bots_client.BotsError)


def test_unreachable_server_raises_unavailable_after_retries() -> None:
    client = bots_client.Client("127.0.0.1:1", retry_timeout=0.5, timeout=0.5)
    with pytest.raises(bots_client.UnavailableError):
        client.get_experiment("x")
    client.close()


def test_rows_unchanged_by_rejected_calls_on_disk(client: bots_client.Client, exp: str) -> None:
    """The posterior stays put under a burst of rejected reports (nothing half-applied)."""
    batch = client.select_batch(exp, 3, request_key="open")
    before = client.snapshot(exp)
    for bad in ({batch.keys[0]: (9, 4)}, {"ghost": (1, 1)}):
        with pytest.raises(bots_client.InvalidArgumentError):
            client.report_outcomes(exp, batch.batch_id, bad)
    after = client.snapshot(exp)
    np.testing.assert_array_equal(before.alpha, after.alpha)
    assert before.step == after.step
