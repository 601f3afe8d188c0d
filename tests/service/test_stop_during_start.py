"""A SIGTERM that reaches `bots-server serve` while it is still starting
(a pod deleted right after it was scheduled) stops it gracefully once it is
up: exit code 0 and a "stopped" line, not death by the signal."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path


def test_sigterm_during_migrations_stops_the_server_gracefully(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bots_server.cli", "serve", "--db", f"sqlite:///{tmp_path / 'new.db'}",
           "--listen", "127.0.0.1:0", "--log-format", "json", "--metrics-listen", ""]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    # One reader for the whole log: communicate() after a partial read would
    # read the pipe past the lines the iterator had buffered already ("serving"
    # among them, when the start is fast). A stuck server is killed, which
    # ends the read.
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    messages: list[str] = []
    signalled = False
    try:
        for line in proc.stderr:
            messages.append(json.loads(line)["message"] if line.startswith("{") else line)
            if not signalled and messages[-1].startswith("Running upgrade"):  # start() is migrating the new database
                proc.send_signal(signal.SIGTERM)
                signalled = True
        proc.wait(60)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 0, messages
    assert "serving" in messages and messages[-1].startswith("stopped"), messages
