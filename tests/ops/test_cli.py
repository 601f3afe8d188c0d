"""The ops commands are for a person at a terminal: an unreachable server is
reported in seconds, in one line, with a non-zero exit (and so are a
server's missing database and taken port); and the default metrics port
stays clear of the monitoring stack's own ports."""

from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import bots_client
from bots_client import Task
from bots_server import cli, settings
from tests.support.servers import ServerProcess
from tests.support.timing import slack

# Ports of the Prometheus stack and its usual neighbours on a host or in a
# pod: Prometheus, Pushgateway, Alertmanager, node_exporter, Grafana, the
# OpenTelemetry collector's own metrics, and the common HTTP alternates.
TAKEN = {9090, 9091, 9093, 9094, 9100, 3000, 8888, 8889, 8080, 8000}


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound (so no other test
    takes it meanwhile) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize(
    "command", [["experiments", "list"], ["experiments", "show", "math"], ["export", "math", "--format", "csv"]]
)
def test_unreachable_server_is_reported_in_seconds(closed_port: int, command: list[str]) -> None:
    address = f"127.0.0.1:{closed_port}"
    # Interpreter and import start-up alone, the same way: on a loaded machine
    # (two pytest workers and other jobs) it has taken over 10 s by itself.
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "bots_server.cli", "--version"], capture_output=True, timeout=60)
    startup = time.monotonic() - started
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", *command, "--server", address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    # The default budget is 5 s of retries, beyond the start-up.
    assert elapsed - startup < 5 + slack(5), f"took {elapsed:.1f}s, {startup:.1f}s of it start-up"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: server {address} unavailable"), lines[0]
    assert result.stdout == ""


def test_retry_budget_is_a_setting(closed_port: int) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "experiments", "list", "--server", f"127.0.0.1:{closed_port}"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "BOTS_RETRY_SECONDS": "0"},
    )  # fmt: skip
    assert result.returncode != 0 and "unavailable after 0 s" in result.stderr
    assert time.monotonic() - started < slack(10)


def test_default_metrics_port_avoids_the_monitoring_stack() -> None:
    _host, port = settings.split_host_port(settings.ServerSettings().metrics_listen, "")
    assert port not in TAKEN
    setting = next(s for s in settings.SETTINGS if s.env == "BOTS_METRICS_LISTEN")
    assert setting.default == settings.ServerSettings().metrics_listen


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--grace-seconds", "30", "--shutdown-seconds", "10"], "--shutdown-seconds = 10 must be more than --grace-seconds = 30"),
        (["--grace-seconds", "60"], None),  # the default limit follows the grace: 85 s
        (["--grace-seconds", "-1"], "--grace-seconds = '-1' must be >= 0"),
        (["--shutdown-seconds", "0"], "--shutdown-seconds = '0' must be > 0"),
    ],
)
def test_stop_settings_are_checked_before_serving(
    flags: list[str], named: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("BOTS_GRACE_SECONDS", "BOTS_SHUTDOWN_SECONDS"):
        monkeypatch.delenv(variable, raising=False)
    parsed = cli.build_parser().parse_args(["serve", *flags])
    if named is None:
        config = settings.from_args(parsed)
        assert config.shutdown_seconds == 60 + settings.SHUTDOWN_AFTER_GRACE_SECONDS
        return
    with pytest.raises(SystemExit, match=re.escape(named)):
        settings.from_args(parsed)


@pytest.mark.parametrize(
    ("text", "limit"), [("0", 0.0), ("3", 3.0), ("45", 45.0), ("0.5", None), ("2.9", None), ("-1", None)]
)
def test_the_stall_limit_is_never_or_three_heartbeats(
    text: str, limit: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Below three heartbeats (one a second) healthy processes were killed in
    # a loop: 4 kills in 8 s at 0.5.
    monkeypatch.delenv("BOTS_PROCESS_STALL_SECONDS", raising=False)
    parsed = cli.build_parser().parse_args(["serve", "--process-stall-seconds", text])
    if limit is None:
        with pytest.raises(SystemExit, match="--process-stall-seconds"):
            settings.from_args(parsed)
        return
    assert settings.from_args(parsed).process_stall_seconds == limit


@pytest.mark.parametrize(("text", "share"), [("0", None), ("1.5", None), ("nan", None), ("0.1", 0.1), ("1", 1.0)])
def test_bulk_share_is_a_fraction(text: str, share: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BOTS_BULK_SHARE", raising=False)
    parsed = cli.build_parser().parse_args(["serve", "--bulk-share", text])
    if share is None:
        with pytest.raises(SystemExit, match=re.escape(f"--bulk-share = {text!r} must be in (0, 1]")):
            settings.from_args(parsed)
    else:
        assert settings.from_args(parsed).bulk_share == share


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "serve", "--metrics-listen", "", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("processes", ["1", "2"])  # one server, or a supervisor of two
@pytest.mark.parametrize("database", ["missing", "unreachable"])
def test_serve_without_its_database_ends_in_one_line(database: str, processes: str, request: pytest.FixtureRequest) -> None:
    if database == "missing":
        url = request.getfixturevalue("pg_url").rsplit("/", 1)[0] + "/does_not_exist_xyz"
    else:
        url = "postgresql+psycopg://postgres@127.0.0.1:1/none"  # port 1 on loopback: refused at once
    result = serve("--db", url, "--listen", "127.0.0.1:0", "--processes", processes)
    assert result.returncode == 1
    # `migrate`'s line, not the driver's chained tracebacks (nor a supervisor
    # starting its processes again forever).
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: database unavailable: "), lines[0]
    assert ("does_not_exist_xyz" if database == "missing" else "port 1") in lines[0]


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])  # one server; a supervisor of two
def test_serve_on_a_port_in_use_says_so_in_one_line(database: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}" if database == "sqlite" else request.getfixturevalue("pg_url")
    processes = "1" if database == "sqlite" else "2"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"127.0.0.1:{held.getsockname()[1]}"
        result = serve("--db", url, "--listen", address, "--processes", processes)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"bots-server: cannot listen on {address}: Address already in use"]
    assert list(tmp_path.iterdir()) == []  # the start created no database file (nor left an empty one)


def test_a_refused_listen_keeps_an_existing_database(tmp_path: Path) -> None:
    path = tmp_path / "kept.db"
    migrated = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "migrate", "--db", f"sqlite:///{path}"], capture_output=True, timeout=120
    )
    assert migrated.returncode == 0, migrated.stderr
    before = path.read_bytes()
    empty = tmp_path / "empty.db"
    empty.touch()  # an empty file is an empty SQLite database: the operator's, kept
    for database in (path, empty):
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            result = serve("--db", f"sqlite:///{database}", "--listen", f"127.0.0.1:{held.getsockname()[1]}")
        assert result.returncode == 1 and "cannot listen" in result.stderr, result.stderr
    assert path.read_bytes() == before
    assert empty.exists() and empty.stat().st_size == 0


def test_export_into_head_stops_quietly(sqlite_server: ServerProcess) -> None:
    name = f"head-{uuid.uuid4().hex[:8]}"
    with bots_client.Client(sqlite_server.address) as client:
        client.create_experiment(name)
        # Far more CSV than a pipe buffers (64 KiB): the export is still
        # writing when the reader goes away.
        client.add_tasks(name, [Task(f"task-{i:06d}") for i in range(20_000)])
    export = subprocess.Popen(
        [sys.executable, "-m", "bots_server.cli", "export", name, "--server", sqlite_server.address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert export.stdout is not None and export.stderr is not None
    first = export.stdout.readline()  # what `| head -1` does: one line, then close
    export.stdout.close()
    stderr = export.stderr.read()
    # 141 = 128 + SIGPIPE: what the shell reports for `cat big | head -1`'s
    # cat, so `set -o pipefail` still sees the output was cut short; no
    # traceback and no message.
    assert export.wait(60) == cli.EXIT_BROKEN_PIPE == 141
    assert first == b"key,alpha,beta,mean,retired\r\n"
    assert stderr == b""


def _subcommands(parser: argparse.ArgumentParser, path: str = "bots-server") -> Iterator[tuple[str, str | None, argparse.ArgumentParser]]:
    """(command line, its help, its parser) of every subcommand, nested ones too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", helps.get(name), sub
                yield from _subcommands(sub, f"{path} {name}")


def test_every_subcommand_and_argument_has_a_help_string() -> None:
    commands = list(_subcommands(cli.build_parser()))
    assert len(commands) >= 14
    for command, text, parser in commands:
        assert text, f"{command}: no help"
        for action in parser._actions:
            assert action.help or isinstance(action, argparse._SubParsersAction), f"{command} {action.dest}: no help"
    # What a person sees: each subcommand listed with its description.
    shown = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "experiments", "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0
    assert re.search(r"^ +list +\S", shown.stdout, flags=re.MULTILINE), shown.stdout
    assert re.search(r"^ +show +\S", shown.stdout, flags=re.MULTILINE), shown.stdout


def test_every_help_of_a_command_that_calls_a_server_names_its_variables() -> None:
    parser = cli.build_parser()
    callers = [(c, p) for c, _, p in _subcommands(parser) if any("--server" in a.option_strings for a in p._actions)]
    assert len(callers) >= 7  # experiments list/show, export, tasks retire/reactivate, groups list/set
    for command, sub in [("bots-server", parser), *callers]:
        text = " ".join(sub.format_help().split())
        for variable in ("BOTS_SERVER", "BOTS_TOKEN"):
            assert variable in text, f"{command} --help does not name {variable}"
    shown = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "export", "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "BOTS_TOKEN (the bearer token" in " ".join(shown.stdout.split())


def test_serve_help_gives_the_real_shutdown_default() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "bots_server.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0
    text = " ".join(shown.stdout.split())
    entry = text[text.index("--shutdown-seconds SHUTDOWN_SECONDS") :].split(" --workers ")[0]
    assert entry.endswith(f"(env BOTS_SHUTDOWN_SECONDS; default --grace-seconds + {settings.SHUTDOWN_AFTER_GRACE_SECONDS:g})")


def test_an_export_that_cannot_be_written_says_so_and_keeps_the_earlier_file(
    sqlite_server: ServerProcess, tmp_path: Path
) -> None:
    # A full disk (here: a file-size limit, EFBIG, as ENOSPC would be) left a
    # cut file over a good earlier export and a traceback; /dev/full too.
    name = f"full-{uuid.uuid4().hex[:8]}"
    with bots_client.Client(sqlite_server.address) as client:
        client.create_experiment(name)
        client.add_tasks(name, [Task(f"task-{i:06d}") for i in range(5_000)])
    command = [sys.executable, "-m", "bots_server.cli", "export", name, "--server", sqlite_server.address]
    good = tmp_path / "posterior.csv"
    assert subprocess.run([*command, "--output", str(good)], capture_output=True, timeout=60).returncode == 0
    before = good.read_bytes()
    assert len(before) > 64 * 1024

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))

    full = subprocess.run(
        [*command, "--output", str(good)], capture_output=True, text=True, timeout=60, preexec_fn=small_files
    )
    assert full.returncode == 1
    assert full.stderr == f"error: {good}: File too large\n", full.stderr
    assert good.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["posterior.csv"]
    # Its mode is kept; a symlink stays a link to the file it names; a FIFO
    # (or a device) is written through.
    good.chmod(0o640)
    link = tmp_path / "latest.csv"
    link.symlink_to(good)
    assert subprocess.run([*command, "--output", str(link)], capture_output=True, timeout=60).returncode == 0
    assert link.is_symlink() and good.stat().st_mode & 0o777 == 0o640 and good.read_bytes() == before
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    assert subprocess.run([*command, "--output", str(fifo)], capture_output=True, timeout=60).returncode == 0
    assert reader.communicate(timeout=60)[0] == before and fifo.exists() and not fifo.is_file()
    with open("/dev/full", "w") as device:
        to_device = subprocess.run(command, stdout=device, stderr=subprocess.PIPE, text=True, timeout=60)
    assert to_device.returncode == 1
    assert to_device.stderr.strip() == "error: cannot write standard output: No space left on device"
