"""The Dockerfile, without a Docker engine: its final stage is non-root and
serves, the build context (.dockerignore) holds what the build copies and
installs, the packages build from that context alone, and the image's
HEALTHCHECK command works against a real server."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import socket
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bots_server import settings
from tests.ops.support import DEPLOY, MetricsServer
from tests.support.servers import REPO

DOCKERFILE = REPO / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str = ""
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"no {keyword} in stage {self.name or self.base}"
        return found[-1]


def stages() -> list[Stage]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continuation lines
    result: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            base, _, name = args.partition(" AS ")
            result.append(Stage(base.strip(), name.strip()))
        elif result:
            result[-1].instructions.append((keyword, args.strip()))
    return result


def env(stage: Stage) -> dict[str, str]:
    values: dict[str, str] = {}
    for args in stage.all("ENV"):
        for key, value in re.findall(r"(\w+)=(\S+)", args):
            values[key] = value
    return values


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matches a
    path or any of its parent directories; `!` re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        regex = fnmatch.translate(glob).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        if glob.startswith("**/"):
            regex = "(.*/)?" + fnmatch.translate(glob[3:]).replace(".*", "[^/]*")
        if any(re.fullmatch(regex, p) for p in prefixes):
            ignored = not negate
    return ignored


def build_context(destination: Path) -> list[str]:
    """Copy what `docker build .` would send; returns the relative paths."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    # Untracked, ignored local state (.venv, *.egg-info, *.db) exists on a
    # developer's machine too: include it, the ignore file must keep it out.
    local = [str(p.relative_to(REPO)) for p in REPO.glob("**/*.egg-info/*")] + [".venv/pyvenv.cfg"]
    kept = []
    for rel in sorted(set(tracked) | set(local)):
        if dockerignored(rel, patterns) or not (REPO / rel).is_file():
            continue
        (destination / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, destination / rel)
        kept.append(rel)
    return kept


def test_final_stage_is_non_root_and_serves() -> None:
    build, final = stages()[0], stages()[-1]
    assert len(stages()) >= 2 and build.name, "multi-stage: a named build stage and a runtime stage"
    user = final.last("USER").split(":")[0]
    assert user.isdigit() and int(user) != 0
    assert json.loads(final.last("ENTRYPOINT")) == ["bots-server"]
    assert json.loads(final.last("CMD")) == ["serve"]
    assert any(a.startswith(f"--from={build.name} ") for a in final.all("COPY"))
    assert not final.all("RUN") or "pip install" not in " ".join(final.all("RUN")), "the runtime stage builds nothing"

    values = env(final)
    image_settings = {k for k in values if k.startswith("BOTS_")}
    assert image_settings <= {s.env for s in settings.SETTINGS}, image_settings
    assert values["BOTS_MIGRATE"] == "false"  # migrations are the separate `migrate` command
    exposed = {int(p) for p in final.last("EXPOSE").split()}
    assert exposed == {
        settings.split_host_port(values["BOTS_LISTEN"], "")[1],
        settings.split_host_port(values["BOTS_METRICS_LISTEN"], "")[1],
    }
    # The pods run as the image's user.
    deployment = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user)


def test_build_context_has_what_the_build_copies_and_nothing_local(tmp_path: Path) -> None:
    context = tmp_path / "context"
    kept = build_context(context)
    for stage in stages():
        for args in stage.all("COPY"):
            if args.startswith("--from="):
                continue
            *sources, _ = args.split()
            for source in sources:
                assert (context / source).exists(), f"COPY {source}: not in the build context"
    assert not [
        k for k in kept if k.startswith((".venv/", ".git/", "tests/")) or ".egg-info/" in k or k.endswith(".db")
    ]

    # The two packages build from the context alone, migrations included.
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels),
         str(context / "clients" / "python"), str(context)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    built = {w.name.split("-")[0]: w for w in wheels.glob("*.whl")}
    assert set(built) == {"bots_client", "bots_server"}
    names = set(zipfile.ZipFile(built["bots_server"]).namelist())
    assert "bots_server/store/migrations/env.py" in names
    assert any(n.startswith("bots_server/store/migrations/versions/0001") for n in names)
    assert "bots_server/metrics.py" in names
    assert not [n for n in names if n.startswith("tests/")]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "bots-server = bots_server.cli:main" in zipfile.ZipFile(built["bots_server"]).read(entry_points).decode()


def test_healthcheck_command_follows_readiness(metrics_server: MetricsServer) -> None:
    healthcheck = stages()[-1].last("HEALTHCHECK")
    command = json.loads(healthcheck[healthcheck.index("CMD") + 3 :].strip())
    assert command[0] == "python"
    run = [sys.executable, *command[1:]]
    ok = subprocess.run(run, env={"BOTS_LISTEN": f"0.0.0.0:{metrics_server.port}"}, capture_output=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    dead = subprocess.run(run, env={"BOTS_LISTEN": f"0.0.0.0:{dead_port}"}, capture_output=True, timeout=60)
    assert dead.returncode != 0


def test_dockerignore_matcher() -> None:
    patterns = ["*", "!server/", "**/__pycache__", "!README.md"]
    assert dockerignored(".venv/bin/python", patterns)
    assert not dockerignored("server/bots_server/cli.py", patterns)
    assert dockerignored("server/bots_server/__pycache__/cli.pyc", patterns)
    assert not dockerignored("README.md", patterns)


LOCK = REPO / "deploy" / "image" / "requirements.txt"


def locked() -> dict[str, tuple[str, list[str]]]:
    """The lock file's pins: name -> (version, sha256 hashes)."""
    text = re.sub(r"\\\n", " ", LOCK.read_text())
    pins: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement, *options = line.split()
            name, _, version = requirement.partition("==")
            pins[canonicalize_name(name)] = (version, [o.removeprefix("--hash=sha256:") for o in options])
    return pins


def test_the_image_installs_from_a_lock_file_with_hashes() -> None:
    # The build stage installs the third-party packages from the lock, hash-checked, and
    # the two local packages with no dependency resolution of their own.
    runs = " ".join(stages()[0].all("RUN"))
    assert re.search(r"pip install --require-hashes --only-binary=:all: --no-deps -r /tmp/requirements\.txt", runs)
    assert re.search(r"pip install --no-deps --no-build-isolation \./clients/python \.", runs)
    assert "pip check" in runs
    assert "deploy/image/requirements.txt /tmp/requirements.txt" in stages()[0].all("COPY")
    # Generated by the committed command from the pyprojects as they are now.
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "lock_image.py"), "--check-in"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # Every pin is exact and hashed; every requirement of the two packages
    # (and the build backend) is pinned, at a version it accepts.
    pins = locked()
    assert all(version and hashes and all(len(h) == 64 for h in hashes) for version, hashes in pins.values())
    wanted = [Requirement(line) for line in (LOCK.with_suffix(".in")).read_text().splitlines() if line and not line.startswith("#")]
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not locked"
        assert requirement.specifier.contains(pins[name][0], prereleases=True), (str(requirement), pins[name][0])
    for extra in ("psycopg-binary",):  # psycopg[binary]: the extra's package is locked too
        assert extra in pins


def test_the_lock_file_installs_the_service_into_a_fresh_venv(tmp_path: Path) -> None:
    # What the build stage runs, on this machine's Python (the image's minor
    # version): pip verifies every downloaded file against the lock's hashes.
    assert sys.version_info[:2] == (3, 11), "the lock is for the image's Python 3.11"
    context = tmp_path / "context"
    build_context(context)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    # --no-compile: the image compiles its modules at build time, but what
    # this checks (hashes, versions, pip check, the entry point) does not
    # depend on it, and compiling every module was most of the test's time.
    steps = [
        [*pip, "install", "--quiet", "--no-compile", "--require-hashes", "--only-binary=:all:", "--no-deps", "-r",
         str(context / "deploy" / "image" / "requirements.txt")],
        [*pip, "install", "--quiet", "--no-compile", "--no-deps", "--no-build-isolation",
         str(context / "clients" / "python"), str(context)],
        [*pip, "check"],
        [str(venv / "bin" / "bots-server"), "--version"],
    ]  # fmt: skip
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (step, result.stdout[-2000:], result.stderr[-2000:])
    frozen = subprocess.run([*pip, "freeze", "--all"], capture_output=True, text=True, check=True).stdout
    installed = {canonicalize_name(n): v for n, _, v in (line.partition("==") for line in frozen.split()) if v}
    for name, (version, _) in locked().items():
        assert installed.get(name) == version, (name, installed.get(name), version)
