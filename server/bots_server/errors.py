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


class Unavailable(ServiceError):
    """The database cannot be reached or is busy; the call may be retried."""
