"""Async trainers: several batches in flight, reports in any order, leases."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

import bots_client
from bots_client import ExperimentConfig, Task
from bots_server.engine import EngineParams, PosteriorState, apply_outcomes
from bots_server.store.base import Store
from bots_server.testing.inprocess import InProcessService
from tests.support.servers import create_pg_database, drop_pg_database, require_postgres


def test_out_of_order_reports_apply_in_arrival_order(client: bots_client.Client) -> None:
    """Each report is one step, in the order reports arrive; the result equals
    the engine applying the same reports in that order."""
    config = ExperimentConfig(weak_feature="w", strong_feature="s", seed=2)
    name = f"async-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name, config)
    weak = np.linspace(0.0, 0.6, 24)
    client.add_tasks(name, [Task(f"t{i}", {"w": float(weak[i]), "s": float(weak[i] + 0.3)}) for i in range(24)])
    in_flight = [client.select_batch(name, 6, request_key=f"rollout-{i}") for i in range(4)]
    assert all(b.step == 0 for b in in_flight)
    assert len({k for b in in_flight for k in b.keys}) == 24  # four disjoint leases

    params = EngineParams.of(config)
    state = PosteriorState.from_prior(params, weak, weak + 0.3)
    index = {f"t{i}": i for i in range(24)}
    for step, batch in enumerate([in_flight[2], in_flight[0], in_flight[3], in_flight[1]], start=1):
        outcomes = {k: (float(index[k] % 5), 4) for k in batch.keys}
        assert client.report_outcomes(name, batch.batch_id, outcomes).step == step
        idx = sorted(index[k] for k in batch.keys)
        state = apply_outcomes(
            params, state, np.array(idx), np.array([float(i % 5) for i in idx]), np.array([4.0] * len(idx))
        ).state
    snap = client.snapshot(name)
    np.testing.assert_array_equal(snap.alpha, state.alpha)
    np.testing.assert_array_equal(snap.beta, state.beta)


def test_partial_report_releases_the_whole_batch(client: bots_client.Client) -> None:
    name = f"partial-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name)
    client.add_tasks(name, [Task(f"t{i}") for i in range(8)])
    batch = client.select_batch(name, 8, request_key="all")
    client.report_outcomes(name, batch.batch_id, {batch.keys[0]: (1, 2)})  # one rollout group failed
    assert client.get_experiment(name).open_batches == 0
    assert len(client.select_batch(name, 8, request_key="next").keys) == 8


def test_a_partial_report_is_logged_with_the_tasks_it_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with InProcessService(f"sqlite:///{tmp_path / 'partial.db'}") as service:
        with bots_client.Client("in-process", channel=service.channel()) as client:
            client.create_experiment("partial")
            client.add_tasks("partial", [Task(f"t{i}") for i in range(4)])
            batch = client.select_batch("partial", 4, request_key="all")
            with caplog.at_level(logging.WARNING, logger="bots_server.core.batches"):
                client.report_outcomes("partial", batch.batch_id, {batch.keys[0]: (1, 2)})
    [record] = [r for r in caplog.records if r.name == "bots_server.core.batches"]
    assert "holds 1 of its 4 tasks" in record.getMessage()
    assert all(k in record.getMessage() for k in batch.keys[1:])
    assert (record.experiment, record.missing_tasks) == ("partial", 3)  # type: ignore[attr-defined]


def test_a_trainer_that_never_reports_cannot_grow_the_batches_without_end(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Selects with fresh request keys and a lease of a millisecond, never
    # reported: the server keeps the newest ones, each still reportable,
    # and a report of one it deleted is NOT_FOUND, saying why.
    monkeypatch.setattr(Store, "max_unreported_batches", 5)
    with InProcessService(f"sqlite:///{tmp_path / 'leaky.db'}") as service:
        with bots_client.Client("in-process", channel=service.channel()) as client:
            client.create_experiment("leaky", ExperimentConfig(lease_ttl_seconds=0.001))
            client.add_tasks("leaky", [Task(f"t{i}") for i in range(4)])
            drawn = []
            for i in range(40):
                drawn.append(client.select_batch("leaky", 4, request_key=f"key-{i}"))
                time.sleep(0.002)  # the lease expires
            with pytest.raises(bots_client.NotFoundError, match="deleted after its lease expired once the experiment holds 5 such"):
                client.report_outcomes("leaky", drawn[0].batch_id, dict.fromkeys(drawn[0].keys, (1, 2)))
            assert client.get_experiment("leaky").step == 0
            for batch in drawn[-5:]:  # the newest five are all there, late or not
                client.report_outcomes("leaky", batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))
            assert client.get_experiment("leaky").step == 5
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'leaky.db'}")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM batches")).scalar_one() == 5  # of 40 selected
    engine.dispose()


def test_a_report_to_another_replica_of_a_batch_deleted_meanwhile_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # Replica b still holds the batch it selected; replica a deletes it at
    # the bound. A late report to b is NOT_FOUND, as on a, not an error.
    require_postgres()
    monkeypatch.setattr(Store, "max_unreported_batches", 3)
    url = create_pg_database("bots_unreported_replicas")
    try:
        with InProcessService(url) as a, InProcessService(url) as b:
            with bots_client.Client("a", channel=a.channel()) as ca, bots_client.Client("b", channel=b.channel()) as cb:
                ca.create_experiment("leaky", ExperimentConfig(lease_ttl_seconds=0.001))
                ca.add_tasks("leaky", [Task(f"t{i}") for i in range(4)])
                held = cb.select_batch("leaky", 4, request_key="on-b")
                for i in range(3):
                    time.sleep(0.002)  # the lease expires
                    ca.select_batch("leaky", 4, request_key=f"on-a-{i}")
                for client in (cb, ca):
                    with pytest.raises(bots_client.NotFoundError, match="once the experiment holds 3 such"):
                        client.report_outcomes("leaky", held.batch_id, dict.fromkeys(held.keys, (1, 2)))
                assert ca.get_experiment("leaky").step == cb.get_experiment("leaky").step == 0
    finally:
        drop_pg_database(url)
