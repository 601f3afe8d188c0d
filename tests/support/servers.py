"""Real servers for tests: re-exported from bots_server.testing (shared with
the benchmarks), plus the pytest policy for a missing PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bots_server.testing.postgres import (
    PG_ADMIN_DSN,
    create_pg_database,
    drop_pg_database,
    load_pg_dump,
    pg_conninfo,
    postgres_available,
)
from bots_server.testing.processes import ServerProcess

REPO = Path(__file__).resolve().parents[2]

__all__ = [
    "PG_ADMIN_DSN",
    "REPO",
    "ServerProcess",
    "create_pg_database",
    "drop_pg_database",
    "load_pg_dump",
    "pg_conninfo",
    "postgres_available",
    "require_postgres",
]


def require_postgres() -> None:
    """Skip without PostgreSQL, except in CI (CI set), where that fails."""
    if not postgres_available():
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not reachable; CI must run the PostgreSQL tests")
        pytest.skip("PostgreSQL is not reachable (set BOTS_TEST_PG_DSN)")
