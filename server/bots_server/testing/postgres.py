"""Throwaway PostgreSQL databases on a running server (BOTS_TEST_PG_DSN,
default 127.0.0.1:5432, user postgres)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import psycopg

PG_ADMIN_DSN = os.environ.get("BOTS_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres")


def postgres_available() -> bool:
    try:
        with psycopg.connect(PG_ADMIN_DSN, connect_timeout=3):
            return True
    except psycopg.OperationalError:
        return False


def create_pg_database(prefix: str = "bots_test") -> str:
    """A new, empty database; returns its SQLAlchemy URL."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    params = psycopg.conninfo.conninfo_to_dict(PG_ADMIN_DSN)
    return f"postgresql+psycopg://{params.get('user', 'postgres')}@{params.get('host', '127.0.0.1')}:{params.get('port', 5432)}/{name}"


def drop_pg_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_conninfo(url: str) -> str:
    """The libpq connection string of a database made by create_pg_database."""
    return psycopg.conninfo.make_conninfo(PG_ADMIN_DSN, dbname=url.rsplit("/", 1)[1])


def load_pg_dump(url: str, path: Path) -> None:
    """Run a plain-format pg_dump file into a database with psql, stopping at the first error."""
    subprocess.run(
        ["psql", "--quiet", "--no-psqlrc", "--set=ON_ERROR_STOP=1", f"--file={path}", pg_conninfo(url)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
