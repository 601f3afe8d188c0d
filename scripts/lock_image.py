"""Writes deploy/image/requirements.txt, the container image's lock file:
every third-party package the server and the client need at run time, plus
the build backend that installs the two, pinned with the sha256 of every
file of that version (pip-compile --generate-hashes), so that two builds of
the image install the same bytes or fail (`pip install --require-hashes`).

    make image-lock                          # the committed command
    python scripts/lock_image.py --check-in  # exit 1 if requirements.in is stale

It writes the requirements it locks to deploy/image/requirements.in first,
read from the two pyproject.toml files (the server's
`bots-client` dependency is the local package, installed from the build
context, so it is left out), and setuptools from the server's
[build-system] (the image builds both packages without build isolation).
Run it with the image's Python minor version (3.11): markers are resolved
for the interpreter that runs it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PYPROJECTS = (REPO / "pyproject.toml", REPO / "clients" / "python" / "pyproject.toml")
LOCK = REPO / "deploy" / "image" / "requirements.txt"
SOURCE = LOCK.with_suffix(".in")
LOCAL_PACKAGES = {"bots-client", "bots-server"}
IMAGE_PYTHON = (3, 11)


def requirements() -> list[str]:
    """The image's direct requirements: runtime dependencies and the build backend."""
    found: list[str] = []
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())
        for spec in project["project"]["dependencies"]:
            if Requirement(spec).name not in LOCAL_PACKAGES and spec not in found:
                found.append(spec)
    for spec in tomllib.loads(PYPROJECTS[0].read_text())["build-system"]["requires"]:
        if spec not in found:
            found.append(spec)
    return found


def source_text() -> str:
    return (
        "# The container image's direct requirements, written by scripts/lock_image.py\n"
        "# from the pyproject.toml files (make image-lock): edit those, not this file.\n"
        + "\n".join(requirements())
        + "\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-in", action="store_true", help="exit 1 if requirements.in is stale, lock nothing")
    args = parser.parse_args()
    if args.check_in:
        if not SOURCE.exists() or SOURCE.read_text() != source_text():
            print(f"{SOURCE} is stale: run make image-lock", file=sys.stderr)
            return 1
        return 0
    if sys.version_info[:2] != IMAGE_PYTHON:
        print(f"run with Python {'.'.join(map(str, IMAGE_PYTHON))}, the image's", file=sys.stderr)
        return 2
    SOURCE.write_text(source_text())
    return subprocess.run(
        [
            sys.executable, "-m", "piptools", "compile", "--quiet", "--generate-hashes",
            "--allow-unsafe",  # setuptools is a requirement here, not an accident
            "--strip-extras", "--no-emit-index-url", "--no-emit-find-links",
            "--output-file", str(LOCK.relative_to(REPO)), str(SOURCE.relative_to(REPO)),
        ],
        cwd=REPO, check=False,
        env={**os.environ, "CUSTOM_COMPILE_COMMAND": "make image-lock"},  # the header names it
    ).returncode  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
