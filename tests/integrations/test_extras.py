"""The published extras install beside real GPU stacks: a resolver run
against PyPI (nothing installed) must find versions for `bots-client[trl]`,
`[verl]` and `[trinity]` next to a vLLM release each framework accepts, and
`[trinity]` next to trinity-rft itself.

The resolver is uv's (`uv pip compile`, for Linux x86-64 and this Python):
it reads the packages' metadata alone, where a `pip install --dry-run`
downloads every wheel of the stack (vLLM, a CUDA torch) to read it, about
80 s and 80 s of CPU a case here, against 5 s.

Needs network access to PyPI (marker `network`; CI has it): without it the
test skips, except under CI where it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.network

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "python"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"

# (extra, the releases it must resolve beside). TRL: the newest vLLM this
# registry can resolve (0.33.0 needs a certifi release it does not have
# yet). `[verl]` covers both adapters: verl 0.7.x caps vLLM at 0.12.0 (its
# own `vllm` extra; newer vLLM needs numpy 2 through opencv-python-headless
# >= 4.13, which verl 0.7.x refuses), and verl 0.9.1's `vllm` extra pins
# vLLM 0.24.0. `[trinity]` does not pull trinity-rft (Trinity loads the selector,
# so it is installed already): it must resolve beside vLLM 0.23.0, the newest
# release trinity-rft 0.6.0's own `vllm` extra allows, and beside
# trinity-rft 0.6.0 itself, where it must avoid the numpy/pyarrow trap.
# trinity-rft 0.6.0 and a vLLM it supports cannot be installed together at
# all (docs/integrations/trinity.md, Pitfalls).
CASES = [
    ("trl", "vllm==0.32.0"),
    ("verl", "verl==0.7.1 vllm==0.12.0"),
    ("verl", "verl==0.9.1 vllm==0.24.0"),
    ("trinity", "vllm==0.23.0"),
    ("trinity", "trinity-rft==0.6.0"),
]


def pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10):
            return True
    except OSError:
        return False


def resolve(extra: str, beside: str, requirements: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    requirements.write_text("\n".join([f"{CLIENT}[{extra}]", *beside.split()]) + "\n")
    pinned = requirements.with_suffix(".txt")
    command = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-header", "--no-annotate",
               "--python-platform", "x86_64-manylinux_2_28", "--python-version", PYTHON, "--output-file",
               str(pinned), str(requirements)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    versions: dict[str, str] = {}
    if done.returncode == 0:
        for line in pinned.read_text().splitlines():
            name, separator, version = line.partition("==")
            if separator:
                versions[name.strip().lower()] = version.strip()
    return done, versions


def test_extras_resolve_beside_vllm(tmp_path: Path) -> None:
    if not pypi_reachable():
        if os.environ.get("CI"):
            pytest.fail("PyPI is not reachable; CI must resolve the extras")
        pytest.skip("PyPI is not reachable")
    with ThreadPoolExecutor(len(CASES)) as pool:
        runs = list(pool.map(lambda i: resolve(*CASES[i], tmp_path / f"{i}.in"), range(len(CASES))))
    for (extra, beside), (done, versions) in zip(CASES, runs):
        assert done.returncode == 0, f"bots-client[{extra}] beside {beside}: {done.stderr[-3000:]}"
        for requirement in beside.split():
            name, version = requirement.split("==")
            assert versions[name] == version
        assert "torch" in versions  # the stack's own torch build: no exact pin of ours stands in its way
    versions = {case: v for case, (_, v) in zip(CASES, runs)}
    # The numpy/pyarrow trap: verl 0.7.x pins numpy < 2 and pyarrow 26 refuses it.
    for case in (("verl", "verl==0.7.1 vllm==0.12.0"), ("trinity", "trinity-rft==0.6.0")):
        assert versions[case]["numpy"].startswith("1.")
        assert int(versions[case]["pyarrow"].split(".")[0]) < 26
    # Beside vLLM, [trinity] brings no trinity-rft, verl or numpy < 2 of its own.
    beside_vllm = versions[("trinity", "vllm==0.23.0")]
    assert "trinity-rft" not in beside_vllm and "verl" not in beside_vllm
    assert not beside_vllm["numpy"].startswith("1.")
