"""Client and AsyncClient run one description of every call: the same calls
on two fresh servers give the same results, call for call."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import bots_client
from bots_client import Batch, Experiment, ExperimentConfig, Snapshot, Task, _convert
from bots_client.proto import bots_pb2 as pb
from bots_client.types import SELECTION_MODES, STRATEGIES
from tests.support.servers import ServerProcess

# run("method", *args): what the client's method returned, or the BotsError it raised.
Run = Callable[..., Any]

CONFIG = ExperimentConfig(seed=3, weak_feature="weak", strong_feature="strong")
OTHER_CONFIG = dataclasses.replace(CONFIG, forgetting=0.2, seed=4)
TASKS = [Task(f"t{i}", {"weak": i / 20, "strong": i / 10}) for i in range(10)]
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@pytest.fixture
def new_server(tmp_path: Path) -> Iterator[Callable[[], ServerProcess]]:
    """Starts fresh servers (each on a SQLite file of its own); stops them after the test."""
    servers: list[ServerProcess] = []

    def start() -> ServerProcess:
        servers.append(ServerProcess(f"sqlite:///{tmp_path / f'bots-{len(servers)}.db'}"))
        return servers[-1].start()

    yield start
    for server in servers:
        server.stop()


def scenario(run: Run) -> dict[str, Any]:
    """Every call, on a fresh server, with the result of each (see comparable)."""
    results: dict[str, Any] = {}

    def call(label: str, method: str, *args: Any) -> Any:
        result = run(method, *args)
        results[label] = comparable(result)
        return result

    call("create", "create_experiment", "exp", CONFIG)
    call("create taken", "create_experiment", "exp", CONFIG)
    call("add_tasks", "add_tasks", "exp", TASKS)
    batch = call("select", "select_batch", "exp", 4, "step-0")
    call("select again", "select_batch", "exp", 4, "step-0")
    call("report", "report_outcomes", "exp", batch.batch_id, dict.fromkeys(batch.keys, (1, 4)))
    call("report again", "report_outcomes", "exp", batch.batch_id, dict.fromkeys(batch.keys, (1, 4)))
    snapshot = call("snapshot", "snapshot", "exp", True)
    call("fork", "fork_experiment", "exp", "forked", OTHER_CONFIG)
    call("restore", "restore_experiment", "restored", snapshot)
    call("get", "get_experiment", "restored")
    call("get_or_create new", "get_or_create_experiment", "resumed", CONFIG)
    call("get_or_create same config", "get_or_create_experiment", "resumed", CONFIG)
    call("get_or_create no config", "get_or_create_experiment", "resumed")
    call("get_or_create other config", "get_or_create_experiment", "resumed", OTHER_CONFIG)
    call("create default", "create_experiment", "default")
    call("list", "list_experiments")
    call("list by 2", "list_experiments", 2)
    call("delete", "delete_experiment", "forked")
    call("get deleted", "get_experiment", "forked")
    call("list by 2 after delete", "list_experiments", 2)
    return results


def comparable(result: object) -> object:
    """The result with what differs between two servers by nature (times,
    random batch ids) blanked, and an error as (class, code, message)."""
    if isinstance(result, Experiment):
        return dataclasses.replace(result, create_time=EPOCH)
    if isinstance(result, Batch):
        return dataclasses.replace(result, batch_id="", lease_expire_time=EPOCH)
    if isinstance(result, Snapshot):
        return comparable(result.experiment), result.keys, result.alpha.tolist(), result.beta.tolist(), result.features
    if isinstance(result, list):
        return [comparable(r) for r in result]
    if isinstance(result, bots_client.BotsError):
        return type(result), result.code, result.message
    return result


def sync_scenario(client: bots_client.Client) -> dict[str, Any]:
    def run(method: str, *args: Any) -> Any:
        try:
            return getattr(client, method)(*args)
        except bots_client.BotsError as e:
            return e

    return scenario(run)


def async_scenario(address: str) -> dict[str, Any]:
    """The scenario through an AsyncClient, each call awaited on one event loop."""

    async def connect() -> bots_client.AsyncClient:
        return bots_client.AsyncClient(address)  # its channel belongs to the running loop

    with asyncio.Runner() as loop:
        client = loop.run(connect())

        def run(method: str, *args: Any) -> Any:
            try:
                return loop.run(getattr(client, method)(*args))
            except bots_client.BotsError as e:
                return e

        try:
            return scenario(run)
        finally:
            loop.run(client.close())


def test_sync_and_async_clients_give_equal_results(new_server: Callable[[], ServerProcess]) -> None:
    with bots_client.Client(new_server().address) as client:
        results = sync_scenario(client)
    assert async_scenario(new_server().address) == results

    # The results themselves are right, so the equality above is no accident.
    assert results["create taken"][0] is bots_client.AlreadyExistsError
    assert results["add_tasks"] == len(TASKS)
    assert results["select again"] == results["select"]
    assert results["report again"] == dataclasses.replace(results["report"], duplicate=True)
    assert results["get"].num_tasks == len(TASKS) and results["get"].step == 1
    created = results["get_or_create new"]
    assert created.name == "resumed" and created.config == CONFIG
    assert results["get_or_create same config"] == results["get_or_create no config"] == created
    error_class, code, message = results["get_or_create other config"]
    assert error_class is bots_client.ConfigMismatchError and code == grpc.StatusCode.FAILED_PRECONDITION
    assert "forgetting: requested 0.2, existing 0.1" in message and "seed: requested 4, existing 3" in message
    assert "temperature" not in message
    names = ["exp", "forked", "restored", "resumed", "default"]
    assert sorted(e.name for e in results["list"]) == sorted(names)
    assert results["list by 2"] == results["list"]  # 3 pages of at most 2
    assert results["get deleted"][0] is bots_client.NotFoundError
    assert sorted(e.name for e in results["list by 2 after delete"]) == sorted(set(names) - {"forked"})


def test_clients_on_a_given_channel(new_server: Callable[[], ServerProcess]) -> None:
    address = new_server().address
    channel = grpc.insecure_channel(address)
    with bots_client.Client("", channel=channel) as client:
        assert client.get_or_create_experiment("on-channel", CONFIG).config == CONFIG
        assert [e.name for e in client.list_experiments()] == ["on-channel"]
    with pytest.raises(ValueError, match="closed channel"):  # close() closed the given channel
        channel.unary_unary("/bots.v1.TaskSelector/GetExperiment")(b"")

    async def on_aio_channel() -> Experiment:
        async with bots_client.AsyncClient("", channel=grpc.aio.insecure_channel(address)) as client:
            return await client.get_or_create_experiment("on-channel", CONFIG)

    assert asyncio.run(on_aio_channel()).config == CONFIG
    with pytest.raises(ValueError, match="credentials"):
        bots_client.Client("", channel=channel, credentials=grpc.local_channel_credentials())


def test_strategies_and_selection_modes_are_the_proto_enum_values() -> None:
    assert [f"STRATEGY_{s.upper()}" for s in STRATEGIES] == pb.Strategy.keys()[1:]
    assert [f"SELECTION_MODE_{m.upper()}" for m in SELECTION_MODES] == pb.SelectionMode.keys()[1:]
    assert pb.Strategy.Name(0) == "STRATEGY_UNSPECIFIED" and pb.SelectionMode.Name(0) == "SELECTION_MODE_UNSPECIFIED"
    for strategy, mode in itertools.product(STRATEGIES, SELECTION_MODES):
        config = ExperimentConfig(strategy=strategy, selection_mode=mode)
        assert _convert.config_from_proto(_convert.config_to_proto(config)) == config


@pytest.mark.parametrize(
    ("outcome", "problem"),
    [
        ((1, 1.9), "has trials = 1.9; trials count rollouts"),
        ((1, float("inf")), "has trials = inf; trials count rollouts"),
        ((1, None), "has trials = None; trials count rollouts"),
        ((1, 2, 0.5, 99), "has 4 values"),
        ((1,), "has 1 values"),
    ],
)
def test_a_malformed_outcome_raises_before_anything_is_sent(
    new_server: Callable[[], ServerProcess], outcome: tuple[float, ...], problem: str
) -> None:
    # int() turned 1.9 trials into 1, and a fourth value was dropped: the
    # report went out changed, without a word.
    with bots_client.Client(new_server().address) as client:
        client.create_experiment("exp", ExperimentConfig(rollouts_per_task=2))
        client.add_tasks("exp", [Task("a"), Task("b")])
        batch = client.select_batch("exp", 2, request_key="k")
        outcomes = {"a": outcome, "b": (1, 2)}
        for report in (
            lambda: client.report_outcomes("exp", batch.batch_id, outcomes),  # type: ignore[arg-type]
            lambda: client.report_and_select("exp", batch.batch_id, outcomes, 2, request_key="k2"),  # type: ignore[arg-type]
        ):
            with pytest.raises(ValueError, match=f"the outcome of task 'a' {problem}"):
                report()
        assert client.get_experiment("exp").step == 0
        assert client.report_outcomes("exp", batch.batch_id, {"a": (1, 2.0), "b": (0, 2)}).step == 1  # 2.0 is whole
