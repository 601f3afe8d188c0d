"""What a newcomer runs first works as shown, twice: examples/quickstart.py
and the client README's training loop, each run two times in a row against
a real server (`make serve`'s defaults but for the port); the second run
resumes the experiment the first left."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import bots_client
from tests.support.servers import REPO, ServerProcess

QUICKSTART = REPO / "examples" / "quickstart.py"
CLIENT_README = REPO / "clients" / "python" / "README.md"


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = ServerProcess(f"sqlite:///{tmp_path_factory.mktemp('first-run') / 'bots.db'}").start()
    yield server.address
    server.stop()


def run_python(
    source: Path, address: str, cwd: Path, variable: str = "BOTS_SERVER"
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k not in ("BOTS_SERVER", "BOTS_ADDRESS", "BOTS_TOKEN")}
    env[variable] = address
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(source)], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )
    return result, time.monotonic() - started


def test_the_quickstart_runs_twice_and_resumes(address: str, tmp_path: Path) -> None:
    lines = QUICKSTART.read_text().splitlines()
    assert len(lines) < 40, f"{len(lines)} lines"
    printed = []
    for variable in ("BOTS_SERVER", "BOTS_ADDRESS"):  # the second: the adapters' name for it
        result, seconds = run_python(QUICKSTART, address, tmp_path, variable)
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
        assert seconds < 30, f"{seconds:.1f} s"
        printed.append(re.findall(r"^step (\d+): batches (\d\.\d\d) off the target", result.stdout, re.MULTILINE))
    assert [int(step) for step, _ in printed[0]] == [10, 20, 30]
    assert [int(step) for step, _ in printed[1]] == [40, 50, 60]
    # Batches nearer the target than random ones (0.25): the selection works.
    assert all(float(off) < 0.25 for run in printed for _, off in run), printed
    with bots_client.Client(address) as client:
        experiment = client.get_experiment("quickstart")
    assert (experiment.step, experiment.num_tasks, experiment.open_batches) == (60, 100, 0)


def python_block(markdown: Path, heading: str) -> str:
    """The first ```python block after `heading`."""
    text = markdown.read_text()
    found = re.search(re.escape(heading) + r".*?```python\n(.*?)```", text, flags=re.DOTALL)
    assert found, f"{markdown}: no python block after {heading!r}"
    return found.group(1)


def test_the_client_readme_loop_runs_twice_and_resumes(address: str, tmp_path: Path) -> None:
    program = tmp_path / "loop.py"
    program.write_text(python_block(CLIENT_README, "## A training loop"))
    for run in (1, 2):
        result, _ = run_python(program, address, tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"step {49 * run}, capability "), result.stdout
    with bots_client.Client(address) as client:
        experiment = client.get_experiment("gsm8k-run-3")
    # The batch selected last is open; the next run asks for it by its key.
    assert (experiment.step, experiment.num_tasks, experiment.open_batches) == (98, 1000, 1)
