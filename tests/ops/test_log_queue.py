"""The log handler (logs.QueuedStreamHandler): the caller never waits for
stderr, what overflows is counted and said, and what was queued is written
at exit, also when logging.shutdown holds the handler's lock."""

from __future__ import annotations

import io
import json
import logging
import threading
import time

import pytest

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


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_under_a_supervisor_every_record_is_one_atomic_write_with_its_ends_kept(fmt: str) -> None:
    # The processes of one supervisor share its stderr: a record longer than
    # PIPE_BUF (an "unexpected error" with its traceback is 5-10 KB) would be
    # written in pieces, and another process's line would land inside it.
    stream = RecordingStream()
    logger, handler = handler_on(stream, capacity=1000)
    cap = logs.SHARED_LINE_BYTES
    handler.setFormatter(logs.JsonFormatter(max_bytes=cap) if fmt == "json" else logs.TextFormatter(cap))

    def deep(n: int) -> None:
        # A chain of causes: each level adds a traceback of its own (a plain
        # recursion would be compacted to "[Previous line repeated ...]").
        if not n:
            raise KeyError("the first cause")
        try:
            deep(n - 1)
        except KeyError as e:
            raise (ValueError if n == 60 else KeyError)("the error at the end é" if n == 60 else f"level {n}") from e

    try:
        deep(60)
    except ValueError:
        logger.exception("unexpected error in ReportOutcomes", extra={"request_id": "r-1"})
    logger.info("ü" * 5000)
    logger.info("short")
    handler.close()
    assert all(len(text.encode()) <= cap + 1 for text in stream.writes)
    if fmt == "json":
        error, wide, short = (json.loads(line) for line in stream.getvalue().splitlines())
        assert error["message"] == "unexpected error in ReportOutcomes" and error["request_id"] == "r-1"
        assert error["exception"].startswith("Traceback") and error["exception"].endswith("the error at the end é")
        assert "characters cut]" in error["exception"] and error["truncated_bytes"] > cap
        assert wide["message"].startswith("ü") and "truncated_bytes" in wide
        assert short == {k: short[k] for k in ("time", "level", "logger", "message")} and short["message"] == "short"
    else:
        text = stream.getvalue()
        assert "unexpected error in ReportOutcomes" in text and "the error at the end é" in text
        assert "characters cut]" in text and text.endswith("short\n")


def test_a_capped_json_line_fits_whatever_its_fields() -> None:
    formatter = logs.JsonFormatter(max_bytes=logs.SHARED_LINE_BYTES)

    def line(**extra: object) -> str:
        record = logging.makeLogRecord({"name": "t", "levelno": 20, "levelname": "INFO", "msg": "m", **extra})
        text = formatter.format(record)
        assert len(text.encode()) <= logs.SHARED_LINE_BYTES
        return text

    big_list = json.loads(line(tasks=[f"task-{i}" for i in range(2000)]))
    assert big_list["message"] == "m" and "characters cut]" in big_list["tasks"]
    many = json.loads(line(**{f"field{i}": "v" * 60 for i in range(100)}))
    assert many["message"] == "m" and many["truncated_bytes"] > logs.SHARED_LINE_BYTES
    assert json.loads(line(path="\udcff" + "x" * 5000))["message"] == "m"


def test_a_capped_text_line_with_an_undecodable_name_is_written() -> None:
    formatter = logs.TextFormatter(logs.SHARED_LINE_BYTES)
    record = logging.makeLogRecord({"name": "t", "levelno": 20, "levelname": "INFO", "msg": "file \udcff" + "y" * 5000})
    text = formatter.format(record)
    assert len(text.encode(errors="backslashreplace")) <= logs.SHARED_LINE_BYTES and "characters cut]" in text
