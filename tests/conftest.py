"""Shared fixtures: the databases every store-level test runs against, and
real server processes.

PostgreSQL: the server at BOTS_TEST_PG_DSN (default 127.0.0.1:5432, user
postgres); each test run creates its own database and drops it at the end.
Without PostgreSQL the PostgreSQL tests skip, except under CI=true, where
they fail: CI must run them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres

BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    require_postgres()
    url = create_pg_database()
    yield url
    drop_pg_database(url)


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    """A database of its own, for tests that need an empty schema."""
    require_postgres()
    url = create_pg_database()
    yield url
    drop_pg_database(url)


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'bots.db'}"


@pytest.fixture(params=BACKENDS, scope="session")
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test using it runs once on SQLite and once on PostgreSQL (one
    database per backend per run; tests isolate by experiment name)."""
    return request.getfixturevalue("pg_url" if request.param == "postgresql" else "sqlite_url")


@pytest.fixture(params=BACKENDS)
def fresh_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of its own, on each backend."""
    if request.param == "postgresql":
        return request.getfixturevalue("fresh_pg_url")
    return f"sqlite:///{tmp_path / 'fresh.db'}"


@pytest.fixture(scope="session")
def server(db_url: str) -> Iterator[ServerProcess]:
    """One server process per backend for the whole run."""
    proc = ServerProcess(db_url).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def sqlite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One SQLite server for the whole run, shared by the suites that do not
    depend on the backend and isolate by experiment name (benchmarks, trainer
    integrations): a server start costs a second or two of imports."""
    proc = ServerProcess(f"sqlite:///{tmp_path_factory.mktemp('shared') / 'bots.db'}").start()
    yield proc
    proc.stop()
