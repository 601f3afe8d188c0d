"""`bots-server --version` (or -V): the installed command prints the package version
and exits 0, without a subcommand."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import bots_server


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_the_package_version(flag: str) -> None:
    # The console script next to the interpreter running the tests: `make
    # test` runs .venv/bin/python without putting .venv/bin on PATH.
    command = Path(sys.executable).parent / "bots-server"
    assert command.exists(), f"{command}: the package is not installed in this environment"
    result = subprocess.run([str(command), flag], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"bots-server {bots_server.__version__}"
    # __version__ and the installed distribution's metadata (pyproject.toml) agree.
    assert bots_server.__version__ == version("bots-server")
