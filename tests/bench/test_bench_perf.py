"""The performance benchmark's parts run end to end on a tiny pool and
measure what they claim (bench/perf.py)."""

from __future__ import annotations

import dataclasses

from bench import common, perf

TINY = dataclasses.replace(
    perf.PerfConfig(),
    backends=("sqlite",),
    pools=(2000,),
    batch_size=16,
    steps=((2000, 6),),
    engine_steps=3,
    crash_steps=3,
    throughput_levels=(1, 2),
    throughput_pool=500,
    throughput_seconds=1.0,
    breakdown_pool=2000,
    breakdown_steps=3,
    history_batches=(0, 20),
)


def test_engine_baseline() -> None:
    e = perf.engine_baseline(2000, 16, 3)
    assert e["step"]["n"] == 3
    assert e["select"]["p50"] > 0 and e["update"]["p50"] > 0


def test_socket_run_measures_latency_rows_restart_and_memory() -> None:
    with common.database("sqlite") as url:
        r = perf.socket_run("sqlite", url, 2000, TINY)
    assert r["select"]["n"] == r["report"]["n"] == 6
    # a step's row and its outcomes as one value; a batch's row and its tasks as one value
    assert r["rows_inserted_per_step"] == {"steps": 1.0, "step_outcomes": 1.0, "batches": 1.0, "batch_task_lists": 1.0}
    assert r["server_wchar_per_report"] > 0
    assert r["restart"]["replayed_steps"] == 0  # a graceful stop checkpoints
    assert r["crash_restart"]["replayed_steps"] == TINY.crash_steps
    assert r["restart"]["rss_loaded"] > 0


def test_throughput_breakdown_history_and_tables() -> None:
    result = {
        "machine": common.machine_info(),
        "engine": [{"pool": 2000, **perf.engine_baseline(2000, 16, 3)}],
        "socket": [],
    }
    with common.database("sqlite") as url:
        t = perf.throughput_run("sqlite", url, TINY)
    assert [(lv["experiments"], lv["step_kind"]) for lv in t["levels"]] == [
        (1, "separate"), (1, "combined"), (2, "separate"), (2, "combined")
    ]
    assert all(lv["steps"] > 0 and lv["cycle"]["n"] == lv["steps"] and not lv["errors"] for lv in t["levels"])
    # The event loop thread is one of the server's threads: part of its CPU.
    assert all(0 < lv["loop_thread_cpu_share"] <= lv["server_cpu_share"] + 0.02 for lv in t["levels"])
    with common.database("sqlite") as url:
        b = perf.breakdown_run("sqlite", url, TINY)
    inserted = {phase: {k: v for k, v in b[phase]["rows_per_call"].items() if k.startswith("INSERT")} for phase in ("report", "select")}
    assert inserted == {
        "report": {"INSERT steps": 1, "INSERT step_outcomes": 1},
        "select": {"INSERT batches": 1, "INSERT batch_task_lists": 1},
    }
    assert b["report"]["parts_ms"]["commit_report"] > 0
    with common.database("sqlite") as url:
        h = perf.history_probe("sqlite", url, TINY)
    assert [p["reported_batches"] for p in h["points"]] == [0, 20]
    result.update(throughput=[t], breakdown=[b], history=[h])
    text = perf.tables(result)
    assert "Throughput" in text and "In-process breakdown" in text and "Lease query" in text


def test_interleaved_run_alternates_the_reference_step_with_the_socket_calls() -> None:
    with common.database("sqlite") as url:
        r = perf.interleaved_run("sqlite", url, 2000, TINY)
    assert r["round_trip"]["n"] == r["combined_round_trip"]["n"] == r["reference_step"]["n"] == 6
    assert r["ratio_p50"] == r["round_trip"]["p50"] / r["reference_step"]["p50"]
    assert r["combined_ratio_p50"] == r["combined_round_trip"]["p50"] / r["reference_step"]["p50"]
    assert r["server_cpu_ms_per_step"] >= 0 and r["combined_server_cpu_ms_per_step"] >= 0
    assert r["server_cpu_ms_per_step"] + r["combined_server_cpu_ms_per_step"] > 0
    table = "\n".join(perf._interleaved_table([r, r]))
    assert "| sqlite | 2,000 | separate | 2 x 6 |" in table and "| sqlite | 2,000 | combined | 2 x 6 |" in table


def test_throughput_of_one_server_with_several_processes() -> None:
    from tests.support.servers import require_postgres

    require_postgres()
    # The loops run in two client processes of the bench, as for a server of many cores.
    cfg = dataclasses.replace(TINY, throughput_replicas=(1,), throughput_processes=(2,), throughput_levels=(4,),
                              throughput_steps=("combined",), throughput_clients=2)  # fmt: skip
    with common.database("postgresql") as url:
        t = perf.throughput_run("postgresql", url, cfg)
    assert [(lv["replicas"], lv["processes"]) for lv in t["levels"]] == [(1, 1), (1, 2)]
    assert all(lv["steps"] > 0 and not lv["errors"] for lv in t["levels"])
    assert [lv["client_processes"] for lv in t["levels"]] == [2, 2]
    assert all(lv["client_cpu_share"] > 0.01 for lv in t["levels"])
    # The CPU of the supervisor's processes is counted, not the supervisor's alone.
    assert t["levels"][1]["server_cpu_share"] > 0.1
    supervisor, *processes = t["levels"][1]["server_cpu_share_by_process"]
    assert len(processes) == 2 and sum(processes) > supervisor
