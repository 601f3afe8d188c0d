"""Logging: human-readable text, or one JSON object per line (--log-format json).

State changes log at INFO with their fields as `extra`; nothing is logged per
call at INFO (the per-call access line is DEBUG). Every record logged while a
gRPC call is handled carries that call's `request_id` (set by
bots_server.service.interceptors), so one grep finds everything a call did.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import sys
from typing import Any

# The id of the gRPC call being handled by the current task; None outside calls.
# A contextvar rather than a thread-local: many calls interleave on one event
# loop thread, each in its own asyncio task (and so its own context).
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("bots_request_id", default=None)
# Who made that call ("name@tenant"), once authenticated; None without auth.
principal: contextvars.ContextVar[str | None] = contextvars.ContextVar("bots_principal_label", default=None)

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class RequestIdFilter(logging.Filter):
    """Adds `request_id` and `principal` to records logged inside a gRPC call."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = request_id.get()
        if rid is not None and not hasattr(record, "request_id"):
            record.request_id = rid
        who = principal.get()
        if who is not None and not hasattr(record, "principal"):
            record.principal = who
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # RFC 3339 in UTC with milliseconds: sortable, and what Loki, Elastic
        # and Cloud Logging parse without a custom pattern.
        time = dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")
        entry = {
            "time": time.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _fields(record)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


AUDIT_LEVELS = ("all", "experiments", "off")


def configure(level: str, fmt: str, audit: str = "all") -> None:
    """`audit`: which audit lines to keep (core/audit.py): all, experiments
    (no line per training step) or off."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    quiet = logging.WARNING
    logging.getLogger("bots_server.audit").setLevel(quiet if audit == "off" else logging.NOTSET)
    logging.getLogger("bots_server.audit.steps").setLevel(quiet if audit != "all" else logging.NOTSET)
    # Alembic announces each of its built-in plugins at INFO on every start
    # (seven lines of noise); its "Running upgrade ..." lines stay.
    logging.getLogger("alembic.runtime.plugins").setLevel(quiet)
