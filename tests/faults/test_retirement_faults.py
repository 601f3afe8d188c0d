"""Pool events under faults: a server SIGKILLed at random moments of a run that
retires and re-activates tasks and changes group shares between its steps
ends bit-identical to an uninterrupted run, every batch with its exact group
counts; two replicas on one PostgreSQL with a trainer on one and
retirements on the other never hand out a task retired before the select
began, and end with identical posteriors and retired masks."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

import bots_client
from bots_client import Task
from tests.faults.test_replicas import run_both
from tests.support.crash import CONFIG, SERVER_ARGS, outcome
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres

POOL = 120
STEPS = 30
BATCH = 16
KILLS = 8


def retired_now(step: int) -> list[str]:
    """Five tasks retired before `step` (a window moving through the pool)."""
    return [f"task-{(step * 7 + j) % POOL}" for j in range(5)]


GROUPS = ("a", "b", "c")
# Every fourth step the shares change: fixed (exact counts checked), or a cap on one group.
FIXED = {"a": 0.5, "b": 0.25, "c": 0.25}
CAPPED = {"a": (0.0, 0.125)}


def group_of(key: str) -> str:
    return GROUPS[int(key.split("-")[1]) % 3]


def setup_groups(client: bots_client.Client, name: str) -> None:
    client.create_experiment(name, CONFIG)
    client.add_tasks(name, [Task(f"task-{i}", {"weak": 0.1, "strong": 0.5}, GROUPS[i % 3]) for i in range(POOL)])


def churn(client: bots_client.Client, name: str, phase: list[str], calls: list[int] | None = None) -> list[list[str]]:
    """Each step: retire five tasks, select, report; every third step bring
    back the five retired three steps before; every fourth, change the group
    shares. `phase`: the call waited on; `calls`: how many calls returned."""
    calls = [0] if calls is None else calls
    picks = []
    shares: dict[str, object] = {}
    for step in range(STEPS):
        if step % 4 == 0:
            phase[0] = "shares"
            shares = dict(FIXED) if step % 8 == 0 else dict(CAPPED)
            client.set_group_shares(name, shares)  # type: ignore[arg-type]
            calls[0] += 1
        phase[0] = "retire"
        client.retire_tasks(name, retired_now(step))
        calls[0] += 1
        if step % 3 == 2:
            phase[0] = "reactivate"
            client.reactivate_tasks(name, retired_now(step - 2))
            calls[0] += 1
        phase[0] = "select"
        batch = client.select_batch(name, BATCH, request_key=f"step-{step}")
        calls[0] += 1
        assert not set(batch.keys) & set(retired_now(step))
        got = [group_of(k) for k in batch.keys]
        if shares == FIXED:
            assert (got.count("a"), got.count("b"), got.count("c")) == (8, 4, 4)
        else:
            assert got.count("a") <= 2
        phase[0] = "report"
        client.report_outcomes(name, batch.batch_id, {k: outcome(k, step) for k in batch.keys})
        calls[0] += 1
        picks.append(batch.keys)
    phase[0] = "done"
    return picks


def state(client: bots_client.Client, name: str) -> tuple[object, ...]:
    snap = client.snapshot(name)
    assert snap.retired is not None
    groups = [(g.name, g.min_share, g.max_share) for g in client.list_groups(name)]
    return snap.step, tuple(snap.keys), snap.alpha.tobytes(), snap.beta.tobytes(), snap.retired.tobytes(), groups


@pytest.fixture(params=["sqlite", "postgresql"])
def two_databases(request: pytest.FixtureRequest, tmp_path) -> Iterator[tuple[str, str]]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
        return
    require_postgres()
    urls = create_pg_database("bots_retire"), create_pg_database("bots_retire")
    yield urls
    for url in urls:
        drop_pg_database(url)


def test_random_kills_during_retirements_leave_the_run_identical(two_databases: tuple[str, str]) -> None:
    db, reference_db = two_databases
    reference = ServerProcess(reference_db, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(reference.address) as client:
            setup_groups(client, "churn")
            expected_picks = churn(client, "churn", ["setup"])
            expected = state(client, "churn")
    finally:
        reference.stop()

    server = ServerProcess(db, extra_args=SERVER_ARGS).start()
    port = server.port
    phase = ["setup"]
    calls = [0]
    picks: list[list[str]] = []
    errors: list[BaseException] = []
    client = bots_client.Client(server.address, retry_timeout=120)

    def trainer() -> None:
        try:
            picks.extend(churn(client, "churn", phase, calls))
        except BaseException as e:
            errors.append(e)
            phase[0] = "done"

    try:
        setup_groups(client, "churn")
        thread = threading.Thread(target=trainer, daemon=True)
        thread.start()
        rng = random.Random(7)
        killed_in: dict[str, int] = {}
        while sum(killed_in.values()) < KILLS and phase[0] != "done":
            time.sleep(rng.uniform(0.0, 0.3))
            if phase[0] == "done":
                break
            killed_in[phase[0]] = killed_in.get(phase[0], 0) + 1
            server.kill()
            server = ServerProcess(db, extra_args=SERVER_ARGS).start(listen=f"127.0.0.1:{port}")
            # The next kill's random moment comes after the trainer got a call
            # through: kills spread over the phases instead of piling onto the
            # call that waited for the restart.
            done_before, deadline = calls[0], time.monotonic() + 60
            while calls[0] == done_before and phase[0] != "done" and time.monotonic() < deadline:
                time.sleep(0.01)
        thread.join(timeout=600)
        assert not errors, errors
        assert sum(killed_in.values()) > 0, "the run finished before any kill"
        assert picks == expected_picks
        assert state(client, "churn") == expected
        print(f"kills by phase: {killed_in}")
    finally:
        client.close()
        server.kill()


def test_retirements_on_one_replica_bind_selects_on_another() -> None:
    require_postgres()
    url = create_pg_database("bots_retire_replicas")
    replicas = [ServerProcess(url).start() for _ in range(2)]
    try:
        clients = [bots_client.Client(r.address) for r in replicas]
        setup_groups(clients[0], "live")
        acknowledged: list[tuple[float, set[str]]] = []  # (time the retirement returned, keys retired for good)
        selected: list[tuple[float, list[str]]] = []  # (time the select began, keys)

        def work(i: int) -> None:
            if i == 0:  # the trainer, on replica 0
                for step in range(24):
                    began = time.monotonic()
                    batch = clients[0].select_batch("live", BATCH, request_key=f"step-{step}")
                    selected.append((began, batch.keys))
                    clients[0].report_outcomes("live", batch.batch_id, {k: outcome(k, step) for k in batch.keys})
            else:  # the data team, on replica 1: retire for good, and toggle others
                for round_ in range(12):
                    gone = {f"task-{round_ * 4 + j}" for j in range(4)}
                    clients[1].retire_tasks("live", sorted(gone))
                    acknowledged.append((time.monotonic(), gone))
                    toggled = [f"task-{100 + round_ % 10}"]
                    clients[1].retire_tasks("live", toggled)
                    clients[1].reactivate_tasks("live", toggled)

        run_both(work)
        for began, keys in selected:
            forbidden = set().union(*(gone for at, gone in acknowledged if at < began))
            assert not forbidden & set(keys)
        final = state(clients[0], "live")
        assert state(clients[1], "live") == final
        snap = clients[1].snapshot("live")
        assert {k for k, r in zip(snap.keys, snap.retired.tolist(), strict=True) if r} == {  # type: ignore[union-attr]
            f"task-{j}" for j in range(48)
        }
        # Shares set through one replica bind the next select through the other.
        clients[1].set_group_shares("live", FIXED)  # type: ignore[arg-type]
        got = [group_of(k) for k in clients[0].select_batch("live", BATCH, request_key="shared").keys]
        assert (got.count("a"), got.count("b"), got.count("c")) == (8, 4, 4)
        final = state(clients[0], "live")
        # A replica started afterwards rebuilds the same state from the store alone.
        late = ServerProcess(url).start()
        replicas.append(late)
        with bots_client.Client(late.address) as client:
            assert state(client, "live") == final
    finally:
        for process in replicas:
            process.stop()
        drop_pg_database(url)
