"""A database written by bots-server 0.1.0 upgrades in place and then serves
exactly what 0.1.0 served from it, on SQLite and PostgreSQL.

The fixture in tests/store/data was written by 0.1.0 (scripts/make_upgrade_fixture.py
says how) and must never be regenerated: it stands for the databases 0.1.0
wrote. Every later version must pass this test unchanged. It talks to the
server only through bots_client, so it does not depend on the schema or the
store's internals.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bots_client
from bots_client import ExperimentConfig
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, load_pg_dump, require_postgres

DATA = Path(__file__).parent / "data"
EXPECTED: dict[str, Any] = json.loads((DATA / "v0_1_0.expected.json").read_text())


def migrate(db_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "migrate", "--db", db_url],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"migrate exited {result.returncode}: {result.stdout}{result.stderr}"


@pytest.fixture(params=["sqlite", "postgresql"])
def upgraded_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The 0.1.0 database, loaded into a fresh database and migrated to this version."""
    if request.param == "sqlite":
        path = tmp_path / "v0_1_0.sqlite"
        shutil.copyfile(DATA / "v0_1_0.sqlite", path)
        url = f"sqlite:///{path}"
        migrate(url)
        yield url
        return
    require_postgres()
    url = create_pg_database("bots_upgrade")
    try:
        load_pg_dump(url, DATA / "v0_1_0.pg.sql")
        migrate(url)
        yield url
    finally:
        drop_pg_database(url)


def snapshot_record(snap: bots_client.Snapshot) -> dict[str, Any]:
    """The snapshot in the form the fixture recorded it (floats as float.hex)."""
    e = snap.experiment
    return {
        "step": e.step,
        "num_tasks": e.num_tasks,
        "open_batches": e.open_batches,
        "capability": None if e.capability is None else e.capability.hex(),
        "forked_from": e.forked_from,
        "forked_at_step": e.forked_at_step,
        "config": dataclasses.asdict(e.config),
        "keys": snap.keys,
        "alpha": [float(x).hex() for x in snap.alpha],
        "beta": [float(x).hex() for x in snap.beta],
    }


def expected_snapshot(recorded: dict[str, Any]) -> dict[str, Any]:
    # Config fields added after 0.1.0 must come out at the values that keep
    # 0.1.0's behaviour: their defaults, but stream 1 of the Thompson draws
    # (new experiments draw in stream 2) and reports weighed by m (new
    # experiments weigh a report by its own trials).
    old = ExperimentConfig(random_stream=1, report_weight="rollouts_per_task")
    config = {**dataclasses.asdict(old), **recorded["config"]}
    return {**recorded, "config": config}


def report_record(result: bots_client.ReportResult) -> dict[str, Any]:
    return {
        "step": result.step,
        "capability": None if result.capability is None else result.capability.hex(),
        "duplicate": result.duplicate,
    }


def outcomes(recorded: dict[str, list[float]]) -> dict[str, tuple[float, int]]:
    return {key: (float(s), int(t)) for key, (s, t) in recorded.items()}


def check_select(client: bots_client.Client, experiment: str, recorded: dict[str, Any]) -> bots_client.Batch:
    batch = client.select_batch(experiment, recorded["batch_size"], request_key=recorded["request_key"])
    assert (batch.step, batch.keys) == (recorded["selected_at_step"], recorded["keys"]), recorded["request_key"]
    return batch


def test_database_written_by_v0_1_0_upgrades_in_place(upgraded_db_url: str) -> None:
    experiments: dict[str, dict[str, Any]] = EXPECTED["experiments"]
    server = ServerProcess(upgraded_db_url).start()
    try:
        with bots_client.Client(server.address) as client:
            assert sorted(e.name for e in client.list_experiments()) == sorted(experiments)
            for name, recorded in experiments.items():
                snap = client.snapshot(name, include_features=True)
                assert snapshot_record(snap) == expected_snapshot(recorded["snapshot"]), name
                assert snap.features == recorded["features"], name

            # The open batch is still leased and comes back for its request key:
            # it was selected at an earlier step than the experiment's, which a
            # new batch for that key could not be.
            opened = EXPECTED["open_batch"]
            batch = check_select(client, opened["experiment"], opened)
            assert batch.lease_expire_time > dt.datetime.now(dt.UTC)
            assert client.get_experiment(opened["experiment"]).open_batches == 1

            for retry in EXPECTED["retries"]:
                reported = check_select(client, retry["experiment"], retry)
                result = client.report_outcomes(retry["experiment"], reported.batch_id, outcomes(retry["outcomes"]))
                assert report_record(result) == {k: retry[k] for k in ("step", "capability", "duplicate")}
                assert result.duplicate

            for name, recorded in experiments.items():
                for step in recorded.get("continuation", []):
                    selected = check_select(client, name, step)
                    result = client.report_outcomes(name, selected.batch_id, outcomes(step["outcomes"]))
                    assert report_record(result) == {k: step[k] for k in ("step", "capability", "duplicate")}

            result = client.report_outcomes(
                opened["experiment"], batch.batch_id, outcomes(opened["report"]["outcomes"])
            )
            assert report_record(result) == {k: opened["report"][k] for k in ("step", "capability", "duplicate")}

            for name, recorded in experiments.items():
                assert snapshot_record(client.snapshot(name)) == expected_snapshot(recorded["final_snapshot"]), name
    finally:
        assert server.stop() == 0
