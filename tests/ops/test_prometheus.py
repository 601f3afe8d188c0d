"""End to end: a real Prometheus scrapes a running server on loopback,
evaluates the alerting rules, and answers the dashboard's queries."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import bots_client
from bots_client import ExperimentConfig, Task
from tests.ops.support import DEPLOY, MetricsServer, eventually, require_tool

ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "bots-selection.json"


def free_port() -> int:
    # Prometheus cannot report a port it picked itself; a just-freed one is
    # good enough on loopback.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, binary: str, workdir: Path, target: str, token_file: Path | None = None) -> None:
        """`token_file`: scrape with the bearer token it holds (the server's --metrics-token-file)."""
        self.port = free_port()
        job: dict[str, Any] = {"job_name": "bots-server", "static_configs": [{"targets": [target]}]}
        if token_file is not None:
            job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [job],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:  # 400 for a bad query: return its error body
            return json.loads(e.read())

    def query(self, expr: str) -> dict[str, Any]:
        return self.api("query", query=expr)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MetricsServer, Prometheus, str]]:
    binary = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    # The endpoint takes only scrapers with its token, as a shared server's would.
    token_file = tmp / "metrics-token"
    token_file.write_text("prometheus-scrape-token-0123456789\n")
    server = MetricsServer(f"sqlite:///{tmp / 'bots.db'}", extra_args=["--metrics-token-file", str(token_file)]).start()
    prometheus = Prometheus(binary, tmp, f"127.0.0.1:{server.metrics_port}", token_file)
    name = "scraped"
    try:
        with bots_client.Client(server.address) as client:
            client.create_experiment(name, ExperimentConfig(seed=1, weak_feature="w", strong_feature="s"))
            # Two groups and a retired task, so the living-pool panels have data too.
            client.add_tasks(name, [Task(f"t{i}", {"w": 0.2, "s": 0.8}, "ab"[i % 2]) for i in range(40)])
            client.retire_tasks(name, ["t39"])
            client.set_group_shares(name, {"a": 0.5, "b": 0.5})
            for step in range(5):
                batch = client.select_batch(name, 8, request_key=f"s{step}")
                client.report_outcomes(name, batch.batch_id, {k: (i % 5, 4) for i, k in enumerate(batch.keys)})
        eventually(prometheus.ready, bool, timeout=60, what="prometheus ready")
        yield server, prometheus, name
    finally:
        prometheus.stop()
        server.stop()


def scalar(result: dict[str, Any]) -> list[tuple[dict[str, str], float]]:
    assert result["status"] == "success", result
    return [(r["metric"], float(r["value"][1])) for r in result["data"]["result"]]


def test_prometheus_scrapes_the_service_and_queries_back(scraped: tuple[MetricsServer, Prometheus, str]) -> None:
    server, prometheus, name = scraped
    with pytest.raises(urllib.error.HTTPError) as refused:  # Prometheus sends the token; a plain scrape has none
        server.scrape()
    assert refused.value.code == 401
    up = eventually(lambda: scalar(prometheus.query('up{job="bots-server"}')), bool, timeout=60, what="a scrape")
    assert up[0][1] == 1.0
    selects = scalar(prometheus.query('grpc_server_handled_total{grpc_method="SelectBatch",grpc_code="OK"}'))
    assert [v for _, v in selects] == [5.0]
    assert selects[0][0]["grpc_type"] == "unary" and selects[0][0]["grpc_service"] == "bots.v1.TaskSelector"
    informative = eventually(
        lambda: scalar(prometheus.query(f'bots_tasks_reported_total{{experiment="{name}"}}')),
        lambda r: bool(r) and r[0][1] == 40,
        what="5 reports of 8 tasks",
    )
    assert informative[0][0]["job"] == "bots-server"


def test_alerting_rules_load_and_evaluate_cleanly(scraped: tuple[MetricsServer, Prometheus, str]) -> None:
    _, prometheus, _ = scraped

    def rules() -> list[dict[str, Any]]:
        groups = prometheus.api("rules")["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    expected = {r.get("alert") or r["record"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    evaluated = eventually(
        rules,
        lambda rs: (
            {r["name"] for r in rs} == expected and all(r.get("lastEvaluation", "0001").startswith("20") for r in rs)
        ),
        timeout=60,
        what="every rule evaluated once",
    )
    assert all(r["health"] == "ok" for r in evaluated), [(r["name"], r.get("lastError")) for r in evaluated]
    # A healthy, busy server trips none of them: a rule still pending once
    # the target is scraped would be a false page. (BotsServerAbsent may be
    # pending for the evaluations before the first scrape.)
    eventually(
        rules,
        lambda rs: [r["name"] for r in rs if r.get("state", "inactive") != "inactive"] == [],  # recording rules have no state
        timeout=30,
        what="no alert pending or firing",
    )


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def test_every_dashboard_query_runs_and_most_have_data(scraped: tuple[MetricsServer, Prometheus, str]) -> None:
    _, prometheus, _ = scraped
    # Let a few scrapes land, so that rate() over the window has two points
    # (earlier tests on this Prometheus have usually waited long enough).
    eventually(
        lambda: scalar(prometheus.query('count_over_time(up{job="bots-server"}[1m])')),
        lambda r: bool(r) and r[0][1] >= 3,
        what="three scrapes",
    )
    empty = []
    for title, expr in dashboard_queries():
        concrete = (
            expr.replace("$__rate_interval", "1m")
            .replace('=~"$job"', '=~".*"')
            .replace('=~"$instance"', '=~".*"')
            .replace('=~"$experiment"', '=~".*"')
        )
        assert "$" not in concrete, (title, concrete)
        result = prometheus.query(concrete)
        assert result["status"] == "success", (title, concrete, result.get("error"))
        if not result["data"]["result"]:
            empty.append(title)
    # Only panels of things that did not happen (errors, checkpoints by time)
    # may be empty after a healthy run.
    allowed_empty = {"Non-OK calls by code", "Checkpoint duration", "Experiment load time (p99)", "Server error ratio"}
    assert set(empty) <= allowed_empty, set(empty) - allowed_empty
    assert re.search(r"\$datasource|\$\{datasource\}", DASHBOARD.read_text())


def test_no_dashboard_panel_draws_series_that_are_always_zero(scraped: tuple[MetricsServer, Prometheus, str]) -> None:
    # The server exports every method x code pair of grpc_server_handled_total
    # from start-up; the Non-OK panel shows only those that occurred.
    server, prometheus, _ = scraped
    with bots_client.Client(server.address) as client:  # one client mistake: NotFound
        with pytest.raises(bots_client.NotFoundError):
            client.get_experiment("no-such-experiment")
    (expr,) = [e for title, e in dashboard_queries() if title == "Non-OK calls by code"]
    concrete = expr.replace("$__rate_interval", "1m").replace('=~"$job"', '=~".*"').replace('=~"$instance"', '=~".*"')
    exported = scalar(prometheus.query('count(grpc_server_handled_total{grpc_code!="OK"})'))
    assert exported and exported[0][1] > 100  # the zero series are there to draw
    drawn = eventually(
        lambda: scalar(prometheus.query(concrete)), lambda r: bool(r), what="the NotFound counted by a scrape"
    )
    assert [(m["grpc_method"], m["grpc_code"]) for m, _ in drawn] == [("GetExperiment", "NotFound")]
    assert all(v > 0 for _, v in drawn)
