"""A SIGTERM that reaches `bots-server serve` while it is still starting
(a pod deleted right after it was scheduled) stops it gracefully once it is
up: exit code 0 and a "stopped" line, not death by the signal."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path


def test_sigterm_during_migrations_stops_the_server_gracefully(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bots_server.cli", "serve", "--db", f"sqlite:///{tmp_path / 'new.db'}",
           "--listen", "127.0.0.1:0", "--log-format", "json", "--metrics-listen", ""]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    messages = []
    try:
        for line in proc.stderr:
            messages.append(json.loads(line)["message"] if line.startswith("{") else line)
            if messages[-1].startswith("Running upgrade"):  # start() is migrating the new database
                proc.send_signal(signal.SIGTERM)
                break
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    messages += [json.loads(line)["message"] for line in rest.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, messages
    assert "serving" in messages and messages[-1].startswith("stopped"), messages
