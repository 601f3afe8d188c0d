"""Names of gRPC things as Prometheus labels: go-grpc-prometheus' method
labels and grpc-go's status code names."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from google.protobuf.descriptor import ServiceDescriptor

# grpc-go's code names (codes.Code.String()), so dashboards and alerts written
# for Go services work unchanged; note "Canceled" with one "l".
GO_CODE_NAMES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}


def grpc_type(request_streaming: bool, response_streaming: bool) -> str:
    if request_streaming:
        return "bidi_stream" if response_streaming else "client_stream"
    return "server_stream" if response_streaming else "unary"


def split_method(full_method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method or "unknown"


def method_labels(service: ServiceDescriptor) -> Iterator[tuple[str, str, str]]:
    """(grpc_type, grpc_service, grpc_method) of every method of a service."""
    for method in service.methods:
        yield grpc_type(method.client_streaming, method.server_streaming), service.full_name, method.name
