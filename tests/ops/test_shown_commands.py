"""What the README, the client's README and the example's README show still
works and still matches: every link resolves (anchors included), every
`make` target exists, every script a command runs exists and takes the flags
shown, every `bots-server` command line parses, every BOTS_* variable is one
the code reads, the quickstart runs as the README shows it, and the
example's committed output is what the example prints now.

Written against the pages' form (code blocks, links, inline code), not their
wording, so a rewritten page is checked the same way."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bots_server import cli
from tests.integrations.conftest import need
from tests.support.servers import REPO, ServerProcess

README = REPO / "README.md"
EXAMPLE = REPO / "examples" / "grpo_curriculum"
PAGES = [README, REPO / "clients" / "python" / "README.md", EXAMPLE / "README.md"]
SHELLS = ("", "sh", "bash", "shell", "console")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def shell_commands(text: str) -> list[str]:
    """The command lines of the shell blocks (continuations joined, prompts
    and comments off) and of the inline code spans that start like one."""
    commands = []
    for language, body in code_blocks(text):
        if language in SHELLS:
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line.removeprefix("$ ")).strip()
                if line:
                    commands.append(line)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    commands += [span for span in re.findall(r"`([^`\n]+)`", prose) if re.match(r"(\S*/)?(make|python|bots-server) ", span)]
    return commands


def words(command: str) -> list[str]:
    """The words of a command, environment assignments (BOTS_DB=... make) off."""
    try:
        parts = shlex.split(command)
    except ValueError:  # an inline span cut in mid-quote
        parts = command.split()
    while parts and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", parts[0]):
        parts.pop(0)
    return parts


def all_commands() -> Iterator[tuple[Path, list[str]]]:
    for page in PAGES:
        for command in shell_commands(page.read_text()):
            yield page, words(command)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_\[\]()]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_every_link_resolves() -> None:
    checked = 0
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(REPO)}: {target} does not exist"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{page.relative_to(REPO)}: no heading #{anchor} in {path or page.name}"
            checked += 1
    assert checked >= 10


def make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.%/$()-]+)\s*:(?!=)", makefile, flags=re.MULTILINE))


def test_every_make_target_shown_exists() -> None:
    targets = make_targets()
    shown = {
        (page, word)
        for page, command in all_commands()
        if command and command[0] == "make"
        for word in command[1:]
        if not word.startswith("-") and "=" not in word
    }
    assert {"serve", "test"} <= {target for _, target in shown}, "the README shows make serve and make test"
    missing = sorted(f"{page.relative_to(REPO)}: make {target}" for page, target in shown if target not in targets)
    assert not missing, missing


def test_every_script_shown_exists_and_takes_the_flags_shown() -> None:
    runs = [(page, c) for page, c in all_commands() if c and re.fullmatch(r"(\S*/)?python3?", c[0]) and len(c) > 1]
    assert runs
    for page, command in runs:
        if command[1] == "-m" or not command[1].endswith(".py"):
            continue
        script = REPO / command[1]  # the pages' commands run in the checkout's root
        assert script.exists(), f"{page.relative_to(REPO)}: {' '.join(command)}: no {command[1]}"
        source = script.read_text()
        for flag in (w.split("=")[0] for w in command[2:] if w.startswith("--")):
            assert f'"{flag}"' in source, f"{page.relative_to(REPO)}: {command[1]} has no option {flag}"


def test_every_option_the_example_names_is_one_it_takes() -> None:
    source = (EXAMPLE / "run.py").read_text()
    prose = re.sub(r"^```.*?^```", "", (EXAMPLE / "README.md").read_text(), flags=re.MULTILINE | re.DOTALL)
    named = set(re.findall(r"`[^`]*?(--[a-z][a-z-]*)", prose)) | set(re.findall(r"`(--[a-z][a-z-]*)", prose))
    assert len(named) > 10
    unknown = sorted(flag for flag in named if f'"{flag}"' not in source and flag != "--help")
    assert not unknown, unknown


def test_every_bots_server_command_shown_parses() -> None:
    shown = [(page, c) for page, c in all_commands() if c and c[0].endswith("bots-server")]
    assert shown
    for page, command in shown:
        parser = cli.build_parser()
        where = f"{page.relative_to(REPO)}: {' '.join(command)}"
        for word in command[1:]:
            if word.startswith("-"):
                options = {o for action in parser._actions for o in action.option_strings}
                assert word.split("=")[0] in options, f"{where}: no option {word}"
                continue
            subcommands = [a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction)]
            if subcommands and word in subcommands[0].choices:
                parser = subcommands[0].choices[word]
            elif subcommands:
                pytest.fail(f"{where}: no command {word}")


def test_every_bots_variable_named_is_read_by_the_code() -> None:
    code = "\n".join(
        path.read_text()
        for root in (REPO / "server" / "bots_server", REPO / "clients" / "python" / "bots_client")
        for path in root.rglob("*.py")
    )
    code += (REPO / "Makefile").read_text()  # BOTS_* a make target passes on
    for page in PAGES:
        for name in set(re.findall(r"\bBOTS_[A-Z0-9_]*[A-Z0-9]\b", page.read_text())):
            assert re.search(rf"\b{name}\b", code), f"{page.relative_to(REPO)}: {name} is read nowhere"


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = ServerProcess(f"sqlite:///{tmp_path_factory.mktemp('shown') / 'bots.db'}").start()
    yield server.address
    server.stop()


def test_the_quickstart_runs_as_the_readme_shows_it(address: str) -> None:
    shown = [c for page, c in all_commands() if page == README and any(w.endswith("examples/quickstart.py") for w in c)]
    assert shown, "the README shows no command that runs examples/quickstart.py"
    for command in shown:
        assert re.fullmatch(r"(\.venv/bin/)?python3?", command[0]), command
        env = {**os.environ, "BOTS_SERVER": address}
        result = subprocess.run(
            [sys.executable, *command[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert re.search(r"^step \d+: ", result.stdout, flags=re.MULTILINE), result.stdout


def documented_run(markdown: str) -> tuple[list[str], list[str]]:
    """The command of the Results heading and the output block under it."""
    found = re.search(r"^## Results \([^`]*`([^`]+)`\)\n(.*?)^```\w*\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)
    assert found, "examples/grpo_curriculum/README.md: no '## Results (..., `command`)' with an output block"
    return words(found.group(1)), found.group(3).splitlines()


def comparable(lines: list[str]) -> list[str]:
    """Output lines without what varies from run to run (seconds) or from
    server to server (its address)."""
    kept = [line.rstrip() for line in lines if line.strip() and not line.startswith("BOTS server at ")]
    kept = [re.sub(r"\(\d+(\.\d+)? s\)", "(_ s)", line) for line in kept]
    return [re.sub(r"\d+(\.\d+)? s per run", "_ s per run", line) for line in kept]


def test_the_example_prints_what_its_readme_shows(tmp_path: Path) -> None:
    need("torch")
    command, documented = documented_run((EXAMPLE / "README.md").read_text())
    assert re.fullmatch(r"(\S*/)?python3?", command[0]) and command[1] == "examples/grpo_curriculum/run.py", command
    # --no-plot: the figure is not compared (nor written); the numbers are.
    result = subprocess.run(
        [sys.executable, str(REPO / command[1]), *command[2:], "--no-plot"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert comparable(result.stdout.splitlines()) == comparable(documented), result.stdout
