"""Make the upgrade fixture: databases written by bots-server 0.1.0, and what
0.1.0 serves from them.

    .venv/bin/python scripts/make_upgrade_fixture.py [--output-dir tests/store/data]

NEVER REGENERATE THESE FILES WITH A LATER VERSION. They stand for the
databases that 0.1.0 wrote in production; tests/store/test_upgrade_from_v0_1.py
checks that every later version upgrades them in place and serves exactly what
0.1.0 served. Regenerating them with a later version would only test that
version against itself. The script refuses to run unless the installed
bots-server is 0.1.0 at schema revision 0002 (check out 3a864f4, the 0.1.0
code of 974ea16 with this script, to run it again, e.g. to check that it is
deterministic; CHANGELOG.md lists the releases).

How the fixture was made, once on SQLite and once on a fresh PostgreSQL
database, with the 0.1.0 server (`bots-server serve` in a child process,
`--checkpoint-every-steps 5`) and the 0.1.0 client:

- `bots-ref`: BOTS with reference features (`pass_0.5b`, `pass_7b`) and every
  config field away from its default except strategy and selection mode
  (bots, thompson). 150 tasks, 5 steps (one report partial), so a checkpoint
  at step 5; then 50 more tasks (extra features), step 6, a batch selected and
  never reported (request key `open-lease`, still leased for about 95 years),
  and step 7. Some tasks have no reference features, some extra ones.
- `mopps-softmax`: MoPPS with softmax selection, 60 tasks without features,
  6 steps (one report partial): a checkpoint at step 5 and the event of step 6.
- `bots-ref-fork`: a fork of `bots-ref` at step 7 (a checkpoint at step 7),
  then one step of its own.
- `uniform-empty`: uniform strategy, mean selection, no tasks.

Outcomes are derived from sha256(key/step). The server is then SIGKILLed, not
stopped: a graceful stop writes a final checkpoint, and the upgrade must
replay the event log after the last checkpoint (steps 6-7, 6 and 8).
The database as it was right after the kill is the fixture:
`v0_1_0.sqlite` (the WAL checkpointed into the main file) and `v0_1_0.pg.sql`
(`pg_dump --no-owner --no-privileges`, plain format).

`v0_1_0.expected.json` is what another 0.1.0 server serves from a copy of
that database: every experiment's snapshot (alpha and beta as float.hex),
the open batch returned again for its request key, identical retries of two
reported batches (`duplicate=True`), three more steps of each experiment with
fixed request keys and outcomes (the selected keys of each), the open batch's
report, and the final snapshots. Both backends must give the same file; batch
ids are random and are not recorded (the tests find batches by request key).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alembic.script import ScriptDirectory

import bots_client
from bots_client import ExperimentConfig, Task
from bots_server.store.revisions import MIGRATIONS
from tests.support.servers import (
    REPO,
    ServerProcess,
    create_pg_database,
    drop_pg_database,
    load_pg_dump,
    pg_conninfo,
)

VERSION = "0.1.0"
SCHEMA_REVISION = "0002"
SERVER_ARGS = ("--checkpoint-every-steps", "5", "--checkpoint-every-seconds", "3600")

BOTS, MOPPS, FORK, EMPTY = "bots-ref", "mopps-softmax", "bots-ref-fork", "uniform-empty"
NAMES = (BOTS, MOPPS, FORK, EMPTY)
# The lease must still be open whenever the upgrade test runs, years from now.
LEASE_TTL_SECONDS = 3.0e9
BOTS_CONFIG = ExperimentConfig(
    strategy="bots", target_success=0.4, forgetting=0.15, implicit_weight=0.2, rollouts_per_task=8,
    selection_mode="thompson", temperature=0.7, weak_feature="pass_0.5b", strong_feature="pass_7b",
    prior_alpha=2.0, prior_beta=3.0, seed=11, lease_ttl_seconds=LEASE_TTL_SECONDS, capability_ema=0.8,
)  # fmt: skip
MOPPS_CONFIG = ExperimentConfig(
    strategy="mopps", selection_mode="softmax", temperature=0.5, target_success=0.6, forgetting=0.05,
    rollouts_per_task=4, seed=5,
)  # fmt: skip
EMPTY_CONFIG = ExperimentConfig(strategy="uniform", selection_mode="mean")
BATCH_SIZE = {BOTS: 16, MOPPS: 8, FORK: 16}
OPEN_KEY = "open-lease"
# Reports that leave out the last quarter of their batch.
PARTIAL = {(BOTS, "step-2"), (MOPPS, "step-3")}
# Reported batches retried after the upgrade: one before the checkpoint, one replayed.
RETRIES = ((BOTS, "step-2"), (BOTS, "step-6"))
CONTINUE_KEYS = ("continue-0", "continue-1", "continue-2")


def unit(text: str) -> float:
    """A deterministic number in [0, 1) from a string, free of any RNG library."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") / 2**64


def outcome(key: str, step: int) -> tuple[float, int]:
    """(successes, trials) of a task's rollouts at a step; successes in halves."""
    h = int.from_bytes(hashlib.sha256(f"{key}/{step}".encode()).digest()[:8], "little")
    trials = 8 if h % 2 else 16
    return (h >> 1) % (2 * trials + 1) / 2, trials


def outcomes_for(experiment: str, batch: bots_client.Batch) -> dict[str, tuple[float, int]]:
    keys = batch.keys
    if (experiment, batch.request_key) in PARTIAL:
        keys = keys[: len(keys) * 3 // 4]
    return {key: outcome(key, batch.step) for key in keys}


def bots_task(i: int) -> Task:
    key = f"task-{i:03d}"
    features: dict[str, float] = {}
    if i % 10 != 3:  # every tenth task has no reference pass rates
        weak = round(0.6 * unit(f"{key}/weak"), 6)
        features = {"pass_0.5b": weak, "pass_7b": round(min(1.0, weak + 0.4 * unit(f"{key}/strong")), 6)}
    if i % 7 == 0:
        features["length"] = float(100 + i)
    if i >= 150:
        features["difficulty"] = round(unit(f"{key}/difficulty"), 6) - 0.5
    return Task(key, features)


def hex_or_none(value: float | None) -> str | None:
    return None if value is None else float(value).hex()


def snapshot_record(snap: bots_client.Snapshot) -> dict[str, Any]:
    e = snap.experiment
    return {
        "step": e.step,
        "num_tasks": e.num_tasks,
        "open_batches": e.open_batches,
        "capability": hex_or_none(e.capability),
        "forked_from": e.forked_from,
        "forked_at_step": e.forked_at_step,
        "config": dataclasses.asdict(e.config),
        "keys": snap.keys,
        "alpha": [float(x).hex() for x in snap.alpha],
        "beta": [float(x).hex() for x in snap.beta],
    }


def report_record(result: bots_client.ReportResult) -> dict[str, Any]:
    return {"step": result.step, "capability": hex_or_none(result.capability), "duplicate": result.duplicate}


def run_step(client: bots_client.Client, experiment: str, request_key: str) -> bots_client.ReportResult:
    batch = client.select_batch(experiment, BATCH_SIZE[experiment], request_key=request_key)
    return client.report_outcomes(experiment, batch.batch_id, outcomes_for(experiment, batch))


def wait_for_checkpoint(server: ServerProcess, experiment: str, step: int, timeout: float = 60.0) -> None:
    """Checkpoints are written in the background; the fixture needs this one
    to be at exactly `step`, so wait before the next report."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in list(server.log_lines):
            if entry.get("message") == "checkpoint written" and entry.get("experiment") == experiment:
                if entry.get("step") != step:
                    raise RuntimeError(f"{experiment}: checkpoint at step {entry.get('step')}, wanted {step}")
                return
        time.sleep(0.05)
    raise RuntimeError(f"{experiment}: no checkpoint at step {step}")


def write_history(client: bots_client.Client, server: ServerProcess) -> None:
    client.create_experiment(BOTS, BOTS_CONFIG)
    client.add_tasks(BOTS, [bots_task(i) for i in range(150)])
    client.create_experiment(MOPPS, MOPPS_CONFIG)
    client.add_tasks(MOPPS, [Task(f"prompt-{i:02d}") for i in range(60)])
    client.create_experiment(EMPTY, EMPTY_CONFIG)
    for step in range(5):
        run_step(client, BOTS, f"step-{step}")
    wait_for_checkpoint(server, BOTS, 5)
    for step in range(6):
        run_step(client, MOPPS, f"step-{step}")
        if step == 4:
            wait_for_checkpoint(server, MOPPS, 5)
    client.add_tasks(BOTS, [bots_task(i) for i in range(150, 200)])
    run_step(client, BOTS, "step-5")
    client.select_batch(BOTS, BATCH_SIZE[BOTS], request_key=OPEN_KEY)
    run_step(client, BOTS, "step-6")
    client.fork_experiment(BOTS, FORK)
    run_step(client, FORK, "step-7")


def make_database(db_url: str) -> dict[str, dict[str, Any]]:
    """Write the history, take every snapshot, SIGKILL the server. Returns the snapshots."""
    server = ServerProcess(db_url, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(server.address) as client:
            write_history(client, server)
            snapshots = {name: snapshot_record(client.snapshot(name)) for name in NAMES}
    finally:
        server.kill()
    return snapshots


def record_expected(db_url: str, before_kill: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a 0.1.0 server serves from a copy of the fixture, in the order the
    upgrade test asks for it."""
    server = ServerProcess(db_url, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(server.address) as client:
            return _record_expected(client, server, before_kill)
    finally:
        server.stop()


def _record_expected(
    client: bots_client.Client, server: ServerProcess, before_kill: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    experiments: dict[str, dict[str, Any]] = {}
    for name in NAMES:
        snap = client.snapshot(name, include_features=True)
        record = snapshot_record(snap)
        if record != before_kill[name]:
            raise RuntimeError(f"{name}: the rebuilt snapshot differs from the one before the kill")
        experiments[name] = {"snapshot": record, "features": snap.features}
    replayed = {
        e["experiment"]: e["replayed_steps"] for e in server.log_lines if e.get("message") == "experiment loaded"
    }
    if replayed != {BOTS: 2, MOPPS: 1, FORK: 1, EMPTY: 0}:
        raise RuntimeError(f"the fixture should need replays of 2, 1, 1 and 0 steps, not {replayed}")

    open_batch = client.select_batch(BOTS, BATCH_SIZE[BOTS], request_key=OPEN_KEY)
    opened: dict[str, Any] = {
        "experiment": BOTS,
        "request_key": OPEN_KEY,
        "batch_size": BATCH_SIZE[BOTS],
        "selected_at_step": open_batch.step,
        "keys": open_batch.keys,
    }
    retries = []
    for experiment, request_key in RETRIES:
        batch = client.select_batch(experiment, BATCH_SIZE[experiment], request_key=request_key)
        outcomes = outcomes_for(experiment, batch)
        result = client.report_outcomes(experiment, batch.batch_id, outcomes)
        if not result.duplicate:
            raise RuntimeError(f"{experiment} {request_key}: the retried report was applied again")
        retries.append({
            "experiment": experiment, "request_key": request_key, "batch_size": BATCH_SIZE[experiment],
            "selected_at_step": batch.step, "keys": batch.keys, "outcomes": outcomes, **report_record(result),
        })  # fmt: skip

    for name in (BOTS, MOPPS, FORK):
        steps = []
        for request_key in CONTINUE_KEYS:
            batch = client.select_batch(name, BATCH_SIZE[name], request_key=request_key)
            outcomes = outcomes_for(name, batch)
            result = client.report_outcomes(name, batch.batch_id, outcomes)
            steps.append({
                "request_key": request_key, "batch_size": BATCH_SIZE[name], "selected_at_step": batch.step,
                "keys": batch.keys, "outcomes": outcomes, **report_record(result),
            })  # fmt: skip
        experiments[name]["continuation"] = steps

    outcomes = outcomes_for(BOTS, open_batch)
    opened["report"] = {
        "outcomes": outcomes,
        **report_record(client.report_outcomes(BOTS, open_batch.batch_id, outcomes)),
    }

    for name in NAMES:
        experiments[name]["final_snapshot"] = snapshot_record(client.snapshot(name))
    return {
        "made_by": f"bots-server {VERSION} (schema revision {SCHEMA_REVISION}), scripts/make_upgrade_fixture.py",
        "experiments": experiments,
        "open_batch": opened,
        "retries": retries,
    }


def make_sqlite(output: Path, tmp: Path) -> dict[str, Any]:
    db = tmp / "fixture.db"
    before_kill = make_database(f"sqlite:///{db}")
    # The committed rows may still be in the WAL: fold it into a copy of the file.
    copy = tmp / "copy.sqlite"
    shutil.copyfile(db, copy)
    if Path(f"{db}-wal").exists():
        shutil.copyfile(f"{db}-wal", f"{copy}-wal")
    conn = sqlite3.connect(copy)
    try:
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise RuntimeError("could not checkpoint the WAL of the SQLite copy")
    finally:
        conn.close()
    wal = Path(f"{copy}-wal")
    if wal.exists() and wal.stat().st_size:
        raise RuntimeError("the SQLite copy still has a WAL after the checkpoint")
    shutil.copyfile(copy, output)

    served = tmp / "served.sqlite"
    shutil.copyfile(output, served)
    return record_expected(f"sqlite:///{served}", before_kill)


def make_postgresql(output: Path) -> dict[str, Any]:
    url = create_pg_database("bots_fixture")
    try:
        before_kill = make_database(url)
        subprocess.run(
            ["pg_dump", "--no-owner", "--no-privileges", "--format=plain", f"--file={output}", pg_conninfo(url)],
            check=True,
        )
    finally:
        drop_pg_database(url)
    served = create_pg_database("bots_fixture")
    try:
        load_pg_dump(served, output)
        return record_expected(served, before_kill)
    finally:
        drop_pg_database(served)


def check_version() -> None:
    version = metadata.version("bots-server")
    heads = ScriptDirectory(str(MIGRATIONS)).get_heads()
    if version != VERSION or heads != [SCHEMA_REVISION]:
        sys.exit(
            f"this is bots-server {version} at schema revision {heads}; the fixture must be written by "
            f"{VERSION} at revision {SCHEMA_REVISION} (it stands for databases that version wrote)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=REPO / "tests" / "store" / "data")
    args = parser.parse_args()
    check_version()
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        expected = make_sqlite(out / "v0_1_0.sqlite", Path(tmp))
    if make_postgresql(out / "v0_1_0.pg.sql") != expected:
        print("SQLite and PostgreSQL served different results", file=sys.stderr)
        return 1
    (out / "v0_1_0.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    for name in ("v0_1_0.sqlite", "v0_1_0.pg.sql", "v0_1_0.expected.json"):
        print(f"{out / name}: {(out / name).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
