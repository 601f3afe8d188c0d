"""The framework-free part every trainer integration shares.

`Curriculum` binds one experiment on a BOTS server to one dataset: it maps the
dataset's stable task keys to dataset indices, makes sure the experiment holds
every task, draws batches with deterministic request keys (so every
data-parallel rank and every retry gets the same batch), routes reported
outcomes to the open batch their task came from, and reports from one rank
only. The torch, verl, TRL and Trinity-RFT adapters are thin shells around it.

Nothing here imports torch or any trainer framework.
"""

from __future__ import annotations

import collections
import importlib
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from bots_client._calls import OutcomeValue, config_differences, outcome_value
from bots_client.client import Client
from bots_client.connection import Connection
from bots_client.errors import (
    AlreadyExistsError,
    ConfigMismatchError,
    ExperimentInUseError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from bots_client.types import Batch, ExperimentConfig, ReportResult, Task

log = logging.getLogger("bots_client.integrations")

# task key -> (successes, trials) or (successes, trials, sum of squared rewards)
OutcomeMap = dict[str, OutcomeValue]

# Batches drawn but not reported that a Curriculum keeps track of; older ones
# are forgotten (on the server their leases simply expire).
MAX_OPEN_BATCHES = 64

# An embedding function: a block of tasks' inputs (their prompts, say) ->
# one vector per input (a sequence of float sequences, or a 2-D array).
EmbedFn = Callable[[Sequence[Any]], Any]
# Inputs per call of an embedding function: one forward pass of a model.
EMBED_BLOCK = 64


def embed_function(value: EmbedFn | str | None, where: str = "embed_fn") -> EmbedFn | None:
    """An embedding function given in code, or named as "module:function"
    (the form a framework's config file can carry); None: none."""
    if value is None or callable(value):
        return value
    module, _, name = str(value).partition(":")
    if not module or not name:
        raise ValueError(f"{where} = {value!r}: name the embedding function as 'module:function'")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"{where} = {value!r}: module {module!r} has no function {name!r}")
    return fn


def embedded(embed_fn: EmbedFn, inputs: Iterable[Any], block: int = EMBED_BLOCK) -> Iterator[np.ndarray]:
    """One float32 vector per input, in order: `embed_fn` applied to
    blocks of `block` inputs (each call must give one vector per input, all
    of one length)."""
    it = iter(inputs)
    while part := list(itertools.islice(it, block)):
        vectors = np.asarray(embed_fn(part), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(part):
            raise ValueError(
                f"the embedding function gave an array of shape {vectors.shape} for {len(part)} inputs; "
                "it must give one vector per input"
            )
        yield from vectors


class UnattributedOutcomesError(ValueError):
    """Reported outcomes that cannot be filed under the batch their rollouts
    came from: a task in no open batch of this run (reported already, never
    drawn, or drawn so long ago that the batch was forgotten), in several
    open batches with nothing to tell them apart, or outside the batch the
    report named. Raised before anything is sent, so nothing is half-applied."""


class EmptyReportError(ValueError):
    """A report with no task outcomes at all (every reward None): the server
    would refuse it, and dropping it quietly would leave its batch leased."""


class GroupSizeMismatchError(ValueError):
    """The experiment's rollouts_per_task is not the trainer's group size
    (the rollouts it runs per task). Raised at setup, before anything is
    drawn: the service weighs the prediction of an unreported task as
    rollouts_per_task rollouts and each report as the rollouts it holds."""


def group_size_problem(experiment: str, rollouts_per_task: int, size: int, setting: str) -> str | None:
    """Why `rollouts_per_task` does not fit `size` rollouts per task set by
    the framework's `setting`; None when they are equal."""
    if rollouts_per_task == size:
        return None
    return (
        f"experiment {experiment!r} has rollouts_per_task = {rollouts_per_task} but the trainer runs {setting} = "
        f"{size} rollouts per task: each report would hold {size} rollouts where the service expects "
        f"{rollouts_per_task}. Set the experiment config's rollouts_per_task = {size} (a new experiment: "
        f"rollouts_per_task is fixed once created), or {setting} = {rollouts_per_task}"
    )


@dataclass(frozen=True)
class CurriculumSignals:
    """What the service saw in one reported batch, for the trainer's logger.

    `success_rate` is the batch's successes over its trials, `informative`
    the fraction of its tasks whose rollouts disagreed (0 < successes <
    trials, or a reward variance above 0 where the sum of squared rewards
    was reported: the ones a group-relative advantage learns from), `capability`
    the service's capability estimate once it has one, and `posterior_mean`
    the mean of the batch's tasks' posterior means after the report (only
    when the Curriculum was asked for it: it costs a snapshot per report).
    `dropped_outcomes` counts the task outcomes this process has dropped so
    far because they could not be attributed (only a lenient curriculum,
    `strict=False`, drops instead of raising).
    """

    step: int
    batch_number: int
    tasks: int
    success_rate: float
    informative: float
    capability: float | None = None
    posterior_mean: float | None = None
    dropped_outcomes: int = 0

    def as_dict(self, prefix: str = "curriculum/") -> dict[str, float]:
        """Scalars to log (None values left out), named `prefix + field`."""
        values = {
            "server_step": float(self.step),
            "batch_success_rate": self.success_rate,
            "informative_fraction": self.informative,
            "capability": self.capability,
            "posterior_mean": self.posterior_mean,
            "dropped_outcomes": self.dropped_outcomes,
        }
        return {prefix + k: float(v) for k, v in values.items() if v is not None}


def batch_signals(
    number: int,
    result: ReportResult,
    outcomes: Mapping[str, OutcomeValue],
    posterior_mean: float | None = None,
    dropped_outcomes: int = 0,
) -> CurriculumSignals:
    successes = sum(float(v[0]) for v in outcomes.values())
    trials = sum(int(v[1]) for v in outcomes.values())
    informative = sum(1 for v in outcomes.values() if rewards_differ(v))
    return CurriculumSignals(
        step=result.step,
        batch_number=number,
        tasks=len(outcomes),
        success_rate=successes / trials if trials else 0.0,
        informative=informative / len(outcomes) if outcomes else 0.0,
        capability=result.capability,
        posterior_mean=posterior_mean,
        dropped_outcomes=dropped_outcomes,
    )


@dataclass(frozen=True)
class SelectedBatch:
    """One batch drawn from the service, in dataset terms.

    `number` is the trainer-side batch counter the request key was built from
    (`request_key == f"{prefix}-{number}"`); `step` is the experiment's step
    on the server when the batch was selected.
    """

    batch_id: str
    number: int
    step: int
    request_key: str
    keys: tuple[str, ...]
    indices: tuple[int, ...]


class SignalLog:
    """The signals of every report a curriculum makes in this process, kept
    until the trainer's logger takes them. A report running in the
    background appends from its own thread."""

    def __init__(self, curriculum: Curriculum) -> None:
        self._signals: collections.deque[CurriculumSignals] = collections.deque()
        curriculum.add_listener(self._signals.append)

    def pop(self) -> list[CurriculumSignals]:
        """The signals kept since the last pop, oldest first."""
        return [self._signals.popleft() for _ in range(len(self._signals))]

    def pop_mean(self) -> dict[str, float]:
        """The mean of each signal over those kept since the last pop ({}: none)."""
        sums: dict[str, list[float]] = {}
        for s in self.pop():
            for name, value in s.as_dict().items():
                sums.setdefault(name, []).append(value)
        return {name: sum(values) / len(values) for name, values in sums.items()}


def distributed_rank_and_world() -> tuple[int, int]:
    """This process's (rank, world size): torch.distributed if it is
    initialised (never imported here), else the RANK / WORLD_SIZE variables
    that torchrun, accelerate and deepspeed set, else (0, 1)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


# A reward variance this small is rounding in the sums of equal rewards, not
# a spread (the server's engine/rewards.py NO_SPREAD).
NO_SPREAD = 1e-9


def rewards_differ(value: OutcomeValue) -> bool:
    """Whether a task's rollouts disagreed: 0 < successes < trials, or with
    the sum of squared rewards, a reward variance above NO_SPREAD."""
    successes, trials = float(value[0]), int(value[1])
    if len(value) == 3 and float(value[2]) != successes:  # equal: rewards of 0 or 1
        mean = successes / trials
        return float(value[2]) / trials - mean * mean > NO_SPREAD
    return 0.0 < successes < trials


def aggregate_outcomes(
    keys: Iterable[Any],
    rewards: Iterable[Any],
    *,
    success_threshold: float | None = 0.5,
) -> OutcomeMap:
    """Per-task (successes, trials) from per-rollout rewards.

    `keys[i]` names the task of rollout i (repeated once per sample, in any
    order); `rewards[i]` is its reward. With a threshold, a rollout succeeds
    when its reward is >= the threshold (binary verifiers, or -1/+1 rewards
    with threshold 0). With `success_threshold=None` rewards must lie in
    [0, 1] and count fractionally (the service accepts fractional successes),
    and each task's value is (successes, trials, sum of squared rewards), so
    that the service sees whether the rewards varied.
    A reward of None (a reward function that does not apply) is skipped.
    Nothing is filtered: all-correct and all-wrong groups count like any other.
    """
    outcomes: dict[str, list[float]] = {}
    keys = list(keys)
    rewards = list(rewards)
    if len(keys) != len(rewards):
        raise ValueError(f"got {len(keys)} task keys but {len(rewards)} rewards; one of each per rollout")
    for key, reward in zip(keys, rewards):
        if reward is None:
            continue
        value = float(reward)
        if math.isnan(value):
            raise ValueError(f"reward of task {key!r} is NaN")
        if success_threshold is None:
            if not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"reward {value} of task {key!r} is outside [0, 1]; pass success_threshold to binarise rewards"
                )
            success = value
        else:
            success = 1.0 if value >= success_threshold else 0.0
        slot = outcomes.setdefault(str(key), [0.0, 0, 0.0])
        slot[0] += success
        slot[1] += 1
        slot[2] += success * success
    if success_threshold is None:
        return {key: (s, int(n), squares) for key, (s, n, squares) in outcomes.items()}
    return {key: (s, int(n)) for key, (s, n, _) in outcomes.items()}


def merge_outcomes(parts: Iterable[Mapping[str, Sequence[Any]]]) -> OutcomeMap:
    """Sum per-task outcomes gathered from several ranks (each rank's
    rollouts of a task are independent trials). A task keeps its sum of
    squared rewards only if every rank reported one."""
    merged: dict[str, list[Any]] = {}
    for part in parts:
        for key, value in part.items():
            s, n, *squares = outcome_value(value)
            slot = merged.setdefault(key, [0.0, 0, 0.0])
            slot[0] += s
            slot[1] += n
            slot[2] = slot[2] + squares[0] if squares and slot[2] is not None else None
    return {
        key: outcome_value((s, n) if squares is None else (s, n, squares)) for key, (s, n, squares) in merged.items()
    }


class Curriculum:
    """One experiment on a BOTS server, seen through one dataset.

    Args:
        client: a `bots_client.Client`, or the server address ("host:port").
        experiment: the experiment name. One experiment per training run: the
            request keys ("step-0", "step-1", ...) are unique within it.
        keys: the stable task key of every dataset row, `keys[i]` for row i.
        batch_size: tasks per batch (the global batch, across all ranks).
        config: create the experiment with this config if it does not exist.
            Without it the experiment must already exist.
        features: optional per-row task features (e.g. reference pass rates
            {"weak": 0.1, "strong": 0.6}), aligned with `keys`, used when
            tasks are added.
        request_prefix: request keys are f"{request_prefix}-{number}".
        rank, world_size: default from torch.distributed / RANK, WORLD_SIZE.
        report_rank: the one rank that sets the experiment up and reports.
        setup_timeout: how long non-reporting ranks wait for the reporting
            rank to create the experiment and add the tasks.
        posterior_means: include the batch's mean posterior mean in the
            signals passed to listeners (one snapshot of the experiment per
            report: leave it off for large pools).
        resume: this run continues the experiment (a restart without a
            checkpoint). Without it, an experiment that already has reported
            steps or open batches raises ExperimentInUseError at setup, so a
            new run never lands in an old one by accident; loading a
            checkpoint's state (`resume_number`) sets it.
        strict: outcomes that cannot be attributed to the batch they came
            from raise UnattributedOutcomesError (default). With
            strict=False they are dropped, logged and counted
            (`dropped_outcomes`, also in every CurriculumSignals).
        embed_fn: each task's embedding, for an experiment with an
            embedding_dim (docs/embeddings.md): called on blocks of
            `embed_inputs` when tasks are added, one vector per input; a
            function or its "module:function" name.
        embed_inputs: what embed_fn is given per row (the prompts), aligned
            with `keys`; default: the keys.
    """

    def __init__(
        self,
        client: Client | str,
        experiment: str,
        keys: Sequence[Any],
        *,
        batch_size: int,
        config: ExperimentConfig | None = None,
        features: Sequence[Mapping[str, float]] | None = None,
        groups: Sequence[Any] | None = None,
        request_prefix: str = "step",
        rank: int | None = None,
        world_size: int | None = None,
        report_rank: int = 0,
        setup_timeout: float = 300.0,
        posterior_means: bool = False,
        resume: bool = False,
        strict: bool = True,
        embed_fn: EmbedFn | str | None = None,
        embed_inputs: Sequence[Any] | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.experiment = experiment
        self.keys = [str(k) for k in keys]
        if batch_size > len(self.keys):
            raise ValueError(f"batch_size = {batch_size} is larger than the dataset of {len(self.keys)} tasks")
        self.index = _unique_index(self.keys)
        if features is not None and len(features) != len(self.keys):
            raise ValueError(f"got {len(features)} feature rows for {len(self.keys)} task keys")
        self.features = features
        if groups is not None and len(groups) != len(self.keys):
            raise ValueError(f"got {len(groups)} groups for {len(self.keys)} task keys")
        # A task's group (e.g. its dataset, for group shares); None: none.
        self.groups = None if groups is None else ["" if g is None else str(g) for g in groups]
        self.embed_fn = embed_function(embed_fn)
        if embed_inputs is not None and len(embed_inputs) != len(self.keys):
            raise ValueError(f"got {len(embed_inputs)} embedding inputs for {len(self.keys)} task keys")
        self.embed_inputs = embed_inputs
        self.batch_size = int(batch_size)
        self.config = config
        self.request_prefix = request_prefix
        detected_rank, detected_world = distributed_rank_and_world()
        self.rank = detected_rank if rank is None else int(rank)
        self.world_size = detected_world if world_size is None else int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank = {self.rank} is not in [0, world_size = {self.world_size})")
        self.report_rank = report_rank
        self.setup_timeout = setup_timeout
        # How to reconnect after a copy (pickling drops the channel): the
        # given client's connection, or one from the BOTS_* variables (TLS
        # files, BOTS_TOKEN) of the process that reconnects; and its timeouts.
        if isinstance(client, str):
            self._connection: Connection | None = None
            self._target = client
            self._client: Client | None = None
            self._client_options: dict[str, float] = {}
        else:
            self._connection = client.connection
            self._target = client.target
            self._client = client
            self._client_options = {
                "timeout": client.timeout,
                "bulk_timeout": client.bulk_timeout,
                "retry_timeout": client.retry_timeout,
            }
        self._lock = threading.Lock()
        self._open: dict[str, SelectedBatch] = {}
        # The report running in the background (report_in_background) and
        # the batches its ReportAndSelect drew ahead, by batch number.
        self._executor: ThreadPoolExecutor | None = None
        self._background: Future[list[ReportResult]] | None = None
        self._prefetched: dict[int, SelectedBatch] = {}
        # Batches whose report raised (still open, for the caller to report
        # again), and the highest batch number reported: a failed batch
        # older than a later report was given up, not in flight.
        self._failed_reports: set[str] = set()
        self._reported_through = -1
        self._ready = False
        self.next_number = 0
        # The server step of the last report acknowledged to this process (the
        # reporting rank's own, broadcast to the others by collective adapters):
        # a checkpoint stores it, so a resume can tell which batches drawn
        # before the checkpoint the server never received.
        self.acknowledged_step: int | None = None
        self.posterior_means = posterior_means
        self.resume = bool(resume)
        self.strict = bool(strict)
        self.dropped_outcomes = 0
        self.listeners: list[Callable[[CurriculumSignals], None]] = []
        self.last_signals: CurriculumSignals | None = None

    # The trainer's rollouts per task and the setting that names it
    # (expect_group_size); None: the adapter cannot know it.
    group_size: tuple[int, str] | None = None

    def expect_group_size(self, size: int, setting: str) -> None:
        """The trainer runs `size` rollouts per task, set by its `setting`
        (e.g. "actor_rollout_ref.rollout.n"): the experiment's
        rollouts_per_task must equal it. Checked now against the config this
        curriculum would create the experiment with, and against the
        experiment's own config at setup, before the first draw (now, if
        set up already). Raises GroupSizeMismatchError."""
        self.group_size = (int(size), str(setting))
        if self.config is not None:
            self._check_group_size(self.config.rollouts_per_task)
        if self._ready:
            self._check_group_size(self.client.get_experiment(self.experiment).config.rollouts_per_task)

    def _check_group_size(self, rollouts_per_task: int) -> None:
        if self.group_size is not None:
            problem = group_size_problem(self.experiment, rollouts_per_task, *self.group_size)
            if problem is not None:
                raise GroupSizeMismatchError(problem)

    # -- plumbing ---------------------------------------------------------------------

    @property
    def client(self) -> Client:
        if self._client is None:
            connection = self._connection or Connection.from_env(self._target)
            self._client = connection.client(**self._client_options)
        return self._client

    @property
    def is_reporter(self) -> bool:
        return self.rank == self.report_rank

    def __getstate__(self) -> dict[str, Any]:
        # A gRPC channel does not pickle (DataLoader workers, Ray actors): the
        # copy reconnects on first use, with the client's Connection if it was
        # made from one, else with the BOTS_* variables of its own process.
        state = self.__dict__.copy()
        state["_client"] = None
        state["_lock"] = None
        state["_executor"] = None
        state["_background"] = None  # a copy does not inherit this process's report
        state["listeners"] = []  # loggers live in the process that made them
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def request_key(self, number: int) -> str:
        return f"{self.request_prefix}-{number}"

    # -- setup ------------------------------------------------------------------------

    def ensure_ready(self) -> None:
        """Create the experiment (if a config was given) and add the dataset's
        tasks it lacks; on other ranks, wait until the reporting rank did."""
        if self._ready:
            return
        step = self._setup() if self.is_reporter else self._wait_for_setup()
        with self._lock:
            # Before this run's first report, the server step it starts from:
            # a checkpoint taken then can still tell a report that was lost.
            if self.acknowledged_step is None:
                self.acknowledged_step = step
        self._ready = True

    def _setup(self) -> int:
        """Set the experiment up; its step."""
        client = self.client
        if self.config is not None:
            try:
                client.create_experiment(self.experiment, self.config)
                log.info("created experiment %r", self.experiment)
            except AlreadyExistsError:
                pass  # checked below: same config, and fresh unless this run resumes it
        try:
            exp = client.get_experiment(self.experiment)
        except NotFoundError:
            raise NotFoundError(
                f"experiment {self.experiment!r} does not exist on {client.target}; "
                "create it first or pass config= to create it"
            ) from None
        if self.config is not None and (differences := config_differences(self.config, exp.config)):
            raise ConfigMismatchError(
                f"experiment {self.experiment!r} exists with another config ({'; '.join(differences)}); "
                "name a new experiment for a new run, or pass the experiment's own config to continue it"
            )
        self._check_group_size(exp.config.rollouts_per_task)
        if not self.resume and (exp.step > 0 or exp.open_batches > 0):
            raise ExperimentInUseError(
                f"experiment {self.experiment!r} already has {exp.step} reported steps and {exp.open_batches} "
                "open batches, and this run does not resume it: name a new experiment for a new run, or "
                "continue this one from its checkpoint (or with resume=True)"
            )
        if exp.num_tasks == len(self.keys):
            return exp.step  # the usual restart case; a foreign key is caught at selection time
        if exp.num_tasks == 0:
            missing = list(range(len(self.keys)))
        else:
            present = set(client.snapshot(self.experiment).keys)
            foreign = [k for k in present if k not in self.index]
            if foreign:
                raise ValueError(
                    f"experiment {self.experiment!r} holds {len(foreign)} task keys that are not in this dataset "
                    f"(e.g. {foreign[:3]}); use one experiment per dataset"
                )
            missing = [i for i, k in enumerate(self.keys) if k not in present]
        if missing:
            try:
                client.add_tasks(self.experiment, self._tasks(missing))
            except AlreadyExistsError:
                # The client retries an upload after UNAVAILABLE; if the
                # first attempt was applied (its answer lost in a server
                # restart), the retry finds the tasks there. Fine once every
                # task is; a real conflict raises.
                present = set(client.snapshot(self.experiment).keys)
                if any(self.keys[i] not in present for i in missing):
                    raise
            log.info("added %d tasks to experiment %r", len(missing), self.experiment)
        return exp.step

    def prepare_draw(self, number: int, how_to_continue: str) -> None:
        """Set the experiment up before a loader draws batch `number` (free
        after the first draw). A new run (no checkpoint loaded, `resume`
        unset) starting at batch 0 is refused on an experiment with reported
        steps (`ExperimentInUseError`, its message ending with
        `how_to_continue`); its open batches at step 0 are this run's own
        first draws before a restart, drawn again under the same request
        keys, so they pass."""
        if not self.resume and number == 0:
            try:
                step = self.client.get_experiment(self.experiment).step
            except NotFoundError:
                step = 0
            if step > 0:
                try:
                    self.ensure_ready()  # raises: another config, or a run with progress
                except ExperimentInUseError as e:
                    raise ExperimentInUseError(f"{e.message}. {how_to_continue}") from None
        self.resume = True
        self.ensure_ready()

    def _tasks(self, rows: Sequence[int]) -> Iterator[Task]:
        """The tasks of these dataset rows, made one at a time (their
        embeddings a block at a time)."""
        if self.embed_fn is None:
            yield from (self._task(i) for i in rows)
            return
        inputs = self.keys if self.embed_inputs is None else self.embed_inputs
        vectors = embedded(self.embed_fn, (inputs[i] for i in rows))
        for i, vector in zip(rows, vectors, strict=True):
            yield self._task(i, vector)

    def _task(self, i: int, embedding: np.ndarray | None = None) -> Task:
        features = {} if self.features is None else dict(self.features[i])
        group = "" if self.groups is None else self.groups[i]
        return Task(self.keys[i], {k: float(v) for k, v in features.items()}, group, embedding)

    def _wait_for_setup(self) -> int:
        """Wait until the reporting rank set the experiment up; its step."""
        deadline = time.monotonic() + self.setup_timeout
        while True:
            try:
                exp = self.client.get_experiment(self.experiment)
                if exp.num_tasks >= len(self.keys):
                    self._check_group_size(exp.config.rollouts_per_task)
                    return exp.step
            except NotFoundError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.rank}: experiment {self.experiment!r} did not get its {len(self.keys)} tasks "
                    f"within {self.setup_timeout} s (rank {self.report_rank} sets it up)"
                )
            time.sleep(0.2)

    # -- selection --------------------------------------------------------------------

    def select(self, number: int | None = None, batch_size: int | None = None) -> SelectedBatch:
        """Batch number `number` (default: the next one) of `batch_size` tasks
        (default: the curriculum's). The same number gives the same batch on
        every rank and after a restart."""
        self.ensure_ready()
        self.wait()  # the next batch comes from the posterior after the last report
        if number is None:
            number = self.next_number
        request_key = self.request_key(number)
        size = self.batch_size if batch_size is None else int(batch_size)
        with self._lock:
            ahead = self._prefetched.pop(number, None)
        if ahead is not None and len(ahead.keys) == size and ahead.batch_id in self._open:
            with self._lock:
                self.next_number = max(self.next_number, number + 1)
            return ahead
        batch = self.client.select_batch(self.experiment, size, request_key=request_key)
        return self._selected(batch, number)

    def _selected(self, batch: Batch, number: int, handed_out: bool = True) -> SelectedBatch:
        """Record a batch the server selected under batch number `number`;
        `handed_out`: the caller gets it now (not drawn ahead for `select`)."""
        request_key = self.request_key(number)
        try:
            indices = tuple(self.index[k] for k in batch.keys)
        except KeyError as e:
            raise ValueError(
                f"the server selected task {e.args[0]!r} of experiment {self.experiment!r}, "
                "which is not in this dataset; use one experiment per dataset"
            ) from None
        selected = SelectedBatch(batch.batch_id, number, batch.step, request_key, tuple(batch.keys), indices)
        with self._lock:
            if handed_out:
                self.next_number = max(self.next_number, number + 1)
            if batch.batch_id not in self._open:
                self._open[batch.batch_id] = selected
                while len(self._open) > MAX_OPEN_BATCHES:  # drawn and never reported (e.g. replayed on resume)
                    self._forget(next(iter(self._open)))
        return selected

    @property
    def open_batches(self) -> list[SelectedBatch]:
        """Batches drawn and not yet reported, oldest first."""
        with self._lock:
            return list(self._open.values())

    def awaiting_report(self) -> list[SelectedBatch]:
        """Batches handed out whose report was not sent yet, oldest first
        (not those drawn ahead for `select`, nor those whose report failed)."""
        with self._lock:
            skipped = self._drawn_ahead() | self._failed_reports
            return [b for b in self._open.values() if b.batch_id not in skipped]

    # -- reporting --------------------------------------------------------------------

    def report(
        self,
        outcomes: Mapping[str, OutcomeValue],
        *,
        batch: SelectedBatch | str | int | None = None,
        strict: bool | None = None,
    ) -> list[ReportResult]:
        """Report key -> (successes, trials) to the open batch the rollouts
        came from; every batch touched is reported once and closed.

        `batch` names that batch (a SelectedBatch, its batch id or its
        number); every key must be in it. Without it, the outcomes go to the
        one open batch that holds all their keys, or, if none does, each key
        to the one open batch that holds it. A key in no open batch, or in
        several with nothing to tell them apart, raises
        UnattributedOutcomesError before anything is reported (strict, the
        curriculum's default), or is dropped and counted (strict=False).

        Only the reporting rank calls the server; the other ranks close the
        batches locally and return []. Tasks of a batch missing from
        `outcomes` count as not selected. A batch that the server already has
        with other outcomes (a trainer resumed from a checkpoint older than
        its last report) is skipped with a warning: the first report stands.
        A report still running in the background is waited for first (its
        error raises here), so reports stay in order.
        """
        self.wait()
        return self._report_groups(self._parts(outcomes, batch, strict))

    def _parts(
        self,
        outcomes: Mapping[str, OutcomeValue],
        batch: SelectedBatch | str | int | None,
        strict: bool | None,
    ) -> list[tuple[SelectedBatch, dict[str, OutcomeValue]]]:
        """The outcomes, each open batch with its share of them; what cannot
        be attributed raises (strict) or is dropped and counted."""
        clean = {str(k): outcome_value(v, str(k)) for k, v in outcomes.items()}
        if not clean and self.is_reporter:  # another rank's outcomes are not sent: nothing is lost there
            # Every reward None (or NaN, which TRL makes of None): nothing
            # can be sent, and the batch stays open and leased until it expires.
            where = "" if batch is None else f" for batch {batch if isinstance(batch, (str, int)) else batch.number}"
            message = (
                f"no task outcomes to report{where} of experiment {self.experiment!r}: every reward was None "
                "(a reward function that applies to none of the rollouts?); the batch stays open and its "
                "tasks stay leased until the lease expires"
            )
            if self.strict if strict is None else strict:
                raise EmptyReportError(message)
            log.error("%s (strict=False: going on)", message)
            return []
        with self._lock:
            groups, problems = self._attribute(clean, batch)
            batches = [self._open[b] for b in groups]
        if problems:
            dropped = sum(len(keys) for keys in problems.values())
            message = (
                f"{dropped} of {len(clean)} reported task outcomes of experiment {self.experiment!r} cannot be "
                f"filed under the batch they came from: "
                + "; ".join(f"{reason}: {keys[:5]}" for reason, keys in problems.items())
            )
            if self.strict if strict is None else strict:
                raise UnattributedOutcomesError(
                    message + ". Report each batch's outcomes with the batch they were drawn in "
                    "(batch=...), once; a lenient curriculum (strict=False) drops and counts them instead"
                )
            with self._lock:
                self.dropped_outcomes += dropped
            log.error("%s; dropped (strict=False): %d dropped so far", message, self.dropped_outcomes)
        return [(b, {k: clean[k] for k in groups[b.batch_id]}) for b in batches]

    def report_in_background(
        self,
        outcomes: Mapping[str, OutcomeValue],
        *,
        batch: SelectedBatch | str | int | None = None,
        strict: bool | None = None,
        lookahead: int | None = 0,
    ) -> Future[list[ReportResult]]:
        """`report`, off the caller's critical path: the outcomes are checked
        and attributed now (an UnattributedOutcomesError raises here), the
        report runs on a background thread, and the next `select` waits for
        it, so the next batch comes from the same posterior as after a
        synchronous report. A failure is logged at once and raised by the
        next `select`, `wait` or checkpoint (`resume_state`), never lost.

        A report of one batch may also select the next batch number
        (`next_number`) in the same call (ReportAndSelect, one transaction
        on the server); `select` of that number then costs nothing. That is
        the batch a synchronous run draws only if its next draw comes after
        this report and before the next one. The caller knows when: its
        loader draws `lookahead` batches ahead of the batch it reports (0:
        none, the torch sampler without workers; 1: accelerate's one-batch
        prefetch), so the selection is joined to the report only when the
        reported batch is exactly that far behind the newest drawn (not,
        e.g., a batch replayed after a resume, or under a loader that drew
        further ahead). None: never.
        """
        self.wait()  # reports stay in order
        parts = self._parts(outcomes, batch, strict)
        joined = (
            lookahead is not None
            and self.is_reporter
            and len(parts) == 1
            and parts[0][0].number == self.next_number - 1 - lookahead
        )
        ahead = self.next_number if joined else None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bots-report")
        future = self._executor.submit(self._report_groups, parts, ahead)
        numbers = [selected.number for selected, _ in parts]
        future.add_done_callback(lambda done: _log_failure(done, numbers))
        self._background = future
        return future

    def wait(self) -> list[ReportResult]:
        """The results of the report running in the background (none: []);
        raises its error."""
        future, self._background = self._background, None
        return [] if future is None else future.result()

    def _report_groups(
        self, parts: Sequence[tuple[SelectedBatch, dict[str, OutcomeValue]]], ahead: int | None = None
    ) -> list[ReportResult]:
        results = []
        for selected, outcomes in parts:
            result = self._report_batch(selected, outcomes, ahead)
            if result is not None:
                results.append(result)
        return results

    def _attribute(
        self, outcomes: Mapping[str, OutcomeValue], batch: SelectedBatch | str | int | None
    ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """batch id -> the keys it gets, and reason -> the keys that cannot
        be attributed (caller holds the lock)."""
        keys = list(outcomes)
        if batch is not None:
            named = self._named_open(batch)
            if named is None:
                return {}, {f"batch {batch if isinstance(batch, (str, int)) else batch.number} is not open": keys}
            members = set(named.keys)
            outside = [k for k in keys if k not in members]
            inside = [k for k in keys if k in members]
            return ({named.batch_id: inside} if inside else {}), (
                {f"not in batch {named.number}": outside} if outside else {}
            )
        holders: dict[str, list[str]] = {k: [] for k in keys}
        # A batch a ReportAndSelect drew ahead is not the caller's until
        # `select` hands it out: outcomes cannot come from it yet (a report
        # repeated by mistake would otherwise be filed under it).
        ahead = self._drawn_ahead()
        for selected in self._open.values():
            if selected.batch_id in ahead:
                continue
            members = set(selected.keys)
            for k in keys:
                if k in members:
                    holders[k].append(selected.batch_id)
        if keys:
            whole = set.intersection(*(set(h) for h in holders.values()))
            if len(whole) == 1:
                return {whole.pop(): keys}, {}
        groups: dict[str, list[str]] = {}
        problems: dict[str, list[str]] = {}
        for k in keys:
            if len(holders[k]) == 1:
                groups.setdefault(holders[k][0], []).append(k)
            elif not holders[k]:
                reason = "in no open batch (reported already, or never drawn by this run)"
                problems.setdefault(reason, []).append(k)
            else:
                reason = "in several open batches (pass batch=)"
                problems.setdefault(reason, []).append(k)
        return groups, problems

    def _drawn_ahead(self) -> set[str]:
        """Ids of the batches a ReportAndSelect drew that `select` has not
        handed out yet (caller holds the lock)."""
        return {b.batch_id for b in self._prefetched.values()}

    def open_batch(self, batch: SelectedBatch | str | int) -> SelectedBatch | None:
        """The open batch `batch` names (a SelectedBatch, its id or its number), if any."""
        with self._lock:
            return self._named_open(batch)

    def _named_open(self, batch: SelectedBatch | str | int) -> SelectedBatch | None:
        if isinstance(batch, SelectedBatch):
            return self._open.get(batch.batch_id)
        if isinstance(batch, str):
            return self._open.get(batch)
        return next((b for b in self._open.values() if b.number == int(batch)), None)

    def batch_of(self, key: str) -> SelectedBatch | None:
        """The open batch holding `key`, if exactly one does."""
        with self._lock:
            holders = [b for b in self._open.values() if key in b.keys]
            return holders[0] if len(holders) == 1 else None

    def report_batch(self, batch: SelectedBatch | str, outcomes: Mapping[str, OutcomeValue]) -> ReportResult | None:
        """Report one batch's outcomes explicitly and close it."""
        results = self.report(outcomes, batch=batch, strict=True)
        return results[0] if results else None

    def _report_batch(
        self, batch: SelectedBatch, outcomes: Mapping[str, OutcomeValue], ahead: int | None = None
    ) -> ReportResult | None:
        """Report one batch and close it; with `ahead`, select batch number
        `ahead` in the same call (ReportAndSelect) and keep it for `select`."""
        result = None
        if self.is_reporter:
            try:
                result = self._send_report(batch, outcomes, ahead)
            except Exception:
                with self._lock:
                    self._failed_reports.add(batch.batch_id)
                raise
        with self._lock:
            self._failed_reports.discard(batch.batch_id)
            self._reported_through = max(self._reported_through, batch.number)
        self.close(batch)
        if result is not None:
            self.acknowledge(result.step)
            if not result.duplicate:
                self._signal(batch, result, outcomes)
        return result

    def _send_report(
        self, batch: SelectedBatch, outcomes: Mapping[str, OutcomeValue], ahead: int | None
    ) -> ReportResult | None:
        """The server's answer to the report (with the selection of `ahead`,
        if given and accepted); None when it already had the batch's report."""
        try:
            result = None if ahead is None else self._report_and_select(batch, outcomes, ahead)
            if result is None:
                result = self.client.report_outcomes(self.experiment, batch.batch_id, outcomes)
            return result
        except FailedPreconditionError as e:
            if "already reported" not in e.message:
                raise
            log.warning("batch %s (%s) was already reported; keeping the first report", batch.number, batch.batch_id)
            return None

    def _report_and_select(
        self, batch: SelectedBatch, outcomes: Mapping[str, OutcomeValue], ahead: int
    ) -> ReportResult | None:
        """Report `batch` and select batch number `ahead` in one transaction;
        None when the server refused the pair (e.g. too few tasks free for
        the next batch): nothing was applied, and the caller reports alone,
        leaving the next select to raise its own error."""
        try:
            result, drawn = self.client.report_and_select(
                self.experiment, batch.batch_id, outcomes, self.batch_size, request_key=self.request_key(ahead)
            )
        except (InvalidArgumentError, FailedPreconditionError, ResourceExhaustedError) as e:
            log.info("ReportAndSelect refused (%s); reporting batch %d alone", e, batch.number)
            return None
        selected = self._selected(drawn, ahead, handed_out=False)
        with self._lock:
            self._prefetched[ahead] = selected
        return result

    def acknowledge(self, step: int) -> None:
        """Record that the server acknowledged a report at `step` (collective
        adapters call it on the ranks that did not report)."""
        with self._lock:
            self.acknowledged_step = max(step, self.acknowledged_step or 0)

    def add_listener(self, listener: Callable[[CurriculumSignals], None]) -> None:
        """Call `listener(signals)` after every report this process makes (the
        reporting rank's; a logger on that rank sees every batch)."""
        self.listeners.append(listener)

    def _signal(self, batch: SelectedBatch, result: ReportResult, outcomes: Mapping[str, OutcomeValue]) -> None:
        if not self.listeners and not self.posterior_means:
            self.last_signals = batch_signals(batch.number, result, outcomes, None, self.dropped_outcomes)
            return
        mean = None
        if self.posterior_means:
            snap = self.client.snapshot(self.experiment)
            position = {k: i for i, k in enumerate(snap.keys)}
            rows = [position[k] for k in batch.keys if k in position]
            if rows:
                a, b = snap.alpha[rows], snap.beta[rows]
                mean = float((a / (a + b)).mean())
        signals = batch_signals(batch.number, result, outcomes, mean, self.dropped_outcomes)
        self.last_signals = signals
        for listener in self.listeners:
            try:
                listener(signals)
            except Exception:  # a logger must never stop training
                log.exception("curriculum listener %r failed", listener)

    # -- resume -----------------------------------------------------------------------

    def resume_state(self, next_number: int) -> dict[str, Any]:
        """What a checkpoint taken now needs to resume exactly once: the
        batches drawn before `next_number` that are not reported yet, and the
        server step of the last acknowledged report (after the report running
        in the background, if any, is acknowledged)."""
        self.wait()
        with self._lock:
            given_up = [
                b
                for b in self._open.values()
                if b.batch_id in self._failed_reports and b.number < self._reported_through
            ]
            for batch in given_up:
                # Its report raised, and the run went on to report later
                # batches: drawing it again on a resume would train those again.
                log.warning(
                    "batch %d's report failed (that error was raised) and was not sent again: its outcomes may not "
                    "be on the server; later batches were reported, so a resume does not draw it again",
                    batch.number,
                )
                self._failed_reports.discard(batch.batch_id)
                self._forget(batch.batch_id)
            ahead = self._drawn_ahead()
            pending = sorted(
                b.number for b in self._open.values() if b.number < next_number and b.batch_id not in ahead
            )
            return {"pending": pending, "acknowledged_step": self.acknowledged_step}

    def checkpoint_state(self, next_number: int) -> dict[str, Any]:
        """A loader's checkpoint: this run's experiment, batch size and
        request prefix, the next batch number and `resume_state`."""
        return {
            "experiment": self.experiment,
            "batch_size": self.batch_size,
            "request_prefix": self.request_prefix,
            "next_number": next_number,
            **self.resume_state(next_number),
        }

    def resume_from(self, state: Mapping[str, Any], what: str) -> int:
        """The batch number to go on with after loading a loader's
        `checkpoint_state` (`what` names the loader in errors): its
        experiment, batch size and request prefix must be this run's (a state
        without one of them passes); then `resume_number`."""
        for name in ("experiment", "batch_size", "request_prefix"):
            saved, ours = state.get(name, getattr(self, name)), getattr(self, name)
            if saved != ours:
                raise ValueError(
                    f"the checkpoint's {what} has {name} = {saved!r}, this run {ours!r}: continue a run with its own "
                    "settings, or start a new experiment"
                )
        return self.resume_number(state, int(state["next_number"]))

    def resume_number(self, state: Mapping[str, Any], next_number: int) -> int:
        """The batch number to go on with after loading a checkpoint.

        Batches drawn but not reported when the checkpoint was taken (verl
        saves its checkpoint before it calls `update()`; a prefetching loader
        draws ahead) are drawn again from the first one the server never got
        a report of; the server says which, per request key, so reports that
        arrived out of order (an asynchronous trainer) lose nothing. The same
        request keys give back the same tasks, so each batch is reported
        exactly once: a batch drawn again whose report the server has keeps
        that first report. When all of them were reported (a crash after
        the last report), none is drawn again.
        """
        self.resume = True  # a checkpoint's state: this run continues the experiment
        pending = sorted(int(n) for n in state.get("pending") or [] if int(n) < next_number)
        # Batch sizes other than the curriculum's (Trinity's steps), where a state keeps them.
        sizes = {
            int(n): int(size) for n, size in zip(state.get("pending") or [], state.get("pending_sizes") or []) if size
        }
        acknowledged = state.get("acknowledged_step")
        if acknowledged is not None:
            with self._lock:
                self.acknowledged_step = int(acknowledged)
        if not pending:
            return next_number
        server_step = self.client.get_experiment(self.experiment).step
        # The server's step now: a checkpoint taken before the next report
        # must count from here, not from the old checkpoint's step.
        self.acknowledge(server_step)
        nothing_since = acknowledged is not None and server_step == int(acknowledged)
        first = next((n for n in pending if nothing_since or not self._was_reported(n, sizes.get(n))), None)
        if first is None:
            return next_number
        log.warning(
            "batch %d was drawn before the checkpoint but the server never got its report; "
            "drawing it again (request key %r: the same tasks) so it is reported once",
            first,
            self.request_key(first),
        )
        return first

    def _was_reported(self, number: int, size: int | None) -> bool:
        """Whether the server has the report of batch `number` of `size`
        tasks (None: the curriculum's batch size), drawn before the
        checkpoint. When it cannot say (a server older than the
        `reported_step` field, a batch drawn with another size), the answer
        is no: the batch is drawn and trained again, and no report is lost,
        as its repeated report is skipped."""
        size = self.batch_size if size is None else size
        try:
            batch = self.client.select_batch(self.experiment, size, request_key=self.request_key(number))
        except FailedPreconditionError as e:
            return "compacted" in e.message  # reported long ago, its tasks gone; else another size
        return batch.reported_step is not None

    def close(self, batch: SelectedBatch | str) -> None:
        """Forget an open batch without reporting it (its lease expires on the server)."""
        batch_id = batch if isinstance(batch, str) else batch.batch_id
        with self._lock:
            self._forget(batch_id)

    def _forget(self, batch_id: str) -> None:
        self._open.pop(batch_id, None)


def _log_failure(future: Future[list[ReportResult]], numbers: Sequence[int]) -> None:
    """A background report's failure, logged when it happens: it is raised
    again by the next select, wait or checkpoint, but a run that ends first
    never raises it, and this line is then all that says so."""
    error = future.exception()
    if error is not None:
        log.error(
            "the report of batch %s, running in the background, failed; the next batch, report, wait() or checkpoint "
            "raises it (if training ends first, nothing does: these outcomes are not on the server): %s",
            ", ".join(map(str, numbers)),
            error,
        )


def address_and_experiment(options: Mapping[str, Any], who: str, where: str) -> tuple[str, str]:
    """The server address and the experiment name of a framework's config
    (`options`), or BOTS_ADDRESS / BOTS_EXPERIMENT; ValueError naming
    `where + "address"` if either is missing."""
    address = options.get("address") or os.environ.get("BOTS_ADDRESS")
    experiment = options.get("experiment") or os.environ.get("BOTS_EXPERIMENT")
    if not address or not experiment:
        raise ValueError(
            f"{who} needs {where}address and {where}experiment "
            "(or the BOTS_ADDRESS and BOTS_EXPERIMENT environment variables)"
        )
    return str(address), str(experiment)


def config_flag(options: Mapping[str, Any], name: str, default: bool, where: str) -> bool:
    """A boolean option of a framework's config (YAML or Hydra may give the
    string "true"); anything else raises, naming `where + name`."""
    value = options.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{where}{name} must be true or false, got {value!r}")


def _unique_index(keys: Sequence[str]) -> dict[str, int]:
    index: dict[str, int] = {}
    duplicates: list[str] = []
    for i, key in enumerate(keys):
        if key in index:
            duplicates.append(key)
        index[key] = i
    if duplicates:
        raise ValueError(
            f"task keys must be unique per dataset row; {len(duplicates)} repeat (e.g. {duplicates[:3]}); "
            "key the rows by a unique id column"
        )
    return index


_LAZY_CLASSES: dict[tuple[str, str], type] = {}


def torch_sampler() -> type:
    """torch.utils.data.Sampler, imported on first use."""
    from torch.utils.data import Sampler

    return Sampler


def lazy_class(module: str, name: str, implementation: type, base: Callable[[], type]) -> type:
    """`implementation` on a framework base class that is imported only on
    first use, so importing an integration module needs no framework. The
    class is cached and named `module.name`, so instances pickle."""
    key = (module, name)
    if key not in _LAZY_CLASSES:
        cls = type(name, (implementation, base()), {"__doc__": implementation.__doc__, "__module__": module})
        cls.__qualname__ = name
        _LAZY_CLASSES[key] = cls
    return _LAZY_CLASSES[key]
