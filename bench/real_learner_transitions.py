"""How a real learner's tasks change between two visits: the evidence behind
`keep_successes` (docs/choosing-a-strategy.md).

Trains the policy of bench/real_learner.py by GRPO on uniform batches (no
service: the sampling must not depend on what is measured) and files every
visit of a task under the outcome of its previous visit (all wrong, mixed,
all right, or never seen) and the steps since, counting what the group gave
this time. A selector wants to know this: how likely a group is to be mixed
(informative), given what the posterior last saw and how long ago.

    .venv/bin/python -m bench.real_learner_transitions            # families a and b, seed 0, 300 steps
    .venv/bin/python -m bench.real_learner_transitions --families a --seeds 2 --steps 200
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import RESULTS, machine_info, machine_line, write_json
from bench.real_learner import grpo_step, initial_policy
from bench.real_learner_tasks import SPECS, make_family

STATES = ("all wrong", "mixed", "all right")
GAPS = ((1, 5), (6, 20), (21, 60), (61, 10**9))


def group_state(rewards: torch.Tensor) -> str:
    if float(rewards.max()) > float(rewards.min()):
        return "mixed"
    return "all right" if float(rewards.min()) > 0.5 else "all wrong"


def gap_label(gap: int) -> str:
    for low, high in GAPS:
        if low <= gap <= high:
            return f"{low}-{high}" if high < 10**9 else f">{low - 1}"
    raise ValueError(gap)


def transitions(family_name: str, seed: int, steps: int) -> collections.Counter[tuple[str, str, str]]:
    """(previous state, gap, this state) -> visits, over one uniform run."""
    spec = replace(SPECS[family_name], steps=steps)
    family = make_family(family_name, seed, spec)
    pool = family.pool
    policy = initial_policy(family, seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=spec.lr)
    generator = torch.Generator().manual_seed(1_000_003 * seed + ord(spec.name[0]))
    rng = np.random.default_rng(seed)
    last: dict[int, tuple[int, str]] = {}
    counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for step in range(1, steps + 1):
        idx = torch.as_tensor(rng.choice(len(pool.keys), spec.batch, replace=False))
        _, reward = grpo_step(policy, optimizer, pool, idx, spec, generator)
        for task, group in zip(idx.tolist(), reward.view(-1, spec.rollouts)):
            now = group_state(group)
            seen = last.get(task)
            key = ("never seen", "-") if seen is None else (seen[1], gap_label(step - seen[0]))
            counts[(*key, now)] += 1
            last[task] = (step, now)
    return counts


def table(counts: collections.Counter[tuple[str, str, str]]) -> list[dict[str, Any]]:
    visits: collections.Counter[tuple[str, str]] = collections.Counter()
    for (before, gap, _), n in counts.items():
        visits[(before, gap)] += n
    rows = []
    for before in ("never seen", *STATES):
        gaps = ["-"] if before == "never seen" else [gap_label(low) for low, _ in GAPS]
        for gap in gaps:
            total = visits[(before, gap)]
            if total:
                shares = {now: counts[(before, gap, now)] / total for now in STATES}
                rows.append({"previous": before, "steps since": gap, "visits": total, **shares})
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Real learners: what a task's next visit gives, by its previous one",
        "",
        machine_line(result["machine"]),
        "",
        f"`{result['command']}`: {result['wall_seconds']:.0f} s wall. Uniform batches, "
        "share of the next visits' groups in each state.",
    ]
    for name, rows in result["families"].items():
        lines += ["", f"## Family {name}", "", "| previous visit | steps since | visits | " + " | ".join(STATES) + " |"]
        lines.append("|---|---|---|" + "---|" * len(STATES))
        for row in rows:
            shares = " | ".join(f"{row[s]:.2f}" for s in STATES)
            lines.append(f"| {row['previous']} | {row['steps since']} | {row['visits']} | {shares} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="a,b", help="comma-separated families of bench/real_learner_tasks.py")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, pooled")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--output", default=str(RESULTS / "real-learner-transitions"), help="path without suffix")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "machine": machine_info(),
        "command": "python -m bench.real_learner_transitions " + " ".join(sys.argv[1:] if argv is None else argv),
        "families": {},
    }
    for name in filter(None, (f.strip() for f in args.families.split(","))):
        pooled: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for seed in range(args.seeds):
            pooled.update(transitions(name, seed, args.steps))
        result["families"][name] = table(pooled)
    result["wall_seconds"] = time.perf_counter() - started
    output = Path(args.output)
    write_json(output.with_suffix(".json"), result)
    output.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
