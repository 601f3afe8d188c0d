"""Authentication and roles: who is calling, and may that role make this call.

A call authenticates with `authorization: Bearer <token>` or, on a mutual TLS
port, with its client certificate (common name or a subject alternative
name listed in the credentials file). A token, when sent, decides: a wrong
token is rejected even on a connection with a good certificate.

UNAUTHENTICATED: no credential, or one the server does not know.
PERMISSION_DENIED: a known principal whose role may not make the call.
Which tenant's experiments a call may touch is decided with the names
(core/tenancy.py), after this.

Health and reflection stay open: the kubelet's probes and load balancers
carry no credentials, and reflection only describes the API.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
from prometheus_client import Counter

from bots_server import logs
from bots_server.core import tenancy
from bots_server.core.tenancy import Principal, Role
from bots_server.service.credentials import Credentials
from bots_server.service.denials import DenialLog, peer_host
from bots_server.service.interceptors import Continuation, metadata_value, on_finish, wrap_handler
from bots_server.service.rpc_names import GO_CODE_NAMES, split_method

AUTHORIZATION_KEY = "authorization"
AUTH_EXEMPT_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
# The least role each TaskSelector method needs; a method missing here
# (added to the proto later) needs the platform's admin until it is listed.
REQUIRED_ROLE = {
    "GetExperiment": Role.READER,
    "ListExperiments": Role.READER,
    "Snapshot": Role.READER,
    "ListGroups": Role.READER,
    "CreateExperiment": Role.WRITER,
    "ForkExperiment": Role.WRITER,
    "RestoreExperiment": Role.WRITER,
    # A trainer's token should not be able to erase its run's history.
    "DeleteExperiment": Role.TENANT_ADMIN,
    "AddTasks": Role.WRITER,
    "SelectBatch": Role.WRITER,
    "ReportOutcomes": Role.WRITER,
    "ReportAndSelect": Role.WRITER,
    "RetireTasks": Role.WRITER,
    "ReactivateTasks": Role.WRITER,
    "SetGroupShares": Role.WRITER,
}

def certificate_identities(context: grpc.aio.ServicerContext) -> list[str]:
    """The client certificate's common name, then its subject alternative
    names; empty without a verified client certificate."""
    auth = context.auth_context()
    values = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in values]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        credentials: Callable[[], Credentials],
        tenant_calls: Counter | None = None,
        tenant_label: Callable[[str], str] = str,
    ) -> None:
        """`credentials()`: those in force now (the file reloads);
        `tenant_calls`: counter labelled (tenant_label(tenant), grpc_method, grpc_code)."""
        self.credentials = credentials
        self.tenant_calls = tenant_calls
        self.tenant_label = tenant_label
        self.denials = DenialLog()

    def authenticate(self, header: str | None, context: grpc.aio.ServicerContext) -> Principal | str:
        """The caller, or why not."""
        credentials = self.credentials()
        if header is not None:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return "malformed authorization header; send 'authorization: Bearer <token>'"
            principal = credentials.by_token(token.strip())
            return principal if principal is not None else "invalid bearer token"
        principal = credentials.by_identities(certificate_identities(context))
        if principal is not None:
            return principal
        return "missing bearer token; send metadata 'authorization: Bearer <token>' with a token the server accepts"

    async def intercept_service(  # type: ignore[override]  # None for unknown methods: the stubs omit it
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(AUTH_EXEMPT_PREFIXES):
            return handler
        header = metadata_value(handler_call_details, AUTHORIZATION_KEY)
        _service, method_name = split_method(method)
        required = REQUIRED_ROLE.get(method_name, Role.ADMIN)

        @contextlib.asynccontextmanager
        async def around(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            principal = self.authenticate(header, context)
            if isinstance(principal, str):
                self.denials.note(peer_host(context.peer()), "UNAUTHENTICATED", method_name, principal)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method}: {principal}")
                return
            label = f"{principal.name}@{principal.tenant}"
            if principal.role < required:
                self._count(principal, method_name, grpc.StatusCode.PERMISSION_DENIED)
                reason = (
                    f"{method_name}: {principal.name!r} has role {principal.role.label}; "
                    f"this call needs {required.label} or above"
                )
                self.denials.note(label, "PERMISSION_DENIED", method_name, reason)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
                return

            def finished(code: grpc.StatusCode) -> None:
                self._count(principal, method_name, code)
                if code == grpc.StatusCode.PERMISSION_DENIED:  # another tenant's experiment (core/tenancy.py)
                    self.denials.note(label, "PERMISSION_DENIED", method_name, context.details() or "")

            tokens = (tenancy.current.set(principal), logs.principal.set(label))
            try:
                async with on_finish(context, finished):
                    yield
            finally:
                logs.principal.reset(tokens[1])
                tenancy.current.reset(tokens[0])

        return wrap_handler(handler, around)

    def _count(self, principal: Principal, method_name: str, code: grpc.StatusCode) -> None:
        if self.tenant_calls is not None:
            code_name = GO_CODE_NAMES.get(code, "Unknown")
            self.tenant_calls.labels(self.tenant_label(principal.tenant), method_name, code_name).inc()
