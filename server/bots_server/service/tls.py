"""TLS for the gRPC port: the server's certificate and key, and with a
client CA, mutual TLS (a client must present a certificate that CA signed)."""

from __future__ import annotations

import grpc

from bots_server.settings import ServerSettings


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"bots-server: {what} = {path!r}: {e.strerror}") from None


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """None: plaintext."""
    if not settings.tls_cert:
        return None
    key = _read(settings.tls_key, "--tls-key")
    cert = _read(settings.tls_cert, "--tls-cert")
    client_ca = _read(settings.tls_client_ca, "--tls-client-ca") if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
