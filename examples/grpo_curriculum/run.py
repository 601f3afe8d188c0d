"""GRPO on CPU, uniform sampling vs. the BOTS selection service.

    python examples/grpo_curriculum/run.py            # about two minutes on 2 cores

A small policy (symbol embeddings and a two-layer MLP, trained from scratch
with torch) learns a family of generated, verifiable tasks by reinforcement
alone: decode a message of L symbols written with a secret substitution
cipher over 32 symbols. A completion is correct only if all L symbols are, so
difficulty grows with the length L (1 to --max-len): an untrained policy
solves a task of length L with probability (1/32)^L, and long tasks give no
learning signal until the policy knows most of the cipher.

Each step picks --batch tasks, samples --rollouts completions of each, scores
them with the verifier and takes a GRPO step (group-normalised advantages, a
token-level mean, a small entropy bonus; groups whose rollouts all agree carry
no gradient). Two arms, with the same rollouts per step:

- uniform: a shuffled DataLoader over the task pool (what a trainer does
  without the service);
- service: the same DataLoader with `bots_client.integrations.torch.BotsSampler`,
  so each batch comes from SelectBatch on a BOTS server (the paper's defaults:
  Thompson sampling near p* = 0.5, forgetting 0.1, implicit evidence with
  weight 0.1 from two reference pass rates per task), and the rollouts'
  outcomes are reported back.

The script starts its own `bots-server` on a temporary SQLite file (or uses
--address), runs both arms for --seeds seeds, prints the steps each needs to
reach the --targets accuracies (greedy decoding, exact match, over the whole
pool) and saves the learning curves to a PNG (--out; by default
build/grpo_curriculum/learning_curves.png, not the committed figure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import bots_client
from bots_client.integrations.torch import BotsSampler
from bots_client.types import SELECTION_MODES

BOS = 10  # the "previous digit" before the first one
# A run writes its figure here by default, not over the committed one (which
# the README shows): running the example leaves the checkout unchanged.
DEFAULT_PLOT = Path("build") / "grpo_curriculum" / "learning_curves.png"
COMMITTED_PLOT = Path("examples") / "grpo_curriculum" / "learning_curves.png"


# -- the task family ------------------------------------------------------------------

VOCAB = 32  # symbols 0..31
# The secret the policy has to discover: a substitution cipher over the symbols.
CIPHER = tuple(int(v) for v in np.random.default_rng(2026).permutation(VOCAB))


@dataclass
class TaskPool:
    """Generated tasks: symbols `x` [N, max_len] (0-padded), lengths `lengths`,
    answers `y` [N, max_len]; a stable key and two reference pass rates each."""

    x: torch.Tensor
    y: torch.Tensor
    lengths: torch.Tensor
    keys: list[str]
    weak: np.ndarray
    strong: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> int:  # the DataLoader yields task indices
        return i


def make_pool(num_tasks: int, max_len: int, seed: int, strong_symbol_accuracy: float = 0.9) -> TaskPool:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=num_tasks)
    x = rng.integers(0, VOCAB, size=(num_tasks, max_len))
    y = np.asarray(CIPHER)[x]
    pad = np.arange(max_len)[None, :] >= lengths[:, None]
    x[pad] = 0
    y[pad] = 0
    # Reference pass rates of two reference models, in closed form here (with
    # an LLM they are measured offline): an untrained policy (each symbol
    # right with probability 1/VOCAB) and a stronger model (each symbol right
    # with probability `strong_symbol_accuracy`).
    weak = (1.0 / VOCAB) ** lengths
    strong = strong_symbol_accuracy**lengths
    keys = [f"cipher-{'.'.join(map(str, row[:n]))}-{i}" for i, (n, row) in enumerate(zip(lengths, x))]
    return TaskPool(
        torch.as_tensor(x), torch.as_tensor(y), torch.as_tensor(lengths), keys, weak.astype(float), strong.astype(float)
    )


def verify(pool: TaskPool, idx: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """The verifier: 1.0 where every symbol of the completion is right
    (positions past a task's length are ignored), else 0.0."""
    live = torch.arange(completion.shape[1])[None, :] < pool.lengths[idx][:, None]
    wrong = (completion != pool.y[idx]) & live
    return (~wrong.any(dim=1)).float()


# -- the policy -----------------------------------------------------------------------


class Policy(nn.Module):
    """p(y_i | x_i): an embedding of the input symbol, a two-layer MLP,
    logits over the symbols; all positions are sampled at once."""

    def __init__(self, max_len: int, hidden: int = 64) -> None:
        super().__init__()
        self.x_emb = nn.Embedding(VOCAB, hidden)
        self.mlp = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, VOCAB))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.x_emb(x))

    def sample(self, x: torch.Tensor, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Completions [rows, max_len], their per-position log-probs and entropies."""
        logp_all = torch.log_softmax(self.logits(x), dim=-1)
        if greedy:
            y = logp_all.argmax(dim=-1)
        else:
            y = torch.multinomial(logp_all.detach().exp().reshape(-1, VOCAB), 1).view(x.shape)
        logp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
        return y, logp, entropy


@torch.no_grad()
def accuracy(policy: Policy, pool: TaskPool) -> float:
    completion, _, _ = policy.sample(pool.x, greedy=True)
    return float(verify(pool, torch.arange(len(pool)), completion).mean())


def grpo_step(
    policy: Policy, optimizer: torch.optim.Optimizer, pool: TaskPool, idx: torch.Tensor, rollouts: int,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sample `rollouts` completions per task, verify, one GRPO update.
    Returns the per-rollout task indices and rewards."""
    rows = idx.repeat_interleave(rollouts)
    completion, logp, entropy = policy.sample(pool.x[rows])
    reward = verify(pool, rows, completion)
    groups = reward.view(-1, rollouts)
    advantage = ((groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    live = (torch.arange(pool.x.shape[1])[None, :] < pool.lengths[rows][:, None]).float()
    tokens = live.sum()
    # GRPO with a token-level mean (as DAPO): every rollout's tokens count,
    # so groups whose rollouts all agree dilute the update.
    loss = -((advantage.detach()[:, None] * logp * live).sum() + entropy_coef * (entropy * live).sum()) / tokens
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return rows, reward


# -- one training run -----------------------------------------------------------------


@dataclass
class Curve:
    arm: str
    seed: int
    steps: list[int] = field(default_factory=list)
    acc: list[float] = field(default_factory=list)
    informative: list[float] = field(default_factory=list)  # groups with 0 < successes < n
    seconds: float = 0.0

    def steps_to(self, target: float) -> int | None:
        for step, acc in zip(self.steps, self.acc):
            if acc >= target:
                return step
        return None


def train(arm: str, pool: TaskPool, args: argparse.Namespace, seed: int, address: str | None) -> Curve:
    torch.manual_seed(seed)
    policy = Policy(args.max_len, args.hidden)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    curve = Curve(arm, seed)
    sampler = None
    if arm == "service":
        use_features = args.implicit_weight > 0
        config = bots_client.ExperimentConfig(
            strategy=args.strategy,
            target_success=args.target,
            forgetting=args.forgetting,
            implicit_weight=args.implicit_weight,
            rollouts_per_task=args.rollouts,
            selection_mode=args.selection_mode,
            track_prediction=args.track_prediction,
            weak_feature="weak" if use_features else "",
            strong_feature="strong" if use_features else "",
            seed=seed,
        )
        features = [{"weak": w, "strong": s} for w, s in zip(pool.weak, pool.strong)] if use_features else None
        sampler = BotsSampler(
            address, f"grpo-example-{seed}-{uuid.uuid4().hex[:8]}", pool.keys,
            batch_size=args.batch, config=config, features=features,
        )  # fmt: skip
        loader = DataLoader(pool, batch_size=sampler.local_batch_size, sampler=sampler)
    else:
        generator = torch.Generator().manual_seed(seed)
        loader = DataLoader(pool, batch_size=args.batch, shuffle=True, drop_last=True, generator=generator)

    def batches() -> Iterator[torch.Tensor]:
        while True:
            yield from loader

    start = time.perf_counter()
    curve.steps.append(0)
    curve.acc.append(accuracy(policy, pool))
    informative = 0.0
    for step, idx in enumerate(batches(), start=1):
        rows, reward = grpo_step(policy, optimizer, pool, idx, args.rollouts, args.entropy)
        successes = reward.view(-1, args.rollouts).sum(dim=1)
        informative += float(((successes > 0) & (successes < args.rollouts)).float().mean())
        if sampler is not None:
            sampler.report_rewards(rows.tolist(), reward.tolist())
        if step % args.eval_every == 0:
            curve.steps.append(step)
            curve.acc.append(accuracy(policy, pool))
            curve.informative.append(informative / args.eval_every)
            informative = 0.0
            if args.verbose:
                print(f"  [{arm} seed {seed}] step {step:4d}  accuracy {curve.acc[-1]:.3f}", flush=True)
            if curve.acc[-1] >= max(args.targets) and args.stop_early:
                break
        if step >= args.steps:
            break
    curve.seconds = time.perf_counter() - start
    if sampler is not None:
        sampler.wait()  # the last report runs in the background: acknowledged (or raised) before closing
        sampler.curriculum.client.close()
    return curve


# -- the server -----------------------------------------------------------------------


@contextmanager
def local_server(db_path: Path) -> Iterator[str]:
    """`bots-server serve` on a temporary SQLite file and a free port."""
    cmd = [sys.executable, "-m", "bots_server.cli", "serve", "--db", f"sqlite:///{db_path}",
           "--listen", "127.0.0.1:0", "--log-format", "json"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    port: list[int] = []
    ready = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry.get("message") == "serving":
                port.append(int(entry["port"]))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while not ready.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("bots-server did not start:\n" + "".join(lines[-20:]))
        yield f"127.0.0.1:{port[0]}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- report ---------------------------------------------------------------------------


def summarize(curves: list[Curve], targets: list[float]) -> str:
    lines = []
    header = f"{'accuracy':>9} | {'uniform: steps (mean)':>28} | {'service: steps (mean)':>28} | steps saved"
    lines += [header, "-" * len(header)]
    for target in targets:
        cells, means = [], {}
        for arm in ("uniform", "service"):
            runs = [c.steps_to(target) for c in curves if c.arm == arm]
            shown = ",".join("-" if s is None else str(s) for s in runs)
            reached = [s for s in runs if s is not None]
            mean = sum(reached) / len(reached) if len(reached) == len(runs) else None
            means[arm] = mean
            cells.append(f"{shown} ({'n/a' if mean is None else f'{mean:.0f}'})")
        saved = "n/a"
        if means["uniform"] and means["service"] is not None:
            saved = f"{100 * (1 - means['service'] / means['uniform']):.0f}%"
        lines.append(f"{target:>9.2f} | {cells[0]:>28} | {cells[1]:>28} | {saved:>11}")
    lines.append("")
    for arm in ("uniform", "service"):
        arm_curves = [c for c in curves if c.arm == arm]
        # Informative groups (0 < successes < n: the only ones with a gradient)
        # while learning, i.e. until the run reached the highest target.
        info = []
        for c in arm_curves:
            done = c.steps_to(max(targets))
            window = [v for step, v in zip(c.steps[1:], c.informative) if done is None or step <= done]
            info.append(np.mean(window) if window else 0.0)
        secs = np.mean([c.seconds for c in arm_curves])
        final = np.mean([c.acc[-1] for c in arm_curves])
        lines.append(
            f"{arm:>8}: {100 * np.mean(info):.0f}% of rollout groups informative while learning; "
            f"final accuracy {final:.3f}; {secs:.1f} s per run"
        )
    return "\n".join(lines)


def plot(curves: list[Curve], targets: list[float], max_len: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = {"uniform": "tab:gray", "service": "tab:blue"}
    for arm in ("uniform", "service"):
        arm_curves = [c for c in curves if c.arm == arm]
        for c in arm_curves:
            ax.plot(c.steps, c.acc, color=colors[arm], alpha=0.25, linewidth=1)
        n = min(len(c.steps) for c in arm_curves)
        mean = np.mean([c.acc[:n] for c in arm_curves], axis=0)
        label = "uniform sampling" if arm == "uniform" else "BOTS service (Thompson, p* = 0.5)"
        ax.plot(
            arm_curves[0].steps[:n], mean, color=colors[arm], linewidth=2.2, label=f"{label}, mean of {len(arm_curves)}"
        )
    for t in targets:
        ax.axhline(t, color="black", linewidth=0.5, linestyle=":")
    ax.set_xlabel("training step (same rollouts per step in both arms)")
    ax.set_ylabel("pool accuracy (greedy exact match)")
    ax.set_title(f"GRPO on cipher tasks of length 1-{max_len}: uniform vs. BOTS service")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--address", help="use this BOTS server instead of starting one")
    p.add_argument("--tasks", type=int, default=2000, help="task pool size")
    p.add_argument("--max-len", type=int, default=8, help="longest task")
    p.add_argument("--batch", type=int, default=32, help="tasks per step")
    p.add_argument("--rollouts", type=int, default=8, help="completions per task (GRPO group size)")
    p.add_argument("--steps", type=int, default=400, help="training steps per run")
    p.add_argument("--seeds", type=int, default=3, help="runs per arm")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--entropy", type=float, default=0.02, help="entropy bonus")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--strategy", default="bots", choices=["bots", "mopps", "uniform"], help="the service's strategy")
    p.add_argument("--target", type=float, default=0.5, help="target success rate p*")
    p.add_argument("--forgetting", type=float, default=0.1, help="lambda")
    p.add_argument("--implicit-weight", type=float, default=0.1, help="rho; 0 turns the reference features off")
    p.add_argument("--selection-mode", default="thompson", choices=SELECTION_MODES, help="the service's selection mode")
    p.add_argument(
        "--track-prediction", type=float, default=0.0, help="carry posteriors along the plug-in's prediction (0: off)"
    )
    p.add_argument("--targets", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8])
    p.add_argument("--stop-early", action="store_true", help="stop a run once it reaches the highest target")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_PLOT,
        help="the PNG of the learning curves (under the current directory: build/ is gitignored in the checkout; "
        f"--out {COMMITTED_PLOT} regenerates the committed figure)",
    )  # fmt: skip
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: more threads only contend with the server process
    pool = make_pool(args.tasks, args.max_len, seed=1234)
    print(
        f"{len(pool)} cipher tasks of length 1-{args.max_len}; {args.batch} tasks x {args.rollouts} rollouts "
        f"per step, {args.steps} steps, {args.seeds} seeds per arm",
        flush=True,
    )
    curves: list[Curve] = []
    with (
        tempfile.TemporaryDirectory(prefix="bots-example-") as tmp,
        local_server(Path(tmp) / "bots.db") if args.address is None else _given(args.address) as address,
    ):
        print(f"BOTS server at {address}", flush=True)
        for seed in range(args.seeds):
            for arm in ("uniform", "service"):
                curve = train(arm, pool, args, seed, address)
                curves.append(curve)
                reached = ", ".join(f"{t:.1f}@{curve.steps_to(t) or '-'}" for t in args.targets)
                print(
                    f"{arm:>8} seed {seed}: accuracy {curve.acc[-1]:.3f} after {curve.steps[-1]} steps "
                    f"({curve.seconds:.1f} s); steps to accuracy {reached}",
                    flush=True,
                )
    print()
    print("Steps to reach each pool accuracy (per seed, and the mean):")
    print(summarize(curves, args.targets))
    if not args.no_plot:
        plot(curves, args.targets, args.max_len, args.out)
        print(f"\nlearning curves: {args.out}")
    return 0


@contextmanager
def _given(address: str) -> Iterator[str]:
    yield address


if __name__ == "__main__":
    sys.exit(main())
