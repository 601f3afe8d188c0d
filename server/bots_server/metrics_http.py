"""The /metrics HTTP endpoint, optionally behind a bearer token or a TLS
client certificate.

With tokens (--metrics-token-file, BOTS_METRICS_TOKEN) every request must
send `Authorization: Bearer <token>`; any other gets 401 with a fixed body
and nothing else. With a certificate and key (--metrics-tls-cert,
--metrics-tls-key) the endpoint speaks HTTPS only, and with a client CA
(--metrics-tls-client-ca) the TLS handshake fails for a client without a
certificate that CA signed. Paths other than /metrics (and /) get 404 with
a fixed body, after the token check: nothing that answers depends on what
the server holds unless the caller is let in.

Served on daemon threads (a thread per scrape), so /metrics answers even
while the event loop is stuck.
"""

from __future__ import annotations

import dataclasses
import hmac
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

PATHS = ("/metrics", "/")
UNAUTHORIZED = b"401 unauthorized: send Authorization: Bearer <token>\n"
NOT_FOUND = b"404 not found: the metrics are at /metrics\n"

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may scrape. Empty: anyone who reaches the port."""

    tokens: frozenset[str] = frozenset()
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""

    @property
    def restricted(self) -> bool:
        return bool(self.tokens or self.tls_client_ca)


def _plain(start_response: StartResponse, status: str, body: bytes, *headers: tuple[str, str]) -> list[bytes]:
    headers = (("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))), *headers)
    start_response(status, list(headers))
    return [body]


def _allowed(header: str, tokens: frozenset[str]) -> bool:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = token.strip().encode()
    # Every token compared, in constant time each: the answer's timing does
    # not say which (or whether a prefix of one) matched.
    return sum(hmac.compare_digest(given, t.encode()) for t in tokens) > 0


def guarded_app(registry: Collector, tokens: frozenset[str]) -> WsgiApp:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if tokens and not _allowed(str(environ.get("HTTP_AUTHORIZATION", "")), tokens):
            challenge = ("WWW-Authenticate", 'Bearer realm="metrics"')
            return _plain(start_response, "401 Unauthorized", UNAUTHORIZED, challenge)
        if environ.get("PATH_INFO", "/") not in PATHS:
            return _plain(start_response, "404 Not Found", NOT_FOUND)
        return metrics(environ, start_response)

    return app


def tls_context(access: Access) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=access.tls_cert, keyfile=access.tls_key)
    if access.tls_client_ca:
        context.load_verify_locations(cafile=access.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _Quiet(WSGIRequestHandler):
    timeout = 10.0  # a client that stalls (in the handshake or the request) holds only its own thread

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (one line per scrape per replica)."""


def serve(registry: Collector, host: str, port: int, access: Access) -> WSGIServer:
    """Serve `registry` on host:port on a daemon thread; stop it with
    shutdown() and server_close()."""

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, guarded_app(registry, access.tokens), Server, handler_class=_Quiet)
    if access.tls_cert:
        try:
            # The handshake happens on the request's thread (its first read),
            # not in accept: a client that never completes it stalls nobody.
            httpd.socket = tls_context(access).wrap_socket(
                httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        except BaseException:
            httpd.server_close()
            raise
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
