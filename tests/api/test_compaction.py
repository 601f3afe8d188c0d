"""Event-log compaction end to end (docs/design.md, Bounded storage): a server
that compacts behind every checkpoint gives the same batches and the same
posterior, bit for bit, as one that keeps every event, across a SIGKILL; old
retries get exact answers or a clear refusal; a replica whose copy is behind
the compaction horizon rebuilds and agrees; the database stops growing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa

import bots_client
from bots_server.core.selector import CheckpointPolicy
from bots_server.testing.inprocess import InProcessService
from tests.api import test_restart
from tests.api.test_restart import CONFIG, bits, outcome, run_steps, setup
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres

two_databases = test_restart.two_databases  # the fixture: a pair of fresh databases of one backend

RETENTION = 5
COMPACTING = ["--checkpoint-every-steps", "4", "--checkpoint-every-seconds", "3600", "--event-retention-steps", str(RETENTION)]
KEEPING = ["--checkpoint-every-steps", "4", "--checkpoint-every-seconds", "3600", "--event-retention-steps", "0"]


def outcome_rows(url: str) -> int:
    """Outcomes stored: each step's are one value of 24 bytes per task."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(sa.text("SELECT coalesce(sum(length(outcomes)), 0) FROM step_outcomes")).scalar_one()
            return int(stored) // 24
    finally:
        engine.dispose()


def test_compacting_server_matches_a_keeping_one_across_a_crash(two_databases: tuple[str, str]) -> None:
    keep_url, compact_url = two_databases
    keeping = ServerProcess(keep_url, extra_args=KEEPING).start()
    compacting = ServerProcess(compact_url, extra_args=COMPACTING).start()
    try:
        with bots_client.Client(keeping.address) as ref:
            setup(ref, "run", CONFIG)
            ref_picks = run_steps(ref, "run", range(30))
            ref_final = bits(ref.snapshot("run"))
        with bots_client.Client(compacting.address) as client:
            setup(client, "run", CONFIG)
            picks = run_steps(client, "run", range(21))  # checkpoint at 20, compacted through 15
        compacting.kill()
        compacting = ServerProcess(compact_url, extra_args=COMPACTING).start()
        with bots_client.Client(compacting.address) as client:
            picks += run_steps(client, "run", range(21, 30))
            assert picks == ref_picks
            assert bits(client.snapshot("run")) == ref_final
            # A reused request key of a compacted batch is refused, naming why;
            # a recent one still returns its batch.
            with pytest.raises(bots_client.FailedPreconditionError, match="compacted.*new request key"):
                client.select_batch("run", 6, request_key="step-1")
            assert client.select_batch("run", 6, request_key="step-29").keys == ref_picks[29]
            assert client.get_experiment("run").step == 30
    finally:
        keeping.stop()
        compacting.stop()
    # Outcomes of 6 tasks per step: the keeping server holds all 30 steps,
    # the compacting one only those after its horizon (the stop's checkpoint
    # at 30 less the retention, give or take a checkpoint interval).
    assert outcome_rows(keep_url) == 30 * 6
    assert outcome_rows(compact_url) <= (RETENTION + 4) * 6


def test_old_report_retries_answer_their_step(tmp_path) -> None:
    policy = CheckpointPolicy(every_steps=4, every_seconds=3600, event_retention_steps=RETENTION)
    with InProcessService(f"sqlite:///{tmp_path / 'r.db'}", checkpoint_policy=policy) as service:
        with bots_client.Client("in-process", channel=service.channel()) as client:
            setup(client, "run", CONFIG)
            batch = client.select_batch("run", 6, request_key="early")
            report = {k: outcome(k, 0) for k in batch.keys}
            first = client.report_outcomes("run", batch.batch_id, report)
            run_steps(client, "run", range(1, 20))
            retried = client.report_outcomes("run", batch.batch_id, report)
            assert (retried.step, retried.capability, retried.duplicate) == (first.step, first.capability, True)
            assert client.get_experiment("run").step == 20  # nothing applied twice


def test_a_replica_behind_the_horizon_rebuilds_and_agrees() -> None:
    require_postgres()
    url = create_pg_database("bots_compact_replicas")
    policy = CheckpointPolicy(every_steps=4, every_seconds=3600, event_retention_steps=RETENTION)
    try:
        with InProcessService(url, checkpoint_policy=policy) as a, InProcessService(url, checkpoint_policy=policy) as b:
            with bots_client.Client("a", channel=a.channel()) as ca, bots_client.Client("b", channel=b.channel()) as cb:
                setup(ca, "run", CONFIG)
                run_steps(ca, "run", range(3))
                assert cb.get_experiment("run").step == 3
                cb.snapshot("run")  # b now holds the experiment at step 3
                run_steps(ca, "run", range(3, 25))  # a compacts well past step 3
                assert ca.get_experiment("run").step == 25
                assert bits(cb.snapshot("run")) == bits(ca.snapshot("run"))
                run_steps(cb, "run", range(25, 28))  # b continues from its rebuilt copy
                assert bits(ca.snapshot("run")) == bits(cb.snapshot("run"))
    finally:
        drop_pg_database(url)


def test_the_compact_command_beside_a_stopped_server(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    server = ServerProcess(url, extra_args=KEEPING).start()
    try:
        with bots_client.Client(server.address) as client:
            setup(client, "run", CONFIG)
            run_steps(client, "run", range(20))
            before = bits(client.snapshot("run"))
    finally:
        server.stop()  # its last checkpoint: step 20
    assert outcome_rows(url) == 20 * 6
    compact = [sys.executable, "-m", "bots_server.cli", "compact", "--db", url, "--retention-steps", str(RETENTION)]
    done = subprocess.run(compact, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "run: step 20, events compacted through step 15, 30 values removed" in done.stdout  # 15 x (outcomes + tasks)
    assert outcome_rows(url) == RETENTION * 6
    server = ServerProcess(url, extra_args=KEEPING).start()
    try:
        with bots_client.Client(server.address) as client:
            assert bits(client.snapshot("run")) == before
            run_steps(client, "run", range(20, 22))
    finally:
        server.stop()


def test_the_compact_command_names_experiments_as_the_api_does(tmp_path) -> None:
    # The default tenant's names are stored plain; "default/NAME" names the
    # same experiment, as it does in every call.
    url = f"sqlite:///{tmp_path / 'names.db'}"
    server = ServerProcess(url).start()
    try:
        with bots_client.Client(server.address) as client:
            client.create_experiment("math")
    finally:
        server.stop()
    compact = [sys.executable, "-m", "bots_server.cli", "compact", "--db", url, "--experiment"]
    for name in ("math", "default/math"):
        done = subprocess.run([*compact, name], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("math: step 0, "), done.stdout
    missing = subprocess.run([*compact, "other/math"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert missing.stderr == "error: experiment 'other/math' not found\n"
    bad = subprocess.run([*compact, "a/b/c"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: tenant of --experiment 'a/b/c'") and len(bad.stderr.splitlines()) == 1
    # A mistyped --db: one line, and no new empty database (there was one, then a traceback).
    typo = tmp_path / "nmaes.db"
    wrong = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "compact", "--db", f"sqlite:///{typo}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert wrong.returncode == 1 and not typo.exists()
    assert wrong.stderr.startswith("error: the database at --db has no schema this code serves") and len(
        wrong.stderr.splitlines()
    ) == 1


def test_a_resume_counts_a_compacted_batch_as_reported(tmp_path) -> None:
    # A checkpoint's pending batches were reported (out of order) and have
    # been compacted since: a resume draws neither again, where drawing one
    # would be refused ("use a new request key").
    from bots_client.integrations import Curriculum

    policy = CheckpointPolicy(every_steps=4, every_seconds=3600, event_retention_steps=RETENTION)
    with InProcessService(f"sqlite:///{tmp_path / 'r.db'}", checkpoint_policy=policy) as service:
        with bots_client.Client("in-process", channel=service.channel()) as client:
            setup(client, "run", CONFIG)
            keys = [f"task-{i}" for i in range(40)]
            run = Curriculum(client, "run", keys, batch_size=6)
            first, second = run.select(), run.select()
            state = run.checkpoint_state(2)
            assert state["pending"] == [0, 1]
            for batch in (second, first):
                run.report({k: outcome(k, batch.number) for k in batch.keys}, batch=batch)
            run_steps(client, "run", range(2, 20))
            with pytest.raises(bots_client.FailedPreconditionError, match="compacted"):
                client.select_batch("run", 6, request_key="step-0")
            assert Curriculum(client, "run", keys, batch_size=6).resume_from(state, "test") == 2
