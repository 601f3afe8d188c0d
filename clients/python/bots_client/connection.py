"""How to reach a server: address, TLS files and bearer token, as plain data
that pickles, so an adapter copied into a DataLoader worker or a Ray actor
reconnects with the same credentials.

    connection = bots_client.Connection.from_env()   # BOTS_SERVER, BOTS_TOKEN, BOTS_TLS_CA, ...
    client = connection.client()

The environment variables are those of the `bots-server` ops commands:

    BOTS_SERVER       host:port (default 127.0.0.1:50051); BOTS_ADDRESS, the
                      framework adapters' name for it, when BOTS_SERVER is unset
    BOTS_TOKEN        bearer token
    BOTS_TLS          "1"/"true": TLS with the system's CA roots
    BOTS_TLS_CA       PEM file of the CA of the server's certificate (implies TLS)
    BOTS_CLIENT_CERT  PEM client certificate, for mutual TLS (implies TLS)
    BOTS_CLIENT_KEY   its PEM key
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc

from bots_client.security import bearer, tls_credentials

if TYPE_CHECKING:
    from bots_client.aio import AsyncClient
    from bots_client.client import Client

DEFAULT_SERVER = "127.0.0.1:50051"
_TRUE = ("1", "true", "yes")


@dataclasses.dataclass(frozen=True)
class Connection:
    target: str = DEFAULT_SERVER
    tls: bool = False
    ca: str = ""
    cert: str = ""
    key: str = ""
    token: str = dataclasses.field(default="", repr=False)  # kept out of logs and reprs

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs both cert and key (BOTS_CLIENT_CERT, BOTS_CLIENT_KEY)")

    @classmethod
    def from_env(cls, target: str | None = None, env: Mapping[str, str] | None = None) -> Connection:
        """From BOTS_* variables; `target`, when given, wins over BOTS_SERVER
        (and BOTS_ADDRESS, which the framework adapters read)."""
        env = os.environ if env is None else env
        return cls(
            target=target or env.get("BOTS_SERVER", "") or env.get("BOTS_ADDRESS", "") or DEFAULT_SERVER,
            tls=env.get("BOTS_TLS", "").lower() in _TRUE,
            ca=env.get("BOTS_TLS_CA", ""),
            cert=env.get("BOTS_CLIENT_CERT", ""),
            key=env.get("BOTS_CLIENT_KEY", ""),
            token=env.get("BOTS_TOKEN", ""),
        )

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca or self.cert)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.uses_tls:
            return None
        return tls_credentials(ca=self.ca or None, cert=self.cert or None, key=self.key or None)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer(self.token) if self.token else ()

    def client(self, **options: Any) -> Client:
        """A Client on this connection; `options`: Client's timeouts."""
        from bots_client.client import Client

        return Client(self.target, credentials=self.credentials(), metadata=self.metadata(), connection=self, **options)

    def async_client(self, **options: Any) -> AsyncClient:
        from bots_client.aio import AsyncClient

        return AsyncClient(self.target, credentials=self.credentials(), metadata=self.metadata(), connection=self, **options)
