"""The server freezes what its start made (modules, protobuf descriptors,
the database engine): the garbage collector's full collections then skip
those objects instead of scanning them each time, some 50 ms on a 2-core
machine during which no caller is answered."""

from __future__ import annotations

from bots_server.testing.processes import ServerProcess


def test_the_objects_of_the_start_are_frozen(sqlite_server: ServerProcess) -> None:
    serving = next(e for e in sqlite_server.log_lines if e.get("message") == "serving")
    # A server's imports alone make some 60k objects the collector tracks.
    assert int(str(serving["frozen_objects"])) > 30_000
