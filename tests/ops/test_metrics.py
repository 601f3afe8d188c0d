"""The /metrics endpoint of a real server process: RPC metrics with the
go-grpc-prometheus names, the learning signals per experiment, checkpoint,
database and process metrics, and that the output passes promtool's lint."""

from __future__ import annotations

import socket
import subprocess
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import bots_client
from bots_client import ExperimentConfig, Task
from bots_server.engine import PosteriorState, posterior_summary
from bots_server.engine.summary import MEAN_QUANTILES, SHARE_BANDS
from tests.ops.support import Labels, MetricsServer, eventually, number, parse, require_tool, value
from tests.support.servers import drop_pg_database

TASK_SELECTOR = "bots.v1.TaskSelector"

# Every label name the server may export. A new label (a task key, a request
# id...) would make the series count grow without bound: it must be added
# here on purpose.
ALLOWED_LABELS = {
    "grpc_type", "grpc_service", "grpc_method", "grpc_code",  # per RPC
    "experiment", "band", "percentile", "kind", "le",  # ours
    "group",  # a task group: at most 64 per experiment (core/limits.py)
    "version", "python",  # bots_build_info
    "generation", "implementation", "major", "minor", "patchlevel",  # prometheus_client's process/GC/platform
}  # fmt: skip


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def handled(samples: dict[str, dict[Labels, float]], method: str, code: str) -> float:
    v = value(samples, "grpc_server_handled_total", grpc_service=TASK_SELECTOR, grpc_method=method, grpc_code=code)
    return v or 0.0


def test_rpc_metrics_count_calls_by_method_type_and_code(metrics_server: MetricsServer) -> None:
    name = unique("rpc")
    before = metrics_server.samples()
    with bots_client.Client(metrics_server.address, retry_timeout=0) as client:
        client.create_experiment(name, ExperimentConfig(seed=1))
        client.add_tasks(name, [Task(f"t{i}") for i in range(20)])
        for step in range(3):
            batch = client.select_batch(name, 4, request_key=f"s{step}")
            client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))
        with pytest.raises(bots_client.NotFoundError):
            client.get_experiment(unique("missing"))
        with pytest.raises(bots_client.InvalidArgumentError):
            client.select_batch(name, 0, request_key="zero")
        client.snapshot(name)
    after = metrics_server.samples()

    def delta(name_: str, **labels: str) -> float:
        return (value(after, name_, **labels) or 0.0) - (value(before, name_, **labels) or 0.0)

    assert handled(after, "SelectBatch", "OK") - handled(before, "SelectBatch", "OK") == 3
    assert handled(after, "SelectBatch", "InvalidArgument") - handled(before, "SelectBatch", "InvalidArgument") == 1
    assert handled(after, "GetExperiment", "NotFound") - handled(before, "GetExperiment", "NotFound") == 1
    select = {"grpc_service": TASK_SELECTOR, "grpc_method": "SelectBatch", "grpc_type": "unary"}
    assert delta("grpc_server_started_total", **select) == 4
    assert delta("grpc_server_handling_seconds_count", **select) == 4
    # Every observation is in the +Inf bucket; a latency histogram whose
    # buckets do not add up is useless to histogram_quantile.
    assert delta("grpc_server_handling_seconds_bucket", **select, le="+Inf") == 4
    assert delta("grpc_server_msg_sent_total", **select) == 3  # the failed call sent no response

    # Streaming calls carry their gRPC type, as go-grpc-prometheus labels them.
    add = {"grpc_method": "AddTasks", "grpc_type": "client_stream"}
    assert delta("grpc_server_handled_total", **add, grpc_code="OK") == 1
    assert delta("grpc_server_msg_received_total", **add) >= 1
    snapshot = {"grpc_method": "Snapshot", "grpc_type": "server_stream"}
    assert delta("grpc_server_handled_total", **snapshot, grpc_code="OK") == 1
    assert delta("grpc_server_msg_sent_total", **snapshot) >= 1


def test_every_method_has_series_before_its_first_call(metrics_server: MetricsServer) -> None:
    # rate() over a series that appears with the first error misses that
    # error; go-grpc-prometheus pre-creates them, and so does the server.
    samples = metrics_server.samples()
    from bots_client.proto import bots_pb2

    for method in bots_pb2.DESCRIPTOR.services_by_name["TaskSelector"].methods:
        for code in ("OK", "Unavailable", "Internal"):
            assert handled(samples, method.name, code) is not None, (method.name, code)


def test_continuous_rewards_are_informative_by_their_spread(metrics_server: MetricsServer) -> None:
    """Rewards in [0, 1] reported with their sum of squares: a group counts as
    informative when its rewards differ, whatever their mean; the success
    counters keep the rewards as reported."""
    name = unique("continuous")
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=3))
        client.add_tasks(name, [Task(f"t{i}") for i in range(4)])
        batch = client.select_batch(name, 4, request_key="s0")
        groups = [
            (2.0, 4, 1.0),  # 4 x 0.5: no spread
            (2.0, 4, 1.5),  # 0, 1, 0.5, 0.5
            (1.2, 4, 0.36),  # 4 x 0.3: no spread
            (3.0, 4),  # binary, 3 of 4
        ]
        client.report_outcomes(name, batch.batch_id, dict(zip(batch.keys, groups)))
    samples = eventually(
        metrics_server.samples,
        lambda s: value(s, "bots_steps_total", experiment=name) == 1,
        what="the report counted as a step",
    )
    assert value(samples, "bots_tasks_informative_total", experiment=name) == 2
    assert value(samples, "bots_batch_informative_fraction", experiment=name) == pytest.approx(0.5)
    assert value(samples, "bots_rollout_successes_total", experiment=name) == pytest.approx(8.2)


def test_learning_signals_of_a_reported_batch(metrics_server: MetricsServer) -> None:
    name = unique("learn")
    config = ExperimentConfig(seed=3, weak_feature="weak", strong_feature="strong")
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, config)
        client.add_tasks(
            name, [Task(f"t{i}", {"weak": (i % 10) / 20, "strong": 0.5 + (i % 10) / 20}) for i in range(50)]
        )
        batch = client.select_batch(name, 8, request_key="s0")
        eventually(
            lambda: value(metrics_server.samples(), "bots_leased_tasks", experiment=name),
            lambda v: v == 8,
            what="8 tasks leased after selecting a batch of 8",
        )
        # 3 all-wrong, 3 mixed, 2 all-right groups of 4 rollouts.
        outcomes = {k: (0, 4) if i < 3 else (2, 4) if i < 6 else (4, 4) for i, k in enumerate(batch.keys)}
        client.report_outcomes(name, batch.batch_id, outcomes)
        experiment = client.get_experiment(name)
        snap = client.snapshot(name)

    samples = eventually(
        metrics_server.samples,
        lambda s: value(s, "bots_steps_total", experiment=name) == 1,
        what="the report counted as a step",
    )

    def v(metric: str, **labels: str) -> float | None:
        return value(samples, metric, experiment=name, **labels)

    assert v("bots_tasks_selected_total") == 8
    assert v("bots_batches_selected_total") == 1
    assert v("bots_tasks_reported_total") == 8
    assert v("bots_tasks_informative_total") == 3
    assert v("bots_batch_informative_fraction") == pytest.approx(3 / 8)
    assert v("bots_rollouts_total") == 32
    assert v("bots_rollout_successes_total") == 14
    assert v("bots_batch_success_rate") == pytest.approx(14 / 32)
    assert v("bots_leased_tasks") == 0
    assert v("bots_experiment_step") == 1
    assert v("bots_experiment_tasks") == 50
    assert experiment.capability is not None
    assert v("bots_capability") == pytest.approx(experiment.capability)

    # The summary is of the posterior the server holds, the one a snapshot returns.
    expected = posterior_summary(
        PosteriorState(snap.alpha, snap.beta, np.full(50, np.nan), np.full(50, np.nan)), config.target_success
    )
    for band, share in zip(SHARE_BANDS, expected.shares, strict=True):
        assert v("bots_posterior_target_share", band=band) == pytest.approx(share), band
    for q, mean in zip(MEAN_QUANTILES, expected.mean_quantiles, strict=True):
        assert v("bots_posterior_mean_quantile", percentile=f"{100 * q:g}") == pytest.approx(mean), q


def test_leased_tasks_are_exact_at_every_scrape(metrics_server: MetricsServer) -> None:
    """A partial report frees its whole batch, and an expired lease frees its
    tasks without any further call: the gauge is computed at scrape time."""
    name = unique("lease")
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=9, lease_ttl_seconds=3))
        client.add_tasks(name, [Task(f"t{i}") for i in range(20)])
        first = client.select_batch(name, 4, request_key="a")
        client.select_batch(name, 5, request_key="b")
        leased = lambda: value(metrics_server.samples(), "bots_leased_tasks", experiment=name)  # noqa: E731
        eventually(leased, lambda v: v == 9, what="two open batches: 4 + 5 tasks")
        client.report_outcomes(name, first.batch_id, {first.keys[0]: (1, 2)})  # 1 of 4 tasks reported
        eventually(leased, lambda v: v == 5, what="the partly reported batch is closed")
    eventually(leased, lambda v: v == 0, timeout=15, what="the other lease expired")


def test_experiments_in_the_store_have_gauges_from_start_up(tmp_path: Path) -> None:
    """After a restart, every experiment's step and pool size are published
    before any call touches it (none is loaded), up to the configured count."""
    db = f"sqlite:///{tmp_path / 'start.db'}"
    first = MetricsServer(db).start()
    try:
        with bots_client.Client(first.address) as client:
            for name, steps in (("a-exp", 2), ("b-exp", 0), ("c-exp", 1)):
                client.create_experiment(name, ExperimentConfig(seed=1))
                client.add_tasks(name, [Task(f"t{i}") for i in range(6 + steps)])
                for step in range(steps):
                    batch = client.select_batch(name, 2, request_key=f"s{step}")
                    client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))
    finally:
        first.stop()
    second = MetricsServer(db, extra_args=["--metrics-max-experiments", "2"]).start()
    try:
        samples = eventually(
            second.samples, lambda s: value(s, "bots_experiment_step", experiment="b-exp") is not None
        )
        assert number(samples, "bots_experiment_step", experiment="a-exp") == 2
        assert number(samples, "bots_experiment_tasks", experiment="a-exp") == 8
        assert number(samples, "bots_experiment_step", experiment="b-exp") == 0
        assert number(samples, "bots_leased_tasks", experiment="a-exp") == 0
        assert number(samples, "bots_steps_since_checkpoint", experiment="a-exp") == 0
        assert value(samples, "bots_experiment_step", experiment="c-exp") is None  # beyond the bound
        assert number(samples, "bots_experiments_loaded") == 0
    finally:
        second.stop()


def test_checkpoint_age_and_duration_follow_checkpoints(metrics_server: MetricsServer) -> None:
    # The shared server checkpoints every 2 steps.
    name = unique("ckpt")
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=5))
        client.add_tasks(name, [Task(f"t{i}") for i in range(10)])

        def step(key: str) -> None:
            batch = client.select_batch(name, 2, request_key=key)
            client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))

        step("s1")
        pending = eventually(
            metrics_server.samples,
            lambda s: value(s, "bots_steps_since_checkpoint", experiment=name) == 1,
            what="one step not checkpointed yet",
        )
        assert number(pending, "bots_checkpoint_age_seconds", experiment=name) > 0
        step("s2")
    done = eventually(
        metrics_server.samples,
        # Both in one scrape: the HTTP thread reads the gauges and the
        # checkpoint view one after the other, so a scrape can fall between
        # the two updates of a checkpoint.
        lambda s: value(s, "bots_steps_since_checkpoint", experiment=name) == 0
        and value(s, "bots_checkpoint_last_duration_seconds", experiment=name) is not None,
        what="the checkpoint at step 2 recorded",
    )
    assert value(done, "bots_checkpoint_age_seconds", experiment=name) == 0
    assert number(done, "bots_checkpoint_last_duration_seconds", experiment=name) > 0
    assert number(done, "bots_checkpoint_last_timestamp_seconds", experiment=name) > 0
    assert number(done, "bots_checkpoint_duration_seconds_count") >= 1


def test_deleting_an_experiment_removes_its_series(metrics_server: MetricsServer) -> None:
    name = unique("gone")
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=6))
        client.add_tasks(name, [Task(f"t{i}") for i in range(10)])
        batch = client.select_batch(name, 2, request_key="s")
        client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))
        eventually(metrics_server.scrape, lambda text: f'experiment="{name}"' in text, what="series exist")
        client.delete_experiment(name)
    eventually(metrics_server.scrape, lambda text: f'experiment="{name}"' not in text, what="series removed")


def test_retired_tasks_and_tasks_selected_per_group(metrics_server: MetricsServer) -> None:
    name = unique("pools")
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=8))
        client.add_tasks(name, [Task(f"m{i}", {}, "math") for i in range(12)] + [Task(f"c{i}", {}, "code") for i in range(8)])
        client.retire_tasks(name, ["m0", "m1", "c0"])
        client.set_group_shares(name, {"math": 0.75, "code": 0.25})
        for step in range(3):
            batch = client.select_batch(name, 4, request_key=f"s{step}")
            client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))

    def selected(group: str) -> float | None:
        return value(metrics_server.samples(), "bots_group_tasks_selected_total", experiment=name, group=group)

    eventually(lambda: selected("code"), lambda v: v == 3.0, what="code: 1 of 4 in each of 3 batches")
    assert selected("math") == 9.0
    assert value(metrics_server.samples(), "bots_experiment_retired_tasks", experiment=name) == 3.0


def test_label_sets_are_bounded_and_task_keys_never_labels(metrics_server: MetricsServer) -> None:
    name = unique("card")
    marker = "TASKKEYMARKER"
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=7))
        client.add_tasks(name, [Task(f"{marker}{i}") for i in range(30)])
        batch = client.select_batch(name, 5, request_key="s")
        client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 3)))
    text = eventually(metrics_server.scrape, lambda t: f'bots_steps_total{{experiment="{name}"}}' in t)
    assert marker not in text
    labels = {label for series in parse(text).values() for key in series for label, _ in key}
    assert labels <= ALLOWED_LABELS, labels - ALLOWED_LABELS


def test_exposition_passes_promtool_lint(metrics_server: MetricsServer) -> None:
    promtool = require_tool("promtool")
    name = unique("lint")
    with bots_client.Client(metrics_server.address) as client:
        client.create_experiment(name, ExperimentConfig(seed=8, weak_feature="w", strong_feature="s"))
        client.add_tasks(name, [Task(f"t{i}", {"w": 0.1, "s": 0.9}) for i in range(10)])
        batch = client.select_batch(name, 3, request_key="s")
        client.report_outcomes(name, batch.batch_id, dict.fromkeys(batch.keys, (1, 4)))
    # Wait for every kind of series to be there: experiment, loop lag, checkpoint.
    text = eventually(
        metrics_server.scrape,
        lambda t: (
            f'bots_posterior_target_share{{band="near",experiment="{name}"}}' in t
            and "bots_event_loop_lag_seconds_count" in t
            and parse(t)["bots_event_loop_lag_seconds_count"][frozenset()] > 0
        ),
    )
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


def test_metrics_port_taken_keeps_grpc_serving(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(
            f"sqlite:///{tmp_path / 'taken.db'}", extra_args=["--metrics-listen", f"127.0.0.1:{port}"]
        )
        server.start()
        try:
            with bots_client.Client(server.address) as client:
                client.create_experiment("still-serving")
            errors = [e for e in server.log_lines if e.get("level") == "ERROR"]
            assert any("cannot serve metrics" in str(e.get("message")) for e in errors), errors
        finally:
            server.stop()


def test_empty_metrics_listen_disables_the_endpoint(tmp_path) -> None:
    server = MetricsServer(f"sqlite:///{tmp_path / 'off.db'}", extra_args=["--metrics-listen", ""]).start()
    try:
        serving = next(e for e in server.log_lines if e.get("message") == "serving")
        assert serving["metrics_port"] is None
        with bots_client.Client(server.address) as client:
            client.create_experiment("no-metrics")
    finally:
        server.stop()


def test_database_outage_is_counted_and_clears_readiness(fresh_pg_url: str) -> None:
    server = MetricsServer(fresh_pg_url).start()
    try:
        with bots_client.Client(server.address, retry_timeout=0.5) as client:
            client.create_experiment("outage")
            drop_pg_database(fresh_pg_url)  # terminates the server's connections too
            with pytest.raises(bots_client.UnavailableError):
                client.get_experiment("outage")

        def database_errors(samples: dict[str, dict[Labels, float]]) -> float:
            return sum(number(samples, "bots_database_errors_total", kind=k) for k in ("unavailable", "connection_lost"))

        samples = eventually(
            server.samples,
            lambda s: value(s, "bots_database_up") == 0,
            what="the health check notices the database is gone",
        )
        assert database_errors(samples) >= 1
        assert value(samples, "bots_database_errors_total", kind="integrity") == 0
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            ready = health.Check(health_pb2.HealthCheckRequest(service=TASK_SELECTOR), timeout=5)
            live = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert live.status == health_pb2.HealthCheckResponse.SERVING
        unavailable = handled(server.samples(), "GetExperiment", "Unavailable")
        assert unavailable >= 1
    finally:
        server.kill()


def test_deleted_experiments_are_remembered_only_as_long_as_their_late_hooks_need() -> None:
    """A hook queued before a delete and run after it must not bring the
    experiment's series back; a server deleting experiments for months must
    not keep every name it deleted."""
    import time

    from prometheus_client import CollectorRegistry

    from bots_server.metrics import REMEMBERED_REMOVALS, ExperimentMetrics

    registry = CollectorRegistry()
    metrics = ExperimentMetrics(registry)

    def selected(experiment: str) -> float | None:
        return registry.get_sample_value("bots_batches_selected_total", {"experiment": experiment})

    metrics.batch_selected("gone", "b0", 4, time.time() + 60)
    metrics.experiment_removed("gone")
    metrics.batch_selected("gone", "b1", 4, time.time() + 60)  # late: queued before the delete
    assert selected("gone") is None
    for i in range(REMEMBERED_REMOVALS):
        metrics.experiment_removed(f"other-{i}")
    # Long after: the name is forgotten, so the memory stays bounded, and a
    # new experiment of that name gets its series.
    metrics.batch_selected("gone", "b2", 4, time.time() + 60)
    assert selected("gone") == 1.0
    metrics.batch_selected(f"other-{REMEMBERED_REMOVALS - 1}", "b3", 4, time.time() + 60)
    assert selected(f"other-{REMEMBERED_REMOVALS - 1}") is None  # a recent delete is still remembered
