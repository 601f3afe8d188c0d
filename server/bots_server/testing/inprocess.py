"""The service in this process, reached through channel objects that stand in
for a gRPC channel: `bots_client.Client(channel=service.channel())` then runs
every call through the real servicer, with every message serialized and parsed
as on the wire, but without a socket, HTTP/2 or the server's interceptors.

The service runs on an event loop of its own, in a background thread, so a
synchronous client (or a client on another loop) can call it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc

from bots_server.core.selector import SelectorService
from bots_server.service import handlers
from bots_server.service.servicer import TaskSelectorServicer
from bots_server.store import Store, open_store

T = TypeVar("T")

# gRPC's default limit on a received message, which a real server enforces
# before the servicer sees the request.
MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024


class InProcessRpcError(grpc.RpcError):
    """How a failed in-process call looks to the client: a status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Context:
    """The part of grpc.aio.ServicerContext the servicer uses."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise InProcessRpcError(code, details)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class InProcessService:
    """A SelectorService on its own store and event loop thread. Use as a
    context manager, or call close()."""

    def __init__(self, db_url: str, **selector_options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bots-inprocess", daemon=True)
        self._thread.start()
        self.store = _open_store(db_url)
        self.core: SelectorService = self.call(self._build(selector_options))
        by_name = handlers.method_handlers(TaskSelectorServicer(self.core))
        self._handlers = {f"/{handlers.SERVICE}/{name}": handler for name, handler in by_name.items()}

    async def _build(self, options: dict[str, Any]) -> SelectorService:
        return SelectorService(self.store, **options)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the service's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def channel(self) -> InProcessChannel:
        """For bots_client.Client(channel=...)."""
        return InProcessChannel(self)

    def aio_channel(self) -> AsyncInProcessChannel:
        """For bots_client.AsyncClient(channel=...)."""
        return AsyncInProcessChannel(self)

    def handler(self, method: str) -> grpc.RpcMethodHandler:
        return self._handlers[method]

    def close(self) -> None:
        self.call(self.core.close())
        self.store.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> InProcessService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_store(db_url: str) -> Store:
    store = open_store(db_url, exclusive=True)
    store.migrate()
    return store


# -- the wire, without the socket ---------------------------------------------------

Serializer = Callable[[Any], bytes] | None


def _encode(serializer: Serializer, message: Any) -> bytes:
    return message if serializer is None else serializer(message)


def _decode(deserializer: Serializer, data: bytes) -> Any:
    return data if deserializer is None else deserializer(data)


async def _requests(parse: Callable[[bytes], Any], encoded: Sequence[bytes]) -> AsyncIterator[Any]:
    for data in encoded:
        yield parse(data)


async def _invoke(service: InProcessService, method: str, encoded: bytes | list[bytes]) -> bytes | list[bytes]:
    """One call on the service's loop: bytes in, bytes out, as a server would."""
    for message in encoded if isinstance(encoded, list) else [encoded]:
        if len(message) > MAX_RECEIVE_MESSAGE_BYTES:
            raise InProcessRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Received message larger than max ({len(message)} vs. {MAX_RECEIVE_MESSAGE_BYTES})",
            )
    handler = service.handler(method)
    # The servicer's behaviors are coroutines and async generators (grpc.aio);
    # grpc's stubs type handlers for the synchronous server.
    parse: Any = handler.request_deserializer
    serialize: Any = handler.response_serializer
    behavior: Any = handler.unary_unary or handler.stream_unary or handler.unary_stream
    context = _Context()
    if handler.stream_unary is not None:
        assert isinstance(encoded, list)
        return serialize(await behavior(_requests(parse, encoded), context))
    if handler.unary_stream is not None:
        return [serialize(r) async for r in behavior(parse(encoded), context)]
    return serialize(await behavior(parse(encoded), context))


class _Call:
    def __init__(
        self, service: InProcessService, method: str, serialize: Serializer, deserialize: Serializer, streaming: str
    ) -> None:
        self.service, self.method = service, method
        self.serialize, self.deserialize = serialize, deserialize
        self.streaming = streaming  # "unary", "request" or "response"

    def _encode(self, request: Any) -> bytes | list[bytes]:
        if self.streaming == "request":
            return [_encode(self.serialize, r) for r in request]
        return _encode(self.serialize, request)

    def _decode(self, result: Any) -> Any:
        if self.streaming == "response":
            assert isinstance(result, list)
            return _Responses([_decode(self.deserialize, r) for r in result])
        return _decode(self.deserialize, result)


class _SyncCall(_Call):
    def __call__(self, request: Any, timeout: float | None = None, **_: Any) -> Any:
        return self._decode(self.service.call(_invoke(self.service, self.method, self._encode(request)), timeout))


class _AsyncCall(_Call):
    async def _run(self, request: Any, timeout: float | None) -> Any:
        future = self.service.submit(_invoke(self.service, self.method, self._encode(request)))
        return self._decode(await asyncio.wait_for(asyncio.wrap_future(future), timeout))

    def __call__(self, request: Any, timeout: float | None = None, **_: Any) -> Any:
        if self.streaming == "response":
            return _AsyncResponses(self._run(request, timeout))
        return self._run(request, timeout)


class _Responses(list[Any]):
    """A server stream's messages, iterable as the sync client expects."""


class _AsyncResponses:
    """A server stream for the asyncio client: `async for` over it."""

    def __init__(self, pending: Coroutine[Any, Any, _Responses]) -> None:
        self._pending = pending

    async def __aiter__(self) -> AsyncIterator[Any]:
        for message in await self._pending:
            yield message


class InProcessChannel:
    """The methods of grpc.Channel that generated stubs use."""

    _call: type[_Call] = _SyncCall

    def __init__(self, service: InProcessService) -> None:
        self.service = service

    def _make(self, method: str, kind: str, request_serializer: Serializer, response_deserializer: Serializer) -> Any:
        return self._call(self.service, method, request_serializer, response_deserializer, kind)

    def unary_unary(
        self, method: str, request_serializer: Serializer = None, response_deserializer: Serializer = None, **_: Any
    ) -> Any:
        return self._make(method, "unary", request_serializer, response_deserializer)

    def stream_unary(
        self, method: str, request_serializer: Serializer = None, response_deserializer: Serializer = None, **_: Any
    ) -> Any:
        return self._make(method, "request", request_serializer, response_deserializer)

    def unary_stream(
        self, method: str, request_serializer: Serializer = None, response_deserializer: Serializer = None, **_: Any
    ) -> Any:
        return self._make(method, "response", request_serializer, response_deserializer)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("bots.v1 has no bidirectional streams")

    def close(self) -> None:
        pass


class AsyncInProcessChannel(InProcessChannel):
    """The methods of grpc.aio.Channel that generated stubs use."""

    _call = _AsyncCall

    async def close(self, grace: float | None = None) -> None:  # type: ignore[override]
        pass


__all__ = ["AsyncInProcessChannel", "InProcessChannel", "InProcessRpcError", "InProcessService"]
