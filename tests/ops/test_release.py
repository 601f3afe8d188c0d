"""Release hygiene: one version everywhere it is written, a CHANGELOG entry
with the schema revision of every release, and the license the packages
declare."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

import bots_client
import bots_server
from bots_server.store import revisions
from tests.support.servers import REPO

CHANGELOG = (REPO / "CHANGELOG.md").read_text()
VERSION = bots_server.__version__


def test_the_server_the_client_and_the_proto_name_one_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    pyproject = (REPO / "pyproject.toml").read_text()
    proto = (REPO / "proto" / "bots" / "v1" / "bots.proto").read_text()
    dockerfile = (REPO / "Dockerfile").read_text()
    written: dict[str, list[str]] = {
        "bots_client.__version__": [bots_client.__version__],
        "installed bots-server (pip install -e . again if stale)": [metadata.version("bots-server")],
        "installed bots-client": [metadata.version("bots-client")],
        "pyproject.toml's pin on bots-client": re.findall(r'"bots-client==([^"]+)"', pyproject),
        "proto/bots/v1/bots.proto's header": re.findall(r"^// .*, as of release (\S+) \(CHANGELOG", proto, re.MULTILINE),
        "Dockerfile's ARG VERSION": re.findall(r"^ARG VERSION=(\S+)", dockerfile, re.MULTILINE),
        "CHANGELOG.md's newest release": re.findall(r"^## (\S+)", CHANGELOG, re.MULTILINE)[:1],
    }
    for kustomization in sorted((REPO / "deploy" / "k8s").rglob("kustomization.yaml")):
        # A release's tag (the dev overlay builds its own, "dev").
        tags = re.findall(r"^\s+newTag: (\d\S*)", kustomization.read_text(), re.MULTILINE)
        if tags:
            written[str(kustomization.relative_to(REPO))] = tags
    assert "deploy/k8s/base/kustomization.yaml" in written
    # The image tag in every command a page or the Dockerfile shows.
    for page in [REPO / "Dockerfile", REPO / "README.md", *sorted(REPO.glob("docs/**/*.md"))]:
        tags = re.findall(r"\bbots-server:(\d+\.\d+\.\d+)\b", page.read_text())
        if tags:
            written[f"image tags in {page.relative_to(REPO)}"] = tags
    assert all(written.values()), {place: found for place, found in written.items() if not found}
    differ = {place: found for place, found in written.items() if set(found) != {VERSION}}
    assert not differ, f"bots_server.__version__ is {VERSION}; elsewhere: {differ}"


def test_both_packages_read_their_version_from_the_code() -> None:
    for path, attr in (("pyproject.toml", "bots_server"), ("clients/python/pyproject.toml", "bots_client")):
        config = tomllib.loads((REPO / path).read_text())
        assert "version" not in config["project"] and "version" in config["project"]["dynamic"], path
        assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": f"{attr}.__version__"}, path


def test_every_release_names_its_schema_revision() -> None:
    releases = re.split(r"^## ", CHANGELOG, flags=re.MULTILINE)[1:]
    assert len(releases) >= 2
    named = [re.search(r"^Schema revision \*\*(\d{4})\*\*", r, re.MULTILINE) for r in releases]
    assert all(named), [r.splitlines()[0] for r, n in zip(releases, named, strict=True) if not n]
    # The newest release is this code: its revision is the migrations' head.
    assert [named[0].group(1)] == revisions.heads()  # type: ignore[union-attr]
    # Every revision is described once, with whether a rollback survives it.
    files = sorted(p.name[:4] for p in revisions.MIGRATIONS.glob("versions/[0-9][0-9][0-9][0-9]_*.py"))
    rows = re.findall(r"^\| (\d{4}) \| .+ \| (yes|no|\(first\)) \|$", CHANGELOG, re.MULTILINE)
    assert sorted(revision for revision, _ in rows) == files


def test_the_license_is_the_one_the_packages_declare() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150
    # The client is built from its own directory: its copy goes into its wheel.
    assert (REPO / "clients" / "python" / "LICENSE").read_text() == text
    for path in ("pyproject.toml", "clients/python/pyproject.toml"):
        assert tomllib.loads((REPO / path).read_text())["project"]["license"] == "Apache-2.0", path
