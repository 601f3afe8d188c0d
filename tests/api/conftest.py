"""The API contract suite runs every test over {the service in this process,
a real server over a socket} x {SQLite, PostgreSQL}, as Optuna runs one
storage suite in-process and through its gRPC proxy.

`client` is a bots_client.Client to the endpoint; `stub` a raw generated stub
(no client-side validation), for hostile requests; `endpoint` makes more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

import bots_client
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_server.testing.inprocess import InProcessService
from tests.support.servers import ServerProcess, create_pg_database, drop_pg_database, require_postgres

MODES = ("inprocess", "socket")


@dataclass(frozen=True)
class Endpoint:
    """How to reach the service under test."""

    mode: str
    connect: Callable[..., bots_client.Client]
    connect_async: Callable[..., bots_client.AsyncClient]
    channel: Callable[[], Any]  # for raw stubs


@pytest.fixture(scope="session")
def inprocess_db_url(request: pytest.FixtureRequest, db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A database of its own for the in-process service (a SQLite file is
    owned by one server, and the socket server holds db_url's)."""
    if db_url.startswith("sqlite"):
        yield f"sqlite:///{tmp_path_factory.mktemp('inprocess') / 'bots.db'}"
        return
    require_postgres()
    url = create_pg_database("bots_test_inprocess")
    yield url
    drop_pg_database(url)


@pytest.fixture(scope="session")
def inprocess_service(inprocess_db_url: str) -> Iterator[InProcessService]:
    with InProcessService(inprocess_db_url) as service:
        yield service


@pytest.fixture(params=MODES, scope="session")
def endpoint(request: pytest.FixtureRequest, db_url: str) -> Endpoint:
    if request.param == "socket":
        server: ServerProcess = request.getfixturevalue("server")
        return Endpoint(
            "socket",
            lambda **kw: bots_client.Client(server.address, **kw),
            lambda **kw: bots_client.AsyncClient(server.address, **kw),
            lambda: grpc.insecure_channel(server.address),
        )
    service: InProcessService = request.getfixturevalue("inprocess_service")
    return Endpoint(
        "inprocess",
        lambda **kw: bots_client.Client("", channel=service.channel(), **kw),
        lambda **kw: bots_client.AsyncClient("", channel=service.aio_channel(), **kw),
        service.channel,
    )


@pytest.fixture
def client(endpoint: Endpoint) -> Iterator[bots_client.Client]:
    with endpoint.connect(retry_timeout=5) as c:
        yield c


@pytest.fixture
def stub(endpoint: Endpoint) -> Iterator[pb_grpc.TaskSelectorStub]:
    channel = endpoint.channel()
    yield pb_grpc.TaskSelectorStub(channel)
    channel.close()


