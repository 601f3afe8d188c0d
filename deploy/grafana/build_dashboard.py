"""Builds bots-selection.json, the Grafana dashboard of the BOTS selection service.

    python deploy/grafana/build_dashboard.py                 # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check         # exit 1 if it is stale (CI)
    python deploy/grafana/build_dashboard.py --output FILE   # write it elsewhere ('-': standard output)

The JSON is generated so that panels stay consistent (one datasource
variable, the same job/instance/experiment filters everywhere); the test suite
checks the committed JSON matches this script and that every expression
parses in a real Prometheus and names only metrics the server exports.
Import it in Grafana (Dashboards > New > Import) or provision it from a
ConfigMap; its uid is fixed, so links to it survive re-imports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

UID = "bots-selection"
OUT = Path(__file__).with_name("bots-selection.json")

DS = {"type": "prometheus", "uid": "${datasource}"}
JOB = 'job=~"$job", instance=~"$instance"'
EXP = f'{JOB}, experiment=~"$experiment"'
TASK_SELECTOR = f'{JOB}, grpc_service="bots.v1.TaskSelector"'
SERVER_ERRORS = 'grpc_code=~"Unknown|Internal|Unavailable|DataLoss|DeadlineExceeded"'


class Layout:
    """Places panels left to right, 24 columns wide, in rows."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = self.y = 0
        self.row_height = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {"type": "row", "title": title, "id": self._id(), "collapsed": False, "panels": [],
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}}
        )  # fmt: skip
        self.y += 1

    def panel(
        self,
        title: str,
        targets: list[tuple[str, str]],
        *,
        unit: str = "short",
        description: str = "",
        width: int = 8,
        height: int = 8,
        stack: bool = False,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> None:
        if self.x + width > 24:
            self._newline()
        defaults: dict[str, Any] = {"unit": unit, "custom": {"fillOpacity": 30 if stack else 10, "showPoints": "never"}}
        if stack:
            defaults["custom"]["stacking"] = {"mode": "normal", "group": "A"}
        if minimum is not None:
            defaults["min"] = minimum
        if maximum is not None:
            defaults["max"] = maximum
        self.panels.append(
            {
                "type": "timeseries",
                "title": title,
                "description": description,
                "id": self._id(),
                "datasource": DS,
                "gridPos": {"h": height, "w": width, "x": self.x, "y": self.y},
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                "targets": [
                    {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(targets)
                ],
            }
        )
        self.x += width
        self.row_height = max(self.row_height, height)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
        self.x, self.row_height = 0, 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def panels() -> list[dict[str, Any]]:
    p = Layout()
    p.row("Traffic and errors")
    p.panel(
        "Calls by method",
        [
            (
                f"sum by (grpc_method) (rate(grpc_server_handled_total{{{TASK_SELECTOR}}}[$__rate_interval]))",
                "{{grpc_method}}",
            )
        ],
        unit="reqps",
        description="TaskSelector calls completed per second.",
    )
    p.panel(
        "Non-OK calls by code",
        [
            (
                # `> 0`: the server exports every method x code pair from
                # start-up (so rate() and alerts see a series before the first
                # error); unfiltered, this panel drew ~160 lines at zero.
                f'sum by (grpc_method, grpc_code) (rate(grpc_server_handled_total{{{TASK_SELECTOR}, grpc_code!="OK"}}[$__rate_interval])) > 0',
                "{{grpc_method}} {{grpc_code}}",
            )
        ],
        unit="reqps",
        description="Client mistakes (InvalidArgument, NotFound, FailedPrecondition) and server errors alike; "
        "only the method and code pairs that occurred in the range.",
    )
    p.panel(
        "Server error ratio",
        [
            (
                (
                    f"sum(rate(grpc_server_handled_total{{{TASK_SELECTOR}, {SERVER_ERRORS}}}[$__rate_interval]))"
                    f" / sum(rate(grpc_server_handled_total{{{TASK_SELECTOR}}}[$__rate_interval]))"
                ),
                "server errors",
            )
        ],
        unit="percentunit",
        minimum=0,
        description="Share of calls failing with Unknown, Internal, Unavailable, DataLoss or DeadlineExceeded "
        "(SLO: 99.9% without; alert BotsAvailabilityBudgetBurn).",
    )
    p.row("Latency")
    for q in ("0.5", "0.99"):
        p.panel(
            f"p{float(q) * 100:g} latency by method",
            [
                (
                    (
                        f"histogram_quantile({q}, sum by (grpc_method, le) "
                        f"(rate(grpc_server_handling_seconds_bucket{{{TASK_SELECTOR}}}[$__rate_interval])))"
                    ),
                    "{{grpc_method}}",
                )
            ],
            unit="s",
            width=12,
            description="Server-side handling time (SLO: 99% of SelectBatch, ReportOutcomes and ReportAndSelect within 0.5 s; "
            "alert BotsLatencyBudgetBurn).",
        )
    p.panel(
        "SLO error budget burn rate (1 h)",
        [
            ('job:bots_rpc_server_errors:ratio_rate1h{job=~"$job"} / 0.001', "availability {{job}}"),
            ('job:bots_rpc_slow_calls:ratio_rate1h{job=~"$job"} / 0.01', "latency {{job}}"),
        ],
        width=24,
        minimum=0,
        description="How many times faster than the 30-day budget allows each SLO is being spent, over the last "
        "hour (1 = exactly on budget). The recording rules of deploy/prometheus/alerts.yaml compute it, per job; "
        "above 14.4 (with the last 5 minutes) pages.",
    )
    p.row("Learning signal")
    p.panel(
        "Steps per minute",
        [(f"sum by (experiment) (rate(bots_steps_total{{{EXP}}}[$__rate_interval])) * 60", "{{experiment}}")],
        description="Reports applied: one per trainer step.",
    )
    p.panel(
        "Informative fraction",
        [
            (
                (
                    f"sum by (experiment) (rate(bots_tasks_informative_total{{{EXP}}}[$__rate_interval]))"
                    f" / sum by (experiment) (rate(bots_tasks_reported_total{{{EXP}}}[$__rate_interval]))"
                ),
                "{{experiment}}",
            )
        ],
        unit="percentunit",
        minimum=0,
        maximum=1,
        description="Share of reported tasks with 0 < successes < trials: the groups that give GRPO a gradient. "
        "BOTS keeps this high; alert BotsInformativeFractionLow below 20%.",
    )
    p.panel(
        "Batch success rate",
        [
            (
                (
                    f"sum by (experiment) (rate(bots_rollout_successes_total{{{EXP}}}[$__rate_interval]))"
                    f" / sum by (experiment) (rate(bots_rollouts_total{{{EXP}}}[$__rate_interval]))"
                ),
                "{{experiment}}",
            )
        ],
        unit="percentunit",
        minimum=0,
        maximum=1,
        description="Successes per rollout in the selected batches; BOTS steers it toward the target rate (0.5 by default).",
    )
    p.panel(
        "Pool relative to the target",
        [(f"max by (experiment, band) (bots_posterior_target_share{{{EXP}}})", "{{experiment}} {{band}}")],
        unit="percentunit",
        stack=False,
        minimum=0,
        maximum=1,
        description="Share of the pool by where each task's posterior puts most of its mass: near the target "
        "success rate (within 0.2), below it (too hard), above it (too easy), or uncertain (too little recent "
        "evidence). Healthy: near holds a steady share the batches can be drawn from, above grows as the model "
        "learns. Unhealthy: near shrinks toward the batch size, or uncertain dominates (forgetting outpaces "
        "the evidence).",
    )
    p.panel(
        "Posterior mean quantiles",
        [(f"max by (experiment, percentile) (bots_posterior_mean_quantile{{{EXP}}})", "{{experiment}} p{{percentile}}")],
        minimum=0,
        maximum=1,
        description="10th, 50th and 90th percentile of the tasks' posterior means. The median rising over the "
        "run is the model learning; p10 and p90 collapsing together means the posterior no longer tells tasks apart.",
    )
    p.panel(
        "Capability estimate",
        [(f"max by (experiment) (bots_capability{{{EXP}}})", "{{experiment}}")],
        minimum=0,
        description="The interpolation plug-in's capability c (0: the weak reference model, 1: the strong one); "
        "empty without reference features.",
    )
    p.panel(
        "Rollouts and tasks per second",
        [
            (f"sum by (experiment) (rate(bots_rollouts_total{{{EXP}}}[$__rate_interval]))", "{{experiment}} rollouts"),
            (
                f"sum by (experiment) (rate(bots_tasks_selected_total{{{EXP}}}[$__rate_interval]))",
                "{{experiment}} tasks selected",
            ),
        ],
        unit="ops",
    )
    p.panel(
        "Leased tasks",
        [(f"sum by (experiment) (bots_leased_tasks{{{EXP}}})", "{{experiment}}")],
        description="Tasks in open batches (selected, not yet reported, lease not expired), summed over the "
        "replicas that handed them out. Growing without bound: a trainer selects and never reports.",
    )
    p.panel(
        "Pool size and step",
        [
            (f"max by (experiment) (bots_experiment_tasks{{{EXP}}})", "{{experiment}} tasks"),
            (f"max by (experiment) (bots_experiment_step{{{EXP}}})", "{{experiment}} step"),
        ],
    )
    p.panel(
        "Batch share by group",
        [
            (
                f"sum by (experiment, group) (rate(bots_group_tasks_selected_total{{{EXP}}}[$__rate_interval]))"
                f" / ignoring (group) group_left () sum by (experiment) "
                f"(rate(bots_group_tasks_selected_total{{{EXP}}}[$__rate_interval]))",
                "{{experiment}} {{group}}",
            )
        ],
        unit="percentunit",
        stack=True,
        minimum=0,
        maximum=1,
        description="Fraction of selected tasks per group (experiments whose tasks have groups): with group "
        "shares set, each group's line sits at its share; a group below its minimum has too few free tasks.",
    )
    p.panel(
        "Retired tasks",
        [(f"max by (experiment) (bots_experiment_retired_tasks{{{EXP}}})", "{{experiment}}")],
        description="Tasks retired from selection (RetireTasks), kept in the posterior.",
    )
    p.row("Persistence")
    p.panel(
        "Checkpoint age",
        [(f"max by (experiment) (bots_checkpoint_age_seconds{{{EXP}}})", "{{experiment}}")],
        unit="s",
        description="Age of the oldest step not in a checkpoint yet (0: current). Alert BotsCheckpointStale above 10 minutes.",
    )
    p.panel(
        "Checkpoint duration",
        [
            (f"max by (experiment) (bots_checkpoint_last_duration_seconds{{{EXP}}})", "{{experiment}} last"),
            (
                f"histogram_quantile(0.99, sum by (le) (rate(bots_checkpoint_duration_seconds_bucket{{{JOB}}}[$__rate_interval])))",
                "p99 (all experiments)",
            ),
        ],
        unit="s",
    )
    p.panel(
        "Steps since checkpoint",
        [(f"max by (experiment) (bots_steps_since_checkpoint{{{EXP}}})", "{{experiment}}")],
        description="What a restart replays from the event log.",
    )
    p.panel(
        "Database errors by kind",
        [(f"sum by (kind) (rate(bots_database_errors_total{{{JOB}}}[$__rate_interval]))", "{{kind}}")],
        unit="ops",
    )
    p.panel(
        "Database reachable",
        [(f"bots_database_up{{{JOB}}}", "{{instance}}")],
        minimum=0,
        maximum=1,
        description="1 while the health check reaches the database; 0 makes the replica not ready.",
    )
    p.panel(
        "Experiment load time (p99)",
        [
            (
                f"histogram_quantile(0.99, sum by (le) (rate(bots_experiment_load_duration_seconds_bucket{{{JOB}}}[$__rate_interval])))",
                "p99",
            )
        ],
        unit="s",
        description="Rebuilding an experiment from its checkpoint and event log (first use after a start).",
    )
    p.row("Process")
    p.panel("Resident memory", [(f"process_resident_memory_bytes{{{JOB}}}", "{{instance}}")], unit="bytes")
    p.panel(
        "CPU", [(f"rate(process_cpu_seconds_total{{{JOB}}}[$__rate_interval])", "{{instance}}")], unit="percentunit"
    )
    p.panel(
        "Event-loop lag (p99)",
        [
            (
                f"histogram_quantile(0.99, sum by (instance, le) (rate(bots_event_loop_lag_seconds_bucket{{{JOB}}}[$__rate_interval])))",
                "{{instance}}",
            )
        ],
        unit="s",
        description="How late the event loop runs timers; every call waits this long. Alert BotsEventLoopLag above 0.5 s.",
    )
    p.panel("Experiments in memory", [(f"bots_experiments_loaded{{{JOB}}}", "{{instance}}")])
    p.panel(
        "Bulk calls waiting for trainers",
        [(f"rate(bots_bulk_yield_seconds_total{{{JOB}}}[$__rate_interval])", "{{instance}}")],
        unit="s",
        description="Seconds per second that uploads, restores and snapshots gave way to selects and reports in flight.",
    )
    return p.panels


def variable(name: str, label: str, query: str, *, include_all: bool = True) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "refresh": 2,
        "includeAll": include_all,
        "multi": include_all,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": "BOTS selection service",
        "description": "Traffic, errors, latency and the learning signal of the BOTS task-selection service.",
        "tags": ["bots", "grpc", "rl"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "",
        "links": [],
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "refresh": 1,
                    "current": {},
                },
                variable("job", "Job", "label_values(bots_build_info, job)"),
                variable("instance", "Instance", 'label_values(bots_build_info{job=~"$job"}, instance)'),
                variable("experiment", "Experiment", 'label_values(bots_experiment_step{job=~"$job"}, experiment)'),
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if --output differs from what this script builds"
    )
    parser.add_argument(
        "--output", type=Path, default=OUT, help=f"the JSON file (default: {OUT.name} beside this script); '-': stdout"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.output.exists() or args.output.read_text() != text:
            print(f"{args.output} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    if str(args.output) == "-":
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
