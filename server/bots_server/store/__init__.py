"""Persistence: the Store contract (base.py) and its SQL implementation
(sql.py) with a dialect each for SQLite and PostgreSQL. No math here."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import exc, make_url

from bots_server.store.base import Store
from bots_server.store.errors import (
    Abandoned,
    BatchAlreadyReported,
    DatabaseInUse,
    LeaseConflict,
    OverQuota,
    RequestKeyTaken,
    StaleStep,
    UnsupportedDatabase,
)
from bots_server.store.records import (
    DEFAULT_TENANT,
    BatchRow,
    CheckpointRow,
    Compacted,
    ExperimentCopy,
    ExperimentRow,
    LoadedRows,
    Lookup,
    PoolEvent,
    RetirementEvent,
    SchemaStatus,
    SharesEvent,
    StepEvent,
    TenantLimits,
    TenantUsage,
)

_EXPECTED = "expected sqlite:///FILE or postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
# The schemes of PostgreSQL without a driver (postgres:// as libpq also reads it).
_POSTGRESQL_SCHEMES = ("postgresql", "postgres")


def open_store(url: str, *, exclusive: bool = False, on_error: Callable[[str], None] | None = None) -> Store:
    """The store of the database at `url`, its dialect chosen by the scheme.

    `exclusive`: on SQLite, hold an advisory lock on the database file for the store's
    life; opening a second exclusive store on the file (another server)
    raises DatabaseInUse. PostgreSQL serves any number of replicas and
    ignores it. `on_error(kind)` is called for every database error a method
    raises (kinds: see sql_base.error_kind); the server counts them in a metric.
    Raises UnsupportedDatabase for any other scheme or driver.
    """
    try:
        parsed = make_url(url)
    except exc.ArgumentError:
        # Not echoed: the text may hold a password.
        raise UnsupportedDatabase(f"cannot parse the database URL; {_EXPECTED}") from None
    if parsed.drivername in _POSTGRESQL_SCHEMES:
        # What libpq, psql and most tools take: the driver here is psycopg 3.
        parsed = parsed.set(drivername="postgresql+psycopg")
    drivername = parsed.drivername
    # Each dialect is imported when used: a SQLite server does not load
    # psycopg and libpq (about 10 MB of resident memory).
    if drivername in ("sqlite", "sqlite+pysqlite"):
        from bots_server.store.sqlite import SqliteStore

        return SqliteStore(url, exclusive=exclusive, on_error=on_error)
    if drivername == "postgresql+psycopg":  # the dialect's COPY and error handling are psycopg 3's
        from bots_server.store.postgresql import PostgresStore

        return PostgresStore(parsed, on_error=on_error)
    raise UnsupportedDatabase(f"unsupported database URL scheme {drivername!r}; {_EXPECTED}")


__all__ = [
    "DEFAULT_TENANT",
    "Abandoned",
    "BatchAlreadyReported",
    "BatchRow",
    "CheckpointRow",
    "Compacted",
    "DatabaseInUse",
    "ExperimentCopy",
    "ExperimentRow",
    "LeaseConflict",
    "LoadedRows",
    "Lookup",
    "OverQuota",
    "PoolEvent",
    "RequestKeyTaken",
    "RetirementEvent",
    "SchemaStatus",
    "SharesEvent",
    "StaleStep",
    "StepEvent",
    "Store",
    "TenantLimits",
    "TenantUsage",
    "UnsupportedDatabase",
    "open_store",
]
