"""Persistence (SQLAlchemy Core; SQLite or PostgreSQL). No math here."""

from bots_server.store.records import BatchRow, CheckpointRow, ExperimentRow, LoadedRows, StepEvent
from bots_server.store.store import StaleStep, Store

__all__ = ["BatchRow", "CheckpointRow", "ExperimentRow", "LoadedRows", "StaleStep", "StepEvent", "Store"]
