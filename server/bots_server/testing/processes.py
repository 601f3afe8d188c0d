"""`bots-server serve` as a child process on a real TCP port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path


class ServerProcess:
    """`bots-server serve` in a child process, listening on a free port.

    The port is read from the server's own "serving" log line, so there is no
    race for a pre-picked free port. `processes`: one server process (the
    default here, whatever the machine), or a supervisor of that many
    (PostgreSQL), ready once each of them serves.
    """

    def __init__(
        self,
        db_url: str,
        *,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        processes: int = 1,
    ) -> None:
        self.db_url = db_url
        self.extra_args = list(extra_args)
        self.processes = processes
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.log_lines: list[dict[str, object]] = []
        self._reader: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int:
        """The /metrics port: the supervisor's (one endpoint for all its
        processes), or the one server's."""
        first = "supervising" if self.processes > 1 else "serving"
        entry = next(e for e in self.log_lines if e.get("message") == first)
        return int(str(entry["metrics_port"]))

    def start(self, listen: str = "127.0.0.1:0", timeout: float = 60.0) -> ServerProcess:
        cmd = [
            sys.executable, "-m", "bots_server.cli", "serve",
            "--db", self.db_url, "--listen", listen, "--log-format", "json",
            "--metrics-listen", "127.0.0.1:0", "--processes", str(self.processes), *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=self.env)
        ready = threading.Event()

        def read() -> None:
            # Keeps up with the server's log: a server that writes faster than
            # this drains its stderr blocks in its own logging calls.
            assert self.proc is not None and self.proc.stderr is not None
            serving = 0
            for line in self.proc.stderr:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    entry = {"message": line.rstrip()}
                self.log_lines.append(entry)
                message = entry.get("message")
                if message == "serving":
                    serving += 1
                    if self.processes == 1:
                        self.port = int(entry["port"])
                elif message == "supervising":
                    self.port = int(entry["port"])
                if self.port and serving >= self.processes:
                    ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server did not start: {self.log_lines[-20:]}")
        return self

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM: graceful shutdown (finishes calls, checkpoints). Returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Hung: have it print every thread's stack (see cli.py), then kill it.
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            self.kill()
            if self._reader is not None:
                self._reader.join(5)
            raise RuntimeError(f"server did not stop within {timeout:g} s: {self.log_lines[-80:]}") from None
        if self._reader is not None:
            self._reader.join(5)
        from bots_server.service.server import EXIT_SHUTDOWN_TIMEOUT

        if code == EXIT_SHUTDOWN_TIMEOUT:  # bounded, but a stop that stalls is worth seeing in every run's summary
            stacks = "\n".join(self.messages()[-80:])
            warnings.warn(f"server shutdown did not finish in time; its last log lines:\n{stacks}", stacklevel=2)
        return code

    def kill(self) -> None:
        """SIGKILL: a crash at an arbitrary moment."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def messages(self) -> list[str]:
        return [str(e.get("message")) for e in self.log_lines]

    def entries(self, message: str, timeout: float = 10.0) -> list[dict[str, object]]:
        """The log lines with `message`, waiting up to `timeout` for the
        first: the server writes its log from a thread of its own every 50 ms
        (logs.py), so a line may come a little after the call's answer."""
        deadline = time.monotonic() + timeout
        while not (found := [e for e in self.log_lines if e.get("message") == message]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return found


def rss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in bytes: its resident memory now, and at its peak."""
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return rss, hwm
