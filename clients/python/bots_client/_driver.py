"""What the sync and async drivers of the call descriptions share: channel
options, the request id of a call and the retry schedule of an RPC."""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from typing import Any

import grpc

try:  # the `tracing` extra: the caller's trace continues on the server
    from opentelemetry import propagate as _otel_propagate
except ImportError:
    _otel_propagate = None  # type: ignore[assignment]

# Reconnect quickly after a server restart (gRPC's default backoff grows to
# 120 s, longer than a pod restart); retries are bounded by retry_timeout.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)

Metadata = tuple[tuple[str, str], ...]
REQUEST_ID_KEY = "x-request-id"

log = logging.getLogger("bots_client")


def with_request_id(metadata: Metadata) -> tuple[str, Metadata]:
    """A fresh request id (kept across every RPC and retry of one call, so the
    server's log lines of all of them share it) and the metadata carrying it,
    with the caller's trace context."""
    request_id = uuid.uuid4().hex
    return request_id, ((REQUEST_ID_KEY, request_id), *trace_context(), *metadata)


def trace_context() -> Metadata:
    """The current OpenTelemetry context as metadata (W3C `traceparent` and
    `tracestate`, by the globally configured propagator), when OpenTelemetry
    is installed and a span is active; the server's span of the call becomes
    its child."""
    if _otel_propagate is None:
        return ()
    carrier: dict[str, str] = {}
    _otel_propagate.inject(carrier)
    return tuple(carrier.items())


RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRIED_IDEMPOTENT = RETRIED | {grpc.StatusCode.DEADLINE_EXCEEDED}
# gRPC's retry pushback (gRFC A6): the server's "try again in this many
# milliseconds", which it sends with a momentary refusal (RESOURCE_EXHAUSTED
# while other calls hold its memory), never with a quota.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class Retries:
    """The retry schedule of one RPC: UNAVAILABLE (a server restart, a database
    outage) is retried after an exponential backoff with full jitter for up to
    retry_timeout seconds, and so is DEADLINE_EXCEEDED for an idempotent RPC
    (a hung server or network); a failure that carries the server's retry
    pushback is retried after it (it wrote nothing); any other status is final."""

    def __init__(self, retry_timeout: float, idempotent: bool, initial: float = 0.1, maximum: float = 2.0) -> None:
        self._deadline = time.monotonic() + retry_timeout
        self._retried = RETRIED_IDEMPOTENT if idempotent else RETRIED
        self._backoff = initial
        self._maximum = maximum
        # An attempt went unanswered and was retried: it may have acted.
        self.after_unanswered_attempt = False

    def delay_after(self, error: grpc.RpcError) -> float | None:
        """Seconds to wait before the next attempt, or None: give up. The
        last wait is cut to the deadline, so the calls go on until
        retry_timeout has passed (not until a jittered wait would overshoot)."""
        delay = random.uniform(0, self._backoff)
        self._backoff = min(self._backoff * 2, self._maximum)
        left = self._deadline - time.monotonic()
        pushback = pushback_seconds(error)
        if pushback is not None:
            delay = pushback
        elif error.code() not in self._retried:
            return None
        if left <= 0:
            return None
        if pushback is None:
            self.after_unanswered_attempt = True
        return min(delay, left)


def pushback_seconds(error: grpc.RpcError) -> float | None:
    """The server's retry pushback in seconds, None without a valid one (a
    negative or unparsable value means "do not retry", as in gRFC A6)."""
    # (key, value) pairs: grpc's _Metadatum tuples, or grpc.aio's Metadata.
    trailing: Any = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == RETRY_PUSHBACK_KEY:
            try:
                milliseconds = int(value)
            except ValueError:
                return None
            return milliseconds / 1000 if milliseconds >= 0 else None
    return None


class Reachability:
    """Says once, at a WARNING, that a client's server cannot be reached
    (UNAVAILABLE: nothing listens, a DNS failure, a server restarting or
    without its database) and that the call goes on retrying; without it a
    trainer started before its server waited its retry_timeout without a
    word. Once the server has answered, a later outage is told again."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._told = False
        self._lock = threading.Lock()

    def retrying(self, error: grpc.RpcError, retry_timeout: float) -> None:
        """A failed attempt that will be retried."""
        if error.code() is not grpc.StatusCode.UNAVAILABLE:
            return
        with self._lock:
            if self._told:
                return
            self._told = True
        detail = " ".join(str(error.details() or "").split())
        log.warning(
            "BOTS server not reachable at %s, retrying for up to %g s (%s)", self._target, retry_timeout, detail
        )

    def answered(self) -> None:
        self._told = False
