"""Figures and commands the documents quote cannot drift from the code:
every settings default in the operations table is the one `serve` uses,
every benchmark command the docs give parses with that benchmark's own
options, and every result file the docs cite is committed."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from bots_server import settings
from tests.support.servers import REPO

PAGES = [REPO / "README.md", *sorted(REPO.glob("docs/**/*.md")), REPO / "bench" / "README.md"]
PAGES += sorted(REPO.glob("examples/**/*.md"))


def page_text(page: Path) -> str:
    return page.read_text()


def settings_rows() -> dict[str, str]:
    """`--flag` -> the default column of docs/operations.md's settings table."""
    rows = {}
    for line in page_text(REPO / "docs" / "operations.md").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`--[a-z0-9-]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def test_every_documented_default_is_the_one_serve_uses() -> None:
    rows = settings_rows()
    checked = 0
    for s in settings.SETTINGS:
        if not s.flag or s.flag not in rows:
            continue  # test_docs.py asserts that every setting is there
        shown = rows[s.flag]
        if s.shown_default:  # computed from other settings: "--grace-seconds + 25"
            number = s.shown_default.rpartition(" ")[2]
            assert shown.endswith(f"+ {number}"), f"{s.flag}: docs say {shown}, serve uses {s.shown_default}"
        elif not s.default:
            assert shown == "(none)", (s.flag, shown)
        else:
            assert shown == f"`{s.default}`", f"{s.flag}: docs say {shown}, serve uses {s.default!r}"
        checked += 1
    assert checked > 30


def unwrapped(text: str) -> str:
    """`text` with wrapped commands on one line: an inline code span of
    prose that wraps, a line of a code block that ends in a backslash."""
    parts = re.split(r"(```.*?```)", text.replace("\\\n", " "), flags=re.DOTALL)

    def join(span: re.Match[str]) -> str:
        return span.group(0).replace("\n", " ")

    return "".join(p if p.startswith("```") else re.sub(r"`[^`]+`", join, p) for p in parts)


def bench_commands() -> list[tuple[str, str, list[str]]]:
    """(page, module, arguments) of every `python -m bench.X ...` the pages quote."""
    found = []
    for page in PAGES:
        for line in unwrapped(page_text(page)).splitlines():
            for match in re.finditer(r"python -m bench\.([a-z_]+)((?: +[^`;#|&]*)?)", line):
                module, rest = match.group(1), match.group(2).strip()
                # A synopsis: "[--backend sqlite]" is optional, "<checkout of ...>" a value to fill in.
                rest = re.sub(r"\[([^\]]*)\]", r"\1", re.sub(r"<[^>]*>", "VALUE", rest))
                found.append((str(page.relative_to(REPO)), module, shlex.split(rest.replace("$r", "1"))))
    return found


class _Parsed(Exception):
    """Raised instead of running the benchmark once its options parsed."""


def parses(module: str, arguments: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None when `python -m bench.<module> <arguments>` parses; the error otherwise."""
    original = argparse.ArgumentParser.parse_args
    errors: list[str] = []

    def parse_then_stop(self: argparse.ArgumentParser, args=None, namespace=None):  # type: ignore[no-untyped-def]
        def error(message: str) -> None:
            errors.append(message)
            raise _Parsed

        self.error = error  # type: ignore[method-assign]
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [f"bench/{module}.py", *arguments])
    monkeypatch.delitem(sys.modules, f"bench.{module}", raising=False)  # imported by another test: run it afresh
    try:
        runpy.run_module(f"bench.{module}", run_name="__main__")
    except _Parsed:
        return errors[0] if errors else None
    return "the benchmark ran without parsing its options"


COMMANDS = bench_commands()


def test_the_docs_quote_benchmark_commands() -> None:
    modules = {module for _, module, _ in COMMANDS}
    assert {"perf", "simulate", "real_learner", "loadgen", "critical_path", "fairness"} <= modules, modules


@pytest.mark.parametrize(("page", "module", "arguments"), COMMANDS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_quoted_benchmark_command_parses(
    page: str, module: str, arguments: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (REPO / "bench" / f"{module}.py").exists(), f"{page}: bench/{module}.py does not exist"
    error = parses(module, arguments, monkeypatch)
    assert error is None, f"{page}: python -m bench.{module} {shlex.join(arguments)}: {error}"


def test_every_cited_result_file_is_committed() -> None:
    missing = []
    for page in PAGES:
        for path in re.findall(r"bench/results/[A-Za-z0-9_.-]+\.(?:md|json|txt|png)", page_text(page)):
            if not (REPO / path).exists():
                missing.append(f"{page.relative_to(REPO)}: {path}")
    assert not missing, missing


def test_the_hostile_input_count_in_the_design_is_the_tests() -> None:
    from tests.api.test_hostile_input import CASES

    quoted = re.search(r"(\d+) bad requests over raw stubs", page_text(REPO / "docs" / "design.md"))
    assert quoted is not None and int(quoted.group(1)) == len(CASES), (quoted, len(CASES))
