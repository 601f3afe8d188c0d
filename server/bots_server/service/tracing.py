"""The tracing interceptor: a SERVER span per call, continuing the trace
the caller sent in the call's metadata (W3C traceparent / tracestate), with
the experiment (from the request) and the step (from the response) as
attributes. Installed by BotsServer only when tracing is on
(bots_server.tracing)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from bots_server import tracing
from bots_server.service.interceptors import Continuation, on_finish, wrap_handler
from bots_server.service.rpc_names import split_method

# Requests name their experiment in one of these fields (the first message
# of a stream does); responses that have a step carry it as `step`.
_EXPERIMENT_FIELDS = ("experiment", "name")
# Client mistakes are the caller's: the span records the code, but only
# server-side failures mark it as an error (OpenTelemetry's gRPC convention).
_SERVER_ERRORS = {
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
}  # fmt: skip


def _field(message: Any, names: tuple[str, ...]) -> Any:
    descriptor = getattr(message, "DESCRIPTOR", None)
    for name in names:
        if descriptor is not None and name in descriptor.fields_by_name:
            return getattr(message, name)
    return None


class TracingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.tracer = tracing.tracer()

    async def intercept_service(  # type: ignore[override]  # None for unknown methods: the stubs omit it
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, method = split_method(handler_call_details.method)
        carrier = {k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)}
        parent = propagate.extract(carrier)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}

        @contextlib.asynccontextmanager
        async def around(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            with self.tracer.start_as_current_span(
                f"{service}/{method}", context=parent, kind=SpanKind.SERVER, attributes=attributes,
                record_exception=False, set_status_on_exception=False,
            ) as span:  # fmt: skip

                def record(code: grpc.StatusCode) -> None:
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    if code in _SERVER_ERRORS:
                        span.set_status(Status(StatusCode.ERROR, code.name))

                async with on_finish(context, record):
                    yield

        # Both run inside `around`, where the call's span is the current one.
        def on_request(message: Any) -> None:
            name = _field(message, _EXPERIMENT_FIELDS)
            if name:
                trace.get_current_span().set_attribute(tracing.EXPERIMENT, name)

        def on_response(message: Any) -> None:
            step = _field(message, ("step",))
            if step is not None:
                trace.get_current_span().set_attribute(tracing.STEP, int(step))

        return wrap_handler(handler, around, on_request=on_request, on_response=on_response)
