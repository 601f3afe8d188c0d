"""Smoke test of bench/unreported.py: both experiments are timed, and the
one at the bound is held at it (its first insert deletes a tenth)."""

from __future__ import annotations

import logging

import pytest

from bench import unreported
from bots_server.store.base import Store
from tests.support.servers import require_postgres


@pytest.mark.parametrize(("backend", "vacuum"), [("sqlite", False), ("postgresql", True)])
def test_a_short_run_times_both_experiments(
    backend: str, vacuum: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if backend == "postgresql":
        require_postgres()
    monkeypatch.setattr(Store, "max_unreported_batches", 40)
    with caplog.at_level(logging.WARNING, logger="bots_server.store"):
        result = unreported.measure(backend, rounds=2, ops=5, vacuum=vacuum)
    assert result["backend"] == backend + (", after VACUUM" if vacuum else "")
    for percentile in ("p50_ms", "p99_ms"):
        times = result[percentile]
        assert isinstance(times, dict) and set(times) == {"clean", "at the bound"}
        assert all(len(rounds) == 2 and all(t > 0 for t in rounds) for rounds in times.values())
    assert "deleted the 5 batches of experiment 'at the bound'" in caplog.text  # 40 + 1 - 40 + 4
