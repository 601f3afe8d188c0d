"""grpc.aio server interceptors: request ids and per-RPC metrics; and the
wrapping every interceptor uses. Auth is in service/auth.py.

Order matters; BotsServer installs them as

    RequestIdInterceptor   outermost: every log line of the call, the auth
                           failure's included, carries the request id
    MetricsInterceptor     counts every call, rejected ones as Unauthenticated
    AuthInterceptor        innermost: rejects before the servicer runs

Each wraps the method handler's behavior in an async context manager, for the
four call shapes (unary/streaming request x unary/streaming response).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from bots_server import logs
from bots_server.metrics import RpcMetrics
from bots_server.service.rpc_names import GO_CODE_NAMES, grpc_type, split_method

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
_MAX_REQUEST_ID_LEN = 128

Around = Callable[[grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[None]]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    around: Around,
    on_request: Callable[[Any], None] | None = None,
    on_response: Callable[[Any], None] | None = None,
) -> grpc.RpcMethodHandler:
    """The same handler with its behavior run inside `around(context)`;
    `on_request` / `on_response` are called with each message (for counting,
    for trace attributes)."""
    received = on_request or _nothing
    sent = on_response or _nothing

    async def count_requests(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            received(request)
            yield request

    def wrap_unary_response(behavior: Callable[..., Awaitable[Any]], streaming_request: bool) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with around(context):
                if streaming_request:
                    request = count_requests(request)
                else:
                    received(request)
                response = await behavior(request, context)
                sent(response)
                return response

        return wrapped

    def wrap_streaming_response(behavior: Callable[..., Any], streaming_request: bool) -> Callable[..., Any]:
        # A response-streaming behavior is either an async generator or a
        # coroutine that writes with context.write (the health service's
        # Watch); the wrapper must have the same shape.
        if inspect.isasyncgenfunction(behavior):

            async def generator(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async with around(context):
                    if streaming_request:
                        request = count_requests(request)
                    else:
                        received(request)
                    async for response in behavior(request, context):
                        sent(response)
                        yield response

            return generator

        async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with around(context):
                if streaming_request:
                    request = count_requests(request)
                else:
                    received(request)
                return await behavior(request, context)

        return coroutine

    serde = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap_unary_response(handler.unary_unary, False), **serde)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap_unary_response(handler.stream_unary, True), **serde)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap_streaming_response(handler.unary_stream, False), **serde)
    assert handler.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(wrap_streaming_response(handler.stream_stream, True), **serde)


def _nothing(message: Any) -> None:
    pass


def metadata_value(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for k, v in details.invocation_metadata or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


def status_of(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with, from how its behavior ended."""
    if error is None or isinstance(error, grpc.aio.AbortError):
        code = context.code()
        if code is None:
            return grpc.StatusCode.OK
        if isinstance(code, grpc.StatusCode):
            return code
        # Some grpcio versions keep the raw cygrpc integer.
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if isinstance(error, asyncio.CancelledError):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # what grpc.aio answers for an uncaught exception


@contextlib.asynccontextmanager
async def on_finish(
    context: grpc.aio.ServicerContext, record: Callable[[grpc.StatusCode], None]
) -> AsyncIterator[None]:
    """Run the call's behavior, then `record` the status it ended with,
    however it ended (an interceptor's `around` wraps its yield in this)."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as e:
        error = e
        raise
    finally:
        record(status_of(context, error))


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Takes `x-request-id` from the call's metadata (or makes one), binds it
    to the call's log records and sends it back in the trailing metadata, so
    a client can quote it in a bug report."""

    async def intercept_service(  # type: ignore[override]  # None for unknown methods: the stubs omit it
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        given = metadata_value(handler_call_details, REQUEST_ID_KEY)
        # Ids from callers end up in log lines: keep them short and printable.
        valid = given is not None and 0 < len(given) <= _MAX_REQUEST_ID_LEN and given.isprintable()

        @contextlib.asynccontextmanager
        async def around(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            request_id = given if valid and given is not None else uuid.uuid4().hex
            token = logs.request_id.set(request_id)
            context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
            try:
                yield
            finally:
                logs.request_id.reset(token)

        return wrap_handler(handler, around)


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """grpc_server_started_total, _handled_total, _handling_seconds and the
    message counters, as go-grpc-prometheus records them; plus a DEBUG access
    line per call (never at INFO: that would be a line per training step)."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics
        # By full method name: the methods are the service's, so the map is bounded.
        self._series: dict[str, _MethodSeries] = {}

    async def intercept_service(  # type: ignore[override]  # None for unknown methods: the stubs omit it
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        series = self._series.get(method)
        if series is None:
            labels = (grpc_type(handler.request_streaming, handler.response_streaming), *split_method(method))
            series = self._series[method] = _MethodSeries(self.metrics, labels)

        @contextlib.asynccontextmanager
        async def around(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            series.started.inc()
            started = time.perf_counter()

            def record(code: grpc.StatusCode) -> None:
                seconds = time.perf_counter() - started
                series.handled(code).inc()
                series.handling_seconds.observe(seconds)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("rpc", extra={"method": method, "code": code.name, "seconds": round(seconds, 6)})

            async with on_finish(context, record):
                yield

        received, sent = series.received, series.sent
        return wrap_handler(handler, around, on_request=lambda _: received.inc(), on_response=lambda _: sent.inc())


class _MethodSeries:
    """One method's labelled series, looked up once: a `labels()` call takes
    a lock and builds a key, five times a call otherwise."""

    def __init__(self, metrics: RpcMetrics, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.metrics = metrics
        self.started = metrics.started.labels(*labels)
        self.handling_seconds = metrics.handling_seconds.labels(*labels)
        self.received = metrics.msg_received.labels(*labels)
        self.sent = metrics.msg_sent.labels(*labels)
        self._handled: dict[grpc.StatusCode, Any] = {}

    def handled(self, code: grpc.StatusCode) -> Any:
        child = self._handled.get(code)
        if child is None:
            child = self._handled[code] = self.metrics.handled.labels(*self.labels, GO_CODE_NAMES.get(code, "Unknown"))
        return child
