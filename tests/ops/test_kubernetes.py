"""The Kubernetes manifests: every overlay renders with `kubectl kustomize`,
validates offline against the Kubernetes schemas, and agrees with the code
(probe service name, ports, setting names, grace period); the Prometheus
Operator resources (CRDs) are checked separately."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from sqlalchemy import make_url

from bots_server import settings
from bots_server.service.server import READINESS_SERVICE
from tests.ops.support import DEPLOY, require_tool
from tests.support.servers import REPO

K8S = DEPLOY / "k8s"
# The oldest Kubernetes with GA gRPC probes, and the newest the schemas know.
VERSIONS = ("1.27", kubernetes_validate.latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
SETTING_ENVS = {s.env for s in (*settings.SETTINGS, *settings.ENV_ONLY)}

Docs = list[dict[str, Any]]


def render(path: Path) -> Docs:
    kubectl = require_tool("kubectl")
    result = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def with_component(tmp_path: Path, overlay: str, component: Path = K8S / "components" / "servicemonitor") -> Path:
    """A kustomization adding the ServiceMonitor component to an overlay, as
    a user would."""
    rel = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [str(rel / overlay)], "components": [os.path.relpath(component, tmp_path)]})
    )
    return tmp_path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Docs]:
    return {
        "base": render(K8S / "base"),
        "dev": render(K8S / "overlays" / "dev"),
        "production": render(K8S / "overlays" / "production"),
        "production+servicemonitor": render(with_component(tmp_path_factory.mktemp("kust"), "overlays/production")),
    }


def one(docs: Docs, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def server_container(docs: Docs) -> dict[str, Any]:
    pod = one(docs, "Deployment", "bots-server")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "server")


def config(docs: Docs) -> dict[str, str]:
    """The ConfigMap the server container reads (its name has a hash suffix)."""
    refs = [e["configMapRef"]["name"] for e in server_container(docs)["envFrom"] if "configMapRef" in e]
    assert len(refs) == 1
    return one(docs, "ConfigMap", refs[0])["data"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("variant", ["base", "dev", "production", "production+servicemonitor"])
def test_renders_and_validates_against_the_kubernetes_schemas(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']} invalid for {version}: {e.message}")


@pytest.mark.parametrize("variant", ["base", "dev", "production"])
def test_pods_match_what_the_server_expects(rendered: dict[str, Docs], variant: str) -> None:
    docs = rendered[variant]
    container = server_container(docs)
    pod = one(docs, "Deployment", "bots-server")["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = config(docs)

    # Setting names are the server's own (a typo would be silently ignored).
    assert set(env) <= SETTING_ENVS, set(env) - SETTING_ENVS
    assert settings.split_host_port(env["BOTS_LISTEN"], "") == ("0.0.0.0", ports["grpc"])
    assert settings.split_host_port(env["BOTS_METRICS_LISTEN"], "") == ("0.0.0.0", ports["metrics"])
    # Annotation-based discovery scrapes the same port; and it is the
    # server's default port, so docs, image and manifests tell one story.
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    assert ports["metrics"] == settings.split_host_port(settings.ServerSettings().metrics_listen, "")[1]

    # Native gRPC probes on the health service: liveness on "", readiness on
    # the service name the server reports (it follows the database).
    assert container["livenessProbe"]["grpc"] == {"port": ports["grpc"], "service": ""}
    assert container["startupProbe"]["grpc"]["port"] == ports["grpc"]
    assert container["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": READINESS_SERVICE}

    # SIGTERM must leave time to drain and checkpoint: preStop, then the
    # server's grace period, then the checkpoints, within the pod's grace.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + float(env["BOTS_GRACE_SECONDS"]) + 30

    # Migrations are a separate command, run before the server starts.
    assert env["BOTS_MIGRATE"] == "false"
    (init,) = pod["spec"]["initContainers"]
    assert init["args"][0] == "migrate" and init["image"] == container["image"]
    assert init["envFrom"] == container["envFrom"]

    # As many server processes as cores the pod requests: the server's own
    # default (every CPU it may use) is every CPU of the node without a CPU limit.
    (processes,) = [e for e in container["env"] if e["name"] == "BOTS_PROCESSES"]
    assert processes["valueFrom"]["resourceFieldRef"] == {
        "containerName": container["name"], "resource": "requests.cpu", "divisor": "1"
    }  # fmt: skip

    # Locked down and sized.
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    for c in (container, init):
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]

    # The Service, PDB (and ServiceMonitor) find the pods, by port name.
    service = one(docs, "Service", "bots-server")
    assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"grpc": "grpc", "metrics": "metrics"}
    pdb = one(docs, "PodDisruptionBudget", "bots-server")
    assert matches(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert "maxUnavailable" in pdb["spec"]  # minAvailable would block every drain with one replica


def test_dev_overlay_runs_its_own_postgresql(rendered: dict[str, Docs]) -> None:
    docs = rendered["dev"]
    statefulset = one(docs, "StatefulSet", "bots-postgres")
    pg_service = one(docs, "Service", "bots-postgres")
    assert matches(pg_service["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"])
    pg_env = one(docs, "Secret", "bots-postgres")["stringData"]
    secret = one(docs, "Secret", "bots-server")["stringData"]
    url = make_url(secret["BOTS_DB"])
    assert url.drivername == "postgresql+psycopg"
    assert (url.host, url.username, url.password, url.database) == (
        "bots-postgres", pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"],
    )  # fmt: skip
    assert secret["BOTS_AUTH_TOKENS"]
    # The server's pods must not be selected by the database's selectors, nor the reverse.
    server_pod = one(docs, "Deployment", "bots-server")["spec"]["template"]["metadata"]["labels"]
    assert not matches(pg_service["spec"]["selector"], server_pod)
    assert not matches(
        one(docs, "Service", "bots-server")["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"]
    )


def test_dev_overlay_runs_the_image_make_dev_image_builds_and_loads(rendered: dict[str, Docs]) -> None:
    # Nothing pushes a dev image: `make dev-image` builds it and loads it into
    # the cluster's nodes, and the overlay must name that image and never pull.
    (dev_image,) = re.findall(r"^DEV_IMAGE := (\S+)$", (REPO / "Makefile").read_text(), flags=re.MULTILINE)
    pod = one(rendered["dev"], "Deployment", "bots-server")["spec"]["template"]["spec"]
    for container in (*pod["initContainers"], *pod["containers"]):
        assert container["image"] == dev_image, container["name"]
        assert container["imagePullPolicy"] == "Never", container["name"]
    for cluster, load in (("kind", f"kind load docker-image {dev_image}"), ("minikube", f"minikube image load {dev_image}")):
        # Not the variables of a `make test` around this run: a sub-make
        # would announce its directory.
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        recipe = subprocess.run(
            ["make", "--no-print-directory", "--dry-run", "dev-image", f"DEV_CLUSTER={cluster}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True,
        ).stdout.splitlines()  # fmt: skip
        assert recipe[0] == f"docker build --tag {dev_image} ."
        assert recipe[1].startswith(load)


def test_production_overlay_replicates_and_keeps_secrets_out_of_git(rendered: dict[str, Docs]) -> None:
    docs = rendered["production"]
    deployment = one(docs, "Deployment", "bots-server")
    assert deployment["spec"]["replicas"] >= 3
    assert deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    # The Secret is created out of band: applying the overlay must not overwrite it.
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert any(e.get("secretRef", {}).get("name") == "bots-server" for e in server_container(docs)["envFrom"])
    # The database is external, reached through a stable in-cluster name.
    assert one(docs, "Service", "bots-postgres")["spec"]["type"] == "ExternalName"
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert "/" in server_container(docs)["image"].split(":")[0]  # pulled from a registry


def test_servicemonitor_and_prometheusrule(rendered: dict[str, Docs], tmp_path: Path) -> None:
    # Not validated against the Kubernetes schemas (they are CRDs): checked
    # against the resources they point at, and the rules with promtool.
    docs = rendered["production+servicemonitor"]
    monitor = one(docs, "ServiceMonitor", "bots-server")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = one(docs, "Service", "bots-server")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"] and "metrics" in port_names
    # The job label the alerts select on: the value of jobLabel on the Service.
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "bots-server"

    rule = one(docs, "PrometheusRule", "bots-server")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    # kube-prometheus-stack's Prometheus selects both by `release: <name>`.
    assert monitor["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # Runbook links are absolute; the settings ConfigMap that set them is not applied.
    assert all(link.startswith("https://") for link in runbook_links(rule))
    assert not [d for d in docs if d["metadata"]["name"] == "bots-monitoring-settings"]
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def runbook_links(rule: dict[str, Any]) -> list[str]:
    return [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]


def test_the_components_settings_set_the_selector_label_and_every_runbook_link(tmp_path: Path) -> None:
    # An operator's copy of the component with its two settings changed.
    component = tmp_path / "servicemonitor"
    shutil.copytree(K8S / "components" / "servicemonitor", component)
    settings_env = component / "settings.env"
    text = settings_env.read_text()
    text = re.sub(r"^release=.*$", "release=monitoring", text, flags=re.MULTILINE)
    text = re.sub(r"^runbookBaseURL=.*$", "runbookBaseURL=https://wiki.example.org/bots/runbook", text, flags=re.MULTILINE)
    settings_env.write_text(text)
    # The kustomization sits beside deploy/k8s so that relative paths resolve.
    overlay = tmp_path / "k8s" / "mine"
    overlay.mkdir(parents=True)
    docs = render(with_component(overlay, "overlays/production", component))

    monitor = one(docs, "ServiceMonitor", "bots-server")
    rule = one(docs, "PrometheusRule", "bots-server")
    assert monitor["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"] == "monitoring"
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert runbook_links(rule) == [f"https://wiki.example.org/bots/runbook#{a.lower()}" for a in alerts]
    # The other labels stay.
    assert monitor["metadata"]["labels"]["app.kubernetes.io/name"] == "bots-server"


def test_a_broken_manifest_is_caught(rendered: dict[str, Docs]) -> None:
    # The validation above is not vacuous.
    def deployment() -> dict[str, Any]:
        return yaml.safe_load(yaml.safe_dump(one(rendered["base"], "Deployment", "bots-server")))

    kubernetes_validate.validate(deployment(), VERSIONS[0], strict=True)
    named_port = deployment()  # gRPC probes take a port number only
    named_port["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    misspelt = deployment()  # strict validation rejects unknown fields
    misspelt["spec"]["replica"] = 3
    for broken in (named_port, misspelt):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[0], strict=True)
