"""`bots-server serve` with several processes: every core behind one address.

One server process runs its Python on one core (the GIL). On PostgreSQL,
replicas on one database give the results of one server (docs/design.md),
so `serve` starts N of them, each a plain `serve` process, all listening on
the same address with SO_REUSEPORT: the kernel spreads the connections over
them. This supervisor holds the address for them (a bound socket that never
listens, so port 0 resolves once and a port in use fails at start), starts
them, starts again one that exits, forwards SIGTERM, SIGINT and SIGHUP, and
serves one /metrics endpoint: each process's series, labelled
`process="<index>"`, plus its own.

A process dies with the supervisor (PR_SET_PDEATHSIG), so killing the
supervisor stops the whole server as killing one process would.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from bots_server.settings import ServerSettings, split_host_port

log = logging.getLogger(__name__)

# Set in a supervised process's environment to the number of processes: it
# listens with SO_REUSEPORT and sizes its helper threads by its share of cores.
SUPERVISED_ENV = "BOTS_SUPERVISED"
_PR_SET_PDEATHSIG = 1
# A process that exits this soon after its start is not restarted in a loop
# faster than this.
_RESTART_DELAY_S = 1.0


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
    processes bind the same port beside it. Fails if another server holds it
    without SO_REUSEPORT (every other server does)."""
    host, port = split_host_port(address, what)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
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


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the supervisor dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _ProcessMetrics(Collector):
    """Every process's /metrics, each series labelled with its process index."""

    def __init__(self, ports: dict[int, int]) -> None:
        self.ports = ports

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for index, port in sorted(self.ports.items()):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2.0) as response:
                    text = response.read().decode()
            except OSError:
                continue  # starting or restarting: bots_server_processes_up says how many answered
            for family in text_string_to_metric_families(text):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    into.samples.append(sample._replace(labels={**sample.labels, "process": str(index)}))
        yield from merged.values()


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
        self.stopping = threading.Event()
        self.registry = CollectorRegistry()
        self.registry.register(_ProcessMetrics(self.metrics_ports))
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
        # argparse keeps the last occurrence of a flag: the overrides win.
        return [sys.executable, "-m", "bots_server.cli", *self.argv, *overrides]

    def _start(self, index: int) -> None:
        import os

        env = {**os.environ, SUPERVISED_ENV: str(self.count)}
        self.children[index] = subprocess.Popen(self._command(index), env=env, preexec_fn=_die_with_parent)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        signal.signal(signal.SIGHUP, lambda *_: self._signal_all(signal.SIGHUP))
        metrics_port = None
        if self.settings.metrics_listen:
            host, port = split_host_port(self.settings.metrics_listen, "--metrics-listen / BOTS_METRICS_LISTEN")
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
            metrics_port = server.server_port
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
        """Start again each process that exits, until told to stop."""
        started = {index: time.monotonic() for index in self.children}
        while not self.stopping.wait(0.2):
            for index, child in list(self.children.items()):
                code = child.poll()
                if code is None or self.stopping.is_set():
                    continue
                log.error("server process exited; starting it again", extra={"process_index": index, "exit_code": code})
                time.sleep(max(0.0, _RESTART_DELAY_S - (time.monotonic() - started[index])))
                self.restarts.inc()
                self._start(index)
                started[index] = time.monotonic()

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
        for child in self.children.values():
            try:
                codes.append(child.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                child.kill()
                codes.append(child.wait())
        self._socket.close()
        if self._health_socket is not None:
            self._health_socket.close()
        log.info("stopped")
        return max((c for c in codes if c > 0), default=0)
