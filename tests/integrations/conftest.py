"""Fixtures of the trainer-integration tests: the run's shared SQLite
`bots-server` process (tests/conftest.py; the adapters are backend-agnostic,
the backends have their own suites), a client, and fresh experiment names.

`need(module)` imports a framework or skips the test. Under CI it fails
instead, for the frameworks CI installs (the top-level `test` extra): torch,
trl, matplotlib, torchdata, openai and tensorboard by default, or the comma-separated list in
BOTS_TEST_REQUIRED_FRAMEWORKS. verl and trinity-rft are not in that list:
verl 0.7 and trinity-rft pin numpy < 2, and verl 0.9 caps transformers
below the version TRL runs on, so the project's environment cannot take
them; their adapters are tested against the data shapes of the frameworks'
sources here, and against the real libraries in environments of their own
(`make test-frameworks`, which .ci/run runs with them required; see
docs/integrations/).
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Iterator
from types import ModuleType

import pytest

import bots_client
from tests.support.servers import ServerProcess

DEFAULT_REQUIRED_IN_CI = ("torch", "trl", "matplotlib", "torchdata", "openai", "tensorboard")


def required_in_ci() -> set[str]:
    given = os.environ.get("BOTS_TEST_REQUIRED_FRAMEWORKS")
    names = DEFAULT_REQUIRED_IN_CI if given is None else [n.strip() for n in given.split(",") if n.strip()]
    return set(names)


def need(module: str) -> ModuleType:
    """Import `module` (e.g. "torch", "verl.experimental.dataset.sampler") or skip."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if os.environ.get("CI") and top in required_in_ci():
            pytest.fail(f"{module} is not installed, but CI must test it (add it to the test extra): {e}")
        pytest.skip(f"{module} is not installed: {e}")


@pytest.fixture
def address(sqlite_server: ServerProcess) -> str:
    return sqlite_server.address


@pytest.fixture
def client(address: str) -> Iterator[bots_client.Client]:
    with bots_client.Client(address) as c:
        yield c


@pytest.fixture
def exp_name(request: pytest.FixtureRequest) -> str:
    return f"it-{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")


# MoPPS without forgetting adds raw counts: alpha = 1 + all successes and
# beta = 1 + all failures reported for a task, so tests can read them back.
EXACT = bots_client.ExperimentConfig(strategy="mopps", forgetting=0.0, implicit_weight=0.0, seed=7)


def counts(client: bots_client.Client, experiment: str) -> dict[str, tuple[float, float]]:
    """key -> (successes, failures) the server has applied (under EXACT)."""
    snap = client.snapshot(experiment)
    return {k: (float(a) - 1.0, float(b) - 1.0) for k, a, b in zip(snap.keys, snap.alpha, snap.beta)}
