"""Helpers of the operations tests: servers with a metrics port, scraping,
external tools (promtool, prometheus, kubectl) that CI must have."""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import REPO, ServerProcess

T = TypeVar("T")

DEPLOY = REPO / "deploy"
Labels = frozenset[tuple[str, str]]


def require_tool(name: str) -> str:
    """The tool's path; skip without it, except under CI, where that fails
    (`make tools` installs promtool and prometheus)."""
    path = shutil.which(name)
    if path is None:
        how = "install kubectl with kustomize v5" if name == "kubectl" else "run `make tools`"
        message = f"{name} is not installed ({how})"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run these tests")
        pytest.skip(message)
    return path


class MetricsServer(ServerProcess):
    """A server process with its /metrics endpoint on a free loopback port."""

    def __init__(self, db_url: str, *, extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        super().__init__(db_url, extra_args=["--metrics-listen", "127.0.0.1:0", *extra_args], env=env)

    def start(self, listen: str = "127.0.0.1:0", timeout: float = 60.0) -> MetricsServer:
        super().start(listen, timeout)
        return self

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()

    def samples(self) -> dict[str, dict[Labels, float]]:
        """Sample name -> {label set: value}."""
        return parse(self.scrape())


def parse(text: str) -> dict[str, dict[Labels, float]]:
    result: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            result.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return result


def value(samples: dict[str, dict[Labels, float]], name: str, **labels: str) -> float | None:
    """The sample with exactly these labels (a subset match if unique)."""
    series = samples.get(name, {})
    wanted = set(labels.items())
    matches = [v for k, v in series.items() if wanted <= k]
    if len(matches) > 1:
        raise AssertionError(f"{name}{labels} matches {len(matches)} series")
    return matches[0] if matches else None


def number(samples: dict[str, dict[Labels, float]], name: str, **labels: str) -> float:
    """Like value(), for a series that must exist."""
    found = value(samples, name, **labels)
    assert found is not None, f"no series {name}{labels}"
    return found


def eventually(probe: Callable[[], T], check: Callable[[T], bool], timeout: float = 30.0, what: str = "") -> T:
    """Poll `probe` until `check` holds. Observer hooks run on worker threads
    after the RPC answered, so a metric may trail the call that caused it."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if check(result):
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout}s: {what or check}; last: {result!r}")
        time.sleep(0.1)
