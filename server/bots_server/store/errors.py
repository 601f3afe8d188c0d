"""Errors of the store contract (base.Store) besides the domain errors of
bots_server.errors it raises too (Unavailable, AlreadyExists). Each tells the
caller what to do: re-read and retry, or stop. None depends on a database
library, so the core can catch them without importing one."""

from __future__ import annotations

from bots_server.store.records import BatchRow, TenantUsage


class StaleStep(Exception):
    """The experiment moved on (another replica or a racing call): re-read and retry."""


class BatchAlreadyReported(Exception):
    """A concurrent report of the same batch committed first."""


class LeaseConflict(Exception):
    """Another writer leased some of the chosen tasks first: choose again."""


class RequestKeyTaken(Exception):
    """The request key has a batch already; the transaction that would
    have stored a new one was rolled back."""

    def __init__(self, existing: BatchRow) -> None:
        super().__init__(existing.batch_id)
        self.existing = existing


class OverQuota(Exception):
    """The write would take its tenant past its TenantLimits: rolled back,
    nothing written. `usage`: the tenant's usage the transaction read."""

    def __init__(self, usage: TenantUsage) -> None:
        super().__init__(usage)
        self.usage = usage


class Abandoned(Exception):
    """The caller gave up before the write committed (its `abandoned` check
    said so): the transaction was rolled back, nothing was written."""


class DatabaseInUse(Exception):
    """Another server process holds this SQLite file."""


class UnsupportedDatabase(ValueError):
    """The database URL names a database (or driver) the store has no dialect for."""
