"""Crash harness: a trainer loop against a server that is SIGKILLed at random
moments and restarted, next to the same loop against a server left alone.

Used by tests/faults/test_crash_recovery.py (a bounded number of kills) and
scripts/soak.py (many more, bounded in time).
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

import bots_client
from bots_client import ExperimentConfig, Task
from tests.support.servers import ServerProcess

CONFIG = ExperimentConfig(weak_feature="weak", strong_feature="strong", seed=3, implicit_weight=0.2)
# Checkpoint every step so kills also land during checkpoints.
SERVER_ARGS = ("--checkpoint-every-steps", "1", "--checkpoint-every-seconds", "3600", "--grace-seconds", "1")


def outcome(key: str, step: int) -> tuple[float, int]:
    """Deterministic outcomes, so both runs see the same rollouts."""
    h = int.from_bytes(hashlib.sha256(f"{key}/{step}".encode()).digest()[:8], "little")
    return float(h % 17), 16


@dataclass
class Run:
    picks: list[list[str]] = field(default_factory=list)
    phase: str = "setup"  # what the trainer is waiting on: select, report or idle
    done: threading.Event = field(default_factory=threading.Event)


def setup(client: bots_client.Client, name: str, pool: int) -> None:
    client.create_experiment(name, CONFIG)
    weak = np.random.default_rng(0).uniform(0, 0.6, pool)
    client.add_tasks(name, [Task(f"task-{i}", {"weak": float(w), "strong": float(min(1, w + 0.3))}) for i, w in enumerate(weak)])


def train(client: bots_client.Client, name: str, steps: int, batch_size: int, run: Run) -> None:
    for step in range(steps):
        run.phase = "select"
        batch = client.select_batch(name, batch_size, request_key=f"step-{step}")
        run.phase = "report"
        client.report_outcomes(name, batch.batch_id, {k: outcome(k, step) for k in batch.keys})
        run.phase = "idle"
        run.picks.append(batch.keys)
    run.done.set()


def train_combined(client: bots_client.Client, name: str, steps: int, batch_size: int, run: Run) -> None:
    """As train, each step's report and the next select in one ReportAndSelect."""
    run.phase = "select"
    batch = client.select_batch(name, batch_size, request_key="step-0")
    for step in range(steps):
        outcomes = {k: outcome(k, step) for k in batch.keys}
        picked = batch.keys
        if step + 1 < steps:
            run.phase = "report_and_select"
            _, batch = client.report_and_select(name, batch.batch_id, outcomes, batch_size, request_key=f"step-{step + 1}")
        else:
            run.phase = "report"
            client.report_outcomes(name, batch.batch_id, outcomes)
        run.phase = "idle"
        run.picks.append(picked)
    run.done.set()


def final_state(client: bots_client.Client, name: str) -> tuple[object, ...]:
    snap = client.snapshot(name)
    return snap.step, snap.experiment.capability, tuple(snap.keys), snap.alpha.tobytes(), snap.beta.tobytes()


@dataclass
class CrashReport:
    kills: int
    phases: dict[str, int]
    identical: bool
    # Reports acknowledged to the trainer, against steps the server applied:
    # fewer applied is a lost outcome, more a doubled one.
    lost: int
    doubled: int


def crash_run(
    db_url: str, reference_db_url: str, *, kills: int, steps: int, pool: int = 3000, batch_size: int = 32,
    max_delay: float = 0.4, seed: int = 0, deadline: float = float("inf"), combined: bool = False,
) -> CrashReport:  # fmt: skip
    """Run the same training twice, once under `kills` random SIGKILLs; compare.
    `combined`: the killed run steps by ReportAndSelect, the reference by
    the separate calls."""
    reference = ServerProcess(reference_db_url, extra_args=SERVER_ARGS).start()
    try:
        with bots_client.Client(reference.address) as client:
            setup(client, "crash", pool)
            expected_run = Run()
            train(client, "crash", steps, batch_size, expected_run)
            expected = final_state(client, "crash")
    finally:
        reference.stop()

    server = ServerProcess(db_url, extra_args=SERVER_ARGS).start()
    port = server.port
    run = Run()
    phases: dict[str, int] = {}
    rng = random.Random(seed)
    client = bots_client.Client(server.address, retry_timeout=120)
    try:
        setup(client, "crash", pool)
        loop = train_combined if combined else train
        trainer = threading.Thread(target=loop, args=(client, "crash", steps, batch_size, run), daemon=True)
        trainer.start()
        done_kills = 0
        while done_kills < kills and not run.done.is_set() and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.0, max_delay))
            if run.done.is_set():
                break
            phases[run.phase] = phases.get(run.phase, 0) + 1
            server.kill()
            done_kills += 1
            server = ServerProcess(db_url, extra_args=SERVER_ARGS).start(listen=f"127.0.0.1:{port}")
            # Let the trainer finish a step before the next kill's random
            # moment: a loaded machine that restarts slowly must not starve
            # the trainer into its retry deadline (no progress, no signal).
            steps_at_kill = len(run.picks)
            progress_deadline = time.monotonic() + 60
            while len(run.picks) == steps_at_kill and not run.done.is_set() and time.monotonic() < progress_deadline:
                time.sleep(0.01)
        trainer.join(timeout=600)
        if trainer.is_alive() or not run.done.is_set():
            raise RuntimeError(f"trainer did not finish: {len(run.picks)} of {steps} steps")
        state = final_state(client, "crash")
        applied = int(state[0])  # type: ignore[call-overload]
        identical = run.picks == expected_run.picks and state == expected
        return CrashReport(done_kills, phases, identical, max(0, steps - applied), max(0, applied - steps))
    finally:
        client.close()
        server.kill()
