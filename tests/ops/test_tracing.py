"""OpenTelemetry tracing, with the SDK's in-memory exporter: a real server on
a socket in this process, a real client whose active span's context travels
in the call's metadata. Each RPC is a SERVER span, child of the caller's
span, with the experiment and the step; the database calls are spans
beneath it; client mistakes are recorded but not marked as errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import bots_client
from bots_client import ExperimentConfig, Task
from bots_server import tracing
from bots_server.service.server import BotsServer
from bots_server.settings import ServerSettings
from tests.ops.support import eventually

SERVICE = "bots.v1.TaskSelector"


class ServerThread:
    """A BotsServer on its own event loop in a thread of this process (so
    its spans reach this process's exporter)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: BotsServer = asyncio.run_coroutine_threadsafe(self._start(settings), self.loop).result(60)

    async def _start(self, settings: ServerSettings) -> BotsServer:
        server = BotsServer(settings)
        await server.start()
        return server

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    # The global provider can be set once per process; this module is the
    # only one that sets it (pytest-xdist runs a file in one worker).
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    assert tracing.enabled()
    yield exporter
    # Later tests in this worker may run in-process servers: drop their spans.
    provider.shutdown()
    exporter.clear()


@pytest.fixture(scope="module")
def served(exporter: InMemorySpanExporter, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("tracing") / "bots.db"
    server = ServerThread(ServerSettings(db=f"sqlite:///{db}", listen="127.0.0.1:0", metrics_listen=""))
    try:
        yield server.address
    finally:
        server.stop()


def server_spans(spans: tuple[ReadableSpan, ...], method: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == f"{SERVICE}/{method}" and s.kind == SpanKind.SERVER]


def finished(exporter: InMemorySpanExporter, *methods: str) -> tuple[ReadableSpan, ...]:
    """The finished spans, once a span of each method is among them: a
    server span ends after the answer is on its way, so just after the
    client has it."""
    return eventually(
        exporter.get_finished_spans,
        lambda spans: all(server_spans(spans, m) for m in methods),
        timeout=10,
        what=f"the spans of {methods}",
    )


def children(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_a_trainer_step_is_one_trace_from_the_client_into_the_database(
    served: str, exporter: InMemorySpanExporter
) -> None:
    with bots_client.Client(served) as client:
        client.create_experiment("traced", ExperimentConfig(seed=1))
        client.add_tasks("traced", [Task(f"t{i}") for i in range(20)])
        exporter.clear()
        with trace.get_tracer("trainer").start_as_current_span("trainer step") as step_span:
            batch = client.select_batch("traced", 4, request_key="step-0")
            result = client.report_outcomes("traced", batch.batch_id, dict.fromkeys(batch.keys, (1, 2)))
    spans = finished(exporter, "SelectBatch", "ReportOutcomes")
    root = step_span.get_span_context()

    (select,) = server_spans(spans, "SelectBatch")
    (report,) = server_spans(spans, "ReportOutcomes")
    for span, step in ((select, batch.step), (report, result.step)):
        # The server's span continues the trainer's trace, under its span.
        assert span.context.trace_id == root.trace_id
        assert span.parent is not None and span.parent.span_id == root.span_id
        assert span.attributes is not None
        assert span.attributes["bots.experiment"] == "traced"
        assert span.attributes["bots.step"] == step
        assert span.attributes["rpc.system"] == "grpc" and span.attributes["rpc.service"] == SERVICE
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
        assert span.status.status_code != StatusCode.ERROR
    assert (batch.step, result.step) == (0, 1)
    # The report's write is a database span beneath the report's span, and
    # inside it in time.
    writes = [s for s in children(spans, report) if s.name.startswith("store.")]
    assert writes, [s.name for s in spans]
    for write in writes:
        assert write.kind == SpanKind.CLIENT and write.context.trace_id == root.trace_id
        assert report.start_time is not None and report.end_time is not None
        assert write.start_time is not None and write.end_time is not None
        assert report.start_time <= write.start_time <= write.end_time <= report.end_time
    # Every database span belongs to one of the calls.
    rpc_ids = {s.context.span_id for s in spans if s.kind == SpanKind.SERVER}
    for span in spans:
        if span.name.startswith("store."):
            assert span.parent is not None and span.parent.span_id in rpc_ids, span.name


def test_without_a_caller_span_the_call_starts_its_own_trace(served: str, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    with bots_client.Client(served) as client:
        client.list_experiments()
    (span,) = server_spans(finished(exporter, "ListExperiments"), "ListExperiments")
    assert span.parent is None


def test_client_mistakes_are_recorded_but_not_errors(served: str, exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    with bots_client.Client(served) as client, pytest.raises(bots_client.NotFoundError):
        client.select_batch("no-such-experiment", 4)
    (span,) = server_spans(finished(exporter, "SelectBatch"), "SelectBatch")
    assert span.attributes is not None
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert span.attributes["bots.experiment"] == "no-such-experiment"
    assert span.status.status_code != StatusCode.ERROR


def test_tracing_is_off_without_a_tracer_provider(tmp_path: Path) -> None:
    # A fresh process: the API alone installs no interceptor and wraps no
    # store call.
    code = (
        "from bots_server import tracing; f = lambda: 1; "
        "print(tracing.available(), tracing.enabled(), tracing.database_call(f) is f)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "True"]
