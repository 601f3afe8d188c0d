"""Upgrading from every earlier schema revision keeps the data and serves it,
on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

import bots_client
from bots_server.core.checkpoint_state import encode_state
from bots_server.engine import PosteriorState
from bots_server.store import Lookup, checkpoint_blob, open_store, pieces
from bots_server.store.revisions import MIGRATIONS
from bots_server.store.sql import SqlStore
from tests.support.servers import ServerProcess

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
REVISIONS = [r.revision for r in reversed(list(ScriptDirectory(str(MIGRATIONS)).walk_revisions()))]

# The seeded event: task 0 reported 4 of 16 at step 2, every task has
# reference pass rates w = 0.1, s = 0.6, the checkpoint's capability is 0.5.
C_HAT = (0.25 - 0.1) / (0.6 - 0.1 + 1e-6)
CAPABILITY = 0.9 * 0.5 + 0.1 * C_HAT


def seed_experiment(store: SqlStore) -> None:
    """An experiment with 3 tasks, a checkpoint at step 1 and an event at step
    2, written with the columns of the revision the database is at."""
    tables = sa.MetaData()
    tables.reflect(store.engine)
    t = tables.tables
    config = dict(
        strategy="bots", target_success=0.5, forgetting=0.1, implicit_weight=0.1, rollouts_per_task=16,
        selection_mode="thompson", temperature=1.0, weak_feature="w", strong_feature="s", prior_alpha=1.0,
        prior_beta=1.0, seed=0, lease_ttl_seconds=3600.0, capability_ema=0.9,
    )  # fmt: skip
    # From revision 0003 on, the settings are one JSON column.
    settings = {"config": json.dumps(config)} if "config" in t["experiments"].c else config
    with store.engine.begin() as conn:
        conn.execute(t["experiments"].insert().values(id=1, name="old", step=2, num_tasks=3, create_time=NOW, **settings))
        conn.execute(
            t["tasks"].insert(),
            [{"experiment_id": 1, "task_idx": i, "key": f"k{i}", "features": json.dumps({"w": 0.1, "s": 0.6})} for i in range(3)],
        )
        if "posteriors" in t:  # before revision 0006: one row per task
            conn.execute(t["checkpoints"].insert().values(experiment_id=1, step=1, num_tasks=3, capability=0.5, create_time=NOW))
            conn.execute(
                t["posteriors"].insert(),
                [{"experiment_id": 1, "task_idx": i, "alpha": 2.0 + i, "beta": 3.0} for i in range(3)],
            )
        else:  # the whole state as one value
            state = PosteriorState(
                np.array([2.0, 3.0, 4.0]), np.full(3, 3.0), np.full(3, 0.1), np.full(3, 0.6), capability=0.5
            )
            blob = encode_state(state)
            if "checkpoint_chunks" in t:  # from revision 0008 on: the value in chunks, the keys in blocks
                size = pieces.chunk_bytes(blob)
                conn.execute(t["checkpoints"].insert().values(experiment_id=1, step=1, num_tasks=3, create_time=NOW, version=1, chunk_bytes=size))
                for seq, data in enumerate(pieces.chunks(blob, size)):
                    conn.execute(t["checkpoint_chunks"].insert().values(experiment_id=1, version=1, seq=seq, step=1, data=data))
                conn.execute(t["task_key_blocks"].insert().values(experiment_id=1, first_task=0, num_tasks=3, keys=pieces.join_texts(["k0", "k1", "k2"])))
            else:
                conn.execute(t["checkpoints"].insert().values(experiment_id=1, step=1, num_tasks=3, create_time=NOW, state=blob))
        conn.execute(t["steps"].insert().values(experiment_id=1, step=2, batch_id="b2", pool_size=3, capability=CAPABILITY, capability_estimate=C_HAT, create_time=NOW))
        if "step_outcomes" in t:  # from revision 0009 on: a step's outcomes and a batch's tasks as one value each
            outcomes = pieces.pack_outcomes([0], [4.0], [16])
            conn.execute(t["step_outcomes"].insert().values(experiment_id=1, step=2, outcomes=outcomes))
        else:
            conn.execute(t["outcomes"].insert().values(experiment_id=1, step=2, task_idx=0, successes=4.0, trials=16))
        conn.execute(
            t["batches"].insert().values(
                experiment_id=1, batch_id="b2", request_key="step-1", step=1, batch_size=1,
                create_time=NOW, lease_expire_time=NOW, reported_step=2,
            )
        )  # fmt: skip
        if "batch_task_lists" in t:
            conn.execute(t["batch_task_lists"].insert().values(experiment_id=1, batch_id="b2", tasks=pieces.pack_tasks([0])))
        else:
            conn.execute(t["batch_tasks"].insert().values(experiment_id=1, batch_id="b2", position=0, task_idx=0))


def downgrade(store: SqlStore, revision: str) -> None:
    with store.engine.begin() as conn:
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def test_revisions_are_a_single_line_ending_at_head() -> None:
    assert REVISIONS[0] == "0001"
    assert len(REVISIONS) >= 2


@pytest.mark.parametrize("start", REVISIONS[:-1])
def test_upgrade_from_every_earlier_revision(fresh_db_url: str, start: str) -> None:
    store = open_store(fresh_db_url)
    assert isinstance(store, SqlStore)  # seeded through its engine
    store.migrate(start)
    seed_experiment(store)
    store.migrate()  # to head
    store.close()

    server = ServerProcess(fresh_db_url).start()
    try:
        with bots_client.Client(server.address) as client:
            experiment = client.get_experiment("old")
            assert (experiment.step, experiment.num_tasks, experiment.capability) == (2, 3, CAPABILITY)
            snap = client.snapshot("old")
            assert snap.keys == ["k0", "k1", "k2"]
            # Checkpoint at step 1 plus the replayed step 2 (lambda 0.1, rho 0.1, m 16).
            p = 0.1 + 0.5 * CAPABILITY
            expected_alpha = [0.9 * 2.0 + 0.1 + 0.9 * 4.0 + 1.6 * 0.25, 0.9 * 3.0 + 0.1 + 1.6 * p, 0.9 * 4.0 + 0.1 + 1.6 * p]
            expected_beta = [0.9 * 3.0 + 0.1 + 0.9 * 12.0 + 1.6 * 0.75] + [0.9 * 3.0 + 0.1 + 1.6 * (1 - p)] * 2
            assert snap.alpha.tolist() == pytest.approx(expected_alpha, rel=1e-12)
            assert snap.beta.tolist() == pytest.approx(expected_beta, rel=1e-12)
            assert snap.experiment.capability == pytest.approx(CAPABILITY, rel=1e-12)
            assert client.report_outcomes("old", "b2", {"k0": (4, 16)}).duplicate
            batch = client.select_batch("old", 2, request_key="step-2")
            assert client.report_outcomes("old", batch.batch_id, dict.fromkeys(batch.keys, (8, 16))).step == 3
    finally:
        server.stop()


def test_the_config_json_revision_downgrades_and_upgrades_again(fresh_db_url: str) -> None:
    """0003 folds the config columns into one JSON object and back, value for value."""
    store = open_store(fresh_db_url)
    assert isinstance(store, SqlStore)
    store.migrate("0002")
    seed_experiment(store)
    store.migrate("0003")
    with store.engine.connect() as conn:
        stored = json.loads(conn.execute(sa.text("SELECT config FROM experiments WHERE id = 1")).scalar_one())
    assert stored["weak_feature"] == "w" and stored["seed"] == 0 and stored["forgetting"] == 0.1
    assert len(stored) == 14
    downgrade(store, "0002")
    with store.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT strategy, weak_feature, seed, forgetting FROM experiments")).one()
    assert tuple(row) == ("bots", "w", 0, 0.1)
    store.migrate()
    with store.engine.connect() as conn:
        assert json.loads(conn.execute(sa.text("SELECT config FROM experiments")).scalar_one()) == stored
    store.close()


def test_the_checkpoint_blob_revision_converts_per_row_checkpoints_and_back(fresh_db_url: str) -> None:
    """0006 turns a checkpoint's rows into one value holding what a rebuild
    read with them (the reference rates from the features, the capability),
    and 0006's downgrade turns it back into rows."""
    store = open_store(fresh_db_url)
    assert isinstance(store, SqlStore)
    store.migrate("0005")
    seed_experiment(store)
    store.migrate("0006")
    with store.engine.connect() as conn:
        blob = conn.execute(sa.text("SELECT state FROM checkpoints WHERE experiment_id = 1")).scalar_one()
    content = checkpoint_blob.decode(bytes(blob))
    arrays = {name: a.tolist() for name, a in content.arrays.items()}
    assert content.num_tasks == 3
    assert arrays == {"alpha": [2.0, 3.0, 4.0], "beta": [3.0] * 3, "weak": [0.1] * 3, "strong": [0.6] * 3}
    assert content.scalars == {"capability": 0.5, "rho_halvings": 0}
    downgrade(store, "0005")
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT task_idx, alpha, beta FROM posteriors ORDER BY task_idx")).all()
        capability = conn.execute(sa.text("SELECT capability FROM checkpoints")).scalar_one()
    assert [tuple(r) for r in rows] == [(0, 2.0, 3.0), (1, 3.0, 3.0), (2, 4.0, 3.0)] and capability == 0.5
    store.migrate("0006")
    with store.engine.connect() as conn:
        assert bytes(conn.execute(sa.text("SELECT state FROM checkpoints")).scalar_one()) == bytes(blob)
    store.close()


def test_the_chunks_revision_splits_checkpoints_and_keys_and_joins_them_back(
    fresh_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0008 moves the checkpoint value into chunks (here many, as small as
    its header) and the task keys and groups into blocks, which a load reads
    back unchanged; its downgrade puts the value back into one column."""
    monkeypatch.setattr(pieces, "CHUNK_BYTES", 8)
    monkeypatch.setattr(pieces, "KEY_BLOCK_TASKS", 2)
    store = open_store(fresh_db_url)
    assert isinstance(store, SqlStore)
    store.migrate("0007")
    seed_experiment(store)
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE tasks SET group_name = 'g' WHERE task_idx = 1"))
        blob = bytes(conn.execute(sa.text("SELECT state FROM checkpoints")).scalar_one())
    store.migrate("0008")
    with store.engine.connect() as conn:
        chunks = conn.execute(sa.text("SELECT count(*) FROM checkpoint_chunks")).scalar_one()
        blocks = conn.execute(sa.text("SELECT count(*) FROM task_key_blocks")).scalar_one()
    assert chunks >= 2 and blocks == 2
    store.migrate()  # the store reads the head revision's schema
    rows = store.load(1)
    assert rows is not None and rows.checkpoint is not None
    assert rows.checkpoint.state == blob
    assert (rows.keys, rows.groups) == (["k0", "k1", "k2"], ["", "g", ""])
    downgrade(store, "0007")
    with store.engine.connect() as conn:
        assert bytes(conn.execute(sa.text("SELECT state FROM checkpoints")).scalar_one()) == blob
    store.migrate()
    assert store.load(1).checkpoint.state == blob
    store.close()


def test_the_packed_log_revision_packs_outcomes_and_batch_tasks_and_unpacks_them_back(fresh_db_url: str) -> None:
    """0009 moves each step's outcome rows and each batch's task rows into one
    value in one row (step_outcomes, batch_task_lists), in task and position
    order; its downgrade makes the rows again. A batch selected but not reported keeps its tasks."""
    store = open_store(fresh_db_url)
    assert isinstance(store, SqlStore)
    store.migrate("0008")
    seed_experiment(store)
    with store.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO outcomes VALUES (1, 2, 2, 1.5, 8)"))
        conn.execute(
            sa.text("INSERT INTO batches VALUES (1, 'b3', 'step-2', 2, 2, :now, :now, NULL)"), {"now": NOW}
        )
        conn.execute(sa.text("INSERT INTO batch_tasks VALUES (1, 'b3', 0, 2), (1, 'b3', 1, 1)"))
    store.migrate("0009")
    with store.engine.connect() as conn:
        outcomes = conn.execute(sa.text("SELECT outcomes FROM step_outcomes WHERE step = 2")).scalar_one()
        tasks = dict(conn.execute(sa.text("SELECT batch_id, tasks FROM batch_task_lists")).all())
    assert pieces.unpack_outcomes(bytes(outcomes)) == ([0, 2], [4.0, 1.5], [16, 8])
    assert {b: pieces.unpack_tasks(bytes(v)) for b, v in tasks.items()} == {"b2": [0], "b3": [2, 1]}
    rows = store.load(1, lookup=Lookup(batch_id="b3"))
    assert rows is not None and rows.batch is not None and rows.batch.task_idx == [2, 1]
    assert [(e.step, e.task_idx, e.successes, e.trials) for e in rows.events] == [(2, [0, 2], [4.0, 1.5], [16, 8])]
    downgrade(store, "0008")
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT * FROM outcomes ORDER BY task_idx")).all() == [(1, 2, 0, 4.0, 16), (1, 2, 2, 1.5, 8)]
        assert conn.execute(sa.text("SELECT * FROM batch_tasks ORDER BY batch_id, position")).all() == [
            (1, "b2", 0, 0), (1, "b3", 0, 2), (1, "b3", 1, 1)
        ]  # fmt: skip
    store.close()


def test_the_packed_log_revision_leaves_compacted_steps_and_batches_without_values(fresh_db_url: str) -> None:
    """What compaction removed before 0009 stays removed (no row), so a
    retry of such a batch is answered as a compacted one."""
    store = open_store(fresh_db_url)
    assert isinstance(store, SqlStore)
    store.migrate("0008")
    seed_experiment(store)
    with store.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outcomes"))
        conn.execute(sa.text("DELETE FROM batch_tasks"))
        conn.execute(sa.text("UPDATE experiments SET compacted_through = 2"))
    store.migrate("0009")
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM step_outcomes")).scalar_one() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM batch_task_lists")).scalar_one() == 0
    assert not store.read_event(1, 2).complete
    rows = store.load(1, lookup=Lookup(batch_id="b2"))
    assert rows is not None and rows.batch is not None and rows.batch.compacted
    store.close()
