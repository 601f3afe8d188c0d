"""Persistence (SQLAlchemy Core; SQLite or PostgreSQL). No math here."""

from bots_server.store.records import BatchRow, CheckpointRow, ExperimentCopy, ExperimentRow, LoadedRows, Lookup, StepEvent
from bots_server.store.store import BatchAlreadyReported, DatabaseInUse, LeaseConflict, StaleStep, Store

__all__ = [
    "BatchAlreadyReported",
    "BatchRow",
    "CheckpointRow",
    "DatabaseInUse",
    "ExperimentCopy",
    "ExperimentRow",
    "LeaseConflict",
    "LoadedRows",
    "Lookup",
    "StaleStep",
    "StepEvent",
    "Store",
]
