"""The TaskSelector's method handlers, as the generated code builds them,
with request parsing that cannot fail: a message protobuf rejects becomes an
Undecodable marker, which the servicer answers with INVALID_ARGUMENT (grpc
itself would answer UNKNOWN with a Python exception name)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError

from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_server.service.servicer import TaskSelectorServicer
from bots_server.service.status import Undecodable

SERVICE = "bots.v1.TaskSelector"


class _Collector:
    """Stands in for a grpc server to receive the generated handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers arrive by name below

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


def method_handlers(servicer: TaskSelectorServicer) -> dict[str, grpc.RpcMethodHandler]:
    """Method name -> handler."""
    collector = _Collector()
    pb_grpc.add_TaskSelectorServicer_to_server(servicer, collector)
    return {name: _tolerant(handler) for name, handler in collector.handlers.items()}


def register(server: grpc.aio.Server, servicer: TaskSelectorServicer) -> None:
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]  # grpcio >= 1.62


def _tolerant(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    assert parse is not None  # generated handlers always parse their request
    message_type = getattr(parse, "__self__", None)
    type_name = message_type.DESCRIPTOR.full_name if message_type is not None else "request"

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Undecodable(type_name, str(e).rpartition(": ")[2])  # without protobuf's type prefix

    serde = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(handler.unary_unary, **serde)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(handler.stream_unary, **serde)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(handler.unary_stream, **serde)
    assert handler.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(handler.stream_stream, **serde)
