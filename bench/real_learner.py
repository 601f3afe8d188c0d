"""Real learners: small transformers trained from scratch by GRPO, with
batches from a real BOTS server, against a uniform DataLoader.

    .venv/bin/python -m bench.real_learner --quick          # 1 seed, 10 steps a family: a smoke test, to a scratch path
    nice -n 10 .venv/bin/python -m bench.real_learner       # 5 seeds, all families, all arms but the oracles
    nice -n 10 .venv/bin/python -m bench.real_learner --sources  # two sources a run: adaptive vs fixed shares

The policy is a causal transformer (2 layers, d = 64, 4 heads, learned
positions; random weights from the seed, nothing downloaded) that reads the
interleaved sequence BOS OP x_1 y_1 ... x_L y_L and samples each answer symbol
y_j after the input symbol x_j, token by token (a key/value cache). Every
step takes `batch` tasks, samples `rollouts` completions of each, scores them
with the family's verifier and takes one GRPO step: group-normalised
advantages (r - mean) / (std + 1e-4) over each task's rollouts, a token-level
mean of -advantage * log-prob over the answer tokens (as DAPO), a small
entropy bonus, Adam. Groups whose rollouts all score the same carry no
gradient. The three task families are described in bench/real_learner_tasks.py.

Arms (ARMS, a name -> ExperimentConfig-overrides table; None: no service):
"uniform" is a shuffled DataLoader; every other arm draws its batches with
`BotsSampler` from an experiment created with
ExperimentConfig(rollouts_per_task=rollouts, seed=seed, **overrides) on one
`bots-server` (a temporary SQLite file) and reports each rollout's reward
(family c: `report_rewards(..., success_threshold=None)`, fractional
successes with their sum of squares, so the group's variance counts; an arm
with report_spread=0 sends the mean reward only, see ARM_ONLY). No arm gets reference pass rates (no weak/strong features), so
the plug-in and `track_prediction` are inert and "bots-plus" is the
expected-loss selection with forgetting 0.05.

With --sources each task of families a and b belongs to one of two sources
(SOURCES, its group on the server) and the arms (SOURCE_ARMS) differ in how
they mix them: fixed equal shares, shares ranked within [0.1, 0.9], or
`adaptive_shares` 1 or 0.5 within the same bounds; each source's share of the batches
over the run is reported beside the steps.

Deterministic per seed: the task pool, the held-out set, the initial weights
(family b: after the same warm-up), the rollout sampler's generator and the
experiment's seed are the same in every arm; torch runs single-threaded.
Runs on two CPU models can part after a hundred steps or so (torch's float
results differ between them): compare arms of one machine.
The metric: steps until the greedy accuracy over the pool (family c: the mean
score) first reaches each target, evaluated every `eval_every` steps
(family b also on the held-out set); a miss counts as the step budget. Per
seed, the ratio of an arm's steps to uniform's and to bots's.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench.common import RESULTS, machine_info, machine_line, scratch_dir, server_process, write_json
from bench.real_learner_tasks import FAMILIES, SPECS, Family, FamilySpec, TaskPool, make_family, score

# name -> ExperimentConfig overrides on top of (rollouts_per_task, seed); None: no service.
# A new engine is one more line here (or --arm NAME:key=value,... on the command line).
# Arms naming weak_feature / strong_feature get the tasks' reference pass rates
# (REFERENCE: "weak" of the initial policy, "strong" of a reference policy).
REFERENCE = {"weak_feature": "weak", "strong_feature": "strong"}
ARMS: dict[str, dict[str, Any] | None] = {
    "uniform": None,
    "bots": {},
    "expected": {"selection_mode": "expected"},
    "bots-plus": {"selection_mode": "expected", "track_prediction": 0.5, "forgetting": 0.05},
    "bots-ref": {**REFERENCE},
    "bots-plus-ref": {"selection_mode": "expected", "track_prediction": 0.5, "forgetting": 0.05, **REFERENCE},
    "bots-keep": {"keep_successes": 1.0},
    # Cross-task prediction (embedding_weight) from embeddings a trainer has
    # (EMBEDDINGS): the base policy's mean hidden state of the prompt, or a
    # fixed random-weights encoder's.
    "bots-embed": {"embedding_weight": 64.0, "embed": "hidden"},
    "bots-embed-enc": {"embedding_weight": 64.0, "embed": "encoder"},
    # Half of every batch uniform at random (uniform_share): the hedge for a
    # learner on which the ranking may not pay.
    "bots-half": {"uniform_share": 0.5},
    # No service: each step the policy's own pass rates pick the batch (see
    # oracle_batch). Not engines: what selection by pass rate could reach.
    # Run only when named (--arms uniform,bots,oracle): a pass over the
    # whole pool every step makes them the slowest arms.
    "oracle": {"oracle": "informative"},
    "oracle-unsolved": {"oracle": "unsolved"},
}
DEFAULT_ARMS = tuple(name for name, arm in ARMS.items() if not (arm or {}).get("oracle"))
# Arm keys that are not ExperimentConfig fields. On how the arm reports:
# report_spread=0 sends family c's mean rewards without their sum of squares
# (`--arm bots-mean:report_spread=0`), so the posterior follows the mean.
# With --sources: share_min / share_max set every source's share range
# (SetGroupShares; unset: no shares); first_share = x fixes the first
# source's share at x and the other's at 1 - x. entropy: the learner's
# entropy bonus in this arm (default the family's).
# No service: oracle=informative or oracle=unsolved, a batch picked with the
# policy's current pass rates (oracle_batch); uniform=1, the shuffled
# DataLoader (`--arm uniform-e0:uniform=1,entropy=0`).
ARM_ONLY = ("report_spread", "share_min", "share_max", "first_share", "entropy", "oracle", "uniform", "embed")
# embed=hidden: each task's embedding is the initial policy's mean final hidden
# state over its prompt (BOS OP x_1 .. x_L), what a trainer's own model gives;
# embed=encoder: the same from a fixed random-weights policy of the family's
# shape (ENCODER_SEED), a stand-in for a generic text encoder.
EMBEDDINGS = ("hidden", "encoder")
ENCODER_SEED = 4242
# --sources: every task's source (its group on the server) by its tier. Two
# datasets of one family that a run mixes: a the short chains (lengths 1-3)
# and the long ones; b the curated tasks (r >= 1) and the scraped ones
# (already solved, r = 0, or corrupted).
SOURCES = {
    "a": {"len1": "short", "len2": "short", "len3": "short", "len4": "long", "len5": "long", "len6": "long"},
    "b": {"r1": "curated", "r2": "curated", "r3+": "curated", "r0": "scraped", "corrupt": "scraped"},
}
SOURCE_ARMS: dict[str, dict[str, Any] | None] = {
    "uniform": None,
    "bots": {},
    "fixed": {"share_min": 0.5, "share_max": 0.5},
    "ranked": {"share_min": 0.1, "share_max": 0.9},
    "adaptive": {"adaptive_shares": 1.0, "share_min": 0.1, "share_max": 0.9},
    "adaptive-half": {"adaptive_shares": 0.5, "share_min": 0.1, "share_max": 0.9},
}
QUICK_STEPS = {"a": 10, "b": 10, "c": 10}  # --quick budgets (1 seed): a smoke test, not a result


# -- the policy -----------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (with an optional
    key/value cache of the positions before) and an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(
        self, h: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, d = h.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(h)).split(d, -1))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        before = k.shape[2] - t
        if before == 0:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.ones(t, before + t, dtype=torch.bool).tril(diagonal=before)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.ln2(h)), (k, v)


class Policy(nn.Module):
    """A small causal transformer over the interleaved sequence
    BOS OP x_1 y_1 ... x_L y_L; y_j is read from the output at x_j.
    Token ids: input symbols 0..V-1, answer symbols V..2V-1, BOS 2V, ops after."""

    def __init__(self, vocab: int, max_len: int, num_ops: int, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.vocab = vocab
        self.bos = 2 * vocab
        self.op0 = 2 * vocab + 1
        self.tok = nn.Embedding(2 * vocab + 1 + num_ops, d)
        self.pos = nn.Embedding(2 + 2 * max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(
        self, tokens: torch.Tensor, start: int = 0, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Answer-symbol logits at every position of `tokens` (placed at
        `start`, after the cached positions `past`), and the new cache."""
        h = self.tok(tokens) + self.pos(torch.arange(start, start + tokens.shape[1]))[None]
        cache = []
        for i, block in enumerate(self.blocks):
            h, kv = block(h, None if past is None else past[i])
            cache.append(kv)
        return self.head(self.ln(h)), cache

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states [rows, positions, d] of `tokens` from position 0."""
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            h, _ = block(h)
        return self.ln(h)

    def prompt(self, pool: TaskPool, rows: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.full_like(rows, self.bos), self.op0 + pool.ops[rows]], dim=1)

    @torch.no_grad()
    def generate(
        self, pool: TaskPool, rows: torch.Tensor, generator: torch.Generator | None = None, greedy: bool = False
    ) -> torch.Tensor:
        """Completions [rows, L] (L: the longest task among `rows`), sampled
        token by token (greedy: the most likely symbol)."""
        length = int(pool.lengths[rows].max())
        x = pool.x[rows]
        chunk = torch.cat([self.prompt(pool, rows), x[:, :1]], dim=1)
        past, start, out = None, 0, []
        for j in range(length):
            logits, past = self(chunk, start, past)
            start += chunk.shape[1]
            last = logits[:, -1]
            if greedy:
                y = last.argmax(dim=-1)
            else:
                y = torch.multinomial(torch.softmax(last, dim=-1), 1, generator=generator).squeeze(1)
            out.append(y)
            if j + 1 < length:
                chunk = torch.stack([self.vocab + y, x[:, j + 1]], dim=1)
        return torch.stack(out, dim=1)

    def log_probs(self, pool: TaskPool, rows: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log-probabilities of the completions `y` [rows, L]
        and the policy's entropy at each answer position."""
        length = y.shape[1]
        inter = torch.stack([pool.x[rows][:, :length], self.vocab + y], dim=2).flatten(1)[:, :-1]
        logits, _ = self(torch.cat([self.prompt(pool, rows), inter], dim=1))
        logp_all = torch.log_softmax(logits[:, 2::2], dim=-1)  # the outputs at x_1 .. x_L
        logp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
        return logp, entropy


def evaluate(policy: Policy, pool: TaskPool, fractional: bool) -> torch.Tensor:
    """Greedy scores of every task of `pool`."""
    rows = torch.arange(len(pool))
    return score(pool, rows, policy.generate(pool, rows, greedy=True), fractional)


def grpo_step(
    policy: Policy, optimizer: torch.optim.Optimizer, pool: TaskPool, idx: torch.Tensor, spec: FamilySpec,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sample `spec.rollouts` completions per task, score them, one GRPO
    update. Returns the rows (task index of each rollout) and the rewards."""
    rows = idx.repeat_interleave(spec.rollouts)
    y = policy.generate(pool, rows, generator)
    reward = score(pool, rows, y, spec.fractional)
    groups = reward.view(-1, spec.rollouts)
    advantage = ((groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    logp, entropy = policy.log_probs(pool, rows, y)
    live = pool.live(rows)[:, : y.shape[1]]
    loss = -((advantage[:, None] * logp * live).sum() + spec.entropy * (entropy * live).sum()) / live.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return rows, reward


def warm_up(policy: Policy, family: Family, seed: int) -> None:
    """Family b's base policy: supervised steps on random strings that teach
    the answers of the common symbols and a uniform answer on the rare ones
    (the base policy knows what it does not know)."""
    spec, known, answer = family.spec, family.known, family.answer_map
    assert known is not None and answer is not None
    generator = torch.Generator().manual_seed(10_000 + seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=spec.lr)
    known_t, answer_t = torch.as_tensor(known), torch.as_tensor(answer)
    uniform = torch.full((spec.vocab,), 1.0 / spec.vocab)
    for _ in range(spec.warmup_steps):
        x = torch.randint(0, spec.vocab, (128, spec.max_len), generator=generator)
        noise = torch.randint(0, spec.vocab, x.shape, generator=generator)
        y = torch.where(known_t[x], answer_t[torch.arange(spec.max_len)[None, :], x], noise)  # what the base policy writes
        pool = TaskPool(torch.zeros(len(x), dtype=torch.long), x, y, torch.full((len(x),), spec.max_len), [], [])
        inter = torch.stack([x, policy.vocab + y], dim=2).flatten(1)[:, :-1]
        logits, _ = policy(torch.cat([policy.prompt(pool, torch.arange(len(x))), inter], dim=1))
        logp_all = torch.log_softmax(logits[:, 2::2], dim=-1)
        target = torch.where(known_t[x][..., None], F.one_hot(y, spec.vocab).float(), uniform)
        loss = -(target * logp_all).sum(dim=-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def initial_policy(family: Family, seed: int) -> Policy:
    """The seed's initial weights (family b: after the warm-up): the same in every arm."""
    torch.manual_seed(seed)
    spec = family.spec
    policy = Policy(spec.vocab, spec.max_len, spec.num_ops)
    if spec.warmup_steps:
        warm_up(policy, family, seed)
    return policy


@torch.no_grad()
def pass_rates(policy: Policy, pool: TaskPool, fractional: bool) -> np.ndarray:
    """Each task's pass rate under `policy`, from one teacher-forced pass:
    exact for all-or-nothing rewards (the product of the probabilities of
    the right symbols, each given a right prefix); for partial credit the
    mean of those probabilities (the expected score if earlier mistakes did
    not change later answers)."""
    out = []
    for rows in torch.arange(len(pool)).split(1024):
        logp, _ = policy.log_probs(pool, rows, pool.y[rows])
        live = pool.live(rows)
        if fractional:
            out.append((logp.exp() * live).sum(dim=1) / live.sum(dim=1))
        else:
            out.append((logp * live).sum(dim=1).exp())
    return torch.cat(out).double().numpy()


# A task counts as solved for the "unsolved" oracle at this pass rate: a
# group of 8 rollouts is then all right at least 43% of the time.
SOLVED = 0.9


@torch.no_grad()
def oracle_batch(policy: Policy, pool: TaskPool, spec: FamilySpec, rule: str, rng: np.random.Generator) -> torch.Tensor:
    """A batch picked with the policy's pass rates now (family c:
    approximate, see pass_rates), what no service can know:

    - "informative": the `spec.batch` tasks whose groups of `spec.rollouts`
      are most likely informative, largest 1 - p^m - (1 - p)^m, ties at random;
    - "unsolved": uniformly at random among the tasks below SOLVED (the
      lowest pass rates when fewer are left)."""
    p = pass_rates(policy, pool, spec.fractional)
    if rule == "informative":
        m = spec.rollouts
        chance = 1.0 - p**m - (1.0 - p) ** m
        return torch.as_tensor(np.lexsort((rng.random(len(p)), -chance))[: spec.batch])
    if rule == "unsolved":
        candidates = np.flatnonzero(p < SOLVED)
        if len(candidates) < spec.batch:
            candidates = np.argsort(p, kind="stable")[: spec.batch]
        return torch.as_tensor(rng.choice(candidates, spec.batch, replace=False))
    raise ValueError(f"unknown oracle rule {rule!r}: expected informative or unsolved")


@torch.no_grad()
def task_embeddings(kind: str, family: Family, init: Policy) -> np.ndarray:
    """Every task's embedding [tasks, d] float32 (see EMBEDDINGS): the mean
    final hidden state over its prompt BOS OP x_1 .. x_L, from the initial
    policy (hidden) or from a random-weights policy (encoder)."""
    if kind == "hidden":
        encoder = init
    elif kind == "encoder":
        spec = family.spec
        with torch.random.fork_rng():
            torch.manual_seed(ENCODER_SEED)
            encoder = Policy(spec.vocab, spec.max_len, spec.num_ops)
    else:
        raise ValueError(f"unknown embedding {kind!r}: expected one of {', '.join(EMBEDDINGS)}")
    pool = family.pool
    rows = torch.arange(len(pool))
    tokens = torch.cat([encoder.prompt(pool, rows), pool.x], dim=1)
    live = (torch.arange(tokens.shape[1])[None, :] < 2 + pool.lengths[:, None]).float()
    hidden = encoder.hidden(tokens)
    mean = (hidden * live[..., None]).sum(dim=1) / live.sum(dim=1, keepdim=True)
    return mean.numpy().astype(np.float32)


def reference_features(family: Family, seed: int, init: Policy, steps: int) -> list[dict[str, float]]:
    """Two reference pass rates per task, measured offline as with real
    reference models: "weak", the initial policy's; "strong", a reference
    policy's: the initial policy after `steps` GRPO steps with uniform
    batches and other rollout and shuffle seeds than any arm's."""
    weak = pass_rates(init, family.pool, family.spec.fractional)
    reference = train(family, "reference", None, 7919 + seed, steps, init, None, stop_early=False, policy_out=True)
    assert isinstance(reference, Policy)
    strong = pass_rates(reference, family.pool, family.spec.fractional)
    return [{"weak": float(w), "strong": float(s)} for w, s in zip(weak, strong)]


def reference_summary(family: Family, seed: int, steps: int, features: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """The reference pass rates' mean per tier (what the plug-in can know)."""
    tiers = np.asarray(family.pool.tiers)
    weak = np.asarray([f["weak"] for f in features])
    strong = np.asarray([f["strong"] for f in features])
    return {
        "seed": seed, "reference_steps": steps,
        "mean_by_tier": {t: [float(weak[tiers == t].mean()), float(strong[tiers == t].mean())]
                         for t in family.pool.tier_names},
    }  # fmt: skip


# -- one training run -----------------------------------------------------------------


@dataclass
class Curve:
    family: str
    arm: str
    seed: int
    budget: int
    steps: list[int] = field(default_factory=list)
    acc: list[float] = field(default_factory=list)  # greedy pool accuracy (c: mean score)
    heldout: list[float] = field(default_factory=list)  # family b
    tier_acc: list[dict[str, float]] = field(default_factory=list)  # per tier, at each evaluation
    # per evaluation window (steps since the last evaluation):
    informative: list[float] = field(default_factory=list)  # groups with unequal rewards
    mean_reward: list[float] = field(default_factory=list)
    tier_share: list[dict[str, float]] = field(default_factory=list)  # what the batches held
    tier_counts: dict[str, int] = field(default_factory=dict)  # tasks per tier in the pool
    reported_outcomes: int = 0  # (task, successes, trials) sent to the server
    fractional_outcomes: int = 0  # of those with a fractional successes value
    seconds: float = 0.0

    def steps_to(self, target: float, heldout: bool = False) -> int | None:
        for step, acc in zip(self.steps, self.heldout if heldout else self.acc):
            if acc >= target - 1e-9:
                return step
        return None


def _record_reports(client: Any, curve: Curve) -> None:
    """Count what goes over the wire: the outcomes of every ReportOutcomes /
    ReportAndSelect call this run's client makes (and the server accepts)."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(experiment: str, batch_id: str, outcomes: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
            result = method(experiment, batch_id, outcomes, *args, **kwargs)
            values = [float(v[0]) for v in outcomes.values()]
            curve.reported_outcomes += len(values)
            curve.fractional_outcomes += sum(1 for s in values if s != int(s))
            return result

        return call

    client.report_outcomes = wrap(client.report_outcomes)
    client.report_and_select = wrap(client.report_and_select)


def uses_service(overrides: Mapping[str, Any] | None) -> bool:
    """Whether an arm draws its batches from the server (uniform and the oracle do not)."""
    return overrides is not None and not overrides.get("oracle") and not overrides.get("uniform")


def train(
    family: Family, arm: str, overrides: dict[str, Any] | None, seed: int, budget: int, init: Policy,
    address: str | None, stop_early: bool = True, verbose: bool = False,
    features: Sequence[Mapping[str, float]] | None = None, policy_out: bool = False,
    sources: Mapping[str, str] | None = None,
) -> Any:  # fmt: skip
    """One run of `budget` steps from `init`: the Curve (policy_out: the
    trained policy). `features` go to the server with the tasks when the
    arm's config names them; `sources` (tier -> source) gives each task its
    group, and the arm's share_min / share_max (or first_share) set the
    sources' shares."""
    from torch.utils.data import DataLoader

    import bots_client
    from bots_client.integrations import Curriculum, aggregate_outcomes
    from bots_client.integrations.torch import BotsSampler

    spec, pool = family.spec, family.pool
    if overrides and "entropy" in overrides:
        spec = replace(spec, entropy=float(overrides["entropy"]))
    policy = copy.deepcopy(init)
    optimizer = torch.optim.Adam(policy.parameters(), lr=spec.lr)
    generator = torch.Generator().manual_seed(1_000_003 * seed + ord(family.spec.name[0]))
    curve = Curve(spec.name, arm, seed, budget)
    curve.tier_counts = {t: pool.tiers.count(t) for t in pool.tier_names}
    sampler = None
    report_spread = True
    if not uses_service(overrides):
        loader: Any = DataLoader(
            pool, batch_size=spec.batch, shuffle=True, drop_last=True,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
    else:
        assert address is not None, "a service arm needs a server"
        report_spread = bool(overrides.get("report_spread", True))
        fields = {k: v for k, v in overrides.items() if k not in ARM_ONLY}
        config = bots_client.ExperimentConfig(**{"rollouts_per_task": spec.rollouts, "seed": seed, **fields})
        if config.weak_feature and features is None:
            raise ValueError(f"arm {arm!r} names reference features, but none were measured")
        if overrides.get("embed"):
            config = replace(config, embedding_dim=init.ln.normalized_shape[0])
            _add_tasks_with_embeddings(
                address, f"{spec.name}-{arm}-seed{seed}", config, pool.keys,
                task_embeddings(str(overrides["embed"]), family, init),
                features if config.weak_feature else None,
            )  # fmt: skip
        curriculum = Curriculum(
            address, f"{spec.name}-{arm}-seed{seed}", pool.keys, batch_size=spec.batch, config=config,
            features=features if config.weak_feature else None,
            groups=None if sources is None else [sources[t] for t in pool.tiers],
        )  # fmt: skip
        shares = source_shares(overrides, sources)
        if shares:
            curriculum.ensure_ready()
            curriculum.client.set_group_shares(curriculum.experiment, shares)
        sampler = BotsSampler(curriculum=curriculum)
        _record_reports(sampler.curriculum.client, curve)
        loader = DataLoader(pool, batch_size=sampler.local_batch_size, sampler=sampler)

    def batches() -> Iterator[torch.Tensor]:
        if overrides is not None and overrides.get("oracle"):
            rng = np.random.default_rng(seed)
            while True:
                yield oracle_batch(policy, pool, spec, str(overrides["oracle"]), rng)
        while True:
            yield from loader

    def evaluation(step: int) -> None:
        scores = evaluate(policy, pool, spec.fractional)
        curve.steps.append(step)
        curve.acc.append(float(scores.mean()))
        tiers = np.asarray(pool.tiers)
        curve.tier_acc.append({t: float(scores[torch.as_tensor(tiers == t)].mean()) for t in pool.tier_names})
        if family.heldout is not None:
            curve.heldout.append(float(evaluate(policy, family.heldout, spec.fractional).mean()))

    def done() -> bool:
        if curve.acc[-1] < max(spec.targets) - 1e-9:
            return False
        return not spec.heldout_targets or curve.heldout[-1] >= max(spec.heldout_targets) - 1e-9

    start = time.perf_counter()
    evaluation(0)
    window: dict[str, float] = {}
    informative = mean_reward = 0.0
    for step, idx in enumerate(batches(), start=1):
        rows, reward = grpo_step(policy, optimizer, pool, idx, spec, generator)
        groups = reward.view(-1, spec.rollouts)
        informative += float((groups.max(dim=1).values > groups.min(dim=1).values).float().mean())
        mean_reward += float(reward.mean())
        for i in idx.tolist():
            window[pool.tiers[i]] = window.get(pool.tiers[i], 0.0) + 1.0
        if sampler is not None:
            threshold = None if spec.fractional else 0.5
            keys = [pool.keys[i] for i in rows.tolist()]
            outcomes = aggregate_outcomes(keys, reward.tolist(), success_threshold=threshold)
            sampler.report(outcomes if report_spread else {k: v[:2] for k, v in outcomes.items()})
        if step % spec.eval_every == 0 or step == budget:
            evaluation(step)
            span = step - curve.steps[-2]
            curve.informative.append(informative / span)
            curve.mean_reward.append(mean_reward / span)
            total = sum(window.values())
            curve.tier_share.append({t: window.get(t, 0.0) / total for t in pool.tier_names})
            window, informative, mean_reward = {}, 0.0, 0.0
            if verbose:
                held = f", held-out {curve.heldout[-1]:.3f}" if curve.heldout else ""
                print(f"    [{spec.name} {arm} seed {seed}] step {step:4d}: accuracy {curve.acc[-1]:.3f}{held}", flush=True)
            if stop_early and done():
                break
        if step >= budget:
            break
    curve.seconds = time.perf_counter() - start
    if sampler is not None:
        sampler.wait()  # the last report runs in the background: acknowledged (or raised) before closing
        sampler.curriculum.client.close()
    return policy if policy_out else curve


def _add_tasks_with_embeddings(
    address: str, experiment: str, config: Any, keys: Sequence[str], embeddings: np.ndarray,
    features: Sequence[Mapping[str, float]] | None,
) -> None:  # fmt: skip
    """Create the experiment with its tasks and their embeddings (the
    Curriculum then finds every task there)."""
    import bots_client

    with bots_client.Client(address) as client:
        client.create_experiment(experiment, config)
        client.add_tasks(
            experiment,
            (
                bots_client.Task(key, {} if features is None else dict(features[i]), embedding=embeddings[i])
                for i, key in enumerate(keys)
            ),
        )


def source_shares(overrides: Mapping[str, Any], sources: Mapping[str, str] | None) -> dict[str, tuple[float, float]]:
    """The shares an arm sets on its sources (see ARM_ONLY); {}: none."""
    if not {"share_min", "share_max", "first_share"} & set(overrides):
        return {}
    if sources is None:
        raise ValueError("an arm that sets source shares needs --sources")
    names = list(dict.fromkeys(sources.values()))
    if "first_share" in overrides:
        first = float(overrides["first_share"])
        return {names[0]: (first, first), names[1]: (1 - first, 1 - first)}
    share = (float(overrides.get("share_min", 0.0)), float(overrides.get("share_max", 1.0)))
    return dict.fromkeys(names, share)


# -- the summary ----------------------------------------------------------------------


def _steps(curve: Curve, target: float, heldout: bool) -> int:
    """Steps to the target; a miss counts as the budget."""
    reached = curve.steps_to(target, heldout)
    return curve.budget if reached is None else reached


def _median_range(values: Sequence[float], digits: int = 2) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summarize(
    curves: Sequence[Curve], spec: FamilySpec, arms: Sequence[str], bases: Sequence[str] = ("uniform", "bots")
) -> list[dict[str, Any]]:
    """Per target and arm: steps per seed (misses at the budget), the per-seed
    ratios to each base arm, their median and range."""
    rows = []
    metrics = [("pool", t, False) for t in spec.targets] + [("held-out", t, True) for t in spec.heldout_targets]
    seeds = sorted({c.seed for c in curves})
    by = {(c.arm, c.seed): c for c in curves}
    for metric, target, heldout in metrics:
        for arm in arms:
            runs = [by[(arm, s)] for s in seeds if (arm, s) in by]
            steps = [_steps(c, target, heldout) for c in runs]
            row: dict[str, Any] = {
                "metric": metric, "target": target, "arm": arm, "seeds": [c.seed for c in runs],
                "steps": steps, "missed": [c.steps_to(target, heldout) is None for c in runs],
                "median_steps": statistics.median(steps) if steps else None,
            }  # fmt: skip
            for base in bases:
                ratios = [
                    _steps(c, target, heldout) / _steps(by[(base, c.seed)], target, heldout)
                    for c in runs
                    if (base, c.seed) in by
                ]
                row[f"ratio_to_{base}"] = ratios
                row[f"median_ratio_to_{base}"] = statistics.median(ratios) if ratios else None
            rows.append(row)
    return rows


def _cell_steps(row: dict[str, Any], budget: int) -> str:
    shown = ",".join(f">{budget}" if miss else str(s) for s, miss in zip(row["steps"], row["missed"]))
    return f"{shown} | {_median_range(row['steps'], 0)}"


def family_markdown(
    family: str, spec: FamilySpec, curves: Sequence[Curve], rows: Sequence[dict[str, Any]],
    bases: Sequence[str] = ("uniform", "bots"), sources: Mapping[str, str] | None = None,
) -> str:  # fmt: skip
    budget = max(c.budget for c in curves)
    seeds = sorted({c.seed for c in curves})
    what = "mean greedy score (fraction of correct symbols)" if spec.fractional else "greedy exact-match accuracy"
    lines = [
        f"## Family {family}: {spec.name}",
        "",
        f"{spec.num_tasks} tasks (V = {spec.vocab}, lengths {spec.min_len}-{spec.max_len}), {spec.batch} tasks x "
        f"{spec.rollouts} rollouts a step, budget {budget} steps, evaluated every {spec.eval_every} steps, seeds "
        f"{', '.join(map(str, seeds))}. Metric: {what} over the pool"
        + (f" and over {spec.num_heldout} held-out tasks" if spec.num_heldout else "")
        + f". Steps to each target per seed ('>{budget}': missed, counted as {budget}); ratios per seed to "
        f"{', '.join(bases)}'s steps; median (range) over seeds.",
        "",
        "| metric | target | arm | steps per seed | median (range) | "
        + " | ".join(f"/ {b}: median (range)" for b in bases) + " |",
        "|---|---|---|---|---|" + "---|" * len(bases),
    ]  # fmt: skip
    for r in rows:
        ratios = " | ".join(_median_range(r[f"ratio_to_{b}"]) for b in bases)
        lines.append(f"| {r['metric']} | {r['target']:.2f} | {r['arm']} | {_cell_steps(r, budget)} | {ratios} |")
    lines += ["", "Per arm (mean over seeds): final pool accuracy, informative groups, what the batches held:", ""]
    tier_names = family_tiers(curves)
    lines += [
        "| arm | final accuracy | informative groups | mean reward | batch share by tier (" + ", ".join(tier_names)
        + ") | seconds a run |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for arm in dict.fromkeys(c.arm for c in curves):
        runs = [c for c in curves if c.arm == arm]
        final = np.mean([c.acc[-1] for c in runs])
        info = np.mean([np.mean(c.informative) for c in runs if c.informative] or [0.0])
        reward = np.mean([np.mean(c.mean_reward) for c in runs if c.mean_reward] or [0.0])
        shares = []
        for t in tier_names:
            per_run = []
            for c in runs:
                weights = np.diff(c.steps)
                per_run.append(sum(w * s.get(t, 0.0) for w, s in zip(weights, c.tier_share)) / max(1, c.steps[-1]))
            shares.append(f"{np.mean(per_run):.2f}")
        held = f" (held-out {np.mean([c.heldout[-1] for c in runs]):.3f})" if runs[0].heldout else ""
        lines.append(
            f"| {arm} | {final:.3f}{held} | {info:.2f} | {reward:.3f} | {' / '.join(shares)} | "
            f"{np.mean([c.seconds for c in runs]):.1f} |"
        )
    if sources is not None:
        lines += ["", sources_markdown(curves, sources)]
    return "\n".join(lines) + "\n"


def sources_markdown(curves: Sequence[Curve], sources: Mapping[str, str]) -> str:
    """Per arm (mean over seeds): each source's share of the batches in the
    first and the second half of the steps run, and its final accuracy."""
    names = list(dict.fromkeys(sources.values()))
    lines = [
        "Per source (mean over seeds): share of the batches in the first / second half of the steps run, "
        "final accuracy over the source's tasks:",
        "",
        "| arm | " + " | ".join(f"{n}: share, first / second half | {n}: final accuracy" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for arm in dict.fromkeys(c.arm for c in curves):
        runs = [c for c in curves if c.arm == arm]
        cells = []
        for name in names:
            halves = np.mean([_source_share_by_half(c, sources, name) for c in runs], axis=0)
            final = np.mean([_source_accuracy(c, sources, name) for c in runs])
            cells += [f"{halves[0]:.2f} / {halves[1]:.2f}", f"{final:.3f}"]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _source_share_by_half(curve: Curve, sources: Mapping[str, str], name: str) -> tuple[float, float]:
    """The source's share of the batches in the evaluation windows of the first
    and of the second half of the steps run, each window weighted by its steps."""
    spans = np.diff(curve.steps)
    held = np.array([sum(v for t, v in share.items() if sources.get(t) == name) for share in curve.tier_share])
    first = np.asarray(curve.steps[:-1]) + spans / 2 < curve.steps[-1] / 2
    first_half, second_half = (
        float(np.average(held[half], weights=spans[half])) if half.any() else float("nan") for half in (first, ~first)
    )
    return first_half, second_half


def _source_accuracy(curve: Curve, sources: Mapping[str, str], name: str) -> float:
    """The final accuracy over the source's tiers, weighted by their tasks (tier_acc is per tier)."""
    tiers = [t for t in curve.tier_acc[-1] if sources.get(t) == name]
    counts = curve.tier_counts
    return sum(curve.tier_acc[-1][t] * counts[t] for t in tiers) / sum(counts[t] for t in tiers)


def family_tiers(curves: Sequence[Curve]) -> list[str]:
    names: dict[str, None] = {}
    for c in curves:
        for share in c.tier_share:
            names.update(dict.fromkeys(share))
    return list(names)


# -- the command line -----------------------------------------------------------------


def parse_arm(text: str) -> tuple[str, dict[str, Any]]:
    """NAME:key=value,key=value -> (NAME, overrides); values are int, float or str."""
    name, _, rest = text.partition(":")
    overrides: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        value: Any = raw
        for kind in (int, float):
            try:
                value = kind(raw)
                break
            except ValueError:
                continue
        overrides[key.strip()] = value
    return name.strip(), overrides


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 seed, short budgets: a smoke test (under 3 minutes)")
    p.add_argument("--families", default=None, help="comma-separated: a (chain), b (tiers), c (partial); default all")
    p.add_argument(
        "--arms", default=None,
        help=f"comma-separated names from ARMS ({', '.join(ARMS)}); default all but the oracles",
    )  # fmt: skip
    p.add_argument(
        "--sources", action="store_true",
        help=f"two sources per family (SOURCES: families {', '.join(SOURCES)}) and the arms of SOURCE_ARMS "
        f"({', '.join(SOURCE_ARMS)}): adaptive shares against fixed ones",
    )  # fmt: skip
    p.add_argument(
        "--arm", action="append", default=[], metavar="NAME:key=value,...",
        help="one more arm: ExperimentConfig overrides (e.g. lambda05:forgetting=0.05); repeatable",
    )  # fmt: skip
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 5; --quick: 1)")
    p.add_argument(
        "--first-seed", type=int, default=0,
        help="start the seeds there (first..first+N-1): runs of other seeds to merge (real_learner_summary --merge)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="the step budget of every family (default: per family)")
    p.add_argument("--no-stop-early", action="store_true", help="run the whole budget after the last target")
    p.add_argument(
        "--output", default=None,
        help="path without suffix (.json, .md); default results/real-learner[-sources] (--quick: a scratch directory)",
    )  # fmt: skip
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.families is None:
        args.families = ",".join(SOURCES if args.sources else FAMILIES)
    if args.output is None:
        name = "real-learner-sources" if args.sources else "real-learner"
        # a smoke run never overwrites the committed results
        args.output = str(Path(scratch_dir()) / name) if args.quick else str(RESULTS / name)
    args.argv = ["python -m bench.real_learner", *(sys.argv[1:] if argv is None else argv)]
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # tiny tensors: more threads only contend with the server process
    torch.use_deterministic_algorithms(True)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    allowed = SOURCES if args.sources else SPECS
    for f in families:
        if f not in allowed:
            raise SystemExit(f"unknown family {f!r}: expected some of {', '.join(allowed)}")
    arms = SOURCE_ARMS if args.sources else ARMS
    table: dict[str, dict[str, Any] | None] = dict(arms)
    default = list(SOURCE_ARMS) if args.sources else list(DEFAULT_ARMS)
    names = default if args.arms is None else [a.strip() for a in args.arms.split(",") if a.strip()]
    for text in args.arm:
        name, overrides = parse_arm(text)
        table[name] = overrides
        if name not in names:
            names.append(name)
    for name in names:
        if name not in table:
            raise SystemExit(f"unknown arm {name!r}: expected some of {', '.join(table)} or --arm NAME:key=value")
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 5)
    bases = ["uniform", "bots", *(["fixed"] if args.sources and "fixed" in names else [])]
    info = machine_info()
    started = time.perf_counter()
    result: dict[str, Any] = {"machine": info, "command": " ".join(args.argv), "arms": {n: table[n] for n in names}}
    result["families"] = {}
    server = None
    db_dir = scratch_dir()
    try:
        if any(uses_service(table[n]) for n in names):
            server = server_process(f"sqlite:///{db_dir}/bots.db").start()
        for fam in families:
            spec = SPECS[fam]
            budget = args.steps or (QUICK_STEPS[fam] if args.quick else spec.steps)
            spec = replace(spec, steps=budget)
            curves: list[Curve] = []
            sources = SOURCES[fam] if args.sources else None
            print(f"family {fam} ({spec.name}): {spec.num_tasks} tasks, budget {budget} steps", flush=True)
            references: list[dict[str, Any]] = []
            for seed in range(args.first_seed, args.first_seed + seeds):
                family = make_family(fam, seed, spec)
                init = initial_policy(family, seed)
                features = None
                if any((table[n] or {}).get("weak_feature") for n in names):
                    ref_steps = max(1, round(spec.reference_steps * budget / SPECS[fam].steps))
                    features = reference_features(family, seed, init, ref_steps)
                    references.append(reference_summary(family, seed, ref_steps, features))
                for arm in names:
                    curve = train(
                        family, arm, table[arm], seed, budget, init, None if server is None else server.address,
                        stop_early=not args.no_stop_early, verbose=args.verbose, features=features, sources=sources,
                    )  # fmt: skip
                    curves.append(curve)
                    reached = ", ".join(f"{t:g}@{curve.steps_to(t) or '-'}" for t in spec.targets)
                    if spec.heldout_targets:
                        reached += "; held-out " + ", ".join(
                            f"{t:g}@{curve.steps_to(t, heldout=True) or '-'}" for t in spec.heldout_targets
                        )
                    print(
                        f"  seed {seed} {arm:>10}: accuracy {curve.acc[0]:.3f} -> {curve.acc[-1]:.3f} after "
                        f"{curve.steps[-1]} steps ({curve.seconds:.1f} s); steps to {reached}",
                        flush=True,
                    )
            rows = summarize(curves, spec, names, bases)
            result["families"][fam] = {
                "spec": asdict(spec), "references": references, "curves": [asdict(c) for c in curves], "summary": rows,
                "sources": sources, "markdown": family_markdown(fam, spec, curves, rows, bases, sources),
            }  # fmt: skip
    finally:
        if server is not None:
            server.stop()
        import shutil

        shutil.rmtree(db_dir, ignore_errors=True)
    result["wall_seconds"] = time.perf_counter() - started
    try:
        import os

        result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return result


def report_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Real learners: GRPO on small transformers, uniform vs. the service's engines",
        "",
        machine_line(result["machine"]),
        "",
        f"`{result['command']}`: {result['wall_seconds']:.0f} s wall, load at end {result.get('loadavg_at_end')}. "
        "Arms (ExperimentConfig overrides on rollouts_per_task and seed; null: no service): "
        f"`{json.dumps(result['arms'])}`.",
        "",
    ]
    for data in result["families"].values():
        lines.append(data["markdown"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    out = Path(args.output)
    write_json(out.with_suffix(".json"), result)
    text = report_markdown(result)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
