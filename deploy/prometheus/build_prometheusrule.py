"""Writes the alerting rules as a Prometheus Operator PrometheusRule.

    python deploy/prometheus/build_prometheusrule.py          # rewrite it
    python deploy/prometheus/build_prometheusrule.py --check  # exit 1 if stale

alerts.yaml is the source (promtool checks and unit-tests it); the
PrometheusRule in deploy/k8s/components/servicemonitor carries the same
groups, copied as text so that the two stay identical line for line.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "alerts.yaml"
OUT = HERE.parent / "k8s" / "components" / "servicemonitor" / "prometheusrule.yaml"

HEADER = """\
# Generated from deploy/prometheus/alerts.yaml by
# deploy/prometheus/build_prometheusrule.py: edit those, not this file.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: bots-server
  labels:
    app.kubernetes.io/name: bots-server
    app.kubernetes.io/part-of: bots
spec:
"""


def render() -> str:
    lines = SOURCE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = "".join(f"  {line}\n" if line else "\n" for line in lines[start:])
    return HEADER + body


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
