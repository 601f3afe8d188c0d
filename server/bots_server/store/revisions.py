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


def upgrade(conn: Connection, revision: str) -> list[str]:
    """Run the migrations up to `revision` in `conn`'s transaction (see
    migrations/env.py, which uses the connection it is given). A database
    already past this code's migrations (a rollback to the previous release)
    is left as it is: returns its revisions then, else []."""
    current = sorted(MigrationContext.configure(conn).get_current_heads())
    if newer_than_code(current):
        return current
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    command.upgrade(config, revision)
    return []


def newer_than_code(revisions: list[str]) -> bool:
    """Whether these database revisions are all unknown to this code and
    numbered past its heads: written by a newer release's migrations.
    Revisions are numbered 0001, 0002, ... (migrations/versions)."""
    script = ScriptDirectory(str(MIGRATIONS))
    known = {r.revision for r in script.walk_revisions()}
    newest = max(int(h) for h in script.get_heads())
    return bool(revisions) and all(r not in known and r.isdigit() and int(r) > newest for r in revisions)


def heads() -> list[str]:
    """The code's head revisions."""
    return sorted(ScriptDirectory(str(MIGRATIONS)).get_heads())


def status(conn: Connection) -> SchemaStatus:
    code = heads()
    current = sorted(MigrationContext.configure(conn).get_current_heads())
    return SchemaStatus(current == code, current, code)
