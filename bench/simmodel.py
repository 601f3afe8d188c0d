"""The simulated world of the learning-dynamics benchmark: tasks, a learner,
reference models. Pure numpy, no I/O (bench/simulate.py drives it).

Tasks follow a two-parameter item-response model with skills: task i needs
skill k_i, has difficulty b_i and discrimination a_i, and a model with
per-skill ability theta solves it with probability

    p_i(theta) = sigmoid(a_i * (theta[k_i] - b_i) + e_i).

e_i is a model-specific affinity for the task (every model, the learner and
each reference model, has its own, drawn once): models that agree on skills
still disagree on particular problems, which is what makes predictions from
reference models imperfect.

The learner is an RL policy trained GRPO-style: each step it rolls out m
attempts of each of the B tasks of its batch, and each group's gradient
signal is the variance of its rewards, r (1 - r) with r = k / m (in
expectation proportional to p (1 - p); exactly 0 for all-correct and
all-wrong groups, which have zero advantage). The signal raises the ability
of the task's skill, with some transfer to every skill, and the step's
update is averaged over the B groups, so groups without signal dilute it:

    theta[k] += lr / B * sum_{i in batch} a_i r_i (1 - r_i) * ((1 - tau) [k_i = k] + tau / K)

Training on a task also memorises it: the learner's logit on that very task
grows by `memorisation * a_i * r_i (1 - r_i)` per visit. Memorisation helps
the training pool only, never held-out accuracy, and no reference model knows
about it, so it is a per-task departure from any prediction made from them.

Held-out accuracy is the learner's expected pass rate on held-out tasks from
the same distribution. Two reference models (a weaker and a stronger one)
have abilities of their own: a level `weak_gap` below / `strong_gap` above
the learner's mean level, and a per-skill profile drawn independently of the
learner's (sd `reference_skill_sd`), plus their own per-task affinities (sd
`reference_idiosyncrasy_sd`). Their pass rates are measured on the training
pool with `reference_samples` attempts each: the noisy features the
interpolation plug-in uses. `WORLDS` names the settings: good reference
models, poor ones, and none at all (`references=False`: no features); and
two without reference models whose tasks carry embeddings (`embeddings`):
"embed", a noisy linear image of each task's skill, difficulty and
discrimination, and "embed-noise", noise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorldConfig:
    num_tasks: int = 3000  # training pool
    num_heldout: int = 1000
    num_skills: int = 8
    difficulty_mean: float = 2.0
    difficulty_sd: float = 3.0
    discrimination_median: float = 1.5  # log-normal
    discrimination_log_sd: float = 0.3
    skill_sd: float = 0.5  # spread of the learner's initial per-skill ability (mean 0)
    idiosyncrasy_sd: float = 0.75  # the learner's per-task logit residual e_i
    references: bool = True  # False: no reference models, tasks carry no features
    weak_gap: float = 0.5  # weak reference model: its mean level this much below the learner's
    strong_gap: float = 3.0  # strong reference model: this much above
    reference_skill_sd: float = 0.5  # the reference models' own per-skill profile (independent of the learner's)
    reference_idiosyncrasy_sd: float = 0.75  # the reference models' own per-task residuals
    reference_samples: int = 16  # attempts per task when measuring reference pass rates
    learning_rate: float = 0.8
    transfer: float = 0.3  # share of a task's signal that raises every skill
    memorisation: float = 1.0  # logit gained on a trained task itself, per unit of a_i r (1 - r)
    # Task embeddings: "none"; "informative", a fixed random linear image of
    # the task's skill (one-hot), difficulty and discrimination plus noise
    # (sd `embedding_noise` per dimension), so it carries the learning
    # structure but not the learner's per-task residual; "noise", pure noise.
    embeddings: str = "none"
    embedding_dim: int = 32
    embedding_noise: float = 1.0


# The worlds of the benchmark. "good": reference models that share the
# learner's notion of difficulty, with profiles and residuals of their own;
# "poor": reference models whose skill profiles and per-task residuals are far
# from the learner's, measured with 4 attempts per task; "none": no reference
# models at all (the plug-in has nothing to work with).
WORLDS: dict[str, WorldConfig] = {
    "good": WorldConfig(),
    "poor": WorldConfig(reference_skill_sd=1.5, reference_idiosyncrasy_sd=2.0, reference_samples=4),
    "none": WorldConfig(references=False),
    # No reference models; tasks carry embeddings that describe them, or noise.
    "embed": WorldConfig(references=False, embeddings="informative"),
    "embed-noise": WorldConfig(references=False, embeddings="noise"),
}


def world_config(name: str, **overrides: object) -> WorldConfig:
    if name not in WORLDS:
        raise ValueError(f"unknown world {name!r}; expected one of {list(WORLDS)}")
    return dataclasses.replace(WORLDS[name], **overrides)  # type: ignore[arg-type]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def group_signal(successes: np.ndarray, trials: np.ndarray | int) -> np.ndarray:
    """Gradient signal of each rollout group: the variance of its 0/1 rewards,
    r (1 - r) with r = successes / trials. Zero for all-correct and all-wrong
    groups; its expectation is p (1 - p) (n - 1) / n."""
    r = np.asarray(successes, dtype=np.float64) / np.asarray(trials, dtype=np.float64)
    return r * (1.0 - r)


@dataclass(frozen=True)
class World:
    config: WorldConfig
    skill: np.ndarray  # (N,) int
    difficulty: np.ndarray  # (N,)
    discrimination: np.ndarray  # (N,)
    heldout_skill: np.ndarray
    heldout_difficulty: np.ndarray
    heldout_discrimination: np.ndarray
    affinity: np.ndarray  # (N,) the learner's per-task logit residual
    heldout_affinity: np.ndarray
    theta0: np.ndarray  # (K,) the learner at step 0
    weak_theta: np.ndarray
    strong_theta: np.ndarray
    weak_ref: np.ndarray  # (N,) measured pass rates of the weak reference model
    strong_ref: np.ndarray  # (N,) ... of the strong one
    embeddings: np.ndarray | None = None  # (N, embedding_dim) float32, or None (config.embeddings "none")

    @classmethod
    def generate(cls, config: WorldConfig, seed: int) -> World:
        rng = np.random.default_rng([seed, 0x5EED])
        k = config.num_skills

        def tasks(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            skill = rng.integers(0, k, size=n)
            difficulty = rng.normal(config.difficulty_mean, config.difficulty_sd, size=n)
            discrimination = config.discrimination_median * np.exp(rng.normal(0, config.discrimination_log_sd, size=n))
            return skill, difficulty, discrimination

        skill, difficulty, discrimination = tasks(config.num_tasks)
        h_skill, h_difficulty, h_discrimination = tasks(config.num_heldout)
        sd = config.idiosyncrasy_sd
        affinity = rng.normal(0, sd, size=config.num_tasks)
        heldout_affinity = rng.normal(0, sd, size=config.num_heldout)
        theta0 = rng.normal(0.0, config.skill_sd, size=k)
        # The reference models' abilities are their own: a level relative to
        # the learner's mean and a profile drawn independently of its profile.
        level = float(theta0.mean())
        weak_theta = level - config.weak_gap + rng.normal(0, config.reference_skill_sd, size=k)
        strong_theta = level + config.strong_gap + rng.normal(0, config.reference_skill_sd, size=k)
        n_ref = config.reference_samples

        def measured(theta: np.ndarray) -> np.ndarray:
            own = rng.normal(0, config.reference_idiosyncrasy_sd, size=config.num_tasks)  # its own affinities
            p = sigmoid(discrimination * (theta[skill] - difficulty) + own)
            return rng.binomial(n_ref, p) / n_ref

        weak_ref, strong_ref = measured(weak_theta), measured(strong_theta)
        if not config.references:
            weak_ref = np.full(config.num_tasks, np.nan)
            strong_ref = np.full(config.num_tasks, np.nan)
        return cls(
            config,
            skill,
            difficulty,
            discrimination,
            h_skill,
            h_difficulty,
            h_discrimination,
            affinity,
            heldout_affinity,
            theta0,
            weak_theta,
            strong_theta,
            weak_ref,
            strong_ref,
            task_embeddings(config, seed, skill, difficulty, discrimination),
        )

    @property
    def num_tasks(self) -> int:
        return int(self.skill.shape[0])

    def success_prob(
        self, theta: np.ndarray, idx: np.ndarray | None = None, memo: np.ndarray | None = None
    ) -> np.ndarray:
        """True pass rates of the training tasks (all, or `idx`) at ability
        theta, with per-task memorised logits `memo` (all tasks) if given."""
        sel = slice(None) if idx is None else idx
        logit = self.discrimination[sel] * (theta[self.skill[sel]] - self.difficulty[sel]) + self.affinity[sel]
        if memo is not None:
            logit = logit + memo[sel]
        return sigmoid(logit)

    def accuracy(self, theta: np.ndarray) -> float:
        """Expected held-out accuracy."""
        p = sigmoid(
            self.heldout_discrimination * (theta[self.heldout_skill] - self.heldout_difficulty) + self.heldout_affinity
        )
        return float(p.mean())


class Learner:
    """The policy being trained: per-skill ability, grown by gradient signal,
    and per-task memorisation of the training tasks it has trained on."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.theta = world.theta0.copy()
        self.memo = np.zeros(world.num_tasks)

    def pass_rates(self, idx: np.ndarray | None = None) -> np.ndarray:
        """The learner's true pass rates on training tasks (all, or `idx`)."""
        return self.world.success_prob(self.theta, idx, self.memo)

    def train(self, idx: np.ndarray, successes: np.ndarray, trials: int, batch_size: int) -> float:
        """One optimizer step on the groups (idx, successes of `trials`).
        The update is averaged over `batch_size` groups. Returns the step's
        total signal (sum of group signals)."""
        cfg = self.world.config
        signal = group_signal(successes, trials)
        weighted = signal * self.world.discrimination[idx]
        per_skill = np.bincount(self.world.skill[idx], weights=weighted, minlength=cfg.num_skills)
        shared = per_skill.sum() / cfg.num_skills
        self.theta = self.theta + cfg.learning_rate / batch_size * (
            (1 - cfg.transfer) * per_skill + cfg.transfer * shared
        )
        if cfg.memorisation:
            memo = self.memo.copy()
            np.add.at(memo, idx, cfg.memorisation * weighted)
            self.memo = memo
        return float(signal.sum())

    def rollout(self, idx: np.ndarray, trials: int, rng: np.random.Generator) -> np.ndarray:
        """Successes of `trials` attempts at each task in idx."""
        return rng.binomial(trials, self.pass_rates(idx))


def task_embeddings(
    config: WorldConfig, seed: int, skill: np.ndarray, difficulty: np.ndarray, discrimination: np.ndarray
) -> np.ndarray | None:
    """The tasks' embeddings (config.embeddings), from a generator of their
    own so that the world's other draws stay as they were."""
    if config.embeddings == "none":
        return None
    rng = np.random.default_rng([seed, 0xE3B])
    n, dim = skill.shape[0], config.embedding_dim
    if config.embeddings == "noise":
        return rng.normal(0.0, 1.0, size=(n, dim)).astype(np.float32)
    if config.embeddings != "informative":
        raise ValueError(f"unknown embeddings {config.embeddings!r}; expected none, informative or noise")
    described = np.concatenate(
        [
            np.eye(config.num_skills)[skill],
            ((difficulty - config.difficulty_mean) / config.difficulty_sd)[:, None],
            (np.log(discrimination / config.discrimination_median) / max(config.discrimination_log_sd, 1e-9))[:, None],
        ],
        axis=1,
    )
    image = rng.normal(0.0, 1.0 / math.sqrt(dim), size=(described.shape[1], dim))
    noise = rng.normal(0.0, config.embedding_noise / math.sqrt(dim), size=(n, dim))
    return (described @ image * math.sqrt(dim / described.shape[1]) + noise).astype(np.float32)


def reference_correlations(world: World) -> tuple[float, float]:
    """Pearson correlation of the weak and the strong reference model's
    measured pass rates with the learner's true initial pass rates on the
    training pool. How well the interpolation plug-in can predict depends on
    it, so every world reports it (issue 15: the default world's weak model
    correlates about 0.9 with the learner, which flatters the plug-in)."""
    if not world.config.references:
        return math.nan, math.nan
    p0 = world.success_prob(world.theta0)
    return float(np.corrcoef(world.weak_ref, p0)[0, 1]), float(np.corrcoef(world.strong_ref, p0)[0, 1])
