"""Algorithm parameters (DESIGN.md section 2), each declared once with its
default, bounds and meaning.

The declarations are the registry of settings: validation, the proto mapping
and storage all iterate `settings()`, so a new setting is one field here (plus
its proto field and the client's field), with no schema migration.
Experiments stored before a setting existed are read back with its `before`
value, which must reproduce their behaviour; it is the default unless given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bots_server.engine.draws import NEWEST_STREAM, STREAMS

REPORT_WEIGHTS = ("trials", "rollouts_per_task")


@dataclass(frozen=True)
class Setting:
    """What a setting may hold. `choices` is a function (the registry of
    strategies is filled after this module is imported)."""

    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself excluded
    choices: Callable[[], tuple[Any, ...]] | None = None
    # The value of experiments stored before the setting existed, where new
    # experiments get a different default (random_stream).
    before: Any = None

    def problem(self, value: Any) -> str | None:
        """Why `value` is not allowed, or None."""
        if self.choices is not None:
            allowed = self.choices()
            return None if value in allowed and not isinstance(value, bool) else f"is not one of {list(allowed)}"
        if isinstance(value, str):
            return None
        if isinstance(value, bool) or not math.isfinite(value):
            return "must be a finite number"
        low = -math.inf if self.low is None else self.low
        high = math.inf if self.high is None else self.high
        if value < low or value > high or (self.low_open and value == low):
            bracket = "(" if self.low_open else "["
            return f"is outside {bracket}{_number(low)}, {_number(high)}]"
        return None


def _number(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:g}"


def setting(default: Any, doc: str, **bounds: Any) -> Any:
    """A dataclass field declaring a setting."""
    return field(default=default, metadata={"setting": Setting(doc, **bounds)})


def _strategy_names() -> tuple[str, ...]:
    from bots_server.engine import strategies

    return strategies.names()


SELECTION_MODES = ("thompson", "mean", "softmax", "softmax_mean", "expected")


@dataclass(frozen=True)
class EngineParams:
    strategy: str = setting("bots", "selection and update rule (engine/strategies)", choices=_strategy_names)
    target_success: float = setting(0.5, "p*: the success rate batches are picked around", low=0.0, high=1.0)
    forgetting: float = setting(0.1, "lambda: pull of the posterior toward the prior per step", low=0.0, high=1.0)
    keep_successes: float = setting(
        0.0,
        "share of the forgetting that a task's successes (alpha) are spared: 0 forgets both toward the prior "
        "(the paper), 1 keeps every success and forgets only failures, for learners whose pass rates rarely "
        "fall back (docs/choosing-a-strategy.md)",
        low=0.0,
        high=1.0,
    )
    adaptive_shares: float = setting(
        0.0,
        "group shares that follow where learning happens: each group's share of a batch, within its min/max, is "
        "(1 - a) / groups + a * its estimated informative fraction / their sum (engine/quotas.py; 0: off, the "
        "ranking decides within the bounds)",
        low=0.0,
        high=1.0,
    )
    implicit_weight: float = setting(0.1, "rho: weight of the plug-in's prediction", low=0.0, high=1.0)
    rollouts_per_task: int = setting(
        16, "m: the group size; the weight of a prediction (a report weighs its own trials)", low=1, high=1_000_000
    )
    selection_mode: str = setting(
        "thompson",
        "thompson (Beta draw), mean (posterior mean), softmax (Beta draw, sampled with temperature), "
        "softmax_mean (posterior mean, sampled with temperature) or expected (smallest posterior expected "
        "squared distance to p*: no draw, uncertainty counts against a task)",
        choices=lambda: SELECTION_MODES
    )
    temperature: float = setting(1.0, "tau of the softmax modes", low=0.0, low_open=True)
    prior_alpha: float = setting(1.0, "a0 of the prior Beta(a0, b0)", low=0.0, low_open=True)
    prior_beta: float = setting(1.0, "b0 of the prior Beta(a0, b0)", low=0.0, low_open=True)
    capability_ema: float = setting(0.9, "smoothing of the plug-in's capability estimate", low=0.0, high=1.0)
    candidate_ratio: float = setting(
        0.0,
        "MoPPS pre-selection: score only a random candidate set of ceil(ratio * batch) available tasks "
        "(0: off, every available task is a candidate; below 1 acts as 1, a random batch)",
        low=0.0,
        high=1_000_000.0,
    )
    warm_start_scale: float = setting(
        0.0,
        "MoPPS warm start: pseudo-rollouts at the reference models' pass rate that a new task starts with "
        "(0: off, tasks start at the prior)",
        low=0.0,
        high=1_000_000.0,
    )
    warm_start_position: float = setting(
        0.0,
        "warm start's pass rate: w + (s - w) * position of the weak (w) and strong (s) reference features "
        "(0: the weak model's rate, 1: the strong one's)",
        low=0.0,
        high=1.0,
    )
    # Adaptive rho's current value lives in PosteriorState.rho_halvings: the
    # replay of events reproduces it and checkpoints carry it (every field of
    # the state, revision 0006).
    adaptive_rho_error: float = setting(
        0.0,
        "adaptive rho: halve rho whenever a batch's mean |predicted - observed| pass rate reaches this "
        "(the reference uses 0.25; 0: off)",
        low=0.0,
        high=1.0,
    )
    random_stream: int = setting(
        NEWEST_STREAM,
        "the random numbers of the Thompson draws (engine/draws.py): 1 draws the pool in one call, 2 in parts "
        "drawn on several cores (the same numbers on any machine); experiments created before stream 2 keep 1",
        choices=lambda: STREAMS,
        before=1,
    )
    # Beyond the paper (docs/choosing-a-strategy.md): both read only the
    # posterior, the reference features and the capability, which checkpoints
    # carry, so they are safe over the API.
    track_prediction: float = setting(
        0.0,
        "carry each task's posterior along the plug-in's predicted change of its pass rate every step, so "
        "observed evidence keeps its offset from the prediction instead of being forgotten (0: off, 1: the full "
        "predicted change); pair it with a smaller forgetting",
        low=0.0,
        high=1.0,
    )
    implicit_reliability: float = setting(
        0.0,
        "set rho each step from the batch: the plug-in's and the posterior's measured errors give the Bayes "
        "weight of the prediction, and rho moves unreported tasks toward it by that much, times this factor "
        "(0: off, the fixed implicit_weight)",
        low=0.0,
        high=1_000.0,
    )

    # The trust it is scaled by lives in PosteriorState.embedding_trust, so
    # replays reproduce it and checkpoints carry it.
    embedding_weight: float = setting(
        0.0,
        "cross-task prediction (engine/crosstask.py): a ridge regression of the posteriors on the task "
        "embeddings predicts every task's pass rate, visited or not, and at most this many pseudo-rollouts at "
        "that rate join each task's posterior, times a trust calibrated on every batch before it updates the "
        "posteriors (embeddings that predict nothing get none); needs embeddings (0: off)",
        low=0.0,
        high=1_000_000.0,
    )

    uniform_share: float = setting(
        0.0,
        "share of every batch drawn uniformly at random from the available tasks before the strategy ranks the "
        "rest (rounded to whole tasks; with group quotas, inert): a hedge for a learner on which the ranking "
        "may not pay (docs/choosing-a-strategy.md; 0: off)",
        low=0.0,
        high=1.0,
    )

    report_weight: str = setting(
        "trials",
        "how many trials a reported outcome counts for in the bots and uniform updates: 'trials', its own "
        "(a group of 3 rollouts moves a posterior by 3); 'rollouts_per_task', m whatever it holds (the "
        "reference's r*m); experiments created before the setting existed keep 'rollouts_per_task', so their "
        "stored reports replay as they were applied",
        choices=lambda: REPORT_WEIGHTS,
        before="rollouts_per_task",
    )

    @classmethod
    def of(cls, config: Any) -> EngineParams:
        """The engine's parameters from any config with the same field names
        (the client's ExperimentConfig, for running the engine in-process)."""
        return cls(**{name: getattr(config, name) for name, _, _ in settings(cls)})


def settings(cls: type[Any]) -> Iterator[tuple[str, Setting, Any]]:
    """(name, declaration, default) of every setting of a params dataclass."""
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("setting")
        if declared is not None:
            yield f.name, declared, f.default
