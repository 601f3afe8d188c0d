"""Logging: human-readable text, or one JSON object per line (--log-format json).

State changes log at INFO with their fields as `extra`; nothing is logged per
call at INFO (the per-call access line is DEBUG). Every record logged while a
gRPC call is handled carries that call's `request_id` (set by
bots_server.service.interceptors), so one grep finds everything a call did.
"""

from __future__ import annotations

import collections
import contextvars
import datetime as dt
import json
import logging
import math
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

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


# A line longer than this is cut (see _Shortening) when several processes
# share the stream: one write of it could not be atomic (PIPE_BUF, 4096
# bytes with the newline), and another process's line would land inside it.
SHARED_LINE_BYTES = 4095


def _cut(text: str, excess: int, size: Callable[[str], int]) -> str:
    """`text` less at least `excess` bytes (as `size` counts them) from its
    middle, marked: a traceback keeps its first frames and the error at its end."""
    per_character = size(text) / max(1, len(text))
    keep = max(0, len(text) - math.ceil(excess / per_character) - 32)
    cut = len(text) - keep
    return f"{text[: keep // 2]} ...[{cut} characters cut]... {text[len(text) - (keep - keep // 2) :]}"


def _size(line: str) -> int:
    # As stderr writes it: a lone surrogate (an undecodable file name) as \udcff.
    return len(line) if line.isascii() else len(line.encode(errors="backslashreplace"))


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _json_size(text: str) -> int:
    return len(json.dumps(text))  # escapes and \uXXXX: ASCII


class _Shortening(logging.Formatter):
    """Keeps each line within `max_bytes` (None: any length) by cutting the
    middle of its longest part."""

    def __init__(self, *args: Any, max_bytes: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_bytes = max_bytes


class JsonFormatter(_Shortening):
    def format(self, record: logging.LogRecord) -> str:
        entry = self._entry(record)
        line = json.dumps(entry, default=str)
        if self.max_bytes is None or _size(line) <= self.max_bytes:
            return line
        entry["truncated_bytes"] = _size(line)
        while True:
            # Cut the longest field (a value that is not a string as its
            # JSON text); each pass shortens a field of more than 64
            # characters, so the loop ends.
            longest = max(entry, key=lambda k: len(_as_text(entry[k])))
            text = _as_text(entry[longest])
            if len(text) <= 64:  # many short fields: keep what names the record
                kept = ("time", "level", "logger", "message", "request_id", "truncated_bytes")
                return json.dumps({k: entry[k] for k in kept if k in entry}, default=str)
            entry[longest] = _cut(text, _size(line) - self.max_bytes, _json_size)
            line = json.dumps(entry, default=str)
            if _size(line) <= self.max_bytes:
                return line

    def _entry(self, record: logging.LogRecord) -> dict[str, Any]:
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
        return entry


class TextFormatter(_Shortening):
    def __init__(self, max_bytes: int | None = None) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", max_bytes=max_bytes)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _fields(record)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        # The whole record, traceback lines and all: it is written at once.
        while self.max_bytes is not None and _size(text) > self.max_bytes:
            text = _cut(text, _size(text) - self.max_bytes, _size)
        return text


# Lines that may wait for a slow reader of stderr before new ones are
# dropped: some 25 s of the audit lines of 1000 steps/s, about 15 MB.
QUEUE_LINES = 50_000
# How long a flush waits for the writer (at exit, or before a forced exit).
FLUSH_SECONDS = 2.0
# How often the writer wakes to write what was logged meanwhile. Not at
# every line: a wake-up per line would hand the GIL back and forth with the
# event loop at every line.
WRITE_INTERVAL_SECONDS = 0.05
# The writer writes whole lines in chunks of at most this many bytes: one
# write each (stderr is line-buffered), not one per line (each write hands
# the GIL back and forth with the event loop), and no longer than PIPE_BUF
# on Linux, so processes sharing a pipe never cut into each other's lines.
# A longer line is written alone, as a plain handler would (under a
# supervisor no line is longer: SHARED_LINE_BYTES).
CHUNK_BYTES = 4096


class QueuedStreamHandler(logging.Handler):
    """Formats each record in the caller, where its request id and principal
    are, and leaves the writing to a thread of its own, which wakes every
    WRITE_INTERVAL_SECONDS: a reader of stderr that stalls (a full pipe, a
    log shipper that falls behind) delays the lines, never a call on the
    event loop. Up to `capacity` lines wait; past that a line is dropped and
    counted, and the writer says how many were dropped, in a line of its
    own, before the next line it writes."""

    def __init__(self, stream: TextIO, capacity: int = QUEUE_LINES) -> None:
        super().__init__()
        self.stream = stream
        self.capacity = capacity
        self.dropped_total = 0
        self._dropped_unsaid = 0
        # A deque: appending and popping need no lock and wake no thread.
        self._lines: collections.deque[str] = collections.deque()
        self._queued = 0  # lines queued so far, under the handler's lock (emit holds it)
        # Not the handler's own lock: logging.shutdown holds that one while
        # it flushes, and the writer must go on meanwhile.
        self._progress = threading.Condition()
        self._written = 0  # lines written (or given up on) so far, under _progress
        self._wake = threading.Event()
        self._closing = False
        self._writer = threading.Thread(target=self._write, name="bots-log-writer", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        if len(self._lines) >= self.capacity:
            with self._progress:
                self.dropped_total += 1
                self._dropped_unsaid += 1
            return
        self._lines.append(line)
        self._queued += 1

    def flush(self, timeout: float = FLUSH_SECONDS) -> None:
        """Wait, `timeout` at most, until the lines queued so far are written."""
        target = self._queued
        self._wake.set()
        with self._progress:
            self._progress.wait_for(lambda: self._written >= target or not self._writer.is_alive(), timeout)

    def close(self) -> None:
        """Write what is queued (FLUSH_SECONDS at most) and stop the writer."""
        self._closing = True
        self.flush()
        self._writer.join(FLUSH_SECONDS)
        super().close()

    def _write(self) -> None:
        while True:
            self._wake.wait(WRITE_INTERVAL_SECONDS)
            self._wake.clear()
            closing = self._closing
            written = 0
            chunk = _Chunk(self._write_out)
            while self._lines:
                self._say_dropped(chunk)
                chunk.add(self._lines.popleft())
                written += 1
            self._say_dropped(chunk)  # closing, or drops since the last line: say them now
            chunk.close()
            self._write_out(None)
            with self._progress:
                self._written += written
                self._progress.notify_all()
            if closing:
                return

    def _write_out(self, text: str | None) -> None:
        """Write whole lines, or flush the stream (None)."""
        try:
            if text is None:
                self.stream.flush()
            else:
                self.stream.write(text)
        except Exception:  # a closed or broken stream: there is nowhere to say so
            pass

    def _say_dropped(self, chunk: _Chunk) -> None:
        """Add a line saying how many lines were dropped since the last such line, if any were."""
        with self._progress:
            dropped, self._dropped_unsaid = self._dropped_unsaid, 0
        if not dropped:
            return
        record = logging.makeLogRecord(
            {
                "name": __name__,
                "levelno": logging.WARNING,
                "levelname": "WARNING",
                "msg": "log lines dropped: stderr was not read fast enough",
                "dropped": dropped,
            }
        )
        chunk.add(self.format(record))


class _Chunk:
    """Whole lines gathered into writes of at most CHUNK_BYTES."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write = write
        self.lines: list[str] = []
        self.size = 0

    def add(self, line: str) -> None:
        text = line + "\n"
        size = len(text) if text.isascii() else 4 * len(text)  # at most 4 bytes a character in UTF-8
        if self.lines and self.size + size > CHUNK_BYTES:
            self.close()
        self.lines.append(text)
        self.size += size

    def close(self) -> None:
        if self.lines:
            self.write("".join(self.lines))
            self.lines, self.size = [], 0


_handler: QueuedStreamHandler | None = None


def dropped_lines() -> int:
    """Log lines this process dropped because stderr was not read fast enough."""
    return _handler.dropped_total if _handler is not None else 0


def flush(timeout: float = FLUSH_SECONDS) -> None:
    """Wait, `timeout` at most, until the lines logged so far are written:
    before an exit that skips the interpreter's own shutdown (os._exit)."""
    if _handler is not None:
        _handler.flush(timeout)


AUDIT_LEVELS = ("all", "experiments", "off")


def configure(
    level: str, fmt: str, audit: str = "all", queue_lines: int = QUEUE_LINES, shared_stream: bool = False
) -> None:
    """`audit`: which audit lines to keep (core/audit.py): all, experiments
    (no line per training step) or off. `queue_lines`: see QueuedStreamHandler.
    `shared_stream`: other processes write to the same stderr (the server
    processes of one supervisor), so each line is kept within SHARED_LINE_BYTES."""
    global _handler
    handler = QueuedStreamHandler(sys.stderr, queue_lines)
    max_bytes = SHARED_LINE_BYTES if shared_stream else None
    handler.setFormatter(JsonFormatter(max_bytes=max_bytes) if fmt == "json" else TextFormatter(max_bytes))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, QueuedStreamHandler):
            old.close()
    root.handlers[:] = [handler]
    _handler = handler
    root.setLevel(level)
    quiet = logging.WARNING
    logging.getLogger("bots_server.audit").setLevel(quiet if audit == "off" else logging.NOTSET)
    logging.getLogger("bots_server.audit.steps").setLevel(quiet if audit != "all" else logging.NOTSET)
    # Alembic announces each of its built-in plugins at INFO on every start
    # (seven lines of noise); its "Running upgrade ..." lines stay.
    logging.getLogger("alembic.runtime.plugins").setLevel(quiet)
    migration = logging.getLogger("alembic.runtime.migration")
    if not any(isinstance(f, AlembicInternalsFilter) for f in migration.filters):
        migration.addFilter(AlembicInternalsFilter())


class AlembicInternalsFilter(logging.Filter):
    """Drops the lines Alembic logs at INFO each time it looks at a database
    ("Context impl SQLiteImpl.", "Will assume non-transactional DDL."): two
    to three pairs a start, about its internals. What it changes ("Running
    upgrade 0001 -> 0002, ...") and anything at WARNING or above stay."""

    INTERNALS = ("Context impl ", "Will assume ")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not str(record.msg).startswith(self.INTERNALS)
