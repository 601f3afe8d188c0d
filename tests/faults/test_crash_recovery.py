"""SIGKILL at random moments (selects, reports, checkpoints), restart, retry:
every acknowledged outcome is applied exactly once, and the final posterior
equals an uninterrupted run's, bit for bit. Also for a trainer stepping by
ReportAndSelect, against an uninterrupted run of the separate calls."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from tests.support.crash import crash_run
from tests.support.servers import create_pg_database, drop_pg_database, require_postgres

KILLS = 6  # per backend and loop: 24 kill points in the suite; `make soak` (scripts/soak.py) runs 1000
# Enough steps, and kills close enough together, that all KILLS land before
# the run ends however fast a step is (a 3000-task checkpoint is one value
# since revision 0004, so a step with its checkpoint takes a few ms: with
# kills up to 0.15 s apart, a fast machine once finished the 120 steps after 8).
STEPS, MAX_DELAY = 120, 0.05


class Loop(NamedTuple):
    """How the trainer steps: by ReportAndSelect or not, the phases its
    kills land in, and the run's seed per backend."""

    combined: bool
    phases: tuple[str, ...]
    seeds: dict[str, int]


LOOPS = {
    "separate": Loop(False, ("select", "report"), {"sqlite": 1, "postgresql": 2}),
    "report_and_select": Loop(True, ("report_and_select",), {"sqlite": 3, "postgresql": 4}),
}


@pytest.mark.parametrize("loop", LOOPS)
def test_sqlite_survives_random_kills(tmp_path, loop: str) -> None:
    report = crash_run(
        f"sqlite:///{tmp_path / 'crash.db'}",
        f"sqlite:///{tmp_path / 'reference.db'}",
        kills=KILLS,
        steps=STEPS,
        max_delay=MAX_DELAY,
        seed=LOOPS[loop].seeds["sqlite"],
        combined=LOOPS[loop].combined,
    )
    assert report.kills == KILLS, report
    assert report.identical, report
    assert sum(report.phases.get(phase, 0) for phase in LOOPS[loop].phases) > 0, report


@pytest.mark.parametrize("loop", LOOPS)
def test_postgresql_survives_random_kills(loop: str) -> None:
    require_postgres()
    urls = create_pg_database("bots_crash"), create_pg_database("bots_crash")
    try:
        seed = LOOPS[loop].seeds["postgresql"]
        report = crash_run(
            *urls, kills=KILLS, steps=STEPS, max_delay=MAX_DELAY, seed=seed, combined=LOOPS[loop].combined
        )
    finally:
        for url in urls:
            drop_pg_database(url)
    assert report.kills == KILLS, report
    assert report.identical, report
