"""Domain errors -> gRPC status codes, in one place.

Every call ends with a status a client can act on: a ServiceError's code and
message (cut to MAX_MESSAGE_CHARACTERS), INVALID_ARGUMENT for a request
protobuf cannot parse, and INTERNAL with the request id, never internals, for
anything unexpected (logged with its traceback).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from bots_server import logs
from bots_server.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

log = logging.getLogger(__name__)

CODES: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# Far below the 8 KB a client accepts in its metadata (the status message
# travels there).
MAX_MESSAGE_CHARACTERS = 1024

Servicer = TypeVar("Servicer")
Request = TypeVar("Request")
Response = TypeVar("Response")


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request message protobuf could not parse (see
    service/handlers.py), so that the call answers INVALID_ARGUMENT."""

    message_type: str
    error: str

    def problem(self) -> InvalidArgument:
        return InvalidArgument(f"the request is not a valid {self.message_type} message: {self.error}")


def _code(error: ServiceError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in CODES:
            return CODES[cls]
    return grpc.StatusCode.INTERNAL


def _cut(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARACTERS else message[:MAX_MESSAGE_CHARACTERS] + "..."


# gRPC's retry pushback (gRFC A6): the client waits this many milliseconds
# before it tries again.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


def _trailing_metadata(context: grpc.aio.ServicerContext, error: ServiceError) -> tuple[tuple[str, str], ...]:
    """The call's trailing metadata with the retry pushback of a momentary
    refusal added; () leaves it as it is (abort replaces what it is given)."""
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is None:
        return ()
    return (*context.trailing_metadata(), (RETRY_PUSHBACK_KEY, str(round(retry_after_s * 1000))))


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    if isinstance(error, ServiceError):
        await context.abort(_code(error), _cut(str(error)), _trailing_metadata(context, error))
    log.exception("unexpected error in %s", method)
    request_id = logs.request_id.get()
    reference = f" (request id {request_id})" if request_id else ""
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}{reference}; the server logged it")


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.problem()
        yield request


def _parsed(request: Any) -> Any:
    """The request, or the stream of requests, with unparsable messages raising InvalidArgument."""
    if isinstance(request, Undecodable):
        raise request.problem()
    return _checked(request) if hasattr(request, "__aiter__") else request


def unary(
    fn: Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]],
) -> Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]]:
    """Map errors of a unary-response handler to status codes."""

    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Request, context: grpc.aio.ServicerContext) -> Response:
        try:
            return await fn(self, _parsed(request), context)
        except Exception as e:
            await _abort(context, fn.__name__, e)
        raise AssertionError("unreachable: abort raises")

    return wrapper


def server_streaming(
    fn: Callable[[Servicer, Request, grpc.aio.ServicerContext], AsyncIterator[Response]],
) -> Callable[[Servicer, Request, grpc.aio.ServicerContext], AsyncIterator[Response]]:
    """Map errors of a response-streaming handler to status codes."""

    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Request, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, _parsed(request), context):
                yield item
        except Exception as e:
            await _abort(context, fn.__name__, e)

    return wrapper
