"""The task families of the real-learner benchmark (bench/real_learner.py).

Every task is a string of input symbols x_1..x_L (plus an operation token in
family c) and a verifiable answer y_1..y_L over the same V symbols. The policy
is a small causal transformer that reads and writes one interleaved sequence

    BOS OP x_1 y_1 x_2 y_2 ... x_L y_L

and samples y_j right after x_j (so each answer symbol sits next to the input
symbol it is about; the prompt is the x's and the op, the completion the y's).
Everything is generated from (family, seed): the same seed gives the same
pool, answers and held-out set in every arm.

- a "chain" (prerequisites unlock tasks): y_j = P_j(x_j), a separate secret
  permutation P_j of the V symbols for every position j, all-or-nothing
  reward. A task of length L is solved only if positions 1..L all are, and
  position j is taught only by tasks of length >= j: length-1 tasks are
  learnable at once (pass rate 1/V), length-L tasks only after the tasks of
  length < L taught positions 1..L-1.
- b "tiers" (fixed per-task difficulty, a base policy that already solves the
  easy part): y_j = f(x_j) for one secret permutation f; a supervised warm-up
  teaches the base policy f on the "common" symbols and leaves it uniform on
  the "rare" ones. A task's difficulty is its number r of rare symbols: r = 0
  starts near pass rate 1 (nothing to learn), r = 1 is learnable from the start
  (pass rate about 1/V), r >= 2 near 0 until r = 1 tasks taught the rare
  symbols; a share of the pool has corrupted answers (a random string: never
  solvable, pass rate (1/V)^L). Held-out set: fresh clean strings with the
  pool's mix of r.
- c "partial" (continuous rewards): an operation token picks the rule (copy:
  y_j = x_j; cipher: y_j = f(x_j); positional cipher: y_j = P_j(x_j)); the
  reward is the fraction of correct answer symbols, in [0, 1], reported to
  the service as fractional successes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

FAMILIES = ("a", "b", "c")
FAMILY_NAMES = {"a": "chain", "b": "tiers", "c": "partial"}
OPS_C = ("copy", "cipher", "poscipher")


@dataclass(frozen=True)
class FamilySpec:
    """A family's shape and its training setup."""

    name: str
    vocab: int  # V: symbols per position
    max_len: int
    min_len: int
    num_tasks: int
    num_heldout: int  # 0: no held-out set
    fractional: bool  # reward = fraction of correct symbols (else all-or-nothing)
    steps: int  # the step budget of the full run
    targets: tuple[float, ...]  # pool accuracy (c: mean score) targets
    heldout_targets: tuple[float, ...] = ()
    eval_every: int = 10
    batch: int = 32  # tasks per step
    rollouts: int = 8  # GRPO group size
    lr: float = 3e-3
    entropy: float = 0.05
    reference_steps: int = 100  # the reference policy's GRPO steps (scaled with --steps)
    num_ops: int = 1
    # b: the warm-up of the base policy
    common: int = 0  # symbols the base policy knows
    warmup_steps: int = 0
    tier_shares: tuple[tuple[str, float], ...] = ()


SPECS: dict[str, FamilySpec] = {
    "a": FamilySpec(
        name="chain", vocab=8, max_len=6, min_len=1, num_tasks=600, num_heldout=0, fractional=False,
        steps=400, targets=(0.3, 0.5, 0.7),
    ),
    "b": FamilySpec(
        name="tiers", vocab=16, max_len=5, min_len=5, num_tasks=800, num_heldout=400, fractional=False,
        steps=300, targets=(0.45, 0.55, 0.65), heldout_targets=(0.55, 0.7, 0.8),
        common=10, warmup_steps=150,
        tier_shares=(("r0", 0.30), ("r1", 0.25), ("r2", 0.15), ("r3+", 0.10), ("corrupt", 0.20)),
    ),
    "c": FamilySpec(
        name="partial", vocab=10, max_len=8, min_len=2, num_tasks=900, num_heldout=0, fractional=True,
        steps=300, targets=(0.4, 0.6, 0.8), num_ops=len(OPS_C),
    ),
}  # fmt: skip


@dataclass
class TaskPool:
    """Tasks as tensors: ops [N], x and y [N, max_len] (0 past a task's
    length), lengths [N]; a stable key and a tier label each."""

    ops: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    lengths: torch.Tensor
    keys: list[str]
    tiers: list[str]
    tier_names: list[str] = field(default_factory=list)  # in display order

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> int:  # the DataLoader yields task indices
        return i

    def live(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, max_len] float mask of the positions inside each task."""
        lengths = self.lengths if rows is None else self.lengths[rows]
        return (torch.arange(self.x.shape[1])[None, :] < lengths[:, None]).float()


@dataclass
class Family:
    spec: FamilySpec
    pool: TaskPool
    heldout: TaskPool | None
    # b: what the warm-up teaches: the answers P_j(s) [max_len, V] of the common symbols s
    known: np.ndarray | None = None
    answer_map: np.ndarray | None = None


def _pool(
    ops: np.ndarray, x: np.ndarray, y: np.ndarray, lengths: np.ndarray, tiers: list[str], prefix: str,
    tier_names: list[str],
) -> TaskPool:  # fmt: skip
    pad = np.arange(x.shape[1])[None, :] >= lengths[:, None]
    x, y = x.copy(), y.copy()
    x[pad] = 0
    y[pad] = 0
    keys = [
        f"{prefix}-{i:05d}-{int(o)}-{''.join(f'{int(s):x}' for s in row[:n])}"
        for i, (o, n, row) in enumerate(zip(ops, lengths, x))
    ]
    return TaskPool(
        torch.as_tensor(ops, dtype=torch.long), torch.as_tensor(x, dtype=torch.long),
        torch.as_tensor(y, dtype=torch.long), torch.as_tensor(lengths, dtype=torch.long), keys, tiers, tier_names,
    )  # fmt: skip


def make_family(family: str, seed: int, spec: FamilySpec | None = None) -> Family:
    """The family's pool (and held-out set) for `seed`: the same in every arm."""
    spec = spec or SPECS[family]
    rng = np.random.default_rng([ord(family), seed, 20261])
    v, n, lmax = spec.vocab, spec.num_tasks, spec.max_len
    if family == "a":
        perms = np.stack([rng.permutation(v) for _ in range(lmax)])  # P_j
        lengths = rng.integers(spec.min_len, lmax + 1, size=n)
        x = rng.integers(0, v, size=(n, lmax))
        y = perms[np.arange(lmax)[None, :], x]
        tiers = [f"len{int(L)}" for L in lengths]
        names = [f"len{L}" for L in range(spec.min_len, lmax + 1)]
        return Family(spec, _pool(np.zeros(n, np.int64), x, y, lengths, tiers, "chain", names), None)
    if family == "b":
        f = np.stack([rng.permutation(v) for _ in range(lmax)])  # P_j
        order = rng.permutation(v)
        common, rare = order[: spec.common], order[spec.common :]
        known = np.zeros(v, dtype=bool)
        known[common] = True

        def draw(count: int, with_corrupt: bool, tag: str) -> TaskPool:
            shares = [(t, s) for t, s in spec.tier_shares if with_corrupt or t != "corrupt"]
            total = sum(s for _, s in shares)
            counts = [round(count * s / total) for _, s in shares]
            counts[0] += count - sum(counts)
            tiers: list[str] = [t for (t, _), c in zip(shares, counts) for _ in range(c)]
            xs = np.zeros((count, lmax), dtype=np.int64)
            ys = np.zeros((count, lmax), dtype=np.int64)
            for i, tier in enumerate(tiers):
                if tier == "corrupt":
                    r = int(rng.integers(0, 2))
                elif tier == "r3+":
                    r = int(rng.integers(3, lmax + 1))
                else:
                    r = int(tier[1:])
                slots = rng.permutation(lmax)[:r]
                row = rng.choice(common, size=lmax)
                row[slots] = rng.choice(rare, size=r)
                xs[i] = row
                ys[i] = rng.integers(0, v, size=lmax) if tier == "corrupt" else f[np.arange(lmax), row]
            perm = rng.permutation(count)  # mix the tiers over the keys
            xs, ys = xs[perm], ys[perm]
            tiers = [tiers[j] for j in perm]
            lengths = np.full(count, lmax)
            names = [t for t, _ in shares]
            return _pool(np.zeros(count, np.int64), xs, ys, lengths, tiers, tag, names)

        pool = draw(n, True, "tiers")
        heldout = draw(spec.num_heldout, False, "heldout")
        return Family(spec, pool, heldout, known=known, answer_map=f)
    if family == "c":
        f = rng.permutation(v)
        perms = np.stack([rng.permutation(v) for _ in range(lmax)])
        ops = rng.integers(0, len(OPS_C), size=n)
        lengths = rng.integers(spec.min_len, lmax + 1, size=n)
        x = rng.integers(0, v, size=(n, lmax))
        y = np.where(ops[:, None] == 0, x, np.where(ops[:, None] == 1, f[x], perms[np.arange(lmax)[None, :], x]))
        tiers = [OPS_C[int(o)] for o in ops]
        return Family(spec, _pool(ops, x, y, lengths, tiers, "partial", list(OPS_C)), None)
    raise ValueError(f"unknown family {family!r}: expected one of {', '.join(FAMILIES)}")


def score(pool: TaskPool, rows: torch.Tensor, completion: torch.Tensor, fractional: bool) -> torch.Tensor:
    """The verifier: the fraction of correct answer symbols (fractional), or
    1.0 when all are right, else 0.0."""
    width = completion.shape[1]  # the longest task among `rows`
    live = pool.live(rows)[:, :width]
    right = (completion == pool.y[rows][:, :width]).float() * live
    if fractional:
        return right.sum(dim=1) / live.sum(dim=1)
    return (right.sum(dim=1) == live.sum(dim=1)).float()
