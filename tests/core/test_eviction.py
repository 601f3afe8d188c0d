"""The memory budget: a service that keeps evicting idle experiments gives
exactly the batches and posteriors of one that never does, on SQLite and
PostgreSQL; experiments in use are never evicted."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

import bots_client
from bots_client import ExperimentConfig, Task
from bots_server.core.selector import CheckpointPolicy
from bots_server.testing.inprocess import InProcessService

EXPERIMENTS = 5
TASKS = 40
ROUNDS = 12


def outcome(key: str, round_: int) -> tuple[int, int]:
    """A deterministic made-up outcome of 8 rollouts."""
    digest = hashlib.sha256(f"{key}/{round_}".encode()).digest()
    return digest[0] % 9, 8


def drive(service: InProcessService, prefix: str) -> tuple[list[list[str]], list[tuple[list[float], list[float]]]]:
    """The same workload on any service (experiment names start with
    `prefix`, nothing else depends on it): experiments used in turn, so that
    with a tiny budget every call finds its experiment evicted."""
    batches: list[list[str]] = []
    with bots_client.Client("in-process", channel=service.channel()) as client:
        for e in range(EXPERIMENTS):
            name = f"{prefix}{e}"
            client.create_experiment(name, ExperimentConfig(seed=e, implicit_weight=0.0 if e % 2 else 0.1))
            client.add_tasks(name, [Task(key=f"exp{e}/t{i}") for i in range(TASKS)])
        for r in range(ROUNDS):
            for e in range(EXPERIMENTS):
                name = f"{prefix}{e}"
                if r == ROUNDS // 2:
                    client.add_tasks(name, [Task(key=f"exp{e}/late{i}") for i in range(3)])
                batch = client.select_batch(name, 6, request_key=f"round-{r}")
                batches.append(list(batch.keys))
                client.report_outcomes(name, batch.batch_id, {k: outcome(k, r) for k in batch.keys})
        posteriors = []
        for e in range(EXPERIMENTS):
            snap = client.snapshot(f"{prefix}{e}")
            posteriors.append((snap.alpha.tolist(), snap.beta.tolist()))
    return batches, posteriors


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_evicting_changes_no_batch_and_no_posterior(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    def url(tag: str) -> str:
        if backend == "sqlite":
            return f"sqlite:///{tmp_path / tag}.db"
        return str(request.getfixturevalue("fresh_pg_url"))  # one database, told apart by the names

    policy = CheckpointPolicy(every_steps=5, every_seconds=3600)  # rebuilds mix checkpoints and replays
    with InProcessService(url("never"), checkpoint_policy=policy) as keeping:
        expected = drive(keeping, "never-")
        assert keeping.core.runtime.evictions == 0
    with InProcessService(url("always"), checkpoint_policy=policy, memory_budget_bytes=1) as evicting:
        got = drive(evicting, "always-")
        runtime = evicting.core.runtime
        # Each call on another experiment than the last evicted the last one.
        assert runtime.evictions >= EXPERIMENTS * ROUNDS
        assert len(runtime.live) == 1
    assert got[0] == expected[0]
    for (alpha, beta), (got_alpha, got_beta) in zip(expected[1], got[1], strict=True):
        np.testing.assert_array_equal(got_alpha, alpha)
        np.testing.assert_array_equal(got_beta, beta)


def _loaded_bytes(db: Path, key_prefix: str) -> int:
    """The memory estimate of one loaded experiment of TASKS tasks keyed
    `key_prefix` + i: the unit the budget tests size their budgets in."""
    with InProcessService(f"sqlite:///{db}") as probe:
        with bots_client.Client("in-process", channel=probe.channel()) as client:
            client.create_experiment("one")
            client.add_tasks("one", [Task(key=f"{key_prefix}{i}") for i in range(TASKS)])
            client.select_batch("one", 1)
        return probe.core.runtime.live["one"].memory_bytes()


def test_the_budget_keeps_what_fits(tmp_path: Path) -> None:
    """With room for about three experiments, three stay loaded."""
    one = _loaded_bytes(tmp_path / "fits.db", "one/t")
    with InProcessService(f"sqlite:///{tmp_path / 'budget.db'}", memory_budget_bytes=int(one * 3.5)) as service:
        with bots_client.Client("in-process", channel=service.channel()) as client:
            for e in range(6):
                client.create_experiment(f"e{e}")
                client.add_tasks(f"e{e}", [Task(key=f"one/t{i}") for i in range(TASKS)])
            for e in range(6):
                client.select_batch(f"e{e}", 1)
        runtime = service.core.runtime
        assert list(runtime.live) == ["e3", "e4", "e5"]  # least recently used went first
        assert runtime.memory_bytes <= one * 3.5


def test_a_tenant_loading_more_than_its_share_evicts_its_own_experiments_first(tmp_path: Path) -> None:
    """One tenant's flood of experiments must not push another tenant's out
    of memory: the tenant holding the most is evicted first."""
    one = _loaded_bytes(tmp_path / "probe.db", "t")
    with InProcessService(f"sqlite:///{tmp_path / 'fair.db'}", memory_budget_bytes=int(one * 3.5)) as service:
        with bots_client.Client("in-process", channel=service.channel()) as client:
            names = ["team-b/victim"] + [f"team-a/flood{e}" for e in range(6)]
            for name in names:
                client.create_experiment(name)
                client.add_tasks(name, [Task(key=f"t{i}") for i in range(TASKS)])
            for name in names:
                client.select_batch(name, 1)
        runtime = service.core.runtime
        # Least recently used alone would have dropped the victim first.
        assert list(runtime.live) == ["team-b/victim", "team-a/flood4", "team-a/flood5"]
        assert runtime.memory_bytes <= one * 3.5
