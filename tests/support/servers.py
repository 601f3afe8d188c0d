"""Real servers for tests: a `bots-server serve` child process on a real TCP
port, and per-run PostgreSQL databases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psycopg
import pytest

PG_ADMIN_DSN = os.environ.get("BOTS_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres")
REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`bots-server serve` in a child process, listening on a free port.

    The port is read from the server's own "serving" log line, so there is no
    race for a pre-picked free port.
    """

    def __init__(self, db_url: str, *, extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.db_url = db_url
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.log_lines: list[dict[str, object]] = []
        self._reader: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, listen: str = "127.0.0.1:0", timeout: float = 60.0) -> ServerProcess:
        cmd = [
            sys.executable, "-m", "bots_server.cli", "serve",
            "--db", self.db_url, "--listen", listen, "--log-format", "json",
            "--metrics-listen", "127.0.0.1:0", *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=self.env)
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    entry = {"message": line.rstrip()}
                self.log_lines.append(entry)
                if entry.get("message") == "serving":
                    self.port = int(entry["port"])  # type: ignore[arg-type]
                    ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server did not start: {self.log_lines[-20:]}")
        return self

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM: graceful shutdown (finishes calls, checkpoints). Returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(5)
        return code

    def kill(self) -> None:
        """SIGKILL: a crash at an arbitrary moment."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def messages(self) -> list[str]:
        return [str(e.get("message")) for e in self.log_lines]


def postgres_available() -> bool:
    try:
        with psycopg.connect(PG_ADMIN_DSN, connect_timeout=3):
            return True
    except psycopg.OperationalError:
        return False


def require_postgres() -> None:
    """Skip without PostgreSQL, except in CI (CI set), where that fails."""
    if not postgres_available():
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not reachable; CI must run the PostgreSQL tests")
        pytest.skip("PostgreSQL is not reachable (set BOTS_TEST_PG_DSN)")


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
