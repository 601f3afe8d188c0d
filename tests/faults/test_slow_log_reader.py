"""A reader of the server's stderr that stops reading (a log shipper that
falls behind, a pipe nobody drains) must not stop the server: calls go on at
their usual pace, the lines past --log-queue-lines are dropped and counted
in bots_log_lines_dropped_total, and once the reader is back a WARNING line
says how many were dropped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

import bots_client
from bots_client import Task

QUEUE_LINES = 50
# Two audit lines a step: enough steps to fill the pipe (64 KiB, some 250
# lines) and the queue many times over.
STEPS = 600


def start(db: Path) -> tuple[subprocess.Popen[str], dict[str, object]]:
    cmd = [
        sys.executable, "-m", "bots_server.cli", "serve", "--db", f"sqlite:///{db}", "--listen", "127.0.0.1:0",
        "--metrics-listen", "127.0.0.1:0", "--log-format", "json", "--log-queue-lines", str(QUEUE_LINES),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # up to the "serving" line, then nobody reads
        entry = json.loads(line)
        if entry["message"] == "serving":
            return proc, entry
    raise AssertionError(f"the server exited with {proc.wait()} before serving")


def dropped_metric(metrics_port: object) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line.startswith("bots_log_lines_dropped_total "):
                return float(line.split()[1])
    raise AssertionError("bots_log_lines_dropped_total is not exported")


def test_a_stalled_log_reader_delays_lines_not_calls(tmp_path: Path) -> None:
    proc, serving = start(tmp_path / "bots.db")
    assert proc.stderr is not None
    try:
        with bots_client.Client(f"127.0.0.1:{serving['port']}", timeout=10.0) as client:
            client.create_experiment("loud")
            client.add_tasks("loud", [Task(key=f"task-{i}") for i in range(64)])
            batch = client.select_batch("loud", 8, request_key="step-0")
            seconds = []
            for step in range(STEPS):
                started = time.perf_counter()
                _, batch = client.report_and_select(
                    "loud", batch.batch_id, dict.fromkeys(batch.keys, (1.0, 2)), 8, f"step-{step + 1}"
                )
                seconds.append(time.perf_counter() - started)
            assert client.snapshot("loud").step == STEPS
        # Not one call waited for the log: the slowest is far below the 10 s deadline.
        assert max(seconds) < 2.0, f"slowest step {max(seconds):.2f} s, p50 {np.median(seconds) * 1e3:.1f} ms"
        dropped = dropped_metric(serving["metrics_port"])
        assert dropped > 0
        proc.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in proc.stderr]  # the reader is back
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
    notices = [e for e in rest if e["message"] == "log lines dropped: stderr was not read fast enough"]
    assert notices and all(e["level"] == "WARNING" for e in notices)
    # Every dropped line is accounted for by a notice (more may have been
    # dropped after the scrape, none before the first line read back).
    assert sum(int(e["dropped"]) for e in notices) >= dropped
    assert rest[-1]["message"] != notices[-1]["message"]  # lines went on after the notice
