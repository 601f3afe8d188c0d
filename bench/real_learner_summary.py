"""One line per family and arm of real-learner results: the per-seed ratio of
steps to each target (pool and held-out; a miss counted at the budget),
averaged over targets and seeds, against each base arm of the run. The
figure issue 28 and docs/choosing-a-strategy.md quote.

    .venv/bin/python -m bench.real_learner_summary bench/results/real-learner*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def mean_ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per family and arm: {base: mean per-seed ratio} over every target row."""
    lines = []
    for family, data in result["families"].items():
        rows = data["summary"]
        bases = sorted({key.removeprefix("ratio_to_") for row in rows for key in row if key.startswith("ratio_to_")})
        for arm in dict.fromkeys(row["arm"] for row in rows):
            ratios = {}
            for base in bases:
                values = [r for row in rows if row["arm"] == arm for r in row[f"ratio_to_{base}"]]
                if values:
                    ratios[base] = statistics.fmean(values)
            seeds = {s for row in rows if row["arm"] == arm for s in row["seeds"]}
            lines.append({"family": family, "arm": arm, "seeds": len(seeds), "ratios": ratios})
    return lines


def markdown(paths: Sequence[Path]) -> str:
    out = [
        "| results | family | arm | seeds | mean per-seed ratio of steps (over every target) |",
        "|---|---|---|---|---|",
    ]
    for path in paths:
        for line in mean_ratios(json.loads(path.read_text())):
            ratios = ", ".join(f"/ {base} {value:.2f}" for base, value in line["ratios"].items())
            out.append(f"| {path.stem} | {line['family']} | {line['arm']} | {line['seeds']} | {ratios} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="JSON written by bench.real_learner")
    print(markdown(p.parse_args(argv).results), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
