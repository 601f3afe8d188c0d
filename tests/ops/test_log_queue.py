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
    # The writer holds what it took before its first write blocked (at most
    # the 10 queued and one), 10 more wait: the rest were dropped.
    assert 500 - 21 <= handler.dropped_total <= 500 - 10
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
