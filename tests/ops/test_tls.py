"""TLS and mutual TLS end to end, with certificates the test makes (openssl):
a plaintext client cannot talk to a TLS server, a client that trusts the CA
can; with a client CA, only clients with a certificate it signed get in; the
probes' plaintext health port serves health and nothing else; the ops CLI
speaks TLS too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import bots_client
from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_server.service.credentials import hash_token
from tests.support.servers import ServerProcess


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, both signed by it;
    and a second CA that signed nothing the server trusts."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("openssl is needed to make the test's certificates")
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "2", "-subj", f"/CN={ca}", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ca, ext in (("server", "ca", ["-extfile", "server.ext"]), ("client", "ca", []), ("stranger", "other-ca", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)  # fmt: skip
    return d


def tls_server(pki: Path, tmp_path: Path, mutual: bool, credentials: str = "") -> ServerProcess:
    args = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"), "--health-listen", "127.0.0.1:0"]
    if mutual:
        args += ["--tls-client-ca", str(pki / "ca.pem")]
    if credentials:
        (tmp_path / "credentials.toml").write_text(credentials)
        args += ["--credentials-file", str(tmp_path / "credentials.toml")]
    return ServerProcess(f"sqlite:///{tmp_path / 'tls.db'}", extra_args=args).start()


def health_port(server: ServerProcess) -> int:
    return int(next(e for e in server.log_lines if e.get("message") == "serving")["health_port"])  # type: ignore[arg-type]


def test_tls_only_for_clients_that_trust_the_ca(pki: Path, tmp_path: Path) -> None:
    server = tls_server(pki, tmp_path, mutual=False)
    try:
        with bots_client.Client(server.address, retry_timeout=0, timeout=5) as plain:
            with pytest.raises(bots_client.UnavailableError):
                plain.create_experiment("nope")
        credentials = bots_client.tls_credentials(ca=str(pki / "ca.pem"))
        with bots_client.Client(server.address, credentials=credentials) as client:
            client.create_experiment("over-tls")
            assert client.get_experiment("over-tls").name == "over-tls"
        stranger = bots_client.tls_credentials(ca=str(pki / "other-ca.pem"))
        with bots_client.Client(server.address, credentials=stranger, retry_timeout=0, timeout=5) as client:
            with pytest.raises(bots_client.UnavailableError):
                client.get_experiment("over-tls")
        # The ops CLI, with the CA from the environment.
        listed = subprocess.run(
            [sys.executable, "-m", "bots_server.cli", "experiments", "list", "--server", server.address],
            capture_output=True, text=True, timeout=60, env={**os.environ, "BOTS_TLS_CA": str(pki / "ca.pem")},
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert "over-tls" in listed.stdout
    finally:
        server.stop()


def test_mutual_tls_admits_only_certificates_the_client_ca_signed(pki: Path, tmp_path: Path) -> None:
    server = tls_server(pki, tmp_path, mutual=True)
    ca = str(pki / "ca.pem")
    try:
        for cert in (None, "stranger"):
            creds = bots_client.tls_credentials(
                ca=ca, cert=str(pki / f"{cert}.pem") if cert else None, key=str(pki / f"{cert}.key") if cert else None
            )
            with bots_client.Client(server.address, credentials=creds, retry_timeout=0, timeout=5) as client:
                with pytest.raises(bots_client.UnavailableError):
                    client.create_experiment("nope")
        creds = bots_client.tls_credentials(ca=ca, cert=str(pki / "client.pem"), key=str(pki / "client.key"))
        with bots_client.Client(server.address, credentials=creds) as client:
            client.create_experiment("mutual")
            assert client.get_experiment("mutual").name == "mutual"
    finally:
        server.stop()


def test_the_plaintext_health_port_serves_only_health(pki: Path, tmp_path: Path) -> None:
    server = tls_server(pki, tmp_path, mutual=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{health_port(server)}") as channel:
            for service in ("", "bots.v1.TaskSelector"):
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.TaskSelectorStub(channel).ListExperiments(pb.ListExperimentsRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()


def test_the_client_certificate_is_the_principal(pki: Path, tmp_path: Path) -> None:
    """With a credentials file, a client certificate's common name (or a SAN)
    names a principal; a bearer token, when sent, decides instead."""
    token = "ops-admin-token-0123456789abcdef"
    server = tls_server(pki, tmp_path, mutual=True, credentials=(
        '[[principals]]\nname = "trainer"\ntenant = "team-c"\nrole = "writer"\ncertificate = "client"\n\n'
        f'[[principals]]\nname = "ops"\ntenant = "ops"\nrole = "admin"\ntoken_sha256 = "{hash_token(token)}"\n'
    ))  # fmt: skip
    creds = bots_client.tls_credentials(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    try:
        with bots_client.Client(server.address, credentials=creds) as trainer:
            trainer.create_experiment("by-certificate")
            assert [e.name for e in trainer.list_experiments()] == ["by-certificate"]
        with bots_client.Client(server.address, credentials=creds, metadata=bots_client.bearer(token)) as ops:
            # The admin of tenant "ops" sees the trainer's experiment in its tenant.
            assert [e.name for e in ops.list_experiments()] == ["team-c/by-certificate"]
        bad = bots_client.bearer("wrong-token")
        with bots_client.Client(server.address, credentials=creds, metadata=bad, retry_timeout=0) as wrong:
            with pytest.raises(bots_client.UnauthenticatedError):
                wrong.list_experiments()
    finally:
        server.stop()
