"""Domain errors. The service maps each to one gRPC status code; every
message names the bad value."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the errors a caller can act on."""


class InvalidArgument(ServiceError):
    pass


class NotFound(ServiceError):
    pass


class AlreadyExists(ServiceError):
    pass


class FailedPrecondition(ServiceError):
    pass


class PermissionDenied(ServiceError):
    """The caller is known but its role or tenant does not allow the call."""


class ResourceExhausted(ServiceError):
    """A quota or a per-request bound; the message names the limit.

    `retry_after_s`: set where the refusal is momentary (the server is busy
    with other calls), so the same call later may well succeed; the client
    gets it as gRPC's retry pushback and retries after it. None: the same
    call will be refused again (a quota, a bound on one call)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(ServiceError):
    """The database cannot be reached or is busy; the call may be retried."""
