"""The store contract: every read and write the core makes, and what each one
guarantees. `open_store` (store/__init__.py) returns an implementation; the
core depends on this class alone.

Common to every method:

- Each read or write of the database is one transaction: it commits
  entirely or changes nothing. (Where every write holds all others, SQLite,
  add_tasks, create_copy and delete_experiment write or remove the tasks
  rows in short transactions of their own, which no read sees before the
  one transaction that adds the tasks commits, or after the one that
  deletes the experiment: see sql_task_rows.py.)
- It raises `bots_server.errors.Unavailable` when the database cannot be
  reached, hangs past its timeouts, or is busy (a locked SQLite file, a full
  connection pool). The call may be retried.
- It is safe to call from several threads at once. Several stores (replicas)
  may share one PostgreSQL database; what keeps them consistent is stated
  per method (compare-and-set on the experiment's step, the experiment row
  lock, the tenant lock).
- A write given `limits` (TenantLimits: create_experiment, create_copy,
  add_tasks) first takes the tenant's lock, held to its commit, then counts
  the tenant's experiments and tasks and raises OverQuota, writing nothing,
  if what it adds would take the tenant past them. The lock serializes
  these writes of one tenant across threads and replicas (PostgreSQL: an
  advisory lock; SQLite: the database's single writer), so concurrent
  writes never leave a tenant above its limits.
- Times are passed in by the caller (timezone-aware) and read back as
  timezone-aware datetimes of the same instants.
"""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from bots_server.store.records import (
    DEFAULT_TENANT,
    BatchRow,
    Compacted,
    ExperimentCopy,
    ExperimentRow,
    LoadedRows,
    Lookup,
    RetirementEvent,
    SchemaStatus,
    SharesEvent,
    StepEvent,
    TenantLimits,
    TenantUsage,
)


class Store(abc.ABC):
    """All persistence of the service. See the module docstring for what
    every method shares."""

    # Batches never reported stay reportable after their lease expires, so
    # selects without reports would grow the batches without end. At this
    # many per experiment, insert_batch deletes those whose lease expired
    # longest ago, down to nine tenths of it (0: never). Reports in flight
    # are far fewer, even in asynchronous runs.
    max_unreported_batches = 10_000

    # -- lifecycle and schema ------------------------------------------------

    @property
    @abc.abstractmethod
    def display_url(self) -> str:
        """The database URL without its password, for logs and messages."""

    @abc.abstractmethod
    def migrate(self, revision: str = "head") -> list[str]:
        """Create or upgrade the schema to `revision` (the latest by default).

        Holds the store's migration lock throughout, so that migrators
        starting together (replicas, init containers) take turns: the next
        one finds nothing to do. Migrating a database already at `revision`
        changes nothing. A database whose revisions are newer than this
        code's (a rollback to the previous release) is left as it is, and
        its revisions returned; otherwise [].
        """

    @abc.abstractmethod
    def schema_status(self) -> SchemaStatus:
        """Whether the database's schema is at the code's latest revision,
        with the database's revisions (empty for an empty database) and the
        code's heads. Reads only."""

    @abc.abstractmethod
    def remove_unfinished_writes(self) -> None:
        """Remove the invisible rows that writes a crash interrupted left
        behind (see the module docstring). Called once the schema is current,
        before serving; by the only server of the database."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Return if the database answers; Unavailable otherwise."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and any lock the store holds (the SQLite file
        lock of an exclusive store). The store is not used afterwards."""

    def close_unused(self) -> None:
        """close(), for a server whose start failed before it used the
        database (its address taken): a database file that opening this store
        created, still empty, is removed, so a failed start leaves nothing."""
        self.close()

    # -- experiments ----------------------------------------------------------

    @abc.abstractmethod
    def create_experiment(
        self,
        name: str,
        config: Mapping[str, Any],
        now: dt.datetime,
        tenant: str = DEFAULT_TENANT,
        abandoned: Callable[[], bool] | None = None,
        *,
        limits: TenantLimits | None = None,
    ) -> ExperimentRow:
        """A new experiment at step 0 with no tasks, and its empty checkpoint.
        `config` is kept as a JSON object, uninterpreted. `name` is the stored
        name (unique across tenants), `tenant` the tenant it belongs to.

        Raises AlreadyExists if the name is taken; of two racing creates of
        one name exactly one succeeds. `abandoned`: see add_tasks. `limits`
        (of `tenant`): OverQuota if the tenant has max_experiments already.
        """

    @abc.abstractmethod
    def create_copy(
        self,
        copy: ExperimentCopy,
        now: dt.datetime,
        abandoned: Callable[[], bool] | None = None,
        *,
        limits: TenantLimits | None = None,
        pace: Callable[[], None] | None = None,
    ) -> ExperimentRow:
        """A new experiment starting at a given state and step (fork,
        restore): its tasks (copied from `copy.source_id`'s first
        `copy.num_tasks` tasks, or the given keys and features), the
        checkpoint `copy.state` at `copy.step`, no events.

        Raises AlreadyExists if the name is taken; nothing is written then.
        Keys must be unique (the caller validates them). `abandoned`: see
        add_tasks. `pace`: see add_tasks. `limits` (of `copy.tenant`): OverQuota if one more
        experiment, or `copy.num_tasks` more tasks, would exceed them.
        """

    @abc.abstractmethod
    def find_experiment(self, name: str) -> ExperimentRow | None:
        """The experiment called `name` with the capability after its latest
        step (None before any), or None if there is none."""

    @abc.abstractmethod
    def list_experiments(self, after_name: str, limit: int, tenant: str | None = None) -> list[ExperimentRow]:
        """Up to `limit` experiments with names after `after_name`, by name
        ascending (a page; pass the last name to get the next one); only
        `tenant`'s, unless None."""

    @abc.abstractmethod
    def tenant_usage(self, tenant: str) -> TenantUsage:
        """How many experiments `tenant` has and their tasks in all."""

    @abc.abstractmethod
    def delete_experiment(
        self, experiment_id: int, abandoned: Callable[[], bool] | None = None, pace: Callable[[], None] | None = None
    ) -> bool:
        """Delete the experiment and every row of it (tasks, events,
        checkpoint, batches). False if it did not exist. `abandoned` and
        `pace`: see add_tasks."""

    @abc.abstractmethod
    def count_open_batches(self, experiment_id: int, now: dt.datetime) -> int:
        """Batches not reported whose lease expires after `now`."""

    # -- tasks and state ------------------------------------------------------

    @abc.abstractmethod
    def add_tasks(
        self,
        experiment_id: int,
        expected_num_tasks: int,
        keys: Sequence[str],
        features: Sequence[dict[str, float]],
        abandoned: Callable[[], bool] | None = None,
        groups: Sequence[str] | None = None,
        *,
        limits: TenantLimits | None = None,
        pace: Callable[[], None] | None = None,
        embeddings: Sequence[bytes] | None = None,
    ) -> int:
        """Append tasks at indices expected_num_tasks, expected_num_tasks+1, ...
        and return the new number of tasks. `groups`: each task's group ("" or
        None: none). `embeddings`: each task's embedding, kept as given (None:
        none).

        A compare-and-set on the experiment's number of tasks: StaleStep if it
        is not `expected_num_tasks` (another writer added tasks first).
        AlreadyExists, naming up to 5 of the keys, if the experiment has any
        of them already. Nothing is written in either case.

        `abandoned` is asked just before the commit; if it says True, nothing
        is written and Abandoned is raised (the caller went away meanwhile).

        `limits` (of the experiment's tenant): OverQuota if `keys` more
        tasks would exceed its max_tasks (max_experiments is not checked:
        no experiment is added).

        `pace`, if given, is called between blocks of the work (encoding the
        rows, and writing them where that does not hold other writers), so
        that the caller can give way to more urgent work meanwhile.
        """

    @abc.abstractmethod
    def load(
        self,
        experiment_id: int,
        *,
        reference_features: tuple[str, str] = ("", ""),
        after_step: int | None = None,
        first_task: int = 0,
        lookup: Lookup | None = None,
        after_pool_event: int = 0,
        embeddings: bool = False,
    ) -> LoadedRows | None:
        """Rows to rebuild or catch up an experiment, plus what `lookup` asks
        for, all from one transaction. None if the experiment does not exist.

        The experiment row, the keys and the two `reference_features` (the
        names of the weak and strong reference pass rates; "": none) of its
        tasks from `first_task` on, and its
        events up to its step as read in the same transaction, ascending,
        each with its outcomes by task index. after_step None (a rebuild):
        also the checkpoint, and the events after it, all read in one
        consistent snapshot; the reference features then only of the tasks
        after those the checkpoint covers (it holds what they gave its
        tasks), so a rebuild reads no JSON for them. Otherwise (catching up
        a cached copy) no checkpoint and the events after `after_step`.

        `lookup`: the batch with `lookup.batch_id`, else the one with
        `lookup.request_key` (None if there is none), and, with
        `lookup.leases_at`, the batches still open at that time, with their
        tasks.

        `pool_events`: the pool's events (retirements, group shares) with
        seq after `after_pool_event`, by seq (a rebuild passes 0: all of
        them); `groups`: the group of each task read ("": none); with
        `embeddings`, the embedding of each task read (checkpoints do not
        hold them).
        """

    @abc.abstractmethod
    def load_features(
        self, experiment_id: int, num_tasks: int, pace: Callable[[], None] | None = None
    ) -> list[dict[str, float]]:
        """The features of tasks 0..num_tasks-1, in task order. `pace`, if
        given, is called between blocks of the decoding (see add_tasks)."""

    @abc.abstractmethod
    def read_event(self, experiment_id: int, step: int) -> StepEvent:
        """The event committed at `step` (a step that exists: a batch's
        reported step). At or before the compaction horizon its outcomes are
        gone: `complete` is False and only the scalars are exact."""

    @abc.abstractmethod
    def compact(self, experiment_id: int, through_step: int, max_steps: int) -> Compacted:
        """Remove the outcomes of steps up to `through_step` and the tasks
        of batches reported up to it, at most `max_steps` steps past the
        current horizon, and move the horizon (ExperimentRow.compacted_through)
        there. Never past the checkpoint's step, read in the same
        transaction, so a rebuild always finds the events it replays. One
        transaction: a crash leaves the previous horizon and its rows. Kept:
        the `steps` and `batches` rows (a retried report answers its step and
        capability; a reused request key learns its batch was compacted).
        Idempotent; of two racing calls one moves the horizon."""

    @abc.abstractmethod
    def write_checkpoint(
        self, experiment_id: int, step: int, num_tasks: int, state: bytes | memoryview, now: dt.datetime
    ) -> bool:
        """Replace the experiment's checkpoint with `state`, the state of
        tasks 0..num_tasks-1 at `step` (bytes the store does not interpret;
        the core writes checkpoint_blob.py's format). Written in chunks of
        about a megabyte, each its own short transaction, then made current
        by one small one: its cost follows its bytes, no transaction holds a
        write lock (SQLite) for more than a chunk, and it locks nothing
        selects and reports of the experiment take.

        False, and nothing written, if a checkpoint at or after `step` exists
        already. Concurrent writers of one experiment's checkpoint are
        serialized: the newest step wins, an older one never overwrites it.
        """

    # -- batches and reports ---------------------------------------------------

    @abc.abstractmethod
    def insert_batch(
        self,
        experiment_id: int,
        batch: BatchRow,
        now: dt.datetime,
        pool_seq: int | None = None,
        *,
        open_batches: Collection[str] | None = None,
        num_tasks: int | None = None,
    ) -> BatchRow:
        """Store a batch chosen at step `batch.step`, atomically with its checks.

        One transaction. Holds the experiment's row lock, which serializes
        selects and reports of the experiment across replicas, while it
        checks, in this order: a batch with the same request key exists (a
        racing call) -> that batch is returned and nothing written; the
        experiment is no longer at `batch.step`, or (given `num_tasks`) no
        longer has that many tasks, or (given `pool_seq`) its last pool event
        is not `pool_seq` -> StaleStep; given `open_batches` (the ids of the
        batches the caller believes open at `now`, whose tasks it left out),
        the batches open at `now` are not exactly those -> LeaseConflict;
        without it, a chosen task is in a batch still open at `now` ->
        LeaseConflict. Otherwise the batch is stored and returned, and if the
        experiment now holds more than `max_unreported_batches` batches never
        reported, those whose lease expired longest ago are deleted, down
        to nine tenths of the bound.
        """

    @abc.abstractmethod
    def commit_retirement(
        self,
        experiment_id: int,
        seq: int,
        task_idx: Sequence[int],
        retired: bool,
        now: dt.datetime,
        abandoned: Callable[[], bool] | None = None,
    ) -> RetirementEvent:
        """Append the retirement event `seq` (tasks `task_idx`, ascending, set
        to `retired`) under the experiment's row lock, so that selects on
        every replica are ordered with it; returns it with the experiment's
        step at the commit.

        A compare-and-set: StaleStep if the experiment's last pool event
        (retirement or shares) is not `seq - 1` (another writer got there
        first); nothing is written then. Once this returns the event is
        durable. `abandoned`: see add_tasks.
        """

    @abc.abstractmethod
    def commit_shares(
        self,
        experiment_id: int,
        seq: int,
        shares: Mapping[str, tuple[float, float]],
        now: dt.datetime,
        abandoned: Callable[[], bool] | None = None,
    ) -> SharesEvent:
        """Append the pool event `seq` setting the group shares (replacing
        any earlier ones; empty: none), as commit_retirement does: under the
        row lock, a compare-and-set on the last seq (StaleStep)."""

    @abc.abstractmethod
    def commit_report(
        self, experiment_id: int, expected_step: int, event: StepEvent, now: dt.datetime, num_tasks: int | None = None
    ) -> None:
        """Append one step's event, mark its batch reported at `event.step`
        and advance the experiment to `event.step`, atomically, in one
        transaction.

        The step is a compare-and-set: StaleStep if the experiment is no
        longer at `expected_step` (another writer got there first) or, given
        `num_tasks`, no longer has that many tasks (another writer added
        some). BatchAlreadyReported if the batch was reported meanwhile (or
        does not exist). Nothing is written in either case. Once this
        returns the event is durable.
        """

    @abc.abstractmethod
    def commit_report_and_insert_batch(
        self,
        experiment_id: int,
        expected_step: int,
        event: StepEvent,
        batch: BatchRow,
        now: dt.datetime,
        pool_seq: int,
        *,
        open_batches: Collection[str],
        num_tasks: int,
    ) -> None:
        """commit_report, then insert_batch of a batch chosen at `event.step`
        (`batch.step`; another step is a ValueError), in one transaction:
        both are written or neither.

        Raises what either raises, and RequestKeyTaken (with the stored
        batch) where insert_batch would return the request key's batch: the
        caller decides what that means for the report. `open_batches` are
        the batches open at `now` besides the reported one. Once this
        returns both are durable.
        """
