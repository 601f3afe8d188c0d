"""Server lifecycle: build, serve, and shut down gracefully on SIGTERM.

Also wires the operations side: the metrics registry (observer, interceptors,
database error counter, event-loop lag) and its /metrics HTTP endpoint on a
port of its own, request ids, and bearer-token auth when tokens are set.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import faulthandler
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

import bots_server
from bots_client.proto import bots_pb2
from bots_server import logs, metric_labels, tracing
from bots_server.core.quotas import Quotas, StreamBounds
from bots_server.core.selector import CheckpointPolicy, SelectorService
from bots_server.engine import parallel
from bots_server.metrics import Metrics
from bots_server.service import handlers, tls
from bots_server.service.admission import Admission, Budgets
from bots_server.service.auth import AuthInterceptor
from bots_server.service.credentials import Credentials, CredentialsFile, static_credentials
from bots_server.service.interceptors import MetricsInterceptor, RequestIdInterceptor
from bots_server.service.rpc_names import GO_CODE_NAMES, method_labels
from bots_server.service.servicer import TaskSelectorServicer
from bots_server.service.supervisor import HEARTBEAT_ENV, HEARTBEAT_SECONDS, SUPERVISED_ENV
from bots_server.settings import ServerSettings, split_host_port
from bots_server.store import DatabaseInUse, UnsupportedDatabase, open_store

log = logging.getLogger(__name__)

SERVICE_NAME = bots_pb2.DESCRIPTOR.services_by_name["TaskSelector"].full_name
# Readiness is reported for the service name (it follows the database);
# the empty name is liveness (serving while the process runs).
READINESS_SERVICE = SERVICE_NAME

# No SO_REUSEPORT (grpc's default): a second server on a port in use must
# fail, not silently take part of the new connections.
_NO_REUSEPORT = (("grpc.so_reuseport", 0),)
_REUSEPORT = (("grpc.so_reuseport", 1),)
_MB = 1024 * 1024


def _listen(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None, shared: bool) -> int:
    """Bind `address` (TLS with credentials); the bound port, or exit with why
    not. `shared`: the supervisor holds the port for this process and its
    siblings (SO_REUSEPORT), and has checked it already."""
    if not shared:
        _exit_if_in_use(address)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise SystemExit(f"bots-server: cannot listen on {address}: the address is in use or not valid here")
    return port


def _exit_if_in_use(address: str) -> None:
    """Exit with one line if another socket listens on `address`. gRPC would
    only log a C-level error line and fail, for a port in use and an address
    not of this host alike."""
    host, port = split_host_port(address, "listen address")
    if port == 0:
        return
    with contextlib.suppress(OSError):  # resolving, or any other error: gRPC's own check decides
        for family, kind, proto, _name, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            with socket.socket(family, kind, proto) as probe:
                # As gRPC binds: a port whose old connections linger in TIME_WAIT is free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(sockaddr)
                except OSError as e:
                    if e.errno == errno.EADDRINUSE:
                        raise SystemExit(f"bots-server: cannot listen on {address}: {e.strerror}") from None


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on, or fewer under a cgroup CPU quota
    (a container's CPU limit): v2's cpu.max, else v1's cfs quota."""
    cores = len(os.sched_getaffinity(0))
    quota = period = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = (cgroup / "cpu.max").read_text().split()
        if fields[0] != "max":
            quota, period = float(fields[0]), float(fields[1])
    if not quota:
        with contextlib.suppress(OSError, ValueError):
            v1 = cgroup / "cpu"
            quota = float((v1 / "cpu.cfs_quota_us").read_text())
            period = float((v1 / "cpu.cfs_period_us").read_text())
    if quota > 0 and period > 0:
        return max(1, min(cores, math.ceil(quota / period)))
    return cores


def _labeller(settings: ServerSettings) -> metric_labels.Labeller | None:
    """The metrics' opaque labels, or None for names."""
    if not metric_labels.opaque(settings.metrics_labels, tenants=bool(settings.credentials_file)):
        return None
    key = metric_labels.key_or_drawn(settings.metrics_label_key, used=True)
    return metric_labels.Labeller(key, opaque_tenants=settings.metrics_tenant_labels == "opaque")


class BotsServer:
    """A running server. `port` is the bound port (useful with port 0)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        # A process of a supervised server (service/supervisor.py) shares the
        # address and the cores with the others; any other server has both alone.
        siblings = int(os.environ.get(SUPERVISED_ENV, "0") or 0)
        parallel.use_cores(max(1, usable_cores() // siblings) if siblings else usable_cores())
        self.metrics = Metrics(version=bots_server.__version__, labeller=_labeller(settings))
        self.credentials_file, credentials = _credentials(settings)
        self.store = open_store(settings.db, exclusive=True, on_error=self.metrics.database_error)
        try:
            self._build(settings, credentials, siblings)
        except BaseException:
            # Its address taken, a bad TLS file: a start that fails leaves no database file behind.
            self.store.close_unused()
            raise

    def _build(self, settings: ServerSettings, credentials: Callable[[], Credentials] | None, siblings: int) -> None:
        tenants = len(credentials().tenants) if credentials is not None else 0
        if tenants > 1 and settings.db.startswith("sqlite"):
            log.warning(
                "%d tenants share this server on SQLite, where every write holds the whole database: one "
                "tenant's large upload stalls the others' reports; run a shared server on PostgreSQL "
                "(docs/security.md, Fair service)",
                tenants,
            )
        default_quotas = _default_quotas(settings)
        self.selector = SelectorService(
            self.store,
            checkpoint_policy=CheckpointPolicy(
                settings.checkpoint_every_steps, settings.checkpoint_every_seconds, settings.event_retention_steps
            ),
            max_workers=settings.workers,
            observer=self.metrics.observer,
            database_timeout_s=settings.database_timeout_seconds,
            quotas_of=(lambda tenant: credentials().quotas(tenant)) if credentials else (lambda tenant: default_quotas),
            memory_budget_bytes=int(settings.memory_budget_mb * _MB) or None,
            bulk_share=settings.bulk_share,
        )
        runtime = self.selector.runtime
        self.metrics.loaded_bytes.set_function(lambda: runtime.memory_bytes)
        self.health = HealthServicer()
        if settings.otlp_endpoint:
            tracing.configure(settings.otlp_endpoint)
        interceptors: list[grpc.aio.ServerInterceptor] = [RequestIdInterceptor(), MetricsInterceptor(self.metrics.rpc)]
        if tracing.enabled():
            # Outermost: the span covers the whole call, rejections included.
            from bots_server.service.tracing import TracingInterceptor

            interceptors.insert(0, TracingInterceptor())
        if credentials is not None:
            interceptors.append(AuthInterceptor(credentials, self.metrics.tenant_calls, self.metrics.tenant_label))
        options = _REUSEPORT if siblings else _NO_REUSEPORT
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        self.metrics.rpc.initialize(method_labels(bots_pb2.DESCRIPTOR.services_by_name["TaskSelector"]), GO_CODE_NAMES.values())
        bounds = StreamBounds(
            max_tasks=settings.max_stream_tasks,
            max_bytes=int(settings.max_stream_mb * _MB),
            idle_seconds=settings.stream_idle_seconds,
        )
        budgets = Budgets(
            total_bytes=int(settings.inflight_budget_mb * _MB) or None,
            tenant_bytes=int(settings.tenant_inflight_budget_mb * _MB) or None,
            tenant_calls=settings.tenant_bulk_calls or None,
        )
        handlers.register(self.server, TaskSelectorServicer(self.selector, bounds, Admission(budgets)))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port = _listen(self.server, settings.listen, tls.server_credentials(settings), shared=bool(siblings))
        # Probes (the kubelet's gRPC probe speaks no TLS) reach the health
        # service on a plaintext port of its own, which serves nothing else.
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        if settings.health_listen:
            self.health_server = grpc.aio.server(options=options)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = _listen(self.health_server, settings.health_listen, None, shared=bool(siblings))
        self.metrics_port: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # What the process is doing, for the log line of a stop that does not
        # end: the thread stacks show an idle event loop whichever await hangs.
        self.stage = "starting"

    async def start(self) -> None:
        if self.settings.migrate and (newer := await asyncio.to_thread(self.store.migrate)):
            log.warning(
                "database schema is newer than this code's migrations; left as it is (a rollback: serve it only "
                "if the newer release's migrations were additive)",
                extra={"revisions": newer},
            )
        await asyncio.to_thread(self.store.remove_unfinished_writes)
        self._start_metrics()
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        database = self.selector.runtime.database
        database.on_change(self._database_changed)
        await database.check()
        self._tasks = [
            asyncio.create_task(self.selector.checkpoints.run(), name="checkpoints"),
            asyncio.create_task(database.watch(), name="database-health"),
            asyncio.create_task(self.metrics.watch_event_loop(), name="event-loop-lag"),
            asyncio.create_task(self._publish_stored_experiments(), name="metrics-listing"),
        ]
        if self.credentials_file is not None:
            self._tasks.append(asyncio.create_task(self.credentials_file.watch(), name="credentials-reload"))
        self.stage = "serving"
        log.info(
            "serving",
            extra={
                "listen": self.settings.listen,
                "port": self.port,
                "tls": bool(self.settings.tls_cert),
                "mutual_tls": bool(self.settings.tls_client_ca),
                "health_port": self.health_port,
                "metrics_listen": self.settings.metrics_listen,
                "metrics_port": self.metrics_port,
                "auth": self.settings.auth,
                "credentials_file": self.settings.credentials_file,
                "db": self.store.display_url,
            },
        )

    def reload_credentials(self) -> None:
        """SIGHUP: re-read the credentials file now."""
        if self.credentials_file is not None:
            self.credentials_file.reload(force=True)

    async def _publish_stored_experiments(self) -> None:
        """Per-experiment gauges from start-up for the experiments in the store
        (the first --metrics-max-experiments by name), from one listing query,
        loading no posterior: without this a restarted replica shows no
        series until each experiment is touched, which reads as an outage."""
        limit = self.settings.metrics_max_experiments
        if limit <= 0 or not self.settings.metrics_listen:
            return
        try:
            rows = await asyncio.to_thread(self.store.list_experiments, "", limit)
        except Exception as e:  # best effort: metrics must never stop the server
            log.warning("cannot list experiments for metrics", extra={"error": str(e)})
            return
        for row in rows:
            self.metrics.observer.experiment_listed(row.name, row.step, row.num_tasks)

    def _start_metrics(self) -> None:
        if not self.settings.metrics_listen:
            return
        host, port = split_host_port(self.settings.metrics_listen, "--metrics-listen")
        try:
            self.metrics_port = self.metrics.serve_http(host, port, self.settings.metrics_access)
        except OSError as e:
            # Serving gRPC matters more than being scraped: keep going, loudly.
            # (In a pod the port is ours alone; collisions happen on shared
            # dev and test hosts.)
            log.error(
                "cannot serve metrics; continuing without a /metrics endpoint",
                extra={"metrics_listen": self.settings.metrics_listen, "error": str(e)},
            )

    async def _database_changed(self, up: bool) -> None:
        self.metrics.database_up.set(1 if up else 0)
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(READINESS_SERVICE, status)

    async def stop(self) -> None:
        """Stop accepting calls, let in-flight ones finish, checkpoint, close."""
        log.info("shutting down", extra={"grace_seconds": self.settings.grace_seconds})
        self.stage = "draining calls"
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.settings.grace_seconds)
        if self.health_server is not None:
            self.stage = "stopping the health port"
            await self.health_server.stop(0)
        for task in self._tasks:
            self.stage = f"stopping the {task.get_name()} task"
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.stage = "final checkpoints"
        await self.selector.close()
        self.stage = "closing the database"
        self.store.close()
        self.stage = "closing the metrics port"
        self.metrics.stop_http()
        if self.settings.otlp_endpoint:
            self.stage = "flushing traces"
            await asyncio.to_thread(tracing.shutdown)  # flush what is queued
        self.stage = "stopped"
        log.info("stopped")


def _default_quotas(settings: ServerSettings) -> Quotas:
    return Quotas(  # 0: no limit
        max_experiments=settings.max_experiments_per_tenant or None,
        max_tasks_per_experiment=settings.max_tasks_per_experiment or None,
        max_tasks=settings.max_tasks_per_tenant or None,
    )


def _credentials(settings: ServerSettings) -> tuple[CredentialsFile | None, Callable[[], Credentials] | None]:
    """The credentials file (if any), and how to get the credentials in
    force; (None, None): no authentication (a single-user local server)."""
    quotas = _default_quotas(settings)
    if settings.credentials_file:
        try:
            source = CredentialsFile(settings.credentials_file, quotas, settings.auth_tokens)
        except (OSError, ValueError) as e:
            raise SystemExit(f"bots-server: --credentials-file = {settings.credentials_file!r}: {e}") from None
        return source, lambda: source.current
    if settings.auth_tokens:
        static = static_credentials(settings.auth_tokens, quotas)
        return None, lambda: static
    return None, None


# How long a thread holding the GIL may keep it while another waits
# (CPython's default is 5 ms). The event loop answers every caller; under
# one tenant's bulk work on worker threads it waits for the GIL at each
# wake-up, so a shorter slice keeps other tenants' latency low (see
# docs/security.md, Fair service).
GIL_SWITCH_INTERVAL_S = 0.0005


async def serve(settings: ServerSettings) -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        server = BotsServer(settings)
    except (DatabaseInUse, UnsupportedDatabase) as e:
        raise SystemExit(f"bots-server: {e}") from None
    # The handlers come first: a SIGTERM while the server starts (a pod
    # deleted at once) must stop it gracefully once it is up, not kill it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload_credentials)
    starting = asyncio.ensure_future(server.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    beating = None
    if not stop.is_set():
        await starting  # raises what the start raised
        beating = _heartbeat(os.environ.get(HEARTBEAT_ENV, ""))
        await stopping
    # The deadline runs from the signal, also when it came while the server
    # was starting (a migration waiting for another's lock).
    _exit_unless_stopped_within(settings.shutdown_seconds, lambda: server.stage)
    await starting
    await server.stop()  # beating on: a process draining for long is not stalled
    if beating is not None:
        beating.cancel()


def _heartbeat(path: str) -> asyncio.Task[None] | None:
    """Under a supervisor: touch `path` every HEARTBEAT_SECONDS from the
    event loop, which tells the supervisor that this process still serves
    (a process whose loop stopped is killed and started again)."""
    if not path:
        return None

    async def beat() -> None:
        heartbeat = Path(path)
        while True:
            with contextlib.suppress(OSError):  # a file gone reads as a process starting: never a false kill
                heartbeat.touch()
            await asyncio.sleep(HEARTBEAT_SECONDS)

    return asyncio.create_task(beat(), name="heartbeat")


# The exit code of a shutdown that did not finish in time (1 and 2 are
# Python's own: an exception, a bad command line).
EXIT_SHUTDOWN_TIMEOUT = 3


def _exit_unless_stopped_within(seconds: float, stage: Callable[[], str]) -> None:
    """A stop must end: past `seconds`, log where every thread is and exit.
    What is lost is at most a final checkpoint (the next start replays the
    events it would have covered); without this a stuck thread (a driver
    waiting on a lock, a call that ignores cancellation) keeps the process
    alive until Kubernetes kills it, with no word of where it was stuck. A
    daemon thread: it fires even if the event loop is blocked, and does not
    keep a process that stopped in time from exiting."""

    def give_up() -> None:
        log.error("shutdown did not finish; exiting", extra={"shutdown_seconds": seconds, "stage": stage()})
        logs.flush()  # the line above before the stacks, which go to stderr directly
        faulthandler.dump_traceback(all_threads=True)
        os._exit(EXIT_SHUTDOWN_TIMEOUT)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
