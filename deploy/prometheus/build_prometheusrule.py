"""Writes the recording and alerting rules as a Prometheus Operator PrometheusRule.

    python deploy/prometheus/build_prometheusrule.py          # rewrite it
    python deploy/prometheus/build_prometheusrule.py --check  # exit 1 if stale
    python deploy/prometheus/build_prometheusrule.py --rules --runbook-base URL > bots-rules.yaml

alerts.yaml is the source (promtool checks and unit-tests it); the
PrometheusRule in deploy/k8s/components/servicemonitor carries the same
groups, copied as text so that the two stay identical line for line. Its
runbook links are rewritten at render time from the component's settings.env
(kustomize replacements). `--rules` prints alerts.yaml for a plain
Prometheus's rule_files instead, with every runbook link under another base
URL (your copy of docs/operations.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "alerts.yaml"
OUT = HERE.parent / "k8s" / "components" / "servicemonitor" / "prometheusrule.yaml"
RUNBOOK = re.compile(r'^(\s*runbook_url: ")([^"#]*)(#[^"]*")$', flags=re.MULTILINE)

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


def runbook_bases(text: str) -> set[str]:
    return {m.group(2) for m in RUNBOOK.finditer(text)}


def with_runbook_base(text: str, base: str) -> str:
    return RUNBOOK.sub(lambda m: m.group(1) + base.rstrip("#") + m.group(3), text)


def render() -> str:
    lines = SOURCE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = "".join(f"  {line}\n" if line else "\n" for line in lines[start:])
    return HEADER + body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the PrometheusRule is stale")
    parser.add_argument("--rules", action="store_true", help="print alerts.yaml (for rule_files) instead")
    parser.add_argument("--runbook-base", help="with --rules: the URL of docs/operations.md the runbook links use")
    args = parser.parse_args()
    if args.rules:
        text = SOURCE.read_text()
        sys.stdout.write(with_runbook_base(text, args.runbook_base) if args.runbook_base else text)
        return 0
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
