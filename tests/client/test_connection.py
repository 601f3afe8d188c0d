"""Connection: TLS files and token from the BOTS_* variables, and an adapter
copied into another process (pickled, as for DataLoader workers and Ray
actors) that reconnects with the same credentials to a server that wants a
token."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import bots_client
from bots_client import Connection, ExperimentConfig
from bots_client.integrations._core import Curriculum
from bots_server.service.credentials import hash_token
from tests.support.servers import ServerProcess


def test_from_env_reads_the_ops_commands_variables() -> None:
    env = {"BOTS_SERVER": "bots.example:443", "BOTS_TOKEN": "t0k", "BOTS_TLS_CA": "/ca.pem"}
    connection = Connection.from_env(env=env)
    assert connection == Connection("bots.example:443", ca="/ca.pem", token="t0k")
    assert connection.uses_tls and connection.metadata() == (("authorization", "Bearer t0k"),)
    assert "t0k" not in repr(connection)
    assert Connection.from_env("other:1", env=env).target == "other:1"  # an explicit target wins
    assert not Connection.from_env(env={}).uses_tls and Connection.from_env(env={}).metadata() == ()
    assert Connection.from_env(env={"BOTS_TLS": "true"}).uses_tls
    # BOTS_ADDRESS, the adapters' variable, when BOTS_SERVER is not set.
    assert Connection.from_env(env={"BOTS_ADDRESS": "a:1"}).target == "a:1"
    assert Connection.from_env(env={"BOTS_ADDRESS": "a:1", "BOTS_SERVER": "s:2"}).target == "s:2"
    assert Connection.from_env(env={}).target == "127.0.0.1:50051"
    with pytest.raises(ValueError, match="both cert and key"):
        Connection.from_env(env={"BOTS_CLIENT_CERT": "/me.pem"})


def test_a_copied_adapter_reconnects_with_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = "trainer-token-0123456789abcdef0123"
    creds = tmp_path / "credentials.toml"
    creds.write_text(f'[[principals]]\nname = "trainer"\nrole = "writer"\ntoken_sha256 = "{hash_token(token)}"\n')
    server = ServerProcess(f"sqlite:///{tmp_path / 'c.db'}", extra_args=["--credentials-file", str(creds)]).start()
    monkeypatch.delenv("BOTS_TOKEN", raising=False)
    try:
        client = Connection(server.address, token=token).client(retry_timeout=0)
        curriculum = Curriculum(client, "copied", [f"k{i}" for i in range(8)], batch_size=4, config=ExperimentConfig(seed=3))
        curriculum.ensure_ready()
        copy = pickle.loads(pickle.dumps(curriculum))
        assert copy.client is not client
        assert copy.client.get_experiment("copied").num_tasks == 8

        # Made from a bare address, a copy takes the token from its own environment.
        bare = Curriculum(server.address, "copied", [f"k{i}" for i in range(8)], batch_size=4)
        with pytest.raises(bots_client.UnauthenticatedError):
            pickle.loads(pickle.dumps(bare)).client.get_experiment("copied")
        monkeypatch.setenv("BOTS_TOKEN", token)
        assert pickle.loads(pickle.dumps(bare)).client.get_experiment("copied").num_tasks == 8
    finally:
        server.stop()
