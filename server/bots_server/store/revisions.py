"""The Alembic revisions in store/migrations: upgrade a connection to one,
and compare a database's revisions with the code's."""

from __future__ import annotations

import pathlib

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from bots_server.store.records import SchemaStatus

MIGRATIONS = pathlib.Path(__file__).parent / "migrations"


def upgrade(conn: Connection, revision: str) -> None:
    """Run the migrations up to `revision` in `conn`'s transaction (see
    migrations/env.py, which uses the connection it is given)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    command.upgrade(config, revision)


def heads() -> list[str]:
    """The code's head revisions."""
    return sorted(ScriptDirectory(str(MIGRATIONS)).get_heads())


def status(conn: Connection) -> SchemaStatus:
    code = heads()
    current = sorted(MigrationContext.configure(conn).get_current_heads())
    return SchemaStatus(current == code, current, code)
