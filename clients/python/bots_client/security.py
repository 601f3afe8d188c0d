"""Credentials for a server that speaks TLS (and mutual TLS) or wants a
bearer token:

    client = bots_client.Client(
        "bots.example:443",
        credentials=bots_client.tls_credentials(ca="ca.pem", cert="me.pem", key="me.key"),
        metadata=bots_client.bearer("s3cret"),
    )
"""

from __future__ import annotations

import grpc


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def tls_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS to the server. `ca`: PEM file of the CA that signed the server's
    certificate (default: the system's roots); `cert` and `key`: PEM files of
    this client's certificate and key, for a server that requires mutual TLS."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both cert and key")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert))


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata carrying a bearer token, for `metadata=`."""
    return (("authorization", f"Bearer {token}"),)
