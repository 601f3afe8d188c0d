"""`bots-server serve` with several processes: every core behind one address.

One server process runs its Python on one core (the GIL). On PostgreSQL,
replicas on one database give the results of one server (docs/design.md),
so `serve` starts N of them, each a plain `serve` process, all listening on
the same address with SO_REUSEPORT: the kernel spreads the connections over
them. This supervisor holds the address for them (a bound socket that never
listens, so port 0 resolves once and a port in use fails at start), starts
them, starts again one that exits (waiting longer after each quick exit, up to
30 s, so a server that cannot start does not spin), kills and starts again
one whose event loop stopped (its heartbeat file not touched for
--process-stall-seconds), forwards SIGTERM, SIGINT and SIGHUP, and serves
one /metrics endpoint: each process's series, labelled `process="<index>"`,
plus its own.

A process dies with the supervisor (PR_SET_PDEATHSIG), so killing the
supervisor stops the whole server as killing one process would.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from bots_server import metric_labels
from bots_server.metrics_http import serve
from bots_server.settings import ServerSettings, split_host_port

log = logging.getLogger(__name__)

# Set in a supervised process's environment to the number of processes: it
# listens with SO_REUSEPORT and sizes its helper threads by its share of cores.
SUPERVISED_ENV = "BOTS_SUPERVISED"
# Set to the file a supervised process touches every HEARTBEAT_SECONDS from
# its event loop once it serves (service/server.py).
HEARTBEAT_ENV = "BOTS_HEARTBEAT_FILE"
HEARTBEAT_SECONDS = 1.0
# Given to each process: the token its /metrics takes, and the key of the
# opaque labels (the configured one, or one the supervisor drew).
METRICS_TOKEN_ENV = "BOTS_METRICS_TOKEN"
METRICS_LABEL_KEY_ENV = "BOTS_METRICS_LABEL_KEY"
_PR_SET_PDEATHSIG = 1
# A process that exits within _STABLE_S of its start is started again after
# _RESTART_DELAY_S, then twice as long after each further quick exit, up to
# _RESTART_DELAY_MAX_S: a server that cannot start (a bad certificate, a
# database that refuses it) retries without spinning a core.
_RESTART_DELAY_S = 1.0
_RESTART_DELAY_MAX_S = 30.0
_STABLE_S = 30.0
# How often the supervisor looks at its processes.
_WATCH_S = 0.2
# The series the supervisor adds to its processes' (alerts may use them).
SUPERVISOR_SERIES = ("bots_server_processes", "bots_server_processes_up", "bots_server_process_restarts_total")


def process_count(settings: ServerSettings, usable_cores: int) -> int:
    """How many server processes `serve` runs: `--processes`, or 0 for the
    cores this container may use. SQLite is served by one process (it holds
    the file exclusively); asking for more is an error."""
    sqlite = settings.db.startswith("sqlite")
    if sqlite:
        if settings.processes > 1:
            raise SystemExit(
                f"bots-server: --processes {settings.processes} needs PostgreSQL: an SQLite file is served by one "
                "process (it holds the file exclusively); use --processes 1, or a postgresql+psycopg:// --db"
            )
        return 1
    return settings.processes or usable_cores


def _reserve(address: str, what: str) -> tuple[socket.socket, str, int]:
    """A bound, never-listening SO_REUSEPORT socket on `address`: the
    processes bind the same port beside it. Fails if anything holds the
    port, another supervised server included: the port is first bound
    without SO_REUSEPORT, which would otherwise let this server join the
    other's sockets and take part of its connections to another database."""
    host, port = split_host_port(address, what)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT hold nothing
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SystemExit(f"bots-server: cannot listen on {address}: {e.strerror}") from None
        port = probe.getsockname()[1]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"bots-server: cannot listen on {address}: {e.strerror}") from None
    bound = sock.getsockname()[1]
    return sock, (f"[{host}]" if family == socket.AF_INET6 else host), bound


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _before_exec(supervisor: int) -> None:
    """In the child, before exec: SIGKILL when the supervisor dies (and exit
    now if it died already, between the fork and here), and SIGHUP ignored
    (kept across exec) until the server installs its own handler: a SIGHUP
    forwarded while the process starts must not kill it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor:
        os._exit(1)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _scrape(port: int, token: str) -> str | None:
    """A process's /metrics, or None if it does not answer within 2 s."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=2.0) as response:
            return str(response.read().decode())
    except (OSError, http.client.HTTPException):  # not started, gone, or killed mid-answer
        return None


class _ProcessMetrics(Collector):
    """Every process's /metrics, each series labelled with its process index."""

    def __init__(self, ports: dict[int, int], token: str) -> None:
        self.ports = ports
        self.token = token
        # All at once: a scrape waits for the slowest process, not for the
        # sum of them (a stalled one takes the whole timeout).
        self._fetcher = ThreadPoolExecutor(max_workers=max(1, len(ports)), thread_name_prefix="bots-scrape")

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        ordered = sorted(self.ports.items())
        texts = list(self._fetcher.map(lambda item: _scrape(item[1], self.token), ordered))
        answered = sum(text is not None for text in texts)
        for (index, _port), text in zip(ordered, texts):
            if text is None:
                continue  # starting, restarting or stalled: bots_server_processes_up counts the others
            for family in text_string_to_metric_families(text):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    into.samples.append(sample._replace(labels={**sample.labels, "process": str(index)}))
        yield from merged.values()
        yield GaugeMetricFamily(
            "bots_server_processes_up", "server processes whose /metrics answered this scrape", value=answered
        )


class Supervisor:
    def __init__(self, settings: ServerSettings, count: int, argv: Sequence[str]) -> None:
        self.settings = settings
        self.count = count
        self.argv = list(argv)
        self._socket, host, self.port = _reserve(settings.listen, "--listen / BOTS_LISTEN")
        self.listen = f"{host}:{self.port}"
        self._health_socket = None
        self.health_listen = ""
        if settings.health_listen:
            self._health_socket, health_host, health_port = _reserve(
                settings.health_listen, "--health-listen / BOTS_HEALTH_LISTEN"
            )
            self.health_listen = f"{health_host}:{health_port}"
        self.metrics_ports = {i: _free_loopback_port() for i in range(count)} if settings.metrics_listen else {}
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self._due: dict[int, float] = {}  # process index -> when to start it again (it exited)
        self._heartbeats = Path(tempfile.mkdtemp(prefix="bots-heartbeats-"))
        self.stopping = threading.Event()
        # The processes' own /metrics listen on loopback, over HTTP: when
        # this server's endpoint takes only some scrapers, theirs take only
        # this supervisor (a token of its own). And they share one key for
        # the opaque labels, so that a series keeps its label across them.
        access = settings.metrics_access
        self._inner_token = secrets.token_urlsafe(32) if access.restricted or access.tls_cert else ""
        opaque = metric_labels.opaque(settings.metrics_labels, tenants=bool(settings.credentials_file))
        self._label_key = metric_labels.key_or_drawn(settings.metrics_label_key, used=opaque)
        self.registry = CollectorRegistry()
        self.registry.register(_ProcessMetrics(self.metrics_ports, self._inner_token))
        self.restarts = Counter(
            "bots_server_process_restarts", "server processes started again after they exited", registry=self.registry
        )
        self.processes = Gauge("bots_server_processes", "server processes this server runs", registry=self.registry)
        self.processes.set(count)

    def _command(self, index: int) -> list[str]:
        overrides = ["--listen", self.listen, "--processes", "1"]
        overrides += ["--health-listen", self.health_listen] if self.health_listen else []
        if self.metrics_ports:
            overrides += ["--metrics-listen", f"127.0.0.1:{self.metrics_ports[index]}"]
            overrides += ["--metrics-token-file", "", "--metrics-tls-cert", "", "--metrics-tls-key", ""]
            overrides += ["--metrics-tls-client-ca", ""]
        # argparse keeps the last occurrence of a flag: the overrides win.
        return [sys.executable, "-m", "bots_server.cli", *self.argv, *overrides]

    def _heartbeat(self, index: int) -> Path:
        return self._heartbeats / f"process-{index}"

    def _start(self, index: int) -> None:
        heartbeat = self._heartbeat(index)
        heartbeat.unlink(missing_ok=True)  # a new process is starting, not stalled, until its first beat
        env = {**os.environ, SUPERVISED_ENV: str(self.count), HEARTBEAT_ENV: str(heartbeat)}
        env |= {METRICS_TOKEN_ENV: self._inner_token, METRICS_LABEL_KEY_ENV: self._label_key}
        self.children[index] = subprocess.Popen(
            self._command(index), env=env, preexec_fn=functools.partial(_before_exec, os.getpid())
        )

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        signal.signal(signal.SIGHUP, lambda *_: self._signal_all(signal.SIGHUP))
        metrics_port = None
        if self.settings.metrics_listen:
            host, port = split_host_port(self.settings.metrics_listen, "--metrics-listen / BOTS_METRICS_LISTEN")
            metrics_port = serve(self.registry, host, port, self.settings.metrics_access).server_port
        for index in range(self.count):
            self._start(index)
        log.info(
            "supervising",
            extra={"processes": self.count, "listen": self.listen, "port": self.port, "metrics_port": metrics_port},
        )
        try:
            self._watch()
        finally:
            code = self._stop()  # also on an error of our own: never leave the processes behind
        return code

    def _watch(self) -> None:
        """Start again each process that exits, and kill one that stalled,
        until told to stop."""
        now = time.monotonic()
        started = dict.fromkeys(self.children, now)
        delays = dict.fromkeys(self.children, _RESTART_DELAY_S)
        due = self._due
        beats = dict.fromkeys(self.children, (0.0, now))  # last heartbeat mtime, when it was first seen
        while not self.stopping.wait(_WATCH_S):
            previous, now = now, time.monotonic()
            if now - previous > _WATCH_S + 1.0:
                # This loop did not run either (the whole server paused:
                # SIGSTOP of the group, a frozen container or VM): that time
                # is nobody's stall.
                paused = now - previous - _WATCH_S
                beats = {index: (mtime, seen + paused) for index, (mtime, seen) in beats.items()}
            for index, child in list(self.children.items()):
                if self.stopping.is_set():
                    return
                if index in due:
                    if now >= due[index]:
                        del due[index]
                        self.restarts.inc()
                        self._start(index)
                        started[index], beats[index] = now, (0.0, now)
                    continue
                code = child.poll()
                if code is None:
                    beats[index] = self._check_beat(index, child, beats[index], now)
                    continue
                if now - started[index] >= _STABLE_S:
                    delays[index] = _RESTART_DELAY_S
                delay = delays[index]
                delays[index] = min(2 * delay, _RESTART_DELAY_MAX_S)
                due[index] = now + delay
                log.error(
                    "server process exited; starting it again",
                    extra={"process_index": index, "exit_code": code, "restart_in_seconds": delay},
                )

    def _check_beat(
        self, index: int, child: subprocess.Popen[bytes], last: tuple[float, float], now: float
    ) -> tuple[float, float]:
        """The process's last heartbeat (file mtime, when first seen); kills
        the process if a heartbeat it began has not moved for
        --process-stall-seconds (the next poll starts it again). The file's
        time is only compared with itself, so a clock step is harmless."""
        try:
            mtime = self._heartbeat(index).stat().st_mtime
        except FileNotFoundError:
            return last  # still starting
        if mtime != last[0]:
            return (mtime, now)
        stalled = now - last[1]
        limit = self.settings.process_stall_seconds
        if limit > 0 and stalled > limit:
            log.error(
                "server process stopped: its event loop has not run for %.0f s; killing it (its threads' stacks "
                "follow) and starting it again",
                stalled,
                extra={"process_index": index, "pid": child.pid, "process_stall_seconds": limit},
            )
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack, even with Python stuck
                time.sleep(0.2)
                child.kill()
            return (mtime, now)
        return last

    def _signal_all(self, sig: int) -> None:
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)

    def _stop(self) -> int:
        """Forward SIGTERM; each process stops within its --shutdown-seconds."""
        log.info("shutting down", extra={"processes": len(self.children)})
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_seconds + 5.0
        codes = []
        for index, child in self.children.items():
            if index in self._due:
                continue  # it exited before the stop, and was logged then: not part of this stop
            try:
                codes.append(child.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                log.error(
                    "server process did not stop in time; killing it",
                    extra={
                        "process_index": index,
                        "pid": child.pid,
                        "shutdown_seconds": self.settings.shutdown_seconds,
                    },
                )
                child.kill()
                codes.append(child.wait())
        self._socket.close()
        if self._health_socket is not None:
            self._health_socket.close()
        shutil.rmtree(self._heartbeats, ignore_errors=True)
        log.info("stopped")
        return max((_exit_status(c) for c in codes), default=0)


def _exit_status(code: int) -> int:
    """A process's part in the supervisor's exit status. Ended by SIGTERM or
    SIGINT before it handled them (still starting): stopped as asked, 0. By
    another signal (killed above at the deadline, or by the kernel) as the
    shell reports it: 128 + the signal."""
    if code in (-signal.SIGTERM, -signal.SIGINT):
        return 0
    return 128 - code if code < 0 else code
