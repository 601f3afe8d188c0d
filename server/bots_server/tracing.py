"""Optional OpenTelemetry tracing.

A span per RPC (service/tracing.py) carries the experiment and the step as
attributes; each database call of the RPC is a span beneath it
(core/runtime.py runs store calls through `database_call`); the caller's
trace context arrives in the call's metadata (W3C `traceparent`), as
bots_client sends it.

Needs the `tracing` extra (`pip install 'bots-server[tracing]'`: the
OpenTelemetry API, SDK and OTLP exporter). Tracing is on when the process
has an SDK tracer provider: the one `--otlp-endpoint` sets up (`configure`),
or one the embedding program or `opentelemetry-instrument` installed.
Otherwise no interceptor is installed and store calls are not wrapped: a
server without tracing pays nothing for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import bots_server

try:
    from opentelemetry import trace
except ImportError:  # the extra is not installed
    trace = None  # type: ignore[assignment]

T = TypeVar("T")

TRACER_NAME = "bots_server"
# Span attributes of the service's own (OpenTelemetry's naming: a namespace,
# dot-separated lower case).
EXPERIMENT = "bots.experiment"
STEP = "bots.step"


def available() -> bool:
    return trace is not None


def enabled() -> bool:
    """Whether a real (SDK) tracer provider is installed."""
    if trace is None:
        return False
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def tracer() -> Any:
    assert trace is not None
    return trace.get_tracer(TRACER_NAME, bots_server.__version__)


def configure(otlp_endpoint: str) -> None:
    """Export spans to an OTLP/gRPC collector (e.g. http://otel-collector:4317),
    in batches, off the calls' path."""
    if trace is None:
        raise SystemExit("--otlp-endpoint / BOTS_OTLP_ENDPOINT needs the tracing extra: pip install 'bots-server[tracing]'")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({"service.name": "bots-server", "service.version": bots_server.__version__})
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    trace.set_tracer_provider(provider)


def shutdown() -> None:
    """Flush the spans still queued (on server stop)."""
    if enabled():
        flush = getattr(trace.get_tracer_provider(), "shutdown", None)
        if flush is not None:
            flush()


def database_call(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` (a store method), in a span of its own when tracing is on. Run in
    the RPC's context (Runtime.run copies it to the worker thread), the span
    is a child of the RPC's."""
    if not enabled():
        return fn
    operation = getattr(fn, "__name__", "call")

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> T:
        with tracer().start_as_current_span(
            f"store.{operation}", kind=trace.SpanKind.CLIENT, attributes={"db.operation.name": operation}
        ):
            return fn(*args, **kwargs)

    return traced
