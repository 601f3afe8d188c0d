"""The fair share of the cores between tenants (core/fairshare.py), with
real threads: a tenant alone takes every slot, a tenant beside another
caller takes its share, the waiting tenant that runs least goes first, and
one tenant's units start in arrival order."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import pytest

from bots_server.core.fairshare import FairShare
from bots_server.engine import draws, parallel


class Units:
    """Threads that each run one unit of a tenant, held until released."""

    def __init__(self, fair: FairShare) -> None:
        self.fair = fair
        self.started: list[str] = []
        self.lock = threading.Lock()
        self.release: dict[str, threading.Event] = {}
        self.threads: list[threading.Thread] = []

    def start(self, tenant: str, label: str) -> None:
        gate = self.release[label] = threading.Event()

        def run() -> None:
            with self.fair.unit(tenant):
                with self.lock:
                    self.started.append(label)
                gate.wait(30)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def wait_started(self, n: int) -> list[str]:
        deadline = time.monotonic() + 10
        while len(self.started) < n:
            assert time.monotonic() < deadline, self.started
            time.sleep(0.005)
        time.sleep(0.05)  # and no more than n
        return list(self.started)

    def finish(self) -> None:
        for gate in self.release.values():
            gate.set()
        for thread in self.threads:
            thread.join(10)


def test_a_tenant_alone_takes_every_slot() -> None:
    units = Units(FairShare(slots=2))
    for i in range(3):
        units.start("a", f"a{i}")
    assert units.wait_started(2) == ["a0", "a1"]  # the third waits for a slot
    units.release["a0"].set()
    assert units.wait_started(3)[-1] == "a2"
    units.finish()


def test_beside_another_tenant_s_call_a_tenant_takes_its_share() -> None:
    fair = FairShare(slots=2)
    units = Units(fair)
    with fair.call("b"):  # b's trainer call in flight, running no parts of its own
        for i in range(3):
            units.start("a", f"a{i}")
        assert units.wait_started(1) == ["a0"]  # one of two slots: the other stays b's
        units.release["a0"].set()
        assert units.wait_started(2) == ["a0", "a1"]  # a's units in arrival order
    assert units.wait_started(3) == ["a0", "a1", "a2"]  # b's call ended (and lingered): both slots again
    units.finish()


def test_another_tenant_s_first_unit_starts_at_once() -> None:
    """a holds both slots and has a third unit waiting; b's first unit
    starts at once, and a's third only when a's share frees."""
    units = Units(FairShare(slots=2))
    units.start("a", "a0")
    units.start("a", "a1")
    assert units.wait_started(2) == ["a0", "a1"]
    units.start("a", "a2")
    time.sleep(0.02)
    units.start("b", "b0")
    assert units.wait_started(3) == ["a0", "a1", "b0"]
    units.release["a0"].set()
    time.sleep(0.05)
    assert "a2" not in units.started  # a runs one unit, b one: every slot busy
    units.release["b0"].set()
    assert units.wait_started(4)[-1] == "a2"
    units.finish()


def test_a_unit_within_a_unit_runs_at_once() -> None:
    fair = FairShare(slots=1)
    with fair.unit("a"), fair.unit("a"):
        pass


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slots = 0"):
        FairShare(slots=0)


def gated_draw(gate: parallel.Gate | None) -> np.ndarray:
    n = draws.PARTED_MIN_TASKS * 2
    alpha, beta = np.linspace(0.5, 20, n), np.linspace(20, 0.5, n)
    token = parallel.PART_GATE.set(gate)
    try:
        return draws.beta_draws(np.random.default_rng(7), alpha, beta, stream=2)
    finally:
        parallel.PART_GATE.reset(token)


def test_the_engine_s_parts_run_within_the_gate_and_draw_the_same_numbers() -> None:
    fair = FairShare(slots=2)
    turns: list[bool] = []

    def gate(may_wait: bool) -> AbstractContextManager[bool]:
        turns.append(may_wait)  # list.append is atomic
        return fair.unit("a", may_wait)

    assert np.array_equal(gated_draw(gate), gated_draw(None))
    assert turns.count(True) >= 1 and len(turns) >= draws.PARTS  # each part took a turn
    assert not fair._running  # every unit ended


def test_a_call_s_parts_finish_within_its_unit_beside_another_tenant() -> None:
    """A trainer call's unit draws its parts on its own thread when its
    tenant has no slot to spare: the call's helpers do not wait for one."""
    fair = FairShare(slots=2)

    def gate(may_wait: bool) -> AbstractContextManager[bool]:
        return fair.unit("a", may_wait)

    done = threading.Event()

    def call() -> None:
        with fair.unit("a"):  # the call's unit, as Runtime gives a trainer call
            gated_draw(gate)
        done.set()

    with fair.call("b"), fair.call("a"):  # a's share: one slot
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        assert done.wait(30)
    thread.join()


def test_a_tenant_over_its_share_gives_way_at_a_part_boundary() -> None:
    """a took both slots while alone; b's call starts beside them at once
    (b is within its share), and at a's next part boundary a gives one
    slot back: a runs one unit, b one."""
    fair = FairShare(slots=2)
    boundary = threading.Event()
    b_ran, b_done, released = threading.Event(), threading.Event(), threading.Event()

    def a_call() -> None:
        with fair.unit("a"):
            boundary.wait(30)
            with fair.unit("a"):  # a part boundary within the call's unit
                released.wait(30)

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, (fair._running, fair._waiting)
            time.sleep(0.005)

    threads = [threading.Thread(target=a_call, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    until(lambda: fair._running.get("a") == 2)

    def b_call() -> None:
        with fair.call("b"), fair.unit("b"):
            b_ran.set()
            b_done.wait(30)

    b = threading.Thread(target=b_call, daemon=True)
    with fair.call("a"):
        b.start()
        assert b_ran.wait(10)  # at once, beside a's two units
        assert fair._running == {"a": 2, "b": 1}
        boundary.set()
        until(lambda: fair._running == {"a": 1, "b": 1} and bool(fair._waiting.get("a")))
        b_done.set()
        b.join(10)
        released.set()
    for thread in threads:
        thread.join(10)
    assert not fair._running
