"""SIGKILL at random moments (selects, reports, checkpoints), restart, retry:
every acknowledged outcome is applied exactly once, and the final posterior
equals an uninterrupted run's, bit for bit. Also for a trainer stepping by
ReportAndSelect, against an uninterrupted run of the separate calls."""

from __future__ import annotations

from tests.support.crash import crash_run
from tests.support.servers import create_pg_database, drop_pg_database, require_postgres

KILLS = 10  # per backend: 20 kill points in the suite; `make soak` (scripts/soak.py) runs many more
# Enough steps, and kills close enough together, that all KILLS land before
# the run ends however fast a step is (a 3000-task checkpoint is one value
# since revision 0004, so a step with its checkpoint takes a few ms).
STEPS, MAX_DELAY = 120, 0.15


def test_sqlite_survives_random_kills(tmp_path) -> None:
    report = crash_run(
        f"sqlite:///{tmp_path / 'crash.db'}",
        f"sqlite:///{tmp_path / 'reference.db'}",
        kills=KILLS,
        steps=STEPS,
        max_delay=MAX_DELAY,
        seed=1,
    )
    assert report.kills == KILLS, report
    assert report.identical, report
    assert report.phases.get("select", 0) + report.phases.get("report", 0) > 0, report


def test_postgresql_survives_random_kills() -> None:
    require_postgres()
    urls = create_pg_database("bots_crash"), create_pg_database("bots_crash")
    try:
        report = crash_run(*urls, kills=KILLS, steps=STEPS, max_delay=MAX_DELAY, seed=2)
    finally:
        for url in urls:
            drop_pg_database(url)
    assert report.kills == KILLS, report
    assert report.identical, report


def test_sqlite_report_and_select_survives_random_kills(tmp_path) -> None:
    report = crash_run(
        f"sqlite:///{tmp_path / 'crash.db'}",
        f"sqlite:///{tmp_path / 'reference.db'}",
        kills=KILLS,
        steps=STEPS,
        max_delay=MAX_DELAY,
        seed=3,
        combined=True,
    )
    assert report.kills == KILLS, report
    assert report.identical, report
    assert report.phases.get("report_and_select", 0) > 0, report


def test_postgresql_report_and_select_survives_random_kills() -> None:
    require_postgres()
    urls = create_pg_database("bots_crash"), create_pg_database("bots_crash")
    try:
        report = crash_run(*urls, kills=KILLS, steps=STEPS, max_delay=MAX_DELAY, seed=4, combined=True)
    finally:
        for url in urls:
            drop_pg_database(url)
    assert report.kills == KILLS, report
    assert report.identical, report
