"""Several server processes on one PostgreSQL: clients spread across them get
the results of a single server. Writes are serialized by the database (the
experiment row lock and the step compare-and-set), never by process memory."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import bots_client
from tests.support.crash import outcome, setup
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres


@pytest.fixture
def databases() -> Iterator[tuple[str, str]]:
    require_postgres()
    urls = create_pg_database("bots_replicas"), create_pg_database("bots_replicas")
    yield urls
    for url in urls:
        drop_pg_database(url)


@contextmanager
def two_replicas_and_a_single_server(
    databases: tuple[str, str],
) -> Iterator[tuple[bots_client.Client, bots_client.Client, bots_client.Client]]:
    """Clients of two replicas on one database and of a single server on the
    other, each database holding experiment "run" with the same 60 tasks."""
    shared_db, single_db = databases
    a, b = (ServerProcess(shared_db).start() for _ in range(2))
    single = ServerProcess(single_db).start()
    try:
        ca, cb, reference = (bots_client.Client(p.address) for p in (a, b, single))
        setup(ca, "run", pool=60)
        setup(reference, "run", pool=60)
        yield ca, cb, reference
    finally:
        for process in (a, b, single):
            process.stop()


def snapshot_bits(client: bots_client.Client, name: str) -> tuple[object, ...]:
    snap = client.snapshot(name)
    return snap.step, snap.experiment.capability, snap.alpha.tobytes(), snap.beta.tobytes()


def test_calls_spread_over_replicas_match_a_single_server(databases: tuple[str, str]) -> None:
    shared_db, single_db = databases
    replicas = [ServerProcess(shared_db).start() for _ in range(3)]
    single = ServerProcess(single_db).start()
    try:
        clients = [bots_client.Client(r.address) for r in replicas]
        reference = bots_client.Client(single.address)
        setup(clients[0], "run", pool=200)
        setup(reference, "run", pool=200)
        rotation = itertools.cycle(clients)
        for step in range(12):
            # Each call goes to the next replica: select on one, report on another.
            batch = next(rotation).select_batch("run", 16, request_key=f"step-{step}")
            assert next(rotation).select_batch("run", 16, request_key=f"step-{step}") == batch
            next(rotation).report_outcomes("run", batch.batch_id, {k: outcome(k, step) for k in batch.keys})
            expected = reference.select_batch("run", 16, request_key=f"step-{step}")
            reference.report_outcomes("run", expected.batch_id, {k: outcome(k, step) for k in expected.keys})
            assert batch.keys == expected.keys
        final = snapshot_bits(reference, "run")
        assert all(snapshot_bits(c, "run") == final for c in clients)
    finally:
        for process in [*replicas, single]:
            process.stop()


def test_replicas_with_stale_copies_choose_what_a_single_server_chooses(databases: tuple[str, str]) -> None:
    """Each replica selects and reports from its copy in memory without
    reading the database first; another replica's open batches, added tasks
    and reports must still make it choose exactly what one server would."""
    with two_replicas_and_a_single_server(databases) as (ca, cb, reference):
        extra = [bots_client.Task(f"late-{i}", {"weak": 0.5, "strong": 0.5}) for i in range(30)]

        def both(client: bots_client.Client, step: str) -> tuple[bots_client.Batch, bots_client.Batch]:
            batch = client.select_batch("run", 20, request_key=step)
            expected = reference.select_batch("run", 20, request_key=step)
            assert batch.keys == expected.keys, step
            return batch, expected

        def report(client: bots_client.Client, pair: tuple[bots_client.Batch, bots_client.Batch], step: int) -> None:
            for c, batch in ((client, pair[0]), (reference, pair[1])):
                c.report_outcomes("run", batch.batch_id, {k: outcome(k, step) for k in batch.keys})

        first = both(ca, "r1")  # a holds the experiment in memory from here on
        second = both(cb, "r2")  # open on b: unknown to a's copy
        third = both(ca, "r3")  # must leave r2's tasks out
        assert not set(third[0].keys) & set(second[0].keys)
        report(cb, first, 1)  # a's copy is a step behind
        cb.add_tasks("run", extra)  # and a pool behind
        reference.add_tasks("run", extra)
        report(ca, third, 2)
        fourth = both(ca, "r4")
        report(ca, second, 3)
        report(cb, fourth, 4)
        fifth = both(ca, "r5")
        report(ca, fifth, 5)
        final = snapshot_bits(reference, "run")
        assert snapshot_bits(ca, "run") == final
        assert snapshot_bits(cb, "run") == final


def test_replicas_stepping_by_report_and_select_choose_what_a_single_server_chooses(
    databases: tuple[str, str],
) -> None:
    """ReportAndSelect on replicas with stale copies (a step, a pool and an
    open batch behind) against the separate calls on one server: the same
    batches and, at the end, the same posterior bit for bit."""
    with two_replicas_and_a_single_server(databases) as (ca, cb, reference):
        extra = [bots_client.Task(f"late-{i}", {"weak": 0.5, "strong": 0.5}) for i in range(30)]

        def step(
            client: bots_client.Client, pair: tuple[bots_client.Batch, bots_client.Batch], n: int, key: str
        ) -> tuple[bots_client.Batch, bots_client.Batch]:
            outcomes = [{k: outcome(k, n) for k in batch.keys} for batch in pair]
            _, batch = client.report_and_select("run", pair[0].batch_id, outcomes[0], 20, request_key=key)
            reference.report_outcomes("run", pair[1].batch_id, outcomes[1])
            expected = reference.select_batch("run", 20, request_key=key)
            assert batch.keys == expected.keys, key
            return batch, expected

        first = ca.select_batch("run", 20, request_key="r1"), reference.select_batch("run", 20, request_key="r1")
        second = cb.select_batch("run", 20, request_key="r2"), reference.select_batch("run", 20, request_key="r2")
        third = step(ca, first, 1, "r3")  # a does not know r2, which b holds open
        assert not set(third[0].keys) & set(second[0].keys)
        fourth = step(cb, second, 2, "r4")  # b's copy is a step behind
        cb.add_tasks("run", extra)
        reference.add_tasks("run", extra)
        fifth = step(ca, third, 3, "r5")  # a's copy is a step and a pool behind
        sixth = step(ca, fourth, 4, "r6")
        step(cb, fifth, 5, "r7")
        step(ca, sixth, 6, "r8")
        final = snapshot_bits(reference, "run")
        assert snapshot_bits(ca, "run") == final
        assert snapshot_bits(cb, "run") == final


def test_an_experiment_deleted_and_created_again_on_another_replica_is_the_new_one(
    databases: tuple[str, str],
) -> None:
    """A replica holds an experiment in memory; another replica deletes it
    and creates one of the same name. The first replica's next calls must
    act on the new experiment (not fail, not touch the old one's rows)."""
    shared_db, _ = databases
    a, b = (ServerProcess(shared_db).start() for _ in range(2))
    try:
        ca, cb = (bots_client.Client(p.address) for p in (a, b))
        setup(ca, "run", pool=40)
        old = ca.select_batch("run", 8, request_key="old-0")
        ca.report_outcomes("run", old.batch_id, {k: outcome(k, 0) for k in old.keys})  # a holds "run" now
        cb.delete_experiment("run")
        cb.create_experiment("run")
        cb.add_tasks("run", [bots_client.Task(f"new-{i}") for i in range(20)])
        batch = ca.select_batch("run", 8, request_key="new-0")
        assert all(k.startswith("new-") for k in batch.keys)
        result = ca.report_outcomes("run", batch.batch_id, dict.fromkeys(batch.keys, (1.0, 1)))
        assert result.step == 1
        assert cb.snapshot("run").step == ca.snapshot("run").step == 1
        with pytest.raises(bots_client.NotFoundError):
            ca.report_outcomes("run", old.batch_id, {k: outcome(k, 0) for k in old.keys})
    finally:
        for process in (a, b):
            process.stop()


def test_concurrent_writers_on_two_replicas_never_double_apply(databases: tuple[str, str]) -> None:
    shared_db, _ = databases
    replicas = [ServerProcess(shared_db).start() for _ in range(2)]
    try:
        clients = [bots_client.Client(r.address) for r in replicas]
        setup(clients[0], "race", pool=400)
        barrier = threading.Barrier(2)
        batches: list[bots_client.Batch] = [None, None]  # type: ignore[list-item]

        def select(i: int) -> None:
            barrier.wait()
            batches[i] = clients[i].select_batch("race", 150, request_key=f"rank-{i}")

        run_both(select)
        assert not set(batches[0].keys) & set(batches[1].keys)  # leases hold across replicas

        results: list[bots_client.ReportResult] = [None, None]  # type: ignore[list-item]

        def report(i: int) -> None:
            barrier.wait()
            results[i] = clients[i].report_outcomes("race", batches[i].batch_id, dict.fromkeys(batches[i].keys, (3, 16)))

        run_both(report)
        assert sorted(r.step for r in results) == [1, 2]

        # The same batch reported through both replicas at once: applied once.
        again = clients[0].select_batch("race", 50, request_key="shared")

        def report_same(i: int) -> None:
            barrier.wait()
            results[i] = clients[i].report_outcomes("race", again.batch_id, dict.fromkeys(again.keys, (5, 16)))

        run_both(report_same)
        assert sorted(r.duplicate for r in results) == [False, True]
        assert {r.step for r in results} == {3}
        assert snapshot_bits(clients[0], "race") == snapshot_bits(clients[1], "race")
        assert clients[1].get_experiment("race").step == 3
    finally:
        for process in replicas:
            process.stop()


def run_both(fn) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
