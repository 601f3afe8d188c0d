"""Tenants, principals and roles, and how experiment names relate to tenants.

Every experiment belongs to one tenant. A caller (a principal) has a home
tenant and a role:

    reader        GetExperiment, ListExperiments, Snapshot, ListGroups, in its tenant
    writer        and every call that trains or changes its tenant's experiments, but deleting one
    tenant-admin  every call, in its own tenant (DeleteExperiment)
    admin         every call, in every tenant (the platform's administrator)

Names: a caller names its own tenant's experiments by their plain name
("gsm8k-run"); the same plain name in two tenants is two experiments. A name
may also be written "tenant/name"; that is the only way to reach another
tenant's experiment, and only an admin may. A non-admin naming another tenant
gets PERMISSION_DENIED whether or not the experiment exists, and a plain name
only ever finds its own tenant's experiment (NOT_FOUND otherwise): nothing
tells a caller what other tenants hold.

In the store an experiment's name is its stored name: the plain name for the
tenant "default" (so a server without tenants, and every database written
before tenants existed, keeps its names), "tenant/name" for every other
tenant. The store also keeps the tenant in a column of its own, for listing
and quotas.
"""

from __future__ import annotations

import contextvars
import enum
from dataclasses import dataclass

from bots_server.core import limits
from bots_server.core.limits import shown
from bots_server.errors import InvalidArgument, PermissionDenied
from bots_server.store import DEFAULT_TENANT


class Role(enum.IntEnum):
    """Ordered: each role may do what the ones below it may."""

    READER = 1
    WRITER = 2
    TENANT_ADMIN = 3
    ADMIN = 4

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls[text.upper().replace("-", "_")]
        except KeyError:
            raise ValueError(f"role {text!r} is not one of {ROLE_LABELS}") from None

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


ROLE_LABELS = ", ".join(r.label for r in Role)


@dataclass(frozen=True)
class Principal:
    name: str
    tenant: str
    role: Role

    def may_enter(self, tenant: str) -> bool:
        return tenant == self.tenant or self.role >= Role.ADMIN


# Who a server without credentials serves: one user, the administrator of
# the default tenant (a local run needs no tokens).
ANONYMOUS = Principal("anonymous", DEFAULT_TENANT, Role.ADMIN)

# The caller of the gRPC call being handled; set by the auth interceptor.
current: contextvars.ContextVar[Principal] = contextvars.ContextVar("bots_principal", default=ANONYMOUS)


def check_tenant(tenant: str, what: str = "tenant") -> None:
    if not limits.TENANT_PATTERN.fullmatch(tenant):
        raise InvalidArgument(
            f"{what} {shown(tenant)} is invalid: use 1-{limits.MAX_TENANT_LENGTH} characters from a-z 0-9 -, "
            "starting and ending with a letter or digit"
        )


def stored_name(tenant: str, name: str) -> str:
    return name if tenant == DEFAULT_TENANT else f"{tenant}/{name}"


def split(stored: str) -> tuple[str, str]:
    """A stored name -> (tenant, plain name)."""
    tenant, sep, name = stored.rpartition("/")
    return (tenant, name) if sep else (DEFAULT_TENANT, stored)


def tenant_of(stored: str) -> str:
    return split(stored)[0]


def resolve(principal: Principal, reference: str, what: str = "experiment name") -> str:
    """The stored name of the experiment `principal` means by `reference`
    ("name" or "tenant/name"). InvalidArgument for a malformed reference,
    PermissionDenied for another tenant's experiment (unless admin)."""
    tenant, sep, name = reference.rpartition("/")
    if not sep:
        tenant = principal.tenant
    else:
        check_tenant(tenant, f"tenant of {what} {shown(reference)}:")
    if not limits.NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(
            f"{what} {shown(reference)} is invalid: use 1-{limits.MAX_NAME_LENGTH} characters from "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit, optionally after 'tenant/'"
        )
    if not principal.may_enter(tenant):
        raise PermissionDenied(
            f"{principal.name!r} (tenant {principal.tenant!r}, role {principal.role.label}) may not use "
            f"experiments of tenant {tenant!r}"
        )
    stored = stored_name(tenant, name)
    if len(stored) > limits.MAX_NAME_LENGTH:
        raise InvalidArgument(
            f"{what} {shown(reference)}: with its tenant, {stored!r} is longer than {limits.MAX_NAME_LENGTH} characters"
        )
    return stored


def shown_to(principal: Principal, stored: str) -> str:
    """How `principal` names a stored experiment: plain in its own tenant,
    "tenant/name" elsewhere. resolve(principal, shown_to(principal, s)) == s."""
    tenant, name = split(stored)
    return name if tenant == principal.tenant else f"{tenant}/{name}"


def lineage_shown_to(principal: Principal, stored: str | None) -> str:
    """How `principal` sees the source of a fork or restore (a stored name):
    like any other name, and withheld ("") when it lies in a tenant the
    principal may not enter, so an administrator's fork across tenants
    tells the new experiment's readers nothing about the source's tenant."""
    if not stored:
        return ""
    return shown_to(principal, stored) if principal.may_enter(tenant_of(stored)) else ""
