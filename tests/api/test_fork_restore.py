"""Fork and restore: a new experiment from a running one or from a snapshot
(possibly of another server) continues exactly where the source was."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import bots_client
from bots_client import ExperimentConfig, Task
from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from tests.support.servers import ServerProcess

CONFIG = ExperimentConfig(weak_feature="weak", strong_feature="strong", seed=9)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def seeded(client: bots_client.Client, steps: int) -> str:
    name = unique("src")
    client.create_experiment(name, CONFIG)
    client.add_tasks(name, [Task(f"t{i}", {"weak": i / 60, "strong": min(1.0, i / 40), "other": 7.0}) for i in range(30)])
    advance(client, name, range(steps))
    return name


def advance(client: bots_client.Client, name: str, steps: range) -> list[list[str]]:
    picks = []
    for step in steps:
        batch = client.select_batch(name, 5, request_key=f"step-{step}")
        client.report_outcomes(name, batch.batch_id, {k: ((step * 7 + len(k)) % 17, 16) for k in batch.keys})
        picks.append(batch.keys)
    return picks


def state(snap: bots_client.Snapshot) -> tuple[object, ...]:
    return snap.step, snap.experiment.capability, snap.keys, snap.alpha.tobytes(), snap.beta.tobytes()


def test_fork_continues_exactly_like_its_source(client: bots_client.Client) -> None:
    source = seeded(client, steps=4)
    fork = unique("fork")
    created = client.fork_experiment(source, fork)
    assert (created.step, created.num_tasks, created.forked_from, created.forked_at_step) == (4, 30, source, 4)
    assert created.config == CONFIG
    assert state(client.snapshot(fork)) == state(client.snapshot(source))
    # Same config, same request keys and outcomes: the two runs stay identical.
    assert advance(client, fork, range(4, 8)) == advance(client, source, range(4, 8))
    assert state(client.snapshot(fork)) == state(client.snapshot(source))
    assert client.snapshot(fork, include_features=True).features == client.snapshot(source, include_features=True).features


def test_fork_with_another_config_branches_an_ablation(client: bots_client.Client) -> None:
    source = seeded(client, steps=3)
    ablation = unique("rho0")
    created = client.fork_experiment(source, ablation, ExperimentConfig(weak_feature="weak", strong_feature="strong", implicit_weight=0.0, seed=9))
    assert created.config.implicit_weight == 0.0 and created.step == 3
    advance(client, source, range(3, 5))
    advance(client, ablation, range(3, 5))
    # Without implicit evidence, an unselected task only decays toward the prior.
    src, abl = client.snapshot(source), client.snapshot(ablation)
    assert not np.array_equal(src.alpha, abl.alpha)


def test_fork_errors(client: bots_client.Client) -> None:
    source = seeded(client, steps=1)
    with pytest.raises(bots_client.NotFoundError, match="'missing'"):
        client.fork_experiment("missing", unique("f"))
    with pytest.raises(bots_client.AlreadyExistsError, match=repr(source)):
        client.fork_experiment(source, source)
    with pytest.raises(bots_client.InvalidArgumentError, match="forgetting = 3.0"):
        client.fork_experiment(source, unique("f"), ExperimentConfig(forgetting=3.0))


def test_restore_on_another_server_resumes_the_run(client: bots_client.Client, tmp_path) -> None:
    source = seeded(client, steps=5)
    snap = client.snapshot(source, include_features=True)
    other = ServerProcess(f"sqlite:///{tmp_path / 'other.db'}").start()
    try:
        with bots_client.Client(other.address) as remote:
            restored = remote.restore_experiment("resumed", snap)
            assert (restored.step, restored.num_tasks, restored.forked_from) == (5, 30, source)
            assert state(remote.snapshot("resumed")) == state(snap)
            assert advance(remote, "resumed", range(5, 9)) == advance(client, source, range(5, 9))
            assert state(remote.snapshot("resumed")) == state(client.snapshot(source))
    finally:
        other.stop()


def test_a_restore_keeps_adaptive_rhos_halvings_and_continues_exactly(client: bots_client.Client) -> None:
    # The halvings were not in the snapshot: a restored run started again
    # at the full rho and its posterior parted from the source's at once.
    name = unique("adaptive")
    config = ExperimentConfig(weak_feature="weak", strong_feature="strong", seed=9, adaptive_rho_error=0.01)
    client.create_experiment(name, config)
    client.add_tasks(name, [Task(f"t{i}", {"weak": i / 60, "strong": min(1.0, i / 40)}) for i in range(30)])
    advance(client, name, range(6))
    snapshot = client.snapshot(name, include_features=True)
    assert snapshot.rho_halvings > 0
    restored = unique("restored")
    client.restore_experiment(restored, snapshot)
    assert client.snapshot(restored).rho_halvings == snapshot.rho_halvings
    assert advance(client, restored, range(6, 10)) == advance(client, name, range(6, 10))
    assert state(client.snapshot(restored)) == state(client.snapshot(name))


def test_restore_rejects_inconsistent_snapshots(client: bots_client.Client) -> None:
    source = seeded(client, steps=1)
    snap = client.snapshot(source, include_features=True)
    with pytest.raises(ValueError, match="include_features=True"):
        client.restore_experiment(unique("r"), client.snapshot(source))
    bad_alpha = snap.alpha.copy()
    bad_alpha[3] = -1.0
    broken = bots_client.Snapshot(snap.experiment, snap.keys, bad_alpha, snap.beta, snap.features)
    name = unique("r")
    with pytest.raises(bots_client.InvalidArgumentError, match="alpha of task 't3' = -1.0"):
        client.restore_experiment(name, broken)
    duplicated = bots_client.Snapshot(snap.experiment, snap.keys[:-1] + ["t0"], snap.alpha, snap.beta, snap.features)
    with pytest.raises(bots_client.InvalidArgumentError, match="'t0' appears more than once"):
        client.restore_experiment(name, duplicated)
    with pytest.raises(bots_client.NotFoundError):
        client.get_experiment(name)  # nothing was created


def test_a_snapshot_with_the_largest_features_streams_and_restores_within_default_limits(
    client: bots_client.Client, stub: pb_grpc.TaskSelectorStub
) -> None:
    """Every task at the feature bounds (64 features with 256-character
    two-byte names): each chunk stays under gRPC's 4 MB default, and the
    default client exports and restores the experiment."""
    name = f"wide-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name)
    features = {f"{i:02d}" + "é" * 254: float(i) for i in range(64)}
    client.add_tasks(name, [Task(f"task-{i}", features) for i in range(200)])
    chunks = list(stub.Snapshot(pb.SnapshotRequest(experiment=name, include_features=True)))
    assert len(chunks) > 1
    assert max(c.ByteSize() for c in chunks) < 4 * 1024 * 1024
    snapshot = client.snapshot(name, include_features=True)
    restored = client.restore_experiment(f"{name}-copy", snapshot)
    assert restored.num_tasks == 200
    assert client.snapshot(f"{name}-copy", include_features=True).features == snapshot.features
