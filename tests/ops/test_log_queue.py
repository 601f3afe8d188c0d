"""The log handler (logs.QueuedStreamHandler): the caller never waits for
stderr, what overflows is counted and said, and what was queued is written
at exit, also when logging.shutdown holds the handler's lock."""

from __future__ import annotations

import io
import json
import logging
import threading
import time

from bots_server import logs


class StalledStream(io.StringIO):
    """stderr whose reader has stopped: a write waits until `resume` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.resume = threading.Event()

    def write(self, text: str) -> int:
        self.resume.wait()
        return super().write(text)


def handler_on(stream: io.StringIO, capacity: int) -> tuple[logging.Logger, logs.QueuedStreamHandler]:
    handler = logs.QueuedStreamHandler(stream, capacity)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger(f"test-log-queue-{id(stream)}")
    logger.propagate = False
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    return logger, handler


def test_a_stalled_stream_costs_the_caller_nothing_and_drops_are_said() -> None:
    stream = StalledStream()
    logger, handler = handler_on(stream, capacity=10)
    started = time.perf_counter()
    for i in range(500):
        logger.info("step", extra={"i": i})
    assert time.perf_counter() - started < 1.0  # not one write waited
    # 10 lines wait, and the writer may hold up to 10 more (what it took
    # from the queue before its write blocked): the rest were dropped.
    assert 500 - 20 <= handler.dropped_total <= 500 - 10
    stream.resume.set()
    handler.flush()  # the reader catches up
    logger.info("after")
    handler.flush()
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    notices = [e for e in entries if e["message"].startswith("log lines dropped")]
    assert sum(e["dropped"] for e in notices) == handler.dropped_total
    assert notices[0]["level"] == "WARNING"
    steps = [e["i"] for e in entries if e["message"] == "step"]
    assert steps == sorted(steps) and steps[0] == 0  # the first lines, in order
    assert len(steps) + handler.dropped_total == 500
    assert entries[-1]["message"] == "after"
    handler.close()


def test_queued_lines_are_written_when_logging_shuts_down() -> None:
    stream = io.StringIO()
    logger, handler = handler_on(stream, capacity=100_000)
    for i in range(20_000):
        logger.info("line", extra={"i": i})
    # logging.shutdown (at interpreter exit) flushes and closes each handler
    # holding its lock: the writer must not need that lock.
    started = time.perf_counter()
    handler.acquire()
    try:
        handler.flush()
        handler.close()
    finally:
        handler.release()
    assert time.perf_counter() - started < logs.FLUSH_SECONDS
    assert len(stream.getvalue().splitlines()) == 20_000


class RecordingStream(io.StringIO):
    """Keeps each write apart, as the pipe sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_writes_are_whole_lines_no_longer_than_pipe_buf_but_a_long_line() -> None:
    # Processes behind one address share a pipe: a write of at most PIPE_BUF
    # bytes is never cut by another process's.
    stream = RecordingStream()
    logger, handler = handler_on(stream, capacity=100_000)
    words = ["x" * (i % 700) for i in range(1000)] + ["é" * 3000, "long" * 3000, "end"]
    for word in words:
        logger.info(word)
    handler.close()
    for text in stream.writes:
        assert text.endswith("\n")
        assert len(text.encode()) <= logs.CHUNK_BYTES or text.count("\n") == 1
    assert [json.loads(line)["message"] for line in stream.getvalue().splitlines()] == words
    assert len(stream.writes) < len(words) / 5  # lines go out together, not one write each
