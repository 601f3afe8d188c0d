"""The alerting rules and the Grafana dashboard: promtool's checks and unit
tests, generated files up to date, every metric they use exported by the
server, every alert with a runbook section."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bots_server.service.supervisor import SUPERVISOR_SERIES
from tests.ops.support import DEPLOY, MetricsServer, parse, require_tool
from tests.support.servers import REPO

ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "bots-selection.json"
OPERATIONS = REPO / "docs" / "operations.md"
# Metrics Prometheus itself adds to every scrape.
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def alert_rules() -> list[dict]:
    return [rule for rule in rules() if "alert" in rule]


def recorded() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def runbook_base() -> str:
    """The one runbook base URL: the component's setting."""
    settings = (DEPLOY / "k8s" / "components" / "servicemonitor" / "settings.env").read_text()
    (base,) = re.findall(r"^runbookBaseURL=(\S+)$", settings, flags=re.MULTILINE)
    return base


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers followed by a
    selector or standing alone, minus functions, keywords and label names."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_labels = re.sub(r"\{[^}]*\}", "{}", without_strings)
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", without_labels)
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_groupings)
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", without_ranges))
    return {n for n in names if "_" in n or n in SYNTHETIC} - {"__rate_interval"}


@pytest.fixture(scope="module")
def exported(metrics_server: MetricsServer) -> set[str]:
    """Every sample name the server can export (families are listed even
    before their first sample)."""
    text = metrics_server.scrape()
    names = set(parse(text))
    names |= set(re.findall(r"^# TYPE (\S+)", text, flags=re.MULTILINE))
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)", text, flags=re.MULTILINE):
        if kind == "histogram":
            names |= {f"{family}_bucket", f"{family}_count", f"{family}_sum"}
        if kind == "counter":
            names.add(f"{family}_total")
    return names


def test_promtool_checks_the_rules() -> None:
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    promtool = require_tool("promtool")
    tests = DEPLOY / "prometheus" / "alerts_test.yaml"
    result = subprocess.run(
        [promtool, "test", "rules", tests.name], capture_output=True, text=True, timeout=120, cwd=tests.parent
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Every alert is exercised by at least one unit test, and so are both
    # SLIs the burn-rate alerts read.
    tested = set(re.findall(r"alertname: (\w+)", tests.read_text()))
    assert {r["alert"] for r in alert_rules()} <= tested
    expr_tested = set(re.findall(r"- expr: (\S+)", tests.read_text()))
    assert {"job:bots_rpc_server_errors:ratio_rate5m", "job:bots_rpc_slow_calls:ratio_rate5m"} <= expr_tested
    # Both severities of each burn-rate alert fire in some test.
    for alert in ("BotsAvailabilityBudgetBurn", "BotsLatencyBudgetBurn"):
        assert {r["labels"]["severity"] for r in alert_rules() if r["alert"] == alert} == {"critical", "warning"}
    assert re.search(r"severity: warning, slo: availability", tests.read_text())
    assert re.search(r"severity: critical, slo: latency", tests.read_text())


def test_burn_rate_alerts_read_every_window_of_their_sli() -> None:
    # The workbook's pairs: 1 h with 5 min and 6 h with 30 min page, 1 d with
    # 2 h and 3 d with 6 h open a ticket; each window is a recording rule.
    for sli in ("bots_rpc_server_errors", "bots_rpc_slow_calls"):
        windows = {name.rpartition("ratio_rate")[2] for name in recorded() if f":{sli}:" in name}
        assert windows == {"5m", "30m", "1h", "2h", "6h", "1d", "3d"}, sli
    for rule in alert_rules():
        if rule["alert"].endswith("BudgetBurn"):
            used = set(re.findall(r"job:\w+:ratio_rate\w+", rule["expr"]))
            assert used and used <= recorded(), rule["alert"]
            assert len({u.rpartition("ratio_rate")[2] for u in used}) == 4, rule["alert"]


def test_every_alert_has_severity_summary_and_a_runbook_link() -> None:
    # Absolute links (Alertmanager and its receivers cannot resolve a
    # repository path), all under the one base URL the component sets, each
    # to the alert's own section of docs/operations.md.
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), flags=re.MULTILINE)}
    assert runbook_base().startswith("https://") and runbook_base().endswith("/docs/operations.md")
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        base, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert base == runbook_base() and anchor == rule["alert"].lower() and anchor in anchors, (rule["alert"], anchor)


def test_rules_for_a_plain_prometheus_take_another_runbook_base(tmp_path: Path) -> None:
    script = DEPLOY / "prometheus" / "build_prometheusrule.py"
    result = subprocess.run(
        [sys.executable, str(script), "--rules", "--runbook-base", "https://wiki.example.org/bots/ops"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    out = tmp_path / "bots-rules.yaml"
    out.write_text(result.stdout)
    groups = yaml.safe_load(result.stdout)["groups"]
    links = [r["annotations"]["runbook_url"] for g in groups for r in g["rules"] if "alert" in r]
    assert links == [f"https://wiki.example.org/bots/ops#{r['alert'].lower()}" for r in alert_rules()]
    promtool = require_tool("promtool")
    checked = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_rules_and_dashboard_use_only_exported_metrics(exported: set[str]) -> None:
    used: dict[str, set[str]] = {}
    for rule in rules():
        # Alerts may read what the recording rules record.
        used[f"rule {rule.get('alert') or rule['record']}"] = metric_names(rule["expr"]) - recorded()
        if rule.get("alert", "").endswith("BudgetBurn"):
            used.pop(f"rule {rule['alert']}")
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            names = metric_names(target["expr"])
            # Recorded series must be recorded by the rules, the rest exported.
            if names & recorded() or any(":" in n for n in names):
                assert names <= recorded(), (panel["title"], names - recorded())
                continue
            used[f"panel {panel['title']}"] = used.get(f"panel {panel['title']}", set()) | names
    for where, names in used.items():
        assert names, f"{where}: no metric found (bad expression?)"
        missing = names - exported - SYNTHETIC - set(SUPERVISOR_SERIES)  # tests/faults/test_processes.py
        assert not missing, f"{where} uses metrics the server does not export: {missing}"


def test_dashboard_is_generated_parameterised_and_complete() -> None:
    for script in (DEPLOY / "grafana" / "build_dashboard.py", DEPLOY / "prometheus" / "build_prometheusrule.py"):
        result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr

    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "bots-selection"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance", "experiment"} <= set(variables)
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        # Every query goes to the chosen data source, not to a hard-coded uid.
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    # No two panels overlap on the 24-column grid.
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    # Traffic, errors, latency and every learning signal the issue asks for.
    used = {n for p in panels for t in p["targets"] for n in metric_names(t["expr"])}
    assert {
        "grpc_server_handled_total", "grpc_server_handling_seconds_bucket", "bots_steps_total",
        "bots_tasks_selected_total", "bots_rollouts_total", "bots_rollout_successes_total",
        "bots_tasks_informative_total", "bots_posterior_target_share", "bots_posterior_mean_quantile", "bots_capability", "bots_leased_tasks",
        "bots_checkpoint_age_seconds", "bots_checkpoint_last_duration_seconds", "bots_database_errors_total",
        "bots_event_loop_lag_seconds_bucket",
    } <= used  # fmt: skip


def test_dashboard_script_has_help_and_writes_where_told(tmp_path: Path) -> None:
    script = DEPLOY / "grafana" / "build_dashboard.py"

    def build(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)

    committed = DASHBOARD.stat().st_mtime_ns
    shown = build("--help")
    assert shown.returncode == 0 and "--check" in shown.stdout and "--output" in shown.stdout
    assert build("--no-such-flag").returncode == 2
    assert DASHBOARD.stat().st_mtime_ns == committed  # neither rewrote the committed JSON
    copy = tmp_path / "board.json"
    assert build("--output", str(copy)).returncode == 0
    assert copy.read_text() == DASHBOARD.read_text()
    assert build("--output", "-").stdout == DASHBOARD.read_text()
    assert build("--check", "--output", str(copy)).returncode == 0
    copy.write_text("{}\n")
    stale = build("--check", "--output", str(copy))
    assert stale.returncode == 1
    assert stale.stderr == f"{copy} is stale: run python build_dashboard.py\n"


def test_prometheusrule_carries_the_same_rules() -> None:
    rule = yaml.safe_load((DEPLOY / "k8s" / "components" / "servicemonitor" / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_metric_name_extraction() -> None:
    # The helper the checks above rely on.
    expr = 'histogram_quantile(0.99, sum by (job, le) (rate(a_b_bucket{job="x", grpc_code=~"A|B"}[5m]))) / ignoring(x) c_d > 0.5'
    assert metric_names(expr) == {"a_b_bucket", "c_d"}
