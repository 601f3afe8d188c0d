"""The tls-and-tenants component: TLS files and the credentials file come
from Secrets, the probes move to the plaintext health port (the kubelet's
gRPC probe speaks no TLS), and every setting name is the server's own."""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import yaml

from bots_server import settings
from bots_server.service.server import READINESS_SERVICE
from tests.ops.test_kubernetes import K8S, SETTING_ENVS, one, render, server_container


def test_tls_and_credentials_from_secrets(tmp_path: Path) -> None:
    rel = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {"resources": [str(rel / "overlays" / "production")], "components": [str(rel / "components" / "tls-and-tenants")]}
        )
    )
    docs = render(tmp_path)
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    container = server_container(docs)
    pod = one(docs, "Deployment", "bots-server")["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}  # BOTS_PROCESSES: from the CPU request
    assert set(env) <= SETTING_ENVS, set(env) - SETTING_ENVS

    # The probes reach the health-only plaintext port the server opens.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert settings.split_host_port(env["BOTS_HEALTH_LISTEN"], "")[1] == ports["health"]
    assert container["livenessProbe"]["grpc"] == {"port": ports["health"], "service": ""}
    assert container["readinessProbe"]["grpc"] == {"port": ports["health"], "service": READINESS_SERVICE}
    assert container["startupProbe"]["grpc"]["port"] == ports["health"]

    # Files from Secrets; the credentials as a directory mount (not subPath),
    # which is what lets an updated Secret reach the running pod.
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert volumes == {"tls": "bots-server-tls", "credentials": "bots-server-credentials"}
    for name, path in (("tls", env["BOTS_TLS_CERT"]), ("tls", env["BOTS_TLS_CLIENT_CA"]), ("credentials", env["BOTS_CREDENTIALS_FILE"])):
        assert path.startswith(mounts[name]["mountPath"] + "/") and "subPath" not in mounts[name]
    # kubernetes.io/tls Secrets name their files tls.crt and tls.key.
    assert Path(env["BOTS_TLS_CERT"]).name == "tls.crt" and Path(env["BOTS_TLS_KEY"]).name == "tls.key"
