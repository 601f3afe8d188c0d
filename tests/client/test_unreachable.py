"""A server that cannot be reached is told at once: one WARNING at the first
failed attempt ("not reachable at ADDRESS, retrying for up to N s"), not a
silent wait of the whole retry budget; told again only for a later outage."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import bots_client
from tests.support.servers import ServerProcess


@pytest.fixture
def closed_address() -> Iterator[str]:
    """A loopback address that refuses connections: bound, not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bots_client" and r.levelno == logging.WARNING]


def test_one_warning_while_the_server_is_not_reachable(closed_address: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bots_client")
    with bots_client.Client(closed_address, timeout=0.5, retry_timeout=1.5) as client:
        for _ in range(2):  # many attempts each, and a second call: still one line
            with pytest.raises(bots_client.UnavailableError):
                client.get_experiment("e")
    [warning] = warnings_of(caplog)
    assert warning.startswith(f"BOTS server not reachable at {closed_address}, retrying for up to 1.5 s ("), warning
    assert "Connection refused" in warning or "failed to connect" in warning


async def test_the_async_client_warns_once_too(closed_address: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bots_client")
    async with bots_client.AsyncClient(closed_address, timeout=0.5, retry_timeout=1) as client:
        for _ in range(2):
            with pytest.raises(bots_client.UnavailableError):
                await client.get_experiment("e")
    [warning] = warnings_of(caplog)
    assert warning.startswith(f"BOTS server not reachable at {closed_address}, retrying for up to 1 s ("), warning


def test_no_warning_without_retries(closed_address: str, caplog: pytest.LogCaptureFixture) -> None:
    # retry_timeout=0: the call fails at once and its error says why.
    with bots_client.Client(closed_address, retry_timeout=0) as client, pytest.raises(bots_client.UnavailableError):
        client.get_experiment("e")
    assert warnings_of(caplog) == []


def test_a_later_outage_is_told_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bots_client")
    db = f"sqlite:///{tmp_path / 'r.db'}"
    server = ServerProcess(db).start()
    address = server.address
    with bots_client.Client(address, timeout=2, retry_timeout=1) as client:
        try:
            client.create_experiment("e")
        finally:
            server.stop()
        with pytest.raises(bots_client.UnavailableError):
            client.get_experiment("e")  # stopped: told once
        server = ServerProcess(db).start(listen=address)  # back on the same port
        try:
            assert client.get_experiment("e").name == "e"  # answered: nothing told
            server.kill()
            with pytest.raises(bots_client.UnavailableError):
                client.get_experiment("e")  # a second outage: told again
        finally:
            server.kill()
    told = warnings_of(caplog)
    assert len(told) == 2, told
    assert all(t.startswith(f"BOTS server not reachable at {address}, retrying for up to 1 s (") for t in told), told
