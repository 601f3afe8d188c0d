"""Task embeddings through the whole service, over real servers on SQLite
and PostgreSQL: AddTasks keeps each task's vector bit for bit, and snapshot,
fork, restore, checkpoints and restarts carry it; every bad vector is
INVALID_ARGUMENT naming the task, with nothing stored; the memory an
experiment holds counts its embeddings."""

from __future__ import annotations

import dataclasses
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import sqlalchemy as sa

import bots_client
from bots_client import ExperimentConfig, Task
from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_server.store import checkpoint_blob
from bots_server.testing.inprocess import InProcessService
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres

Code = grpc.StatusCode
DIM = 8


def vectors(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    """Embeddings with values float32 rounds (float64 draws): what the
    server keeps is the float32 of each."""
    return np.random.default_rng(seed).normal(size=(n, dim))


def embedded_tasks(prefix: str, values: np.ndarray) -> list[Task]:
    # Half as numpy rows, half as lists of Python floats: both are accepted.
    return [
        Task(f"{prefix}{i}", embedding=row if i % 2 else row.tolist(), group="a" if i % 3 else "")
        for i, row in enumerate(values)
    ]


def unique(stem: str) -> str:
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def run(client: bots_client.Client, name: str, steps: range) -> None:
    for step in steps:
        batch = client.select_batch(name, 4, request_key=f"step-{step}")
        client.report_outcomes(name, batch.batch_id, {k: ((step + len(k)) % 5, 4) for k in batch.keys})


def test_embeddings_round_trip_through_snapshot_fork_and_restore(client: bots_client.Client) -> None:
    name = unique("emb")
    client.create_experiment(name, ExperimentConfig(embedding_dim=DIM, seed=3, rollouts_per_task=4))
    first, second = vectors(20, seed=1), vectors(6, seed=2)
    client.add_tasks(name, embedded_tasks("t", first))
    run(client, name, range(3))
    client.add_tasks(name, embedded_tasks("u", second))  # a second block, after steps
    run(client, name, range(3, 5))
    expected = np.concatenate([first, second]).astype(np.float32)

    snap = client.snapshot(name, include_features=True)
    assert snap.config.embedding_dim == DIM
    assert snap.embeddings is not None and snap.embeddings.dtype == np.float32
    assert snap.embeddings.tobytes() == expected.tobytes()  # bit for bit
    assert client.snapshot(name).embeddings is None  # only with the features

    fork = unique("emb-fork")
    client.fork_experiment(name, fork)
    forked = client.snapshot(fork, include_features=True)
    assert forked.embeddings is not None and forked.embeddings.tobytes() == expected.tobytes()
    assert forked.alpha.tobytes() == snap.alpha.tobytes()
    # A fork keeps its source's tasks, so their embedding_dim too.
    with pytest.raises(bots_client.BotsError) as refused:
        client.fork_experiment(name, unique("emb-fork"), ExperimentConfig(seed=3, rollouts_per_task=4))
    assert refused.value.code == Code.INVALID_ARGUMENT
    assert "embedding_dim = 0 differs from the source's (8)" in refused.value.message

    restored = unique("emb-restored")
    client.restore_experiment(restored, snap)
    back = client.snapshot(restored, include_features=True)
    assert back.embeddings is not None and back.embeddings.tobytes() == expected.tobytes()
    assert back.keys == snap.keys and back.groups == snap.groups
    # The copies go on: new tasks need their vectors there too.
    client.add_tasks(restored, embedded_tasks("v", vectors(2, seed=9)))
    run(client, restored, range(5, 7))

    # A snapshot without its embeddings cannot restore an experiment that has them.
    with pytest.raises(bots_client.BotsError) as refused:
        client.restore_experiment(unique("emb-cut"), dataclasses.replace(snap, embeddings=None))
    assert refused.value.code == Code.INVALID_ARGUMENT
    assert "task 't0': no embedding" in refused.value.message
    assert not [e for e in client.list_experiments() if e.name.startswith("emb-cut")]


def test_experiments_without_embeddings_are_as_before(client: bots_client.Client) -> None:
    name = unique("plain")
    client.create_experiment(name)
    client.add_tasks(name, [Task(f"t{i}") for i in range(5)])
    snap = client.snapshot(name, include_features=True)
    assert snap.config.embedding_dim == 0 and snap.embeddings is None
    restored = unique("plain-restored")
    client.restore_experiment(restored, snap)
    assert client.snapshot(restored, include_features=True).embeddings is None


def _f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


GOOD = _f32(*range(4))
BAD_TASKS = {
    "nan": (4, _f32(0.0, float("nan"), 1.0, 2.0), "task 'bad': embedding value #1 is nan"),
    "infinity": (4, _f32(0.0, 1.0, float("-inf"), 2.0), "task 'bad': embedding value #2 is -inf"),
    "wrong dimension": (4, _f32(1.0, 2.0, 3.0), "task 'bad': embedding has 3 values; the experiment's embedding_dim is 4"),
    "not float32": (4, GOOD[:7], "task 'bad': embedding of 7 bytes is not float32 values"),
    "missing": (4, b"", "task 'bad': no embedding; the experiment's tasks each need 4 values"),
    "without embedding_dim": (0, GOOD, "task 'bad' has an embedding, but the experiment has none"),
}


@pytest.mark.parametrize("case", list(BAD_TASKS))
def test_a_bad_embedding_rejects_the_whole_stream_and_stores_nothing(
    client: bots_client.Client, stub: pb_grpc.TaskSelectorStub, case: str
) -> None:
    dim, bad, message = BAD_TASKS[case]
    name = unique("bad-emb")
    client.create_experiment(name, ExperimentConfig(embedding_dim=dim))
    good = GOOD if dim else b""
    client.add_tasks(name, [Task("kept", embedding=np.arange(dim) if dim else None)])
    before = client.snapshot(name, include_features=True)
    # The bad task in the stream's second message: the first one's tasks are not stored either.
    stream = [
        pb.AddTasksRequest(experiment=name, tasks=[pb.Task(key=f"ok{i}", embedding=good) for i in range(3)], total_tasks=5),
        pb.AddTasksRequest(tasks=[pb.Task(key="ok3", embedding=good), pb.Task(key="bad", embedding=bad)]),
    ]
    with pytest.raises(grpc.RpcError) as refused:
        stub.AddTasks(iter(stream))
    assert refused.value.code() == Code.INVALID_ARGUMENT, refused.value.details()
    assert message in (refused.value.details() or "")
    after = client.snapshot(name, include_features=True)
    assert after.keys == before.keys == ["kept"]
    assert after.experiment.num_tasks == 1
    if dim:
        assert after.embeddings is not None and before.embeddings is not None
        assert after.embeddings.tobytes() == before.embeddings.tobytes()


def test_bad_embedding_dims_and_restored_vectors_are_refused(
    client: bots_client.Client, stub: pb_grpc.TaskSelectorStub
) -> None:
    with pytest.raises(bots_client.BotsError) as refused:
        client.create_experiment(unique("huge"), ExperimentConfig(embedding_dim=4097))
    assert refused.value.code == Code.INVALID_ARGUMENT
    assert "config.embedding_dim = 4097 is outside [0, 4096]" in refused.value.message
    name = unique("restore-bad")
    first = pb.RestoreExperimentRequest(
        name=name, config=pb.ExperimentConfig(embedding_dim=4), keys=["a", "b"], alpha=[1, 1], beta=[1, 1],
        features=[pb.Features(), pb.Features()], embeddings=[GOOD, _f32(0, 0, float("inf"), 0)], total_tasks=2,
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as rpc_refused:
        stub.RestoreExperiment(iter([first]))
    assert rpc_refused.value.code() == Code.INVALID_ARGUMENT
    assert "task 'b': embedding value #2 is inf" in (rpc_refused.value.details() or "")
    with pytest.raises(bots_client.BotsError) as missing:
        client.get_experiment(name)
    assert missing.value.code == Code.NOT_FOUND


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'emb.db'}"
        return
    require_postgres()
    url = create_pg_database("bots_embeddings")
    yield url
    drop_pg_database(url)


def _checkpoint(url: str) -> checkpoint_blob.CheckpointContent:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.text("SELECT version FROM checkpoints")).scalar_one()
            chunks = conn.execute(
                sa.text("SELECT data FROM checkpoint_chunks WHERE version = :v ORDER BY seq"), {"v": version}
            ).scalars()
            return checkpoint_blob.decode(b"".join(bytes(c) for c in chunks))
    finally:
        engine.dispose()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_restart_rebuilds_the_embeddings_from_the_tasks_rows(database: str, how: str) -> None:
    """Checkpoints leave the embeddings out (the tasks rows hold them): a
    rebuild from a checkpoint plus tasks added after it has every vector,
    and selects exactly as the server before it."""
    args = ["--checkpoint-every-steps", "4", "--checkpoint-every-seconds", "3600"]
    server = ServerProcess(database, extra_args=args).start()
    try:
        with bots_client.Client(server.address) as client:
            client.create_experiment("run", ExperimentConfig(embedding_dim=DIM, seed=1, rollouts_per_task=4))
            client.add_tasks("run", embedded_tasks("t", vectors(30, seed=4)))
            run(client, "run", range(5))  # a checkpoint at step 4
            client.add_tasks("run", embedded_tasks("u", vectors(10, seed=5)))  # after it
            run(client, "run", range(5, 6))
            before = client.snapshot("run", include_features=True)
        content = _checkpoint(database)
        assert content.num_tasks == 30 and "embeddings" not in content.arrays
        if how == "sigterm":
            assert server.stop() == 0
        else:
            server.kill()
        server = ServerProcess(database, extra_args=args).start()
        with bots_client.Client(server.address) as client:
            after = client.snapshot("run", include_features=True)
            assert after.embeddings is not None and before.embeddings is not None
            assert after.embeddings.tobytes() == before.embeddings.tobytes()
            assert (after.step, after.alpha.tobytes(), after.beta.tobytes()) == (
                before.step,
                before.alpha.tobytes(),
                before.beta.tobytes(),
            )
            run(client, "run", range(6, 9))  # a checkpoint at step 8, after the restart
    finally:
        server.kill()
    assert "embeddings" not in _checkpoint(database).arrays


def test_an_experiment_s_memory_counts_its_embeddings(tmp_path: Path) -> None:
    """The memory budget (eviction) sees the vectors: the same pool with
    256-dimensional embeddings holds 1 KiB more per task, as float32."""
    tasks, dim = 500, 256
    with InProcessService(f"sqlite:///{tmp_path / 'memory.db'}") as service:
        with bots_client.Client("in-process", channel=service.channel()) as client:  # type: ignore[arg-type]
            client.create_experiment("plain")
            client.add_tasks("plain", [Task(f"t{i}") for i in range(tasks)])
            client.create_experiment("embedded", ExperimentConfig(embedding_dim=dim))
            client.add_tasks("embedded", embedded_tasks("t", vectors(tasks, dim)))
            for name in ("plain", "embedded"):
                client.select_batch(name, 1)
        live = service.core.runtime.live
        assert live["embedded"].memory_bytes() - live["plain"].memory_bytes() == tasks * dim * 4


def test_a_stream_s_embeddings_count_against_its_byte_bound(tmp_path: Path) -> None:
    """An upload's bound in bytes (--max-stream-mb) counts the vectors it carries."""
    server = ServerProcess(f"sqlite:///{tmp_path / 'bound.db'}", extra_args=["--max-stream-mb", "1"]).start()
    try:
        with bots_client.Client(server.address, retry_timeout=5) as client:
            client.create_experiment("big", ExperimentConfig(embedding_dim=4096))
            with pytest.raises(bots_client.BotsError) as refused:
                client.add_tasks("big", embedded_tasks("t", vectors(80, 4096)))  # 1.3 MB of vectors
            assert refused.value.code == Code.RESOURCE_EXHAUSTED
            assert client.get_experiment("big").num_tasks == 0
            client.add_tasks("big", embedded_tasks("t", vectors(40, 4096)))  # 0.65 MB: fits
            assert client.get_experiment("big").num_tasks == 40
    finally:
        server.kill()


def test_an_upload_s_admission_charge_counts_what_its_embeddings_hold(tmp_path: Path) -> None:
    """The memory an AddTasks call is admitted for counts each vector three
    times (in the stream, as a bytes object, in the array): 1000 tasks of
    1024 values (4 MB on the wire) need about 12 MiB, more than an 8 MiB budget."""
    server = ServerProcess(f"sqlite:///{tmp_path / 'admit.db'}", extra_args=["--inflight-budget-mb", "8"]).start()
    try:
        with bots_client.Client(server.address, retry_timeout=5) as client:
            client.create_experiment("wide", ExperimentConfig(embedding_dim=1024))
            with pytest.raises(bots_client.BotsError) as refused:
                client.add_tasks("wide", embedded_tasks("t", vectors(1000, 1024)))
            assert refused.value.code == Code.RESOURCE_EXHAUSTED
            assert "needs about 12 MB" in refused.value.message, refused.value.message
            assert client.get_experiment("wide").num_tasks == 0
            client.add_tasks("wide", embedded_tasks("t", vectors(400, 1024)))  # about 5 MB: fits
            assert client.get_experiment("wide").num_tasks == 400
    finally:
        server.kill()


def test_a_replica_catches_up_with_the_embeddings_another_one_added() -> None:
    """Two servers on one PostgreSQL database: a replica that holds the
    experiment takes in the tasks the other added, vectors included, and
    selects from them."""
    require_postgres()
    url = create_pg_database("bots_embedding_replicas")
    a, b = (ServerProcess(url).start() for _ in range(2))
    try:
        with bots_client.Client(a.address) as ca, bots_client.Client(b.address) as cb:
            ca.create_experiment("run", ExperimentConfig(embedding_dim=DIM, seed=2, rollouts_per_task=4))
            ca.add_tasks("run", embedded_tasks("t", vectors(12, seed=6)))
            run(cb, "run", range(2))  # b loads the experiment
            ca.add_tasks("run", embedded_tasks("u", vectors(5, seed=7)))  # a adds more
            run(cb, "run", range(2, 4))  # b catches up before it selects
            from_b = cb.snapshot("run", include_features=True)
            from_a = ca.snapshot("run", include_features=True)
        expected = np.concatenate([vectors(12, seed=6), vectors(5, seed=7)]).astype(np.float32)
        assert from_b.embeddings is not None and from_b.embeddings.tobytes() == expected.tobytes()
        assert from_a.embeddings is not None and from_a.embeddings.tobytes() == expected.tobytes()
        assert from_a.alpha.tobytes() == from_b.alpha.tobytes()
    finally:
        a.kill()
        b.kill()
        drop_pg_database(url)
