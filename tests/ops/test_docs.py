"""docs/operations.md keeps up with the code: every setting and every
exported metric is documented."""

from __future__ import annotations

import re

from bots_server import settings
from bots_server.cli import build_parser
from tests.ops.support import MetricsServer
from tests.support.servers import REPO

OPERATIONS = (REPO / "docs" / "operations.md").read_text()


def test_every_setting_is_documented() -> None:
    for s in (*settings.SETTINGS, *settings.ENV_ONLY):
        assert f"`{s.env}`" in OPERATIONS, s.env
        if s.flag:
            assert f"`{s.flag}`" in OPERATIONS, s.flag
    commands = build_parser()._subparsers._group_actions[0].choices
    experiments = commands["experiments"]._subparsers._group_actions[0].choices
    for name, parser in (("migrate", commands["migrate"]), ("export", commands["export"]), *experiments.items()):
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in ("-h", "--help") or f"`{flag}`" in OPERATIONS, f"{name} {flag}"


def test_install_lines_install_from_the_checkout() -> None:
    # bots-client and bots-server are not on PyPI (yet): `pip install
    # 'bots-client[torch]'` fails; './clients/python[torch]' works.
    pages = [REPO / "README.md", REPO / "clients" / "python" / "README.md", *REPO.glob("docs/**/*.md")]
    pages += REPO.glob("examples/**/*.md")
    found = []
    for page in pages:
        text = " ".join(page.read_text().split())  # an install line may wrap
        for command in re.findall(r"`pip install [^`]*`", text):
            assert not re.search(r"\bbots-(client|server)\b", command), f"{page.relative_to(REPO)}: {command}"
            found.append(command)
    assert "`pip install './clients/python[torch]'`" in found
    assert (REPO / "clients" / "python" / "pyproject.toml").exists()


def test_every_exported_metric_is_documented(metrics_server: MetricsServer) -> None:
    families = set(re.findall(r"^# TYPE (\S+)", metrics_server.scrape(), flags=re.MULTILINE))
    ours = {f for f in families if f.startswith(("bots_", "grpc_server_"))}
    assert len(ours) > 20
    # A counter's family is named without _total; the docs use the sample name.
    missing = {f for f in ours if f"`{f}`" not in OPERATIONS and f"`{f}_total`" not in OPERATIONS}
    assert not missing, missing
