"""Domain errors -> gRPC status codes, in one place."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from bots_server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ServiceError, Unavailable

log = logging.getLogger(__name__)

CODES: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}

Servicer = TypeVar("Servicer")
Request = TypeVar("Request")
Response = TypeVar("Response")


def _code(error: Exception) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in CODES:
            return CODES[cls]
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    if isinstance(error, ServiceError):
        await context.abort(_code(error), str(error))
    log.exception("unexpected error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(error).__name__}")


def unary(
    fn: Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]],
) -> Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]]:
    """Map errors of a unary-response handler to status codes."""

    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Request, context: grpc.aio.ServicerContext) -> Response:
        try:
            return await fn(self, request, context)
        except ServiceError as e:
            await _abort(context, fn.__name__, e)
        except Exception as e:  # noqa: BLE001 - anything else is an INTERNAL with a log line
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
            async for item in fn(self, request, context):
                yield item
        except ServiceError as e:
            await _abort(context, fn.__name__, e)
        except Exception as e:  # noqa: BLE001
            await _abort(context, fn.__name__, e)

    return wrapper
