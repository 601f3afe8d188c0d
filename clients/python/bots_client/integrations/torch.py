"""PyTorch: a `torch.utils.data` sampler that draws every batch from the service.

    from bots_client.integrations.torch import BotsSampler

    sampler = BotsSampler("127.0.0.1:50051", "run-42", keys=dataset_keys, batch_size=64,
                          config=bots_client.ExperimentConfig(rollouts_per_task=8))
    loader = DataLoader(dataset, batch_size=sampler.local_batch_size, sampler=sampler)
    for rows in loader:
        batch = sampler.last_batch                      # keys / indices of this step
        rewards = rollout_and_verify(rows)              # n samples per task
        sampler.report_rewards(task_of_each_sample, rewards)   # or sampler.report({key: (s, n)})

Under DistributedDataParallel every rank builds the same sampler: all ranks ask
for batch k with request key "step-k" and get the same batch; with
`shard=True` (default) each rank yields its strided share of it, like
`DistributedSampler`. `report()` is then collective: the ranks' outcomes are
all-gathered, exactly one rank (`report_rank`, default 0) reports them, and
it broadcasts the server's answer, so no rank selects the next batch before
the report is acknowledged (`wait_for_report=False` skips that wait, for
trainers that pipeline). `state_dict()` names the experiment, the next batch
number and the batches drawn but not reported; loading it into a new sampler
continues with the same batches, drawing again a pending batch the server
never got. torchdata's `StatefulDataLoader` saves and restores it on its own.
`on_report=` receives each report's `CurriculumSignals` (e.g.
`tensorboard_listener(writer)`).

torch is imported when `BotsSampler` / `BotsBatchSampler` is first accessed.
"""

from __future__ import annotations

import logging
import numbers
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bots_client._calls import outcome_value
from bots_client.integrations._core import (
    Curriculum,
    CurriculumSignals,
    EmbedFn,
    OutcomeValue,
    SelectedBatch,
    aggregate_outcomes,
    lazy_class,
    merge_outcomes,
    torch_sampler,
)
from bots_client.types import ExperimentConfig, ReportResult

if TYPE_CHECKING:
    from bots_client.client import Client

__all__ = [
    "BotsBatchSampler",
    "BotsSampler",
    "ReportingRankError",
    "acknowledge_on_every_rank",
    "all_gather_outcomes",
    "broadcast_acknowledgement",
    "tensorboard_listener",
]

log = logging.getLogger("bots_client.integrations.torch")


def _process_group() -> Any:
    """torch.distributed if a process group of more than one rank is up."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist


def broadcast_acknowledgement(curriculum: Curriculum, results: Sequence[ReportResult]) -> list[ReportResult]:
    """`acknowledge_on_every_rank` of answers already in hand (the
    reporting rank's `results`)."""
    return acknowledge_on_every_rank(curriculum, lambda: results)


class ReportingRankError(RuntimeError):
    """The reporting rank's report failed; raised on the other ranks (the
    reporting rank raises the error itself)."""


def acknowledge_on_every_rank(
    curriculum: Curriculum, answer: Callable[[], Sequence[ReportResult]]
) -> list[ReportResult]:
    """Wait, on every rank, until the reporting rank's report is acknowledged
    (a collective: every rank must call it). `answer()` is the report, or
    the wait for the one running in the background; the reporting rank
    broadcasts what it returns, the others record the acknowledged step. So
    no rank selects the next batch before the server applied this report,
    and every rank's checkpoint knows the acknowledged step. If `answer()`
    raises on the reporting rank, the error is broadcast instead and every
    rank raises (the others ReportingRankError), rather than waiting in a
    collective the reporting rank never joins. Returns the answers on the
    reporting rank, [] elsewhere; without a process group, `answer()`."""
    dist = _process_group()
    if dist is None:
        return list(answer())
    results: list[ReportResult] = []
    error: BaseException | None = None
    try:
        results = list(answer())
    except Exception as e:  # raised below, after the other ranks have heard of it
        error = e
    failure = None if error is None else f"{type(error).__name__}: {error}"
    box: list[Any] = [(results, failure) if curriculum.is_reporter else None]
    dist.broadcast_object_list(box, src=curriculum.report_rank)
    acknowledged, reporter_failure = box[0]
    if error is not None:
        raise error
    if reporter_failure is not None:
        raise ReportingRankError(f"rank {curriculum.report_rank}'s report to the service failed: {reporter_failure}")
    for result in acknowledged:
        curriculum.acknowledge(result.step)
    return results if curriculum.is_reporter else []


def await_background_report(curriculum: Curriculum, collective: bool) -> list[ReportResult]:
    """The report running in the background: its answers, or its error.
    `collective`: after a report under torch.distributed, on every rank
    (`acknowledge_on_every_rank`)."""
    if collective:
        return acknowledge_on_every_rank(curriculum, curriculum.wait)
    return curriculum.wait()


def tensorboard_listener(writer: Any, prefix: str = "curriculum/") -> Callable[[CurriculumSignals], None]:
    """A listener (`BotsSampler(on_report=...)`) writing each report's
    curriculum signals to a TensorBoard `SummaryWriter` at the server step,
    so they sit beside the loss: `on_report=tensorboard_listener(writer)`."""

    def write(signals: CurriculumSignals) -> None:
        for name, value in signals.as_dict(prefix).items():
            writer.add_scalar(name, value, signals.step)

    return write


def all_gather_outcomes(outcomes: Mapping[str, OutcomeValue]) -> dict[str, OutcomeValue]:
    """Merge per-rank outcomes over torch.distributed (a collective: every
    rank must call it). Without an initialised process group: a copy."""
    dist = _process_group()
    if dist is None:
        return {k: outcome_value(v, k) for k, v in outcomes.items()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dict(outcomes))
    return merge_outcomes(parts)


class _SamplerBase:
    """What both samplers share; the public classes add torch's base class."""

    def __init__(
        self,
        client: Client | str | None = None,
        experiment: str | None = None,
        keys: Sequence[Any] | None = None,
        *,
        batch_size: int | None = None,
        num_batches: int | None = None,
        shard: bool = True,
        gather: bool = True,
        config: ExperimentConfig | None = None,
        features: Sequence[Mapping[str, float]] | None = None,
        request_prefix: str = "step",
        rank: int | None = None,
        world_size: int | None = None,
        report_rank: int = 0,
        curriculum: Curriculum | None = None,
        wait_for_report: bool = True,
        on_report: Callable[[CurriculumSignals], None] | None = None,
        posterior_means: bool = False,
        resume: bool = False,
        strict: bool = True,
        overlap: bool = True,
        embed_fn: EmbedFn | str | None = None,
        embed_inputs: Sequence[Any] | None = None,
    ) -> None:
        if curriculum is None:
            if client is None or experiment is None or keys is None or batch_size is None:
                raise TypeError("pass client, experiment, keys and batch_size (or a ready curriculum=)")
            curriculum = Curriculum(
                client,
                experiment,
                keys,
                batch_size=batch_size,
                config=config,
                features=features,
                request_prefix=request_prefix,
                rank=rank,
                world_size=world_size,
                report_rank=report_rank,
                posterior_means=posterior_means,
                resume=resume,
                strict=strict,
                embed_fn=embed_fn,
                embed_inputs=embed_inputs,
            )
        self.curriculum = curriculum
        world = curriculum.world_size
        self.shard = bool(shard) and world > 1
        if self.shard and curriculum.batch_size % world:
            raise ValueError(f"batch_size = {curriculum.batch_size} does not split evenly over {world} ranks")
        self.local_batch_size = curriculum.batch_size // world if self.shard else curriculum.batch_size
        self.num_batches = int(num_batches) if num_batches else max(1, len(curriculum.keys) // curriculum.batch_size)
        self.gather = gather
        self.wait_for_report = wait_for_report
        self.overlap = overlap
        self._acknowledgement_due = False  # a collective broadcast owed before the next select
        # A background report's error caught while the loader drew ahead,
        # raised by the trainer's next report(), wait() or state_dict().
        self._deferred_error: Exception | None = None
        if on_report is not None:
            curriculum.add_listener(on_report)
        self.step = 0  # the next batch number to draw
        self.offset = 0  # indices of batch `step` this rank already yielded
        self._checkpoint_step: int | None = None  # the loaded checkpoint's next batch, until the next epoch starts
        self.last_batch: SelectedBatch | None = None

    # -- keys <-> indices -------------------------------------------------------------

    @property
    def experiment(self) -> str:
        return self.curriculum.experiment

    def key_of(self, index: int) -> str:
        return self.curriculum.keys[int(index)]

    def index_of(self, key: str) -> int:
        return self.curriculum.index[key]

    def local_indices(self, batch: SelectedBatch) -> list[int]:
        """This rank's share of a batch (strided, like DistributedSampler)."""
        indices = list(batch.indices)
        if self.shard:
            return indices[self.curriculum.rank :: self.curriculum.world_size]
        return indices

    def _epoch_batches(self) -> Iterator[tuple[SelectedBatch, list[int]]]:
        # After a resume that draws a batch again, the epoch is the one the
        # checkpoint was in (verl: global_steps // len(loader)), not the
        # replayed batch's: at an epoch's last step, that is the next epoch.
        position = max(self.step, self._checkpoint_step or 0)
        self._checkpoint_step = None
        end = (position // self.num_batches + 1) * self.num_batches
        while self.step < end:
            self._wait_before_drawing()
            batch = self.curriculum.select(self.step)
            self.last_batch = batch
            yield batch, self.local_indices(batch)
        self._wait_before_drawing()  # the epoch's last report: its failure surfaces here, not later

    def _wait_before_drawing(self) -> None:
        """`wait()` before the loader draws. Its error raises here, unless the
        loader drew ahead of the trainer (DataLoader workers: batches handed
        out and not reported): such a loader drops the rows it fetched when
        its sampler raises, so the error waits for the trainer's next
        `report()`, `wait()` or `state_dict()`. Every rank decides alike:
        the batches in flight are the same on each."""
        try:
            self.wait()
        except Exception as error:
            if not self.curriculum.awaiting_report():
                raise
            self._deferred_error = error

    def _raise_deferred_error(self) -> None:
        error, self._deferred_error = self._deferred_error, None
        if error is not None:
            raise error

    def wait(self) -> list[ReportResult]:
        """Wait for the report running in the background (overlap=True) and
        return the server's answers (on the reporting rank; [] elsewhere);
        raises its error. Under torch.distributed a collective, like
        `report`: every rank waits until the reporting rank's report is
        acknowledged. Drawing the next batch calls it."""
        self._raise_deferred_error()
        collective, self._acknowledgement_due = self._acknowledgement_due, False
        return await_background_report(self.curriculum, collective)

    def set_epoch(self, epoch: int) -> None:
        """Go on at epoch `epoch`'s first batch unless already there or past it.

        A sampler that resumed from `load_state_dict` is already in place; a
        fresh one in a trainer that resumes by epoch number and then skips
        the batches it trained (transformers' Trainer, or a loop calling
        `set_epoch` like for DistributedSampler) starts at batch
        `epoch * num_batches`, so the skipped batches have the request keys of
        the first run and are not drawn anew."""
        first = int(epoch) * self.num_batches
        if self.step < first:
            self.step, self.offset = first, 0

    # -- reporting --------------------------------------------------------------------

    def report(
        self,
        outcomes: Mapping[str, OutcomeValue],
        *,
        batch: SelectedBatch | str | int | None = None,
        gather: bool | None = None,
        strict: bool | None = None,
    ) -> list[ReportResult]:
        """Report key -> (successes, trials) for tasks drawn by this sampler,
        to the batch they were drawn in: `batch` (e.g. `sampler.last_batch`
        when the loader does not prefetch), or the one open batch holding
        them (`Curriculum.report`).

        With `overlap` (default) the report, and the selection of the next
        batch with it, run in the background while the trainer works; this
        returns [] at once (after checking the outcomes) and the next batch,
        or `wait()`, waits for them and raises their error. The batches and
        the posterior are those of a synchronous report. With
        overlap=False it returns the server's answers.

        Under torch.distributed with `gather` (default), this is a collective:
        every rank passes its own tasks' outcomes, they are merged, and only
        the reporting rank calls the server. Returns the server's answers on
        the reporting rank, [] elsewhere."""
        self._raise_deferred_error()  # an earlier report's, from the loader: this one is not sent
        collective = self.gather if gather is None else gather
        if collective:
            self._need_process_group("report()")
            outcomes = all_gather_outcomes(outcomes)
        if self.overlap:
            self.wait()
            self.curriculum.report_in_background(outcomes, batch=batch, strict=strict)
            self._acknowledgement_due = collective and self.wait_for_report
            return []
        if collective and self.wait_for_report:
            return acknowledge_on_every_rank(
                self.curriculum, lambda: self.curriculum.report(outcomes, batch=batch, strict=strict)
            )
        return self.curriculum.report(outcomes, batch=batch, strict=strict)

    def report_rewards(
        self,
        tasks: Sequence[Any],
        rewards: Sequence[Any],
        *,
        success_threshold: float | None = 0.5,
        batch: SelectedBatch | str | int | None = None,
        gather: bool | None = None,
    ) -> list[ReportResult]:
        """Report per-rollout rewards: `tasks[i]` is rollout i's dataset index
        (int) or task key (str), `rewards[i]` its reward (see
        `aggregate_outcomes` for the threshold); `batch` as in `report`."""
        keys = [self.key_of(t) if _is_index(t) else str(t) for t in tasks]
        outcomes = aggregate_outcomes(keys, rewards, success_threshold=success_threshold)
        return self.report(outcomes, batch=batch, gather=gather)

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        self._raise_deferred_error()
        self.curriculum.wait()  # the checkpoint records the report running in the background
        return {
            "experiment": self.curriculum.experiment,
            "step": self.step,
            "offset": self.offset,
            "batch_size": self.curriculum.batch_size,
            "request_prefix": self.curriculum.request_prefix,
            "world_size": self.curriculum.world_size,
            **self.curriculum.resume_state(self.step),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["experiment"] != self.curriculum.experiment:
            raise ValueError(
                f"checkpoint is of experiment {state['experiment']!r}, this sampler uses {self.curriculum.experiment!r}"
            )
        if int(state.get("batch_size", self.curriculum.batch_size)) != self.curriculum.batch_size:
            raise ValueError(
                f"checkpoint used batch_size = {state['batch_size']}, this sampler {self.curriculum.batch_size}"
            )
        if state.get("request_prefix", self.curriculum.request_prefix) != self.curriculum.request_prefix:
            raise ValueError("checkpoint used another request_prefix")
        step, offset = int(state["step"]), int(state.get("offset", 0))
        resumed = self._agreed_resume_number(state, step)
        if resumed != step:
            offset = 0  # an earlier batch again, from its start
        elif offset and int(state.get("world_size", self.curriculum.world_size)) != self.curriculum.world_size:
            # The position inside a batch is within one rank's share; another
            # world size shares the batch out differently. The batch is not
            # reported yet (its rows were still being drawn): start it over.
            log.warning(
                "checkpoint taken inside batch %d with world size %s; resuming with %d ranks from the batch's start",
                step,
                state["world_size"],
                self.curriculum.world_size,
            )
            offset = 0
        self.step, self.offset = resumed, offset
        self._checkpoint_step = step
        self.curriculum.next_number = max(self.curriculum.next_number, self.step)

    def _agreed_resume_number(self, state: Mapping[str, Any], step: int) -> int:
        """`Curriculum.resume_number`, the same on every rank. With `gather`
        under torch.distributed, a collective like `report`: every rank
        loads its checkpoint, and the reporting rank's answer, with the
        acknowledged step it knows, is broadcast to the others, so no rank
        asks the server after the reporting rank went on (an overlapped
        report is acknowledged to the other ranks only when they draw the
        next batch: their checkpoints may hold an older acknowledged step)."""
        resumed = self.curriculum.resume_number(state, step)
        dist = _process_group() if self.gather else None
        if dist is None:
            return resumed
        cur = self.curriculum
        box: list[Any] = [(resumed, cur.acknowledged_step) if cur.is_reporter else None]
        dist.broadcast_object_list(box, src=cur.report_rank)
        resumed, acknowledged = box[0]
        if acknowledged is not None:
            cur.acknowledge(acknowledged)
        return int(resumed)

    def _need_process_group(self, what: str) -> None:
        """Raise if this sampler shares batches over several ranks but no
        torch.distributed process group is up: the outcomes of the other
        ranks could not be gathered and would be lost without a word."""
        world = self.curriculum.world_size
        if world > 1 and _process_group() is None:
            raise RuntimeError(
                f"{what} with gather=True is a torch.distributed collective, but this sampler has "
                f"world_size = {world} and no process group of that size is initialised: call "
                "torch.distributed.init_process_group first, or pass gather=False and gather the "
                "ranks' outcomes yourself (only report_rank's are sent)"
            )


class _BotsSampler(_SamplerBase):
    """Yields dataset indices one at a time, `local_batch_size` per batch:
    use with `DataLoader(dataset, batch_size=sampler.local_batch_size,
    sampler=sampler)` (and `drop_last=True` or a divisible length)."""

    def __iter__(self) -> Iterator[int]:
        for _batch, local in self._epoch_batches():
            for j in range(self.offset, len(local)):
                # Advance the position before yielding, so a state_dict taken
                # right after the last index of a batch points at the next batch.
                if j + 1 == len(local):
                    self.step, self.offset = self.step + 1, 0
                else:
                    self.offset = j + 1
                yield local[j]

    def __len__(self) -> int:
        return self.num_batches * self.local_batch_size


class _BotsBatchSampler(_SamplerBase):
    """Yields one list of dataset indices per service batch (this rank's
    share): `DataLoader(dataset, batch_sampler=sampler)`."""

    def __iter__(self) -> Iterator[list[int]]:
        for _batch, local in self._epoch_batches():
            self.step, self.offset = self.step + 1, 0
            yield local

    def __len__(self) -> int:
        return self.num_batches


def _is_index(value: Any) -> bool:
    """A dataset index: a Python or numpy integer, or a 0-d integer tensor."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):
        return True
    dtype = getattr(value, "dtype", None)
    return getattr(value, "ndim", None) == 0 and dtype is not None and "int" in str(dtype)


_IMPLEMENTATIONS = {"BotsSampler": _BotsSampler, "BotsBatchSampler": _BotsBatchSampler}


def __getattr__(name: str) -> Any:
    if name in _IMPLEMENTATIONS:
        return lazy_class(__name__, name, _IMPLEMENTATIONS[name], torch_sampler)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    BotsSampler = _BotsSampler
    BotsBatchSampler = _BotsBatchSampler
