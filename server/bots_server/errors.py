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
    """A quota or a per-request bound; the message names the limit."""


class Unavailable(ServiceError):
    """The database cannot be reached or is busy; the call may be retried."""
