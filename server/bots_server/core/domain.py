"""The service's domain: experiments, their config, tasks, batches, outcomes.

Plain data, owned by the server. The service converts the API's messages to
and from these (service/convert.py); the store keeps them as rows, the config
as one JSON object (so a new setting needs no schema migration).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bots_server.core.limits import MAX_EMBEDDING_DIM, MAX_LEASE_TTL_SECONDS, MAX_SEED
from bots_server.engine import EngineParams, Setting, settings
from bots_server.engine.params import setting


@dataclass(frozen=True)
class ExperimentConfig(EngineParams):
    """The engine's parameters plus what the core needs around them.
    Defaults: the paper's reference config."""

    weak_feature: str = setting("", "task feature holding a weaker reference model's pass rate")
    strong_feature: str = setting("", "task feature holding a stronger reference model's pass rate")
    seed: int = setting(0, "seeds the selection RNG together with the step and request key", low=0, high=MAX_SEED)
    lease_ttl_seconds: float = setting(
        3600.0, "how long a selected batch holds its tasks", low=0.0, low_open=True, high=MAX_LEASE_TTL_SECONDS
    )
    embedding_dim: int = setting(
        0,
        "length of every task's embedding, fixed for the experiment's life (0: tasks have none; docs/embeddings.md)",
        low=0,
        high=MAX_EMBEDDING_DIM,
    )

    @property
    def reference_features(self) -> tuple[str, str]:
        """The names of the weak and strong reference pass rates ("": none)."""
        return self.weak_feature, self.strong_feature

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ExperimentConfig:
        """A stored config; settings it lacks (added after it was stored) take
        their `before` values, which reproduce the behaviour from before they existed."""
        known = {name: declared for name, declared, _ in config_settings()}
        older = {name: d.before for name, d in known.items() if d.before is not None and name not in values}
        return cls(**{k: v for k, v in values.items() if k in known}, **older)


def config_settings() -> list[tuple[str, Setting, Any]]:
    """(name, declaration, default) of every experiment setting."""
    return list(settings(ExperimentConfig))


@dataclass
class NewTasks:
    """Tasks to add, as columns (one entry per task in each): an upload of a
    million tasks as a million objects would give the garbage collector a
    million more to scan, in pauses that every caller of the process waits
    through; strings, and dicts of numbers, it does not scan."""

    keys: list[str] = field(default_factory=list)
    features: list[dict[str, float]] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)  # e.g. its dataset; "": none
    # Each task's embedding (config.embedding_dim little-endian float32
    # values, core/embeddings.py); empty: no task has one.
    embeddings: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class GroupInfo:
    """One group of an experiment's pool: its size, its share range (None:
    no quota) and what the posterior says of it."""

    name: str
    num_tasks: int
    num_retired: int
    min_share: float | None
    max_share: float | None
    mean_success: float  # mean of its tasks' posterior means
    near_target: float  # fraction of its tasks whose posterior mean is within the target band
    informative: float  # estimated fraction of its rollout groups whose rewards differ (engine/quotas.py)
    adaptive_share: float | None  # with adaptive_shares: its share of a batch now (every unretired task free)


@dataclass(frozen=True)
class Outcomes:
    """What a report's rollouts gave, as columns, entry i for task keys[i]:
    `successes` of `trials` (a sum of rewards in [0, 1] may be fractional),
    and for rewards that are not all 0 or 1 the sum of their squares
    (engine/rewards.py), None where not given. Columns, not one object per
    task: a report carries hundreds of tasks, and the checks, the match
    against the batch and the signals each run over whole columns."""

    keys: Sequence[str]
    successes: Sequence[float]
    trials: Sequence[int]
    sum_squares: Sequence[float | None]

    @classmethod
    def of(cls, rows: Iterable[tuple[str, float, int, float | None]]) -> Outcomes:
        """From (key, successes, trials, sum_squares) rows."""
        columns = tuple(zip(*rows, strict=True))
        return cls(*columns) if columns else cls((), (), (), ())

    def __len__(self) -> int:
        return len(self.keys)

    def rows(self) -> Iterator[tuple[str, float, int, float | None]]:
        return zip(self.keys, self.successes, self.trials, self.sum_squares, strict=True)


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
class RetireResult:
    """What a RetireTasks / ReactivateTasks call did."""

    changed: int  # tasks whose state it changed (the others already were so)
    num_retired: int  # retired tasks in the experiment afterwards
    num_tasks: int


@dataclass(frozen=True)
class Snapshot:
    """An experiment's posterior at one step, in task order."""

    experiment: Experiment
    keys: list[str]
    alpha: list[float]
    beta: list[float]
    features: list[dict[str, float]] | None
    retired: list[bool] | None = None  # per task; None: none retired
    groups: list[str] | None = None  # per task ("": none); None: no groups
    shares: dict[str, tuple[float, float]] = field(default_factory=dict)  # group -> (min, max); none: no quotas
    rho_halvings: int = 0  # adaptive rho's halvings so far (engine/state.py)
    embeddings: list[bytes] | None = None  # with features, per task, when the experiment has embeddings


@dataclass(frozen=True)
class RestoreData:
    """A snapshot to start a new experiment from."""

    name: str
    config: ExperimentConfig
    step: int
    capability: float | None
    source: str
    keys: list[str]
    alpha: list[float]
    beta: list[float]
    features: list[dict[str, float]]
    retired: list[bool] = field(default_factory=list)  # per task; empty: none retired
    groups: list[str] = field(default_factory=list)  # per task; empty: no groups
    shares: dict[str, tuple[float, float]] = field(default_factory=dict)  # group -> (min, max); none: no quotas
    rho_halvings: int = 0  # adaptive rho's halvings so far (engine/state.py)
    embeddings: list[bytes] = field(default_factory=list)  # per task, when the config has an embedding_dim
