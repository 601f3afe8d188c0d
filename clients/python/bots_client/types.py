"""Plain data types of the API. Only the names of the enum values come from
the generated protobuf code."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from bots_client.proto import bots_pb2 as pb


def _value_numbers(enum: EnumTypeWrapper, prefix: str) -> dict[str, int]:
    """The client's name of each value of a proto enum (STRATEGY_MOPPS is
    "mopps") and its number; UNSPECIFIED is no choice of its own."""
    return {
        name.removeprefix(prefix).lower(): number for name, number in enum.items() if name != f"{prefix}UNSPECIFIED"
    }


# Read from bots.proto, so a strategy or selection mode added there needs no
# client change. (The casts: the stubs type an enum's numbers as its class.)
STRATEGY_NUMBERS = cast("dict[str, pb.Strategy]", _value_numbers(pb.Strategy, "STRATEGY_"))
SELECTION_MODE_NUMBERS = cast("dict[str, pb.SelectionMode]", _value_numbers(pb.SelectionMode, "SELECTION_MODE_"))
STRATEGIES = tuple(STRATEGY_NUMBERS)
SELECTION_MODES = tuple(SELECTION_MODE_NUMBERS)


@dataclass(frozen=True)
class ExperimentConfig:
    """How an experiment selects and learns. Defaults: the paper's reference config.

    strategy: "bots" (Thompson selection, explicit + implicit evidence, every
    task forgets every step), "mopps" (explicit evidence only, only reported
    tasks forget) or "uniform" (uniform random selection; the posterior is
    still tracked with the BOTS update, for monitoring).
    """

    strategy: str = "bots"
    target_success: float = 0.5
    forgetting: float = 0.1
    implicit_weight: float = 0.1
    rollouts_per_task: int = 16
    selection_mode: str = "thompson"
    temperature: float = 1.0
    weak_feature: str = ""
    strong_feature: str = ""
    prior_alpha: float = 1.0
    prior_beta: float = 1.0
    seed: int = 0
    lease_ttl_seconds: float = 3600.0
    capability_ema: float = 0.9
    candidate_ratio: float = 0.0
    warm_start_scale: float = 0.0
    warm_start_position: float = 0.0
    adaptive_rho_error: float = 0.0
    track_prediction: float = 0.0
    implicit_reliability: float = 0.0
    random_stream: int = 2
    keep_successes: float = 0.0
    adaptive_shares: float = 0.0
    # The length of every task's embedding (Task.embedding); 0: no task has one.
    embedding_dim: int = 0
    # Cross-task prediction from the embeddings: at most this many pseudo-rollouts
    # at each task's predicted pass rate, times a calibrated trust (0: off).
    embedding_weight: float = 0.0
    # The share of every batch drawn uniformly at random (0: off).
    uniform_share: float = 0.0
    # What a reported outcome counts for: "trials", its own; "rollouts_per_task", m.
    report_weight: str = "trials"


@dataclass(frozen=True)
class Task:
    key: str
    features: Mapping[str, float] = field(default_factory=dict)
    group: str = ""  # e.g. its dataset, for group shares; "": none
    # Its embedding: the experiment's embedding_dim numbers (a sequence of
    # floats or a 1-D numpy array), sent as float32; None: none (required
    # when the experiment has an embedding_dim, refused when it has not).
    embedding: Sequence[float] | np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Outcome:
    """What the rollouts of one task gave: `successes` of `trials` (a sum of
    rewards in [0, 1] may be fractional), and for rewards that are not all
    0 or 1 the sum of their squares."""

    key: str
    successes: float
    trials: int
    sum_squares: float | None = None


@dataclass(frozen=True)
class Experiment:
    name: str
    config: ExperimentConfig
    step: int
    num_tasks: int
    open_batches: int
    capability: float | None
    create_time: dt.datetime
    forked_from: str | None = None  # set on forked or restored experiments
    forked_at_step: int | None = None


@dataclass(frozen=True)
class Batch:
    batch_id: str
    step: int
    keys: list[str]
    request_key: str
    lease_expire_time: dt.datetime
    reported_step: int | None = None  # set when the request key's batch was reported already


@dataclass(frozen=True)
class ReportResult:
    step: int
    capability: float | None
    duplicate: bool


@dataclass(frozen=True)
class Snapshot:
    experiment: Experiment
    keys: list[str]
    alpha: np.ndarray
    beta: np.ndarray
    features: list[dict[str, float]] | None = None  # with include_features=True
    retired: np.ndarray | None = None  # bool per task: retired (never selected); None: not known
    groups: list[str] | None = None  # per task: its group ("": none); None: no task has one
    # group -> (min, max) share of each batch (Client.set_group_shares); empty: no quotas
    shares: dict[str, tuple[float, float]] = field(default_factory=dict)
    rho_halvings: int = 0  # how often adaptive rho (adaptive_rho_error) halved rho so far
    # float32, one row per task (num_tasks x embedding_dim): with include_features, when the experiment has embeddings
    embeddings: np.ndarray | None = None

    @property
    def step(self) -> int:
        return self.experiment.step

    @property
    def config(self) -> ExperimentConfig:
        return self.experiment.config

    @property
    def mean(self) -> np.ndarray:
        return self.alpha / (self.alpha + self.beta)


@dataclass(frozen=True)
class RetireResult:
    """What retire_tasks / reactivate_tasks did."""

    changed: int  # tasks the call changed (the others already were in that state)
    num_retired: int  # retired tasks in the experiment afterwards
    num_tasks: int


@dataclass(frozen=True)
class GroupInfo:
    """One group of an experiment's pool (Client.list_groups)."""

    name: str  # "": the tasks without a group
    num_tasks: int
    num_retired: int
    min_share: float | None  # None: no share set for this group
    max_share: float | None
    mean_success: float  # mean of its tasks' posterior means
    near_target: float  # fraction of its tasks with posterior mean within 0.2 of the target
    # estimated fraction of its rollout groups whose rewards differ, from its recent reports
    informative: float = 0.0
    adaptive_share: float | None = None  # with adaptive_shares: its share of a batch now; None otherwise
