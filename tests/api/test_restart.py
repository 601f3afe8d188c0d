"""State survives restarts: after a graceful stop (SIGTERM) or a crash
(SIGKILL) the rebuilt posterior is bit-for-bit the one before, and the run
continues exactly as an uninterrupted one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator

import numpy as np
import pytest
import sqlalchemy as sa

import bots_client
from bots_client import ExperimentConfig, Task
from bots_server.engine import EngineParams, PosteriorState, select, step_rng
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres

CONFIG = ExperimentConfig(weak_feature="weak", strong_feature="strong", seed=5, implicit_weight=0.2)
# Checkpoint every 4 steps: a restart rebuilds from a checkpoint plus replayed events.
SERVER_ARGS = ["--checkpoint-every-steps", "4", "--checkpoint-every-seconds", "3600"]


def outcome(key: str, step: int) -> tuple[float, int] | tuple[float, int, float]:
    """A deterministic, uneven outcome for a task at a step: some fractional,
    and some of those with a sum of squared rewards (continuous rewards,
    whose variance the posterior's evidence depends on)."""
    h = int(hashlib.sha256(f"{key}/{step}".encode()).hexdigest(), 16)
    successes = (h % 17) / (2 if h % 3 == 0 else 1)
    if h % 3 == 0 and h % 2 == 0:
        low = successes * successes / 16  # no spread ... successes: the widest
        return successes, 16, low + (successes - low) * ((h >> 8) % 5) / 4
    return successes, 16


# The opt-in engines beyond the paper read the posterior, the features and the
# capability only, so a rebuilt server must continue them exactly as well.
OPT_IN = ExperimentConfig(
    weak_feature="weak", strong_feature="strong", seed=5, forgetting=0.05, selection_mode="expected",
    track_prediction=0.5, implicit_reliability=1.0,
)  # fmt: skip
# Adaptive rho (the reference's rule) with a threshold this workload's errors
# reach in the first steps: its halvings must survive the checkpoint.
ADAPTIVE_RHO = ExperimentConfig(weak_feature="weak", strong_feature="strong", seed=5, adaptive_rho_error=0.05)
# Successes kept: no features named, so every task is spared (a per-task forgetting).
KEEP_SUCCESSES = ExperimentConfig(seed=5, keep_successes=1.0, forgetting=0.3)


def run_steps(client: bots_client.Client, name: str, steps: range) -> list[list[str]]:
    picked = []
    for step in steps:
        batch = client.select_batch(name, 6, request_key=f"step-{step}")
        client.report_outcomes(name, batch.batch_id, {k: outcome(k, step) for k in batch.keys})
        picked.append(batch.keys)
    return picked


def setup(client: bots_client.Client, name: str, config: ExperimentConfig = CONFIG) -> None:
    client.create_experiment(name, config)
    rng = np.random.default_rng(1)
    weak = rng.uniform(0, 0.6, 40)
    client.add_tasks(name, [Task(f"task-{i}", {"weak": float(w), "strong": float(min(1, w + 0.3))}) for i, w in enumerate(weak)])


def bits(snap: bots_client.Snapshot) -> tuple[object, ...]:
    return snap.step, snap.experiment.capability, tuple(snap.keys), snap.alpha.tobytes(), snap.beta.tobytes()


@pytest.fixture(params=["sqlite", "postgresql"])
def two_databases(request: pytest.FixtureRequest, tmp_path) -> Iterator[tuple[str, str]]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
        return
    require_postgres()
    urls = create_pg_database("bots_restart"), create_pg_database("bots_restart")
    yield urls
    for url in urls:
        drop_pg_database(url)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_restart_rebuilds_identical_posterior_and_continues_identically(two_databases: tuple[str, str], how: str) -> None:
    restarted_db, reference_db = two_databases
    reference = ServerProcess(reference_db, extra_args=SERVER_ARGS).start()
    server = ServerProcess(restarted_db, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(reference.address) as ref:
            setup(ref, "run")
            ref_picks = run_steps(ref, "run", range(14))
            ref_final = bits(ref.snapshot("run"))

        with bots_client.Client(server.address) as client:
            setup(client, "run")
            picks = run_steps(client, "run", range(7))  # 7 steps: checkpoint at 4, events 5-7 after it
            # An open batch must survive the restart too.
            pending = client.select_batch("run", 6, request_key="step-7")
            before = bits(client.snapshot("run"))
        if how == "sigterm":
            assert server.stop() == 0
            assert "checkpoint written" in server.messages()
        else:
            server.kill()
        server = ServerProcess(restarted_db, extra_args=SERVER_ARGS).start()
        with bots_client.Client(server.address) as client:
            assert bits(client.snapshot("run")) == before
            assert client.select_batch("run", 6, request_key="step-7") == pending
            client.report_outcomes("run", pending.batch_id, {k: outcome(k, 7) for k in pending.keys})
            picks += [pending.keys] + run_steps(client, "run", range(8, 14))
            final = bits(client.snapshot("run"))
        assert picks == ref_picks
        assert final == ref_final
    finally:
        server.kill()
        reference.kill()


@pytest.mark.parametrize(
    "config", [OPT_IN, ADAPTIVE_RHO, KEEP_SUCCESSES], ids=["beyond-the-paper", "adaptive-rho", "keep-successes"]
)
def test_restart_continues_the_opt_in_engines_identically(tmp_path, config: ExperimentConfig) -> None:
    reference = ServerProcess(f"sqlite:///{tmp_path / 'ref.db'}", extra_args=SERVER_ARGS).start()
    db = f"sqlite:///{tmp_path / 'run.db'}"
    server = ServerProcess(db, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(reference.address) as ref:
            setup(ref, "run", config)
            ref_picks = run_steps(ref, "run", range(14))
            ref_final = bits(ref.snapshot("run"))
        with bots_client.Client(server.address) as client:
            setup(client, "run", config)
            picks = run_steps(client, "run", range(7))  # checkpoint at 4, events 5-7 replayed
            before = bits(client.snapshot("run"))
        server.kill()
        server = ServerProcess(db, extra_args=SERVER_ARGS).start()
        with bots_client.Client(server.address) as client:
            assert bits(client.snapshot("run")) == before
            picks += run_steps(client, "run", range(7, 14))
            final = bits(client.snapshot("run"))
        assert picks == ref_picks
        assert final == ref_final
    finally:
        server.kill()
        reference.kill()


def test_restart_replays_tasks_added_between_steps(tmp_path) -> None:
    """Tasks added after a checkpoint take part only in later steps on replay."""
    db = f"sqlite:///{tmp_path / 'grow.db'}"
    server = ServerProcess(db, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(server.address) as client:
            setup(client, "grow")
            run_steps(client, "grow", range(5))  # checkpoint at step 4
            client.add_tasks("grow", [Task(f"late-{i}", {"weak": 0.2, "strong": 0.7}) for i in range(10)])
            run_steps(client, "grow", range(5, 7))
            client.add_tasks("grow", [Task("later", {"weak": 0.5, "strong": 0.9})])
            run_steps(client, "grow", range(7, 8))
            before = bits(client.snapshot("grow"))
        server.kill()
        server = ServerProcess(db, extra_args=SERVER_ARGS).start()
        with bots_client.Client(server.address) as client:
            assert bits(client.snapshot("grow")) == before
    finally:
        server.kill()


def test_an_experiment_stored_before_stream_2_keeps_stream_1(two_databases: tuple[str, str]) -> None:
    """A config stored without random_stream (a server before it existed)
    reads back as stream 1 after an upgrade: its batches are the ones stream
    1 draws, while a new experiment's are stream 2's. 40,000 tasks: stream 2
    draws parts from 32,768."""
    db, _ = two_databases
    n, config = 40_000, ExperimentConfig(weak_feature="weak", strong_feature="strong", seed=5)
    rng = np.random.default_rng(2)
    weak = rng.uniform(0, 0.6, n)
    strong = np.minimum(1.0, weak + 0.3)
    tasks = [Task(f"t{i}", {"weak": float(w), "strong": float(s)}) for i, (w, s) in enumerate(zip(weak, strong))]
    server = ServerProcess(db).start()
    try:
        with bots_client.Client(server.address) as client:
            for name in ("old", "new"):
                client.create_experiment(name, config)
                client.add_tasks(name, tasks)
        assert server.stop() == 0
        engine = sa.create_engine(db)
        with engine.begin() as conn:
            stored = json.loads(conn.execute(sa.text("SELECT config FROM experiments WHERE name = 'old'")).scalar_one())
            del stored["random_stream"]
            conn.execute(sa.text("UPDATE experiments SET config = :c WHERE name = 'old'"), {"c": json.dumps(stored)})
        engine.dispose()
        server = ServerProcess(db).start()
        with bots_client.Client(server.address) as client:
            batches = {name: client.select_batch(name, 32, request_key="first").keys for name in ("old", "new")}
            assert client.get_experiment("old").config.random_stream == 1
            assert client.get_experiment("new").config.random_stream == 2
    finally:
        server.kill()
    for name, stream in (("old", 1), ("new", 2)):
        params = EngineParams.of(dataclasses.replace(config, random_stream=stream))
        state = PosteriorState.from_prior(params, weak, strong)
        chosen = select(params, state.alpha, state.beta, np.ones(n, dtype=bool), 32, step_rng(5, 0, "first"))
        assert batches[name] == [f"t{i}" for i in chosen]
    assert batches["old"] != batches["new"]
