"""Prometheus metrics: per-RPC (go-grpc-prometheus names), per-experiment
learning signals, database errors, event-loop lag, and the /metrics endpoint.

Label cardinality is bounded by design: RPC series by method and status code,
experiment series by experiment name only (never a task key), database errors
by a fixed set of kinds. An experiment's series are removed when it is
deleted.

Everything here is thread-safe: the core calls the observer hooks on worker
threads, the interceptor on the event loop, and the HTTP exporter scrapes on
its own thread (so /metrics answers even while the event loop is stuck, which
is when you need it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import platform
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bots_server import logs
from bots_server.core.observer import BatchSignals, PosteriorView, SelectorObserver
from bots_server.engine.summary import MEAN_QUANTILES, SHARE_BANDS, TARGET_BAND
from bots_server.metric_labels import Labeller, OpaqueLabels
from bots_server.metrics_http import Access, serve

log = logging.getLogger(__name__)

# `*_created` series double the series count and nothing in our dashboards
# or alerts reads them; go-grpc-prometheus does not have them either.
prometheus_client.disable_created_metrics()

# Our RPCs take from well under a millisecond (a cached GetExperiment) to
# minutes (AddTasks of a million tasks); go-grpc-prometheus' default buckets
# (5 ms .. 10 s) would put every fast call in the first bucket.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
CHECKPOINT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# The kinds bots_server.store reports; pre-created at zero so rate() and
# alerts see a series before the first error.
DATABASE_ERROR_KINDS = ("unavailable", "timeout", "connection_lost", "integrity", "other")
# How many deleted experiments' names the metrics remember, to keep their
# late hooks from bringing their series back (ExperimentMetrics._removed).
REMEMBERED_REMOVALS = 4096


class RpcMetrics:
    """The go-grpc-prometheus server metrics, with the handling-time histogram on."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("grpc_type", "grpc_service", "grpc_method")
        self.started = Counter(
            "grpc_server_started_total", "Total number of RPCs started on the server.", labels, registry=registry
        )
        self.handled = Counter(
            "grpc_server_handled_total",
            "Total number of RPCs completed on the server, regardless of success or failure.",
            (*labels, "grpc_code"),
            registry=registry,
        )
        self.msg_received = Counter(
            "grpc_server_msg_received_total",
            "Total number of RPC stream messages received on the server.",
            labels,
            registry=registry,
        )
        self.msg_sent = Counter(
            "grpc_server_msg_sent_total",
            "Total number of gRPC stream messages sent by the server.",
            labels,
            registry=registry,
        )
        self.handling_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.",
            labels,
            buckets=RPC_BUCKETS,
            registry=registry,
        )

    def initialize(self, methods: Iterable[tuple[str, str, str]], codes: Iterable[str]) -> None:
        """Create every method's series at zero, as go-grpc-prometheus'
        InitializeMetrics does: a rate() over a series that appears only with
        the first error misses that error. `methods`: (type, service, method)."""
        codes = tuple(codes)
        for labels in methods:
            self.started.labels(*labels)
            self.msg_received.labels(*labels)
            self.msg_sent.labels(*labels)
            self.handling_seconds.labels(*labels)
            for code in codes:
                self.handled.labels(*labels, code)


@dataclasses.dataclass
class _ExperimentView:
    """What the scrape-time collector needs of one experiment."""

    posterior: PosteriorView | None = None
    step: int = -1
    checkpoint_step: int = -1
    # Monotonic time of the first step not yet in a checkpoint; None: current.
    dirty_since: float | None = None
    # Batches this replica handed out and has not seen reported:
    # batch id -> (tasks, Unix time the lease ends).
    open_batches: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)


class ExperimentMetrics(SelectorObserver, Collector):
    """The SelectorObserver that turns state changes into metrics.

    Hooks only store numbers and a reference to the (immutable) posterior
    arrays; the O(pool) posterior summary is computed (by the engine) at
    scrape time, so its cost follows the scrape interval, not the step rate.
    Leases are kept as the open batches with their end times and summed at
    scrape time: O(batches in flight), exact at every scrape.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        exp = ("experiment",)
        self.steps = Counter("bots_steps_total", "Reports applied (steps) on this replica.", exp, registry=registry)
        self.step = Gauge("bots_experiment_step", "The experiment's current step.", exp, registry=registry)
        self.tasks = Gauge("bots_experiment_tasks", "Tasks in the experiment's pool.", exp, registry=registry)
        self.group_tasks_selected = Counter(
            "bots_group_tasks_selected_total",
            "Tasks handed out in new batches, per group (at most 64 groups per experiment).",
            ("experiment", "group"), registry=registry,
        )  # fmt: skip
        self.retired_tasks = Gauge(
            "bots_experiment_retired_tasks", "Tasks of the pool that are retired (never selected).", exp,
            registry=registry,
        )  # fmt: skip
        self.batches_selected = Counter(
            "bots_batches_selected_total", "New batches selected (not counting repeats of a request key).", exp,
            registry=registry,
        )  # fmt: skip
        self.tasks_selected = Counter(
            "bots_tasks_selected_total", "Tasks handed out in new batches.", exp, registry=registry
        )
        self.tasks_reported = Counter(
            "bots_tasks_reported_total", "Task outcomes reported (one per task per report).", exp, registry=registry
        )
        self.tasks_informative = Counter(
            "bots_tasks_informative_total",
            "Reported task outcomes whose rewards differ (0 < successes < trials, or a reward variance above 0): "
            "the groups that give a GRPO gradient.",
            exp,
            registry=registry,
        )
        self.rollouts = Counter("bots_rollouts_total", "Rollouts (trials) reported.", exp, registry=registry)
        self.successes = Counter(
            "bots_rollout_successes_total", "Successes among the reported rollouts.", exp, registry=registry
        )
        self.batch_success_rate = Gauge(
            "bots_batch_success_rate", "Successes / trials of the last reported batch.", exp, registry=registry
        )
        self.batch_informative = Gauge(
            "bots_batch_informative_fraction",
            "Share of the last reported batch's tasks whose rewards differ.",
            exp,
            registry=registry,
        )
        self.capability = Gauge(
            "bots_capability",
            "The interpolation plug-in's capability estimate after the last step (NaN until known).",
            exp,
            registry=registry,
        )
        self.checkpoint_last_seconds = Gauge(
            "bots_checkpoint_last_duration_seconds", "How long the last checkpoint took to write.", exp,
            registry=registry,
        )  # fmt: skip
        self.checkpoint_timestamp = Gauge(
            "bots_checkpoint_last_timestamp_seconds",
            "Unix time of the last checkpoint this replica wrote.",
            exp,
            registry=registry,
        )
        self.checkpoint_seconds = Histogram(
            "bots_checkpoint_duration_seconds",
            "Time to write a checkpoint (all experiments).",
            buckets=CHECKPOINT_BUCKETS,
            registry=registry,
        )
        self.load_seconds = Histogram(
            "bots_experiment_load_duration_seconds",
            "Time to rebuild an experiment from the store (checkpoint + replay).",
            buckets=CHECKPOINT_BUCKETS,
            registry=registry,
        )
        self._labelled = (
            self.steps, self.step, self.tasks, self.retired_tasks, self.batches_selected, self.tasks_selected,
            self.tasks_reported, self.tasks_informative, self.rollouts, self.successes, self.batch_success_rate,
            self.batch_informative, self.capability, self.checkpoint_last_seconds, self.checkpoint_timestamp,
        )  # fmt: skip
        self.evictions = Counter(
            "bots_experiment_evictions_total",
            "Idle experiments dropped from memory to keep within the memory budget (--memory-budget-mb).",
            registry=registry,
        )
        self.bulk_yield = Counter(
            "bots_bulk_yield_seconds",
            "Time uploads, restores and snapshots waited for trainer calls (selects and reports) in flight.",
            registry=registry,
        )
        self._views: dict[str, _ExperimentView] = {}
        self._groups: dict[str, set[str]] = {}  # labels of group_tasks_selected, to drop with the experiment
        # Deleted experiments whose late hooks (queued before the delete, run
        # after it on another thread) must not bring their series back. Such
        # hooks run within moments of the delete, so only the most recent
        # names are kept: a server that creates and deletes experiments for
        # months does not grow a name per delete.
        self._removed: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        registry.register(self)

    # -- hooks (worker threads) ----------------------------------------------------

    def _gone(self, experiment: str) -> bool:
        with self._lock:
            return experiment in self._removed

    def batch_selected(self, experiment: str, batch_id: str, batch_size: int, lease_expires: float) -> None:
        if self._gone(experiment):
            return
        self.batches_selected.labels(experiment).inc()
        self.tasks_selected.labels(experiment).inc(batch_size)
        with self._lock:
            view = self._views.setdefault(experiment, _ExperimentView())
            view.open_batches[batch_id] = (batch_size, lease_expires)

    def report_applied(self, experiment: str, batch_id: str, signals: BatchSignals, posterior: PosteriorView) -> None:
        if self._gone(experiment):
            return
        self.steps.labels(experiment).inc()
        self.tasks_reported.labels(experiment).inc(signals.tasks)
        self.tasks_informative.labels(experiment).inc(signals.informative)
        self.rollouts.labels(experiment).inc(signals.trials)
        self.successes.labels(experiment).inc(signals.successes)
        if signals.success_rate is not None:
            self.batch_success_rate.labels(experiment).set(signals.success_rate)
        if signals.informative_fraction is not None:
            self.batch_informative.labels(experiment).set(signals.informative_fraction)
        with self._lock:
            view = self._views.setdefault(experiment, _ExperimentView())
            # A report closes its whole batch, partial or not.
            view.open_batches.pop(batch_id, None)
            # Hooks of consecutive steps may run out of order on different
            # worker threads; keep the newest state.
            if posterior.step <= view.step:
                return
            view.step, view.posterior = posterior.step, posterior
            if view.dirty_since is None and posterior.step > view.checkpoint_step:
                view.dirty_since = time.monotonic()
        self._set_posterior(experiment, posterior)

    def experiment_listed(self, experiment: str, step: int, num_tasks: int) -> None:
        with self._lock:
            if experiment in self._removed or experiment in self._views:
                return  # deleted meanwhile, or already loaded: the newer state wins
            # Listed state is durable as of the listing (checkpoint + events).
            self._views[experiment] = _ExperimentView(step=step, checkpoint_step=step)
        self.step.labels(experiment).set(step)
        self.tasks.labels(experiment).set(num_tasks)

    def checkpoint_written(self, experiment: str, step: int, seconds: float) -> None:
        self.checkpoint_seconds.observe(seconds)
        if self._gone(experiment):
            return
        self.checkpoint_last_seconds.labels(experiment).set(seconds)
        self.checkpoint_timestamp.labels(experiment).set(time.time())
        with self._lock:
            view = self._views.setdefault(experiment, _ExperimentView())
            view.checkpoint_step = max(view.checkpoint_step, step)
            if view.step <= view.checkpoint_step:
                view.dirty_since = None

    def experiment_loaded(self, experiment: str, posterior: PosteriorView, seconds: float) -> None:
        self.load_seconds.observe(seconds)
        self._set_posterior(experiment, posterior)
        with self._lock:
            self._removed.pop(experiment, None)
            view = self._views.get(experiment)
            if view is None or view.step < posterior.step or view.posterior is None:
                # The loaded state is durable (checkpoint + event log): count
                # checkpoint age from here. Leases handed out before survive.
                step = posterior.step
                leases = view.open_batches if view is not None else {}
                self._views[experiment] = _ExperimentView(
                    posterior=posterior, step=step, checkpoint_step=step, open_batches=leases
                )

    def _set_posterior(self, experiment: str, posterior: PosteriorView) -> None:
        self.step.labels(experiment).set(posterior.step)
        self.tasks.labels(experiment).set(posterior.num_tasks)
        self.capability.labels(experiment).set(posterior.capability)

    def tasks_added(self, experiment: str, num_tasks: int) -> None:
        if not self._gone(experiment):
            self.tasks.labels(experiment).set(num_tasks)

    def bulk_yielded(self, seconds: float) -> None:
        self.bulk_yield.inc(seconds)  # thread-safe

    def experiment_evicted(self, experiment: str) -> None:
        # Let go of its posterior arrays (the memory the eviction frees); its
        # step, pool and lease series stay, the posterior summary returns
        # with the next load.
        self.evictions.inc()
        with self._lock:
            view = self._views.get(experiment)
            if view is not None:
                view.posterior = None

    def groups_selected(self, experiment: str, counts: dict[str, int]) -> None:
        if not self._gone(experiment):
            with self._lock:
                self._groups.setdefault(experiment, set()).update(counts)
            for group, count in counts.items():
                self.group_tasks_selected.labels(experiment, group).inc(count)

    def tasks_retired(self, experiment: str, num_retired: int, num_tasks: int) -> None:
        if not self._gone(experiment):
            self.retired_tasks.labels(experiment).set(num_retired)
            self.tasks.labels(experiment).set(num_tasks)

    def experiment_removed(self, experiment: str) -> None:
        with self._lock:
            self._views.pop(experiment, None)
            self._removed[experiment] = None
            self._removed.move_to_end(experiment)
            while len(self._removed) > REMEMBERED_REMOVALS:
                self._removed.popitem(last=False)
        for metric in self._labelled:
            with contextlib.suppress(KeyError):
                metric.remove(experiment)
        with self._lock:
            groups = self._groups.pop(experiment, set())
        for group in groups:
            with contextlib.suppress(KeyError):
                self.group_tasks_selected.remove(experiment, group)

    # -- scrape time (exporter thread) ---------------------------------------------

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return ()  # unchecked collector: its names are its own

    def collect(self) -> Iterable[GaugeMetricFamily]:
        now_wall = time.time()
        with self._lock:
            for view in self._views.values():
                # Expired leases free their tasks: drop them here, so the map
                # stays as small as the batches actually in flight.
                expired = [b for b, (_n, until) in view.open_batches.items() if until <= now_wall]
                for batch_id in expired:
                    del view.open_batches[batch_id]
            views = {
                name: dataclasses.replace(view, open_batches=dict(view.open_batches))
                for name, view in self._views.items()
            }
        share = GaugeMetricFamily(
            "bots_posterior_target_share",
            f"Share of the pool by where each task's posterior puts most of its mass: band below "
            f"(< p* - {TARGET_BAND}), near (within {TARGET_BAND} of p*), above (> p* + {TARGET_BAND}), "
            "uncertain (none of them).",
            labels=("experiment", "band"),
        )
        quantiles = GaugeMetricFamily(
            "bots_posterior_mean_quantile",
            "Percentiles of the tasks' posterior means (label percentile: 10, 50, 90).",
            labels=("experiment", "percentile"),
        )
        leased = GaugeMetricFamily(
            "bots_leased_tasks",
            "Tasks in open batches this replica handed out (selected, not reported, lease not expired), "
            "as of the scrape.",
            labels=("experiment",),
        )
        age = GaugeMetricFamily(
            "bots_checkpoint_age_seconds",
            "Seconds since the oldest step that is not in a checkpoint yet (0 while the checkpoint is current).",
            labels=("experiment",),
        )
        behind = GaugeMetricFamily(
            "bots_steps_since_checkpoint",
            "Steps a restart would replay from the event log on top of the last checkpoint.",
            labels=("experiment",),
        )
        loaded = GaugeMetricFamily("bots_experiments_loaded", "Experiments held in memory on this replica.")
        loaded.add_metric((), sum(1 for view in views.values() if view.posterior is not None))
        now = time.monotonic()
        for name, view in views.items():
            age.add_metric((name,), 0.0 if view.dirty_since is None else now - view.dirty_since)
            behind.add_metric((name,), max(0, view.step - view.checkpoint_step))
            leased.add_metric((name,), sum(n for n, _until in view.open_batches.values()))
            if view.posterior is not None and view.posterior.num_tasks > 0:
                summary = view.posterior.summary()
                for band, value in zip(SHARE_BANDS, summary.shares, strict=True):
                    share.add_metric((name, band), value)
                for q, value in zip(MEAN_QUANTILES, summary.mean_quantiles, strict=True):
                    quantiles.add_metric((name, f"{100 * q:g}"), value)
        return (share, quantiles, leased, age, behind, loaded)


class _DroppedLogLines(Collector):
    """bots_log_lines_dropped_total, read from the log handler at scrape time."""

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            "bots_log_lines_dropped",
            "Log lines dropped because stderr was not read fast enough (--log-queue-lines were waiting).",
            value=logs.dropped_lines(),
        )


class Metrics:
    """All of the server's metrics on one registry (not the global one, so
    several servers in one process, as in tests, do not collide)."""

    def __init__(self, version: str = "", labeller: Labeller | None = None) -> None:
        """`labeller`: opaque labels (metric_labels.py); None: names."""
        self.registry = CollectorRegistry(auto_describe=True)
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.PlatformCollector(registry=self.registry)
        prometheus_client.GCCollector(registry=self.registry)
        prometheus_client.Info("bots_build", "Version of the BOTS server.", registry=self.registry).info(
            {"version": version, "python": platform.python_version()}
        )
        self.rpc = RpcMetrics(self.registry)
        experiments = ExperimentMetrics(self.registry)
        self.observer: SelectorObserver = experiments if labeller is None else OpaqueLabels(experiments, labeller)
        # The tenant label of bots_tenant_calls_total.
        self.tenant_label: Callable[[str], str] = (lambda tenant: tenant) if labeller is None else labeller.tenant
        self.database_errors = Counter(
            "bots_database_errors_total",
            "Database errors by kind (unavailable, timeout, connection_lost, integrity, other).",
            ("kind",),
            registry=self.registry,
        )
        for kind in DATABASE_ERROR_KINDS:
            self.database_errors.labels(kind)
        self.database_up = Gauge(
            "bots_database_up", "1 if the last database health check succeeded, else 0.", registry=self.registry
        )
        self.loop_lag = Histogram(
            "bots_event_loop_lag_seconds",
            "How late the event loop ran a timer: time the loop was blocked and calls waited.",
            buckets=LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        # Bounded: tenants are those of the credentials file.
        self.tenant_calls = Counter(
            "bots_tenant_calls_total",
            "Authenticated calls by the caller's tenant, method and status code.",
            ("tenant", "grpc_method", "grpc_code"),
            registry=self.registry,
        )
        self.loaded_bytes = Gauge(
            "bots_loaded_experiments_bytes",
            "Estimated memory of the experiments held in memory, which --memory-budget-mb bounds.",
            registry=self.registry,
        )
        self.registry.register(_DroppedLogLines())
        self._http: WSGIServer | None = None

    def database_error(self, kind: str) -> None:
        self.database_errors.labels(kind if kind in DATABASE_ERROR_KINDS else "other").inc()

    async def watch_event_loop(self, interval_s: float = 0.25) -> None:
        """Until cancelled: sleep `interval_s`, record how much later we woke."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(interval_s)
            self.loop_lag.observe(max(0.0, loop.time() - started - interval_s))

    def serve_http(self, host: str, port: int, access: Access | None = None) -> int:
        """Serve /metrics on a daemon thread; returns the bound port."""
        server = serve(self.registry, host, port, access or Access())
        self._http = server
        return int(server.server_address[1])

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
