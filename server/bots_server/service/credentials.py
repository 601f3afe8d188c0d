"""The credentials file: who may call, as whom, and each tenant's quotas.

A TOML file (--credentials-file); tokens are stored only as SHA-256 hashes
(`bots-server token` makes a token and its entry):

    [defaults]                      # quotas of every tenant (optional; 0: no limit)
    max_experiments = 100
    max_tasks_per_experiment = 2000000
    max_tasks = 20000000

    [tenants.team-a]                # one tenant's quotas (optional)
    max_experiments = 20

    [[principals]]
    name = "alice"                  # shown in audit lines
    tenant = "team-a"
    role = "writer"                 # reader, writer, tenant-admin or admin
    token_sha256 = "9f86d0..."      # hex SHA-256 of the bearer token

    [[principals]]
    name = "trainer-b"
    tenant = "team-b"
    role = "writer"
    certificate = "trainer-b.team-b.example"   # mutual TLS: the client
                                    # certificate's common name or a SAN

Tokens are random secrets of at least 128 bits, so one unsalted SHA-256
is enough to keep a leaked file from yielding them (a salted slow hash
defends low-entropy passwords, which these are not).

The server re-reads the file when it changes (checked every few seconds,
and at once on SIGHUP). A file that does not parse on reload is logged and
the previous credentials stay: a typo must not lock every trainer out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import secrets
import tomllib
from collections.abc import Mapping
from typing import Any

from bots_server.core import tenancy
from bots_server.core.quotas import Quotas
from bots_server.core.tenancy import Principal, Role
from bots_server.errors import InvalidArgument

log = logging.getLogger(__name__)

RELOAD_INTERVAL_S = 2.0
_QUOTA_FIELDS = tuple(f.name for f in dataclasses.fields(Quotas))


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh bearer token: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


@dataclasses.dataclass(frozen=True)
class Credentials:
    by_token_hash: Mapping[str, Principal]
    by_certificate: Mapping[str, Principal]
    default_quotas: Quotas
    tenant_quotas: Mapping[str, Quotas]

    def quotas(self, tenant: str) -> Quotas:
        return self.tenant_quotas.get(tenant, self.default_quotas)

    def by_token(self, token: str) -> Principal | None:
        return self.by_token_hash.get(hash_token(token))

    def by_identities(self, identities: list[str]) -> Principal | None:
        """The principal of the first identity (CN, then SANs) the file names."""
        for identity in identities:
            principal = self.by_certificate.get(identity)
            if principal is not None:
                return principal
        return None

    @property
    def tenants(self) -> frozenset[str]:
        principals = (*self.by_token_hash.values(), *self.by_certificate.values())
        return frozenset(p.tenant for p in principals) | frozenset(self.tenant_quotas)


def parse(
    text: str,
    default_quotas: Quotas,
    static_admin_tokens: frozenset[str] = frozenset(),
    plain_role: Role = Role.TENANT_ADMIN,
) -> Credentials:
    """The credentials of a file's text; ValueError naming what is wrong.
    `default_quotas`: the server's flags, which [defaults] overrides.
    `static_admin_tokens`: plain tokens from BOTS_AUTH_TOKENS, each of the
    default tenant with `plain_role`: beside a credentials file a
    tenant-admin, so that a shared trainer token reaches no other team's
    experiments; alone (no file, no teams) the server's admin, as always."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not valid TOML: {e}") from None
    unknown = set(data) - {"defaults", "tenants", "principals"}
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; expected defaults, tenants, principals")
    defaults = _quotas(data.get("defaults", {}), default_quotas, "[defaults]")
    tenant_quotas = {}
    for tenant, table in _table(data.get("tenants", {}), "[tenants]").items():
        _tenant(tenant, f"[tenants.{tenant}]")
        tenant_quotas[tenant] = _quotas(table, defaults, f"[tenants.{tenant}]")
    by_token: dict[str, Principal] = {
        hash_token(t): _plain_principal(i, plain_role) for i, t in enumerate(sorted(static_admin_tokens))
    }
    by_certificate: dict[str, Principal] = {}
    names: set[str] = set()
    principals = data.get("principals", [])
    if not isinstance(principals, list):
        raise ValueError("principals must be an array of tables ([[principals]])")
    for i, entry in enumerate(principals):
        where = f"[[principals]] #{i + 1}"
        principal, token_hash, certificate = _principal(_table(entry, where), where)
        if principal.name in names:
            raise ValueError(f"{where}: name {principal.name!r} appears twice")
        names.add(principal.name)
        if token_hash is not None:
            if token_hash in by_token:
                raise ValueError(f"{where}: this token_sha256 belongs to another principal too")
            by_token[token_hash] = principal
        if certificate is not None:
            if certificate in by_certificate:
                raise ValueError(f"{where}: certificate {certificate!r} belongs to another principal too")
            by_certificate[certificate] = principal
    return Credentials(by_token, by_certificate, defaults, tenant_quotas)


def static_credentials(tokens: frozenset[str], default_quotas: Quotas) -> Credentials:
    """Credentials of plain admin tokens alone (BOTS_AUTH_TOKENS), no file."""
    return parse("", default_quotas, tokens, plain_role=Role.ADMIN)


def _plain_principal(i: int, role: Role) -> Principal:
    """A plain token (BOTS_AUTH_TOKENS, --auth-tokens-file), of the tenant `default`."""
    return Principal(f"token-{i + 1}", tenancy.DEFAULT_TENANT, role)


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a table")
    return value


def _tenant(tenant: Any, where: str) -> str:
    if not isinstance(tenant, str):
        raise ValueError(f"{where}: tenant must be a string")
    try:
        tenancy.check_tenant(tenant)
    except InvalidArgument as e:
        raise ValueError(f"{where}: {e}") from None
    return tenant


def _quotas(table: Any, base: Quotas, where: str) -> Quotas:
    table = _table(table, where)
    unknown = set(table) - set(_QUOTA_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected {', '.join(_QUOTA_FIELDS)}")
    for key, value in table.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {key} = {value!r} must be a whole number >= 0 (0: no limit)")
    return dataclasses.replace(base, **{key: value or None for key, value in table.items()})


def _principal(entry: dict[str, Any], where: str) -> tuple[Principal, str | None, str | None]:
    unknown = set(entry) - {"name", "tenant", "role", "token_sha256", "certificate"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 128:
        raise ValueError(f"{where}: name must be 1-128 printable characters")
    tenant = _tenant(entry.get("tenant", tenancy.DEFAULT_TENANT), f"{where} ({name})")
    try:
        role = Role.parse(str(entry.get("role", "")))
    except ValueError as e:
        raise ValueError(f"{where} ({name}): {e}") from None
    token_hash = entry.get("token_sha256")
    if token_hash is not None:
        token_hash = str(token_hash).lower()
        if len(token_hash) != 64 or any(c not in "0123456789abcdef" for c in token_hash):
            raise ValueError(f"{where} ({name}): token_sha256 must be 64 hex digits (bots-server token makes one)")
    certificate = entry.get("certificate")
    if certificate is not None and (not isinstance(certificate, str) or not certificate):
        raise ValueError(f"{where} ({name}): certificate must be a non-empty string")
    if token_hash is None and certificate is None:
        raise ValueError(f"{where} ({name}): give token_sha256, certificate, or both")
    return Principal(name, tenant, role), token_hash, certificate


class CredentialsFile:
    """The credentials in force, re-read from the file when it changes."""

    def __init__(self, path: str, default_quotas: Quotas, static_admin_tokens: frozenset[str] = frozenset()) -> None:
        self.path = path
        self.default_quotas = default_quotas
        self.static_admin_tokens = static_admin_tokens
        self._stamp = self._file_stamp()
        # A bad file at start is fatal (SystemExit from the caller); later, not.
        self.current = self._read()
        self.reloads = 0
        self.failed_reloads = 0

    def _file_stamp(self) -> tuple[int, int, int]:
        # Kubernetes updates a mounted Secret by swapping a symlink: stat
        # follows it, so the inode changes even when the mtime does not.
        st = os.stat(self.path)
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _read(self) -> Credentials:
        with open(self.path, encoding="utf-8") as f:
            return parse(f.read(), self.default_quotas, self.static_admin_tokens)

    def reload(self, force: bool = False) -> bool:
        """Re-read the file if it changed (or `force`); True if new
        credentials are in force."""
        try:
            stamp = self._file_stamp()
            if not force and stamp == self._stamp:
                return False
            credentials = self._read()
        except (OSError, ValueError) as e:
            self.failed_reloads += 1
            log.error("credentials file not reloaded; the previous credentials stay", extra={"path": self.path, "error": str(e)})
            return False
        self._stamp, self.current = stamp, credentials
        self.reloads += 1
        log.info(
            "credentials reloaded",
            extra={"path": self.path, "tokens": len(credentials.by_token_hash), "certificates": len(credentials.by_certificate)},
        )
        return True

    async def watch(self, interval_s: float = RELOAD_INTERVAL_S) -> None:
        """Until cancelled: reload whenever the file changes."""
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.reload)
