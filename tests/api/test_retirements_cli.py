"""`bots-server tasks retire|reactivate`: by key and from a file, against a
real server; a bad key exits 1 naming it and changes nothing."""

from __future__ import annotations

import csv
import io
import uuid
from pathlib import Path

import bots_client
from bots_client import Task
from tests.api.test_server_ops import cli
from tests.support.servers import ServerProcess


def test_cli_retires_and_reactivates_by_key_and_from_a_file(server: ServerProcess, tmp_path: Path) -> None:
    name = f"cli-retire-{uuid.uuid4().hex[:8]}"
    with bots_client.Client(server.address) as client:
        client.create_experiment(name)
        client.add_tasks(name, [Task(f"t{i}") for i in range(6)])

    by_key = cli(server, "tasks", "retire", name, "t0", "t1")
    assert by_key.returncode == 0, by_key.stderr
    assert "retired 2 of 2 tasks" in by_key.stdout and "2 of 6 tasks are retired" in by_key.stdout

    listed = tmp_path / "broken.txt"
    listed.write_text("# leaked into the eval set\nt1\n\nt2\nt3\n")
    from_file = cli(server, "tasks", "retire", name, "--from-file", str(listed))
    assert from_file.returncode == 0, from_file.stderr
    assert "retired 2 of 3 tasks" in from_file.stdout and "(1 already were)" in from_file.stdout

    unknown = cli(server, "tasks", "reactivate", name, "t0", "nope")
    assert unknown.returncode == 1
    assert "INVALID_ARGUMENT" in unknown.stderr and "'nope'" in unknown.stderr

    back = cli(server, "tasks", "reactivate", name, "t0")
    assert back.returncode == 0 and "3 of 6 tasks are retired" in back.stdout, back.stderr

    exported = cli(server, "export", name, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert {r["key"] for r in rows if r["retired"] == "1"} == {"t1", "t2", "t3"}

    empty = cli(server, "tasks", "retire", name)
    assert empty.returncode == 1 and "no task keys given" in empty.stderr


def test_cli_lists_groups_and_sets_their_shares(server: ServerProcess) -> None:
    name = f"cli-groups-{uuid.uuid4().hex[:8]}"
    with bots_client.Client(server.address) as client:
        client.create_experiment(name)
        client.add_tasks(name, [Task(f"m{i}", {}, "math") for i in range(6)] + [Task(f"c{i}", {}, "code") for i in range(4)])

    shares = cli(server, "groups", "set", name, "math=0.6", "code=0.2:0.8")
    assert shares.returncode == 0, shares.stderr
    rows = {line.split()[0]: line.split() for line in shares.stdout.splitlines()[1:]}
    assert rows["math"][1:4] == ["6", "0", "0.6"] and rows["code"][1:4] == ["4", "0", "0.2:0.8"]

    bad = cli(server, "groups", "set", name, "math=0.5", "poetry=0.5")
    assert bad.returncode == 1 and "'poetry'" in bad.stderr and "INVALID_ARGUMENT" in bad.stderr

    listing = cli(server, "groups", "list", name)
    assert listing.returncode == 0 and "0.6" in listing.stdout, listing.stderr
