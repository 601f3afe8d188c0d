"""One line per family and arm of real-learner results: the per-seed ratio of
steps to each target (pool and held-out; a miss counted at the budget),
averaged over targets and seeds, against each base arm of the run. The
figure issue 28 and docs/choosing-a-strategy.md quote.

    .venv/bin/python -m bench.real_learner_summary bench/results/real-learner*.json
    .venv/bin/python -m bench.real_learner_summary --merge A.json B.json   # arms of several runs against each other

--merge reads runs of the same benchmark code on the same CPU model as one:
a run is deterministic per seed there (torch's float results differ between
CPU models), so an arm measured in one run is compared with the base arms
(uniform, bots) of another. It stops when the files name different CPUs,
or an arm and seed present in several files has another curve in each.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def mean_ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per family and arm: {base: (mean per-seed ratio over every target
    row, its standard error over the seeds)}. A seed's ratio is the mean of
    its ratios over the targets; the error is the spread of those over the
    seeds (stdev / sqrt(seeds); 0 with one seed)."""
    lines = []
    for family, data in result["families"].items():
        rows = data["summary"]
        bases = sorted({key.removeprefix("ratio_to_") for row in rows for key in row if key.startswith("ratio_to_")})
        for arm in dict.fromkeys(row["arm"] for row in rows):
            ratios = {}
            for base in bases:
                per_seed: dict[int, list[float]] = {}
                for row in rows:
                    if row["arm"] == arm and len(row[f"ratio_to_{base}"]) == len(row["seeds"]):
                        for seed, ratio in zip(row["seeds"], row[f"ratio_to_{base}"]):
                            per_seed.setdefault(seed, []).append(ratio)
                if per_seed:
                    means = [statistics.fmean(values) for values in per_seed.values()]
                    error = statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else 0.0
                    ratios[base] = (statistics.fmean(means), error)
            seeds = {s for row in rows if row["arm"] == arm for s in row["seeds"]}
            lines.append({"family": family, "arm": arm, "seeds": len(seeds), "ratios": ratios})
    return lines


def across_families(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm present in every family: {base: (mean of the family means,
    its standard error from theirs)}: issue 28's figure, "averaged over
    families and seeds"."""
    families = {line["family"] for line in lines}
    out = []
    for arm in dict.fromkeys(line["arm"] for line in lines):
        mine = [line for line in lines if line["arm"] == arm]
        if {line["family"] for line in mine} != families:
            continue
        ratios = {}
        for base in mine[0]["ratios"]:
            if all(base in line["ratios"] for line in mine):
                means = [line["ratios"][base][0] for line in mine]
                errors = [line["ratios"][base][1] for line in mine]
                ratios[base] = (statistics.fmean(means), math.sqrt(sum(e * e for e in errors)) / len(errors))
        out.append({"family": "all", "arm": arm, "seeds": min(line["seeds"] for line in mine), "ratios": ratios})
    return out


def merged(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result of several runs' curves, its summary rows recomputed
    against the base arms any of them holds."""
    from bench.real_learner import Curve, summarize
    from bench.real_learner_tasks import SPECS

    cpus = {result["machine"]["cpu"] for result in results}
    if len(cpus) > 1:
        raise SystemExit(f"runs on different CPUs ({', '.join(sorted(cpus))}) are not comparable seed by seed")
    curves: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    for result in results:
        for family, data in result["families"].items():
            for curve in data["curves"]:
                key = (curve["arm"], curve["seed"])
                known = curves.setdefault(family, {}).get(key)
                if known is not None and (known["steps"], known["acc"]) != (curve["steps"], curve["acc"]):
                    raise SystemExit(f"family {family}, arm {key[0]}, seed {key[1]} differs between the files")
                curves[family][key] = curve
    families = {}
    for family, by_run in curves.items():
        runs = [Curve(**c) for c in by_run.values()]
        arms = list(dict.fromkeys(c.arm for c in runs))
        bases = [b for b in ("uniform", "bots") if b in arms]
        families[family] = {"summary": summarize(runs, SPECS[family], arms, bases)}
    return {"families": families}


def markdown(paths: Sequence[Path], merge: bool = False) -> str:
    out = [
        "| results | family | arm | seeds | mean per-seed ratio of steps (over every target) +- standard error |",
        "|---|---|---|---|---|",
    ]
    loaded = [(path.stem, json.loads(path.read_text())) for path in paths]
    if merge:
        loaded = [(" + ".join(name for name, _ in loaded), merged([result for _, result in loaded]))]
    for name, result in loaded:
        lines = mean_ratios(result)
        if len({line["family"] for line in lines}) > 1:
            lines += across_families(lines)
        for line in lines:
            ratios = ", ".join(f"/ {base} {mean:.2f} +- {error:.2f}" for base, (mean, error) in line["ratios"].items())
            out.append(f"| {name} | {line['family']} | {line['arm']} | {line['seeds']} | {ratios} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="JSON written by bench.real_learner")
    p.add_argument("--merge", action="store_true", help="the files' arms against each other (same code, seeds)")
    args = p.parse_args(argv)
    print(markdown(args.results, args.merge), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
