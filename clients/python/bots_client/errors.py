"""Typed exceptions: every failed call raises a BotsError subclass carrying the
gRPC status code and the server's message."""

from __future__ import annotations

import grpc


class BotsError(Exception):
    """`request_id`: the x-request-id the call carried; the server's log lines
    for the call carry it too. `after_unanswered_attempt`: an earlier attempt
    of the same RPC got no answer (UNAVAILABLE, DEADLINE_EXCEEDED) and was
    retried, so it may have taken effect before this failure."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        request_id: str = "",
        after_unanswered_attempt: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.after_unanswered_attempt = after_unanswered_attempt
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgumentError(BotsError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(BotsError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(BotsError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(BotsError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ConfigMismatchError(FailedPreconditionError):
    """get_or_create_experiment found the experiment with a config other than
    the requested one; the message names each differing field. Raised by the
    client, not mapped from a status code."""


class ExperimentInUseError(FailedPreconditionError):
    """A new training run found its experiment name already in use by a run
    that made progress (reported steps or open batches) and did not say it
    resumes it. Raised by the trainer integrations, not mapped from a status
    code: pass `resume=True` (or load the run's checkpoint) to continue that
    experiment, or name a new one."""


class UnavailableError(BotsError):
    """The server or its database is unreachable; raised after retries ran out."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(BotsError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhaustedError(BotsError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnauthenticatedError(BotsError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(BotsError):
    code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        UnavailableError,
        DeadlineExceededError,
        ResourceExhaustedError,
        UnauthenticatedError,
        PermissionDeniedError,
    )
}


def from_rpc_error(error: grpc.RpcError, request_id: str = "", after_unanswered_attempt: bool = False) -> BotsError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _BY_CODE.get(code, BotsError)
    return cls(details or code.name, code, request_id, after_unanswered_attempt)
