"""Tenant quotas hold exactly under concurrent writes: 100 concurrent calls of
each kind that adds to a tenant's usage (CreateExperiment, ForkExperiment,
RestoreExperiment, AddTasks), then all four kinds at once, against real
server processes: one on SQLite, one on PostgreSQL, and two replicas over
one PostgreSQL database. The tenant ends at or below its quotas, every
refused call is RESOURCE_EXHAUSTED naming the quota and wrote nothing, and
every accepted call's write is complete."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import bots_client
from bots_client import Task
from bots_client.aio import AsyncClient
from bots_server.service.credentials import hash_token
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres

CALLS = 100
# tenant -> (max_experiments, max_tasks); 0: no limit.
TENANTS = {
    "create": (3, 0),
    "fork": (0, 40),  # 4 sources of 5 tasks: room for 4 forks
    "restore": (3, 0),  # a 5-task snapshot, restored: room for 3
    "add": (0, 25),  # 2 tasks a call: room for 12 calls
    "mixed": (6, 40),
}


def token(tenant: str) -> str:
    return f"race-{tenant}-token-0123456789abcdef"


def credentials(path: Path) -> Path:
    text = ""
    for tenant, (experiments, tasks) in TENANTS.items():
        text += f"[tenants.{tenant}]\nmax_experiments = {experiments}\nmax_tasks = {tasks}\n\n"
    for tenant in TENANTS:
        text += (
            f'[[principals]]\nname = "{tenant}-owner"\ntenant = "{tenant}"\nrole = "tenant-admin"\n'
            f'token_sha256 = "{hash_token(token(tenant))}"\n\n'
        )
    path.write_text(text)
    return path


@dataclass
class Race:
    """Clients of one tenant, one per server process, used in turn."""

    addresses: Sequence[str]
    tenant: str

    def sync(self) -> bots_client.Client:
        return bots_client.Client(self.addresses[0], metadata=bots_client.bearer(token(self.tenant)))

    def run(self, calls: Sequence[Callable[[AsyncClient], Awaitable[object]]]) -> list[object]:
        """Each call on the next process's client, all at once; each one's
        result or error."""

        async def race() -> list[object]:
            clients = [AsyncClient(a, metadata=bots_client.bearer(token(self.tenant))) for a in self.addresses]
            try:
                rotation = itertools.cycle(clients)
                return await asyncio.gather(*(call(next(rotation)) for call in calls), return_exceptions=True)
            finally:
                for c in clients:
                    await c.close()

        return asyncio.run(race())


def tasks(prefix: str, n: int) -> list[Task]:
    return [Task(key=f"{prefix}-{i}", features={"x": float(i)}) for i in range(n)]


def accepted_and_refused(results: Sequence[object], quota: str) -> list[int]:
    """The indices of the calls that succeeded; every other one must have
    been refused for `quota` (e.g. "max_tasks = 25")."""
    accepted = []
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            assert isinstance(result, bots_client.ResourceExhaustedError), repr(result)
            assert quota in str(result) and "tenant" in str(result), str(result)
        else:
            accepted.append(i)
    return accepted


def stored(c: bots_client.Client) -> dict[str, int]:
    return {e.name: e.num_tasks for e in c.list_experiments()}


def keys_of(c: bots_client.Client, name: str) -> list[str]:
    return c.snapshot(name).keys


@pytest.fixture(scope="module", params=["sqlite", "postgresql", "postgresql-2-replicas"])
def race(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Race]]:
    tmp = tmp_path_factory.mktemp("races")
    if request.param == "sqlite":
        url = f"sqlite:///{tmp / 'races.db'}"
    else:
        require_postgres()
        url = create_pg_database("bots_quota_races")
    replicas = 2 if request.param.endswith("replicas") else 1
    args = ["--credentials-file", str(credentials(tmp / "credentials.toml"))]
    servers = [ServerProcess(url, extra_args=args) for _ in range(replicas)]
    try:
        for server in servers:
            server.start()
        addresses = [s.address for s in servers]
        yield lambda tenant: Race(addresses, tenant)
    finally:
        for server in servers:
            server.stop()
        if request.param != "sqlite":
            drop_pg_database(url)


def test_concurrent_creates(race: Callable[[str], Race]) -> None:
    """3 of 100 fit."""
    r = race("create")
    results = r.run([lambda c, i=i: c.create_experiment(f"e{i}") for i in range(CALLS)])
    accepted = accepted_and_refused(results, "max_experiments = 3")
    with r.sync() as c:
        assert stored(c) == {f"e{i}": 0 for i in accepted}
    assert len(accepted) == 3


def test_concurrent_forks(race: Callable[[str], Race]) -> None:
    """Forks of 4 sources of 5 tasks each (20 of 40 tasks): 4 fit."""
    r = race("fork")
    with r.sync() as c:
        for s in range(4):
            c.create_experiment(f"src{s}")
            c.add_tasks(f"src{s}", tasks(f"s{s}", 5))
    results = r.run([lambda c, i=i: c.fork_experiment(f"src{i % 4}", f"f{i}") for i in range(CALLS)])
    accepted = accepted_and_refused(results, "max_tasks = 40")
    with r.sync() as c:
        forks = {name: n for name, n in stored(c).items() if name.startswith("f")}
        assert forks == {f"f{i}": 5 for i in accepted}
        assert all(keys_of(c, f"f{i}") == keys_of(c, f"src{i % 4}") for i in accepted)
    assert len(accepted) == 4


def test_concurrent_restores(race: Callable[[str], Race]) -> None:
    """Restores of a 5-task snapshot: 3 fit."""
    r = race("restore")
    with r.sync() as c:
        c.create_experiment("origin")
        c.add_tasks("origin", tasks("o", 5))
        snapshot = c.snapshot("origin", include_features=True)
        c.delete_experiment("origin")
    results = r.run([lambda c, i=i: c.restore_experiment(f"r{i}", snapshot) for i in range(CALLS)])
    accepted = accepted_and_refused(results, "max_experiments = 3")
    with r.sync() as c:
        assert stored(c) == {f"r{i}": 5 for i in accepted}
        for i in accepted:
            restored = c.snapshot(f"r{i}")
            assert restored.keys == snapshot.keys and np.array_equal(restored.alpha, snapshot.alpha)
    assert len(accepted) == 3


def test_concurrent_add_tasks(race: Callable[[str], Race]) -> None:
    """2 tasks a call to 10 experiments: 12 calls (24 tasks of 25) fit."""
    r = race("add")
    with r.sync() as c:
        for e in range(10):
            c.create_experiment(f"a{e}")
    results = r.run([lambda c, i=i: c.add_tasks(f"a{i % 10}", tasks(f"t{i}", 2)) for i in range(CALLS)])
    accepted = accepted_and_refused(results, "max_tasks = 25")
    with r.sync() as c:
        for e in range(10):
            expected = {f"t{i}-{j}" for i in accepted if i % 10 == e for j in range(2)}
            assert set(keys_of(c, f"a{e}")) == expected
    assert len(accepted) == 12


def test_all_kinds_at_once(race: Callable[[str], Race]) -> None:
    """100 calls of each kind together, on a tenant holding one 5-task
    experiment: at most 6 experiments and 40 tasks, whichever calls win."""
    r = race("mixed")
    with r.sync() as c:
        c.create_experiment("src")
        c.add_tasks("src", tasks("s", 5))
        snapshot = c.snapshot("src", include_features=True)
    calls: list[Callable[[AsyncClient], Awaitable[object]]] = []
    created: list[str] = []  # the experiment each call creates ("": none)
    for i in range(CALLS):
        calls += [
            lambda c, i=i: c.create_experiment(f"c{i}"),
            lambda c, i=i: c.fork_experiment("src", f"f{i}"),
            lambda c, i=i: c.restore_experiment(f"r{i}", snapshot),
            lambda c, i=i: c.add_tasks("src", tasks(f"t{i}", 2)),
        ]
        created += [f"c{i}", f"f{i}", f"r{i}", ""]
    results = r.run(calls)
    accepted = set(accepted_and_refused(results, "quota max_"))
    with r.sync() as c:
        usage = stored(c)
        assert len(usage) <= 6 and sum(usage.values()) <= 40, usage
        assert set(usage) == {"src"} | {created[i] for i in accepted if created[i]}
        added = sum(2 for i in accepted if not created[i])
        assert usage["src"] == 5 + added
