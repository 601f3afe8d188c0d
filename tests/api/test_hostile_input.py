"""Hostile input over raw stubs (no client-side checks): every RPC, on both
backends, in-process and over a socket. Each bad request must get the right
status with a short message naming the problem, and change nothing: the
experiment's snapshot and the list of experiments are compared before and
after every case."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from tests.api.conftest import Endpoint

Code = grpc.StatusCode
NAN, INF = float("nan"), float("inf")
SERVICE = "/bots.v1.TaskSelector/"
# An error message must fit easily in a client's metadata (8 KB by default).
MAX_MESSAGE = 2048


@dataclass(frozen=True)
class Case:
    id: str
    rpc: str  # the stub method, or "raw:Method" for undecodable bytes
    request: Callable[[str], Any]  # experiment name -> request (a list for client streams)
    code: Code
    fragment: str


def cfg(**values: Any) -> pb.ExperimentConfig:
    return pb.ExperimentConfig(**values)


def create(config: pb.ExperimentConfig, name: str = "") -> Callable[[str], Any]:
    return lambda exp: pb.CreateExperimentRequest(name=name or f"new-{uuid.uuid4().hex[:8]}", config=config)


def add(*chunks: pb.AddTasksRequest) -> Callable[[str], Any]:
    def build(exp: str) -> list[pb.AddTasksRequest]:
        out = [pb.AddTasksRequest() for _ in chunks]
        for o, c in zip(out, chunks, strict=True):
            o.CopyFrom(c)
        if out[0].experiment == "EXP":  # the experiment under test
            out[0].experiment = exp
        return out

    return build


def tasks(*keys: str, **features: float) -> list[pb.Task]:
    return [pb.Task(key=k, features=features) for k in keys]


def restore(first: dict[str, Any], *more: dict[str, Any]) -> Callable[[str], Any]:
    def build(exp: str) -> list[pb.RestoreExperimentRequest]:
        base = {"name": f"restored-{uuid.uuid4().hex[:8]}", "step": 3}
        return [pb.RestoreExperimentRequest(**{**base, **first})] + [pb.RestoreExperimentRequest(**m) for m in more]

    return build


def one(key: str = "r0", a: float = 1.0, b: float = 2.0, f: dict[str, float] | None = None) -> dict[str, Any]:
    return {"keys": [key], "alpha": [a], "beta": [b], "features": [pb.Features(values=f or {})]}


def select(size: int = 2, key: str = "k", exp: str | None = None) -> Callable[[str], Any]:
    return lambda e: pb.SelectBatchRequest(experiment=e if exp is None else exp, batch_size=size, request_key=key)


Reported = tuple[str, float, int] | tuple[str, float, int, float]  # key, successes, trials[, sum_squares]


def outcome(reported: Reported, key: str | None = None) -> pb.Outcome:
    message = pb.Outcome(key=reported[0] if key is None else key, successes=reported[1], trials=reported[2])
    if len(reported) == 4:
        message.sum_squares = reported[3]
    return message


def report(batch: str | None, *outcomes: Reported) -> Callable[[str], Any]:
    """batch None: the experiment's reported batch (looked up by the fixture)."""
    return lambda e: pb.ReportOutcomesRequest(
        experiment=e, batch_id=BATCHES[e] if batch is None else batch, outcomes=[outcome(o) for o in outcomes]
    )


def report_and_select(
    batch: str | None, *outcomes: Reported, size: int = 2, key: str = "k", exp: str | None = None
) -> Callable[[str], Any]:
    """batch None: the experiment's open batch; REPORTED: its reported batch,
    with the outcomes it was reported with unless others are given. A key
    IN_OPEN: a task of the open batch."""

    def build(e: str) -> pb.ReportAndSelectRequest:
        request = pb.ReportAndSelectRequest(experiment=e if exp is None else exp, batch_size=size, request_key=key)
        if batch == REPORTED and not outcomes:
            request.batch_id = REPORTS[e].batch_id
            request.outcomes.extend(REPORTS[e].outcomes)
        else:
            request.batch_id = {None: BATCHES.get(e, ""), REPORTED: REPORTS[e].batch_id}.get(batch, batch or "")
            request.outcomes.extend(outcome(o, OPEN_KEYS[e][0] if o[0] == IN_OPEN else None) for o in outcomes)
        return request

    return build


REPORTED = "REPORTED"
IN_OPEN = "IN_OPEN"
OPEN_KEYS: dict[str, list[str]] = {}  # experiment -> its open batch's task keys
BATCHES: dict[str, str] = {}  # experiment -> its open batch's id
REPORTS: dict[str, pb.ReportOutcomesRequest] = {}  # experiment -> the report of its reported batch
LONG = "x" * 1_000_000

CASES = [
    # -- CreateExperiment ------------------------------------------------------
    Case("create-empty-name", "CreateExperiment", lambda e: pb.CreateExperimentRequest(name=""), Code.INVALID_ARGUMENT, "experiment name"),
    Case("create-nul-name", "CreateExperiment", create(cfg(), "a\x00b"), Code.INVALID_ARGUMENT, "is invalid"),
    Case("create-long-name", "CreateExperiment", create(cfg(), "a" * 129), Code.INVALID_ARGUMENT, "is invalid"),
    Case("create-megabyte-name", "CreateExperiment", create(cfg(), LONG), Code.INVALID_ARGUMENT, "is invalid"),
    Case("create-space-name", "CreateExperiment", create(cfg(), "a b"), Code.INVALID_ARGUMENT, "is invalid"),
    Case("create-unicode-name", "CreateExperiment", create(cfg(), "exp-é"), Code.INVALID_ARGUMENT, "is invalid"),
    Case("create-dash-first", "CreateExperiment", create(cfg(), "-exp"), Code.INVALID_ARGUMENT, "is invalid"),
    Case("create-exists", "CreateExperiment", lambda e: pb.CreateExperimentRequest(name=e), Code.ALREADY_EXISTS, "already exists"),
    Case("target-above-1", "CreateExperiment", create(cfg(target_success=1.5)), Code.INVALID_ARGUMENT, "target_success"),
    Case("target-negative", "CreateExperiment", create(cfg(target_success=-0.1)), Code.INVALID_ARGUMENT, "target_success"),
    Case("target-nan", "CreateExperiment", create(cfg(target_success=NAN)), Code.INVALID_ARGUMENT, "target_success"),
    Case("forgetting-above-1", "CreateExperiment", create(cfg(forgetting=1.1)), Code.INVALID_ARGUMENT, "forgetting"),
    Case("forgetting-inf", "CreateExperiment", create(cfg(forgetting=-INF)), Code.INVALID_ARGUMENT, "forgetting"),
    Case("implicit-above-1", "CreateExperiment", create(cfg(implicit_weight=2.0)), Code.INVALID_ARGUMENT, "implicit_weight"),
    Case("implicit-nan", "CreateExperiment", create(cfg(implicit_weight=NAN)), Code.INVALID_ARGUMENT, "implicit_weight"),
    Case("rollouts-zero", "CreateExperiment", create(cfg(rollouts_per_task=0)), Code.INVALID_ARGUMENT, "rollouts_per_task"),
    Case("rollouts-huge", "CreateExperiment", create(cfg(rollouts_per_task=2**32 - 1)), Code.INVALID_ARGUMENT, "rollouts_per_task"),
    Case("temperature-zero", "CreateExperiment", create(cfg(temperature=0.0)), Code.INVALID_ARGUMENT, "temperature"),
    Case("temperature-inf", "CreateExperiment", create(cfg(temperature=INF)), Code.INVALID_ARGUMENT, "temperature"),
    Case("prior-alpha-zero", "CreateExperiment", create(cfg(prior_alpha=0.0)), Code.INVALID_ARGUMENT, "prior_alpha"),
    Case("prior-alpha-nan", "CreateExperiment", create(cfg(prior_alpha=NAN)), Code.INVALID_ARGUMENT, "prior_alpha"),
    Case("prior-beta-negative", "CreateExperiment", create(cfg(prior_beta=-1.0)), Code.INVALID_ARGUMENT, "prior_beta"),
    Case("prior-beta-inf", "CreateExperiment", create(cfg(prior_beta=INF)), Code.INVALID_ARGUMENT, "prior_beta"),
    Case("seed-2^63", "CreateExperiment", create(cfg(seed=2**63)), Code.INVALID_ARGUMENT, "seed"),
    Case("seed-2^64-1", "CreateExperiment", create(cfg(seed=2**64 - 1)), Code.INVALID_ARGUMENT, "seed"),
    Case("lease-zero", "CreateExperiment", create(cfg(lease_ttl_seconds=0.0)), Code.INVALID_ARGUMENT, "lease_ttl_seconds"),
    Case("lease-1e12", "CreateExperiment", create(cfg(lease_ttl_seconds=1e12)), Code.INVALID_ARGUMENT, "lease_ttl_seconds"),
    Case("lease-nan", "CreateExperiment", create(cfg(lease_ttl_seconds=NAN)), Code.INVALID_ARGUMENT, "lease_ttl_seconds"),
    Case("ema-above-1", "CreateExperiment", create(cfg(capability_ema=1.5)), Code.INVALID_ARGUMENT, "capability_ema"),
    Case("weak-without-strong", "CreateExperiment", create(cfg(weak_feature="w")), Code.INVALID_ARGUMENT, "set both"),
    Case("strong-without-weak", "CreateExperiment", create(cfg(strong_feature="s")), Code.INVALID_ARGUMENT, "set both"),
    Case("weak-equals-strong", "CreateExperiment", create(cfg(weak_feature="w", strong_feature="w")), Code.INVALID_ARGUMENT, "both 'w'"),
    Case("feature-quote", "CreateExperiment", create(cfg(weak_feature='w"', strong_feature="s")), Code.INVALID_ARGUMENT, "printable ASCII"),
    Case("feature-backslash", "CreateExperiment", create(cfg(weak_feature="w\\", strong_feature="s")), Code.INVALID_ARGUMENT, "printable ASCII"),
    Case("feature-nul", "CreateExperiment", create(cfg(weak_feature="w\x00", strong_feature="s")), Code.INVALID_ARGUMENT, "NUL"),
    Case("feature-long", "CreateExperiment", create(cfg(weak_feature="w" * 257, strong_feature="s")), Code.INVALID_ARGUMENT, "longer than 256"),
    Case("strategy-99", "CreateExperiment", create(cfg(strategy=99)), Code.INVALID_ARGUMENT, "strategy enum value 99"),
    Case("mode-42", "CreateExperiment", create(cfg(selection_mode=42)), Code.INVALID_ARGUMENT, "selection_mode enum value 42"),
    Case("stream-0", "CreateExperiment", create(cfg(random_stream=0)), Code.INVALID_ARGUMENT, "random_stream = 0"),
    # -- GetExperiment, ListExperiments, DeleteExperiment, Snapshot ---------------
    Case("get-nul", "GetExperiment", lambda e: pb.GetExperimentRequest(name=e + "\x00"), Code.INVALID_ARGUMENT, "is invalid"),
    Case("get-megabyte", "GetExperiment", lambda e: pb.GetExperimentRequest(name=LONG), Code.INVALID_ARGUMENT, "is invalid"),
    Case("get-unknown", "GetExperiment", lambda e: pb.GetExperimentRequest(name="no-such-exp"), Code.NOT_FOUND, "no-such-exp"),
    Case("list-page-1001", "ListExperiments", lambda e: pb.ListExperimentsRequest(page_size=1001), Code.INVALID_ARGUMENT, "page_size"),
    Case("list-page-max", "ListExperiments", lambda e: pb.ListExperimentsRequest(page_size=2**32 - 1), Code.INVALID_ARGUMENT, "page_size"),
    Case("list-token-nul", "ListExperiments", lambda e: pb.ListExperimentsRequest(page_token="a\x00"), Code.INVALID_ARGUMENT, "NUL"),
    Case("list-token-long", "ListExperiments", lambda e: pb.ListExperimentsRequest(page_token=LONG), Code.INVALID_ARGUMENT, "page_token"),
    Case("delete-nul", "DeleteExperiment", lambda e: pb.DeleteExperimentRequest(name=e + "\x00"), Code.INVALID_ARGUMENT, "is invalid"),
    Case("delete-empty", "DeleteExperiment", lambda e: pb.DeleteExperimentRequest(name=""), Code.INVALID_ARGUMENT, "is invalid"),
    Case("delete-unknown", "DeleteExperiment", lambda e: pb.DeleteExperimentRequest(name="no-such-exp"), Code.NOT_FOUND, "not found"),
    Case("snapshot-unknown", "Snapshot", lambda e: pb.SnapshotRequest(experiment="no-such-exp"), Code.NOT_FOUND, "not found"),
    Case("snapshot-nul", "Snapshot", lambda e: pb.SnapshotRequest(experiment="a\x00"), Code.INVALID_ARGUMENT, "is invalid"),
    Case("snapshot-megabyte", "Snapshot", lambda e: pb.SnapshotRequest(experiment=LONG), Code.INVALID_ARGUMENT, "is invalid"),
    # -- ForkExperiment ------------------------------------------------------------
    Case("fork-source-nul", "ForkExperiment", lambda e: pb.ForkExperimentRequest(source=e + "\x00", name="f1"), Code.INVALID_ARGUMENT, "source experiment name"),
    Case("fork-source-empty", "ForkExperiment", lambda e: pb.ForkExperimentRequest(source="", name="f1"), Code.INVALID_ARGUMENT, "source experiment name"),
    Case("fork-name-invalid", "ForkExperiment", lambda e: pb.ForkExperimentRequest(source=e, name="a b"), Code.INVALID_ARGUMENT, "is invalid"),
    Case("fork-unknown-source", "ForkExperiment", lambda e: pb.ForkExperimentRequest(source="no-such-exp", name="f2"), Code.NOT_FOUND, "not found"),
    Case("fork-onto-itself", "ForkExperiment", lambda e: pb.ForkExperimentRequest(source=e, name=e), Code.ALREADY_EXISTS, "already exists"),
    Case("fork-bad-config", "ForkExperiment", lambda e: pb.ForkExperimentRequest(source=e, name="f3", config=cfg(forgetting=2.0)), Code.INVALID_ARGUMENT, "forgetting"),
    # -- RestoreExperiment ---------------------------------------------------------
    Case("restore-empty-stream", "RestoreExperiment", lambda e: [], Code.INVALID_ARGUMENT, "empty stream"),
    Case("restore-no-name", "RestoreExperiment", restore({"name": "", **one()}), Code.INVALID_ARGUMENT, "must name"),
    Case("restore-bad-name", "RestoreExperiment", restore({"name": "a\x00", **one()}), Code.INVALID_ARGUMENT, "is invalid"),
    Case("restore-existing-name", "RestoreExperiment", lambda e: [pb.RestoreExperimentRequest(name=e, **one())], Code.ALREADY_EXISTS, "already exists"),
    Case("restore-lengths-differ", "RestoreExperiment", restore({"keys": ["a", "b"], "alpha": [1.0], "beta": [1.0, 1.0], "features": [pb.Features(), pb.Features()]}), Code.INVALID_ARGUMENT, "differ in length"),
    Case("restore-alpha-zero", "RestoreExperiment", restore(one(a=0.0)), Code.INVALID_ARGUMENT, "alpha"),
    Case("restore-alpha-nan", "RestoreExperiment", restore(one(a=NAN)), Code.INVALID_ARGUMENT, "alpha"),
    Case("restore-beta-negative", "RestoreExperiment", restore(one(b=-1.0)), Code.INVALID_ARGUMENT, "beta"),
    Case("restore-beta-inf", "RestoreExperiment", restore(one(b=INF)), Code.INVALID_ARGUMENT, "beta"),
    Case("restore-step-2^63", "RestoreExperiment", restore({**one(), "step": 2**63}), Code.INVALID_ARGUMENT, "step"),
    Case("restore-step-2^64-1", "RestoreExperiment", restore({**one(), "step": 2**64 - 1}), Code.INVALID_ARGUMENT, "step"),
    Case("restore-capability-nan", "RestoreExperiment", restore({**one(), "capability": NAN}), Code.INVALID_ARGUMENT, "capability"),
    Case("restore-source-nul", "RestoreExperiment", restore({**one(), "source": "s\x00"}), Code.INVALID_ARGUMENT, "restore source"),
    Case("restore-source-long", "RestoreExperiment", restore({**one(), "source": "s" * 257}), Code.INVALID_ARGUMENT, "restore source"),
    Case("restore-key-nul", "RestoreExperiment", restore(one(key="k\x00")), Code.INVALID_ARGUMENT, "NUL"),
    Case("restore-key-empty", "RestoreExperiment", restore(one(key="")), Code.INVALID_ARGUMENT, "empty key"),
    Case("restore-duplicate-keys", "RestoreExperiment", restore(one(key="d"), one(key="d")), Code.INVALID_ARGUMENT, "more than once"),
    Case("restore-feature-nan", "RestoreExperiment", restore(one(f={"x": NAN})), Code.INVALID_ARGUMENT, "not finite"),
    Case("restore-feature-name-nul", "RestoreExperiment", restore(one(f={"x\x00": 1.0})), Code.INVALID_ARGUMENT, "NUL"),
    Case("restore-too-many-features", "RestoreExperiment", restore(one(f={f"f{i}": 1.0 for i in range(65)})), Code.INVALID_ARGUMENT, "at most 64"),
    Case("restore-cut-short", "RestoreExperiment", restore({**one(), "total_tasks": 2}), Code.INVALID_ARGUMENT, "announced 2"),
    Case("restore-bad-config", "RestoreExperiment", restore({**one(), "config": cfg(prior_beta=0.0)}), Code.INVALID_ARGUMENT, "prior_beta"),
    # -- AddTasks ----------------------------------------------------------------
    Case("add-empty-stream", "AddTasks", lambda e: [], Code.INVALID_ARGUMENT, "empty stream"),
    Case("add-no-experiment", "AddTasks", add(pb.AddTasksRequest(tasks=tasks("n1"))), Code.INVALID_ARGUMENT, "must name"),
    Case("add-other-experiment", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1")), pb.AddTasksRequest(experiment="other", tasks=tasks("n2"))), Code.INVALID_ARGUMENT, "after"),
    Case("add-unknown-experiment", "AddTasks", lambda e: [pb.AddTasksRequest(experiment="no-such-exp", tasks=tasks("n1"))], Code.NOT_FOUND, "not found"),
    Case("add-no-tasks", "AddTasks", add(pb.AddTasksRequest(experiment="EXP")), Code.INVALID_ARGUMENT, "no tasks"),
    Case("add-key-nul", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n\x00"))), Code.INVALID_ARGUMENT, "NUL"),
    Case("add-key-empty", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1", ""))), Code.INVALID_ARGUMENT, "empty key"),
    Case("add-key-long", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("k" * 1025))), Code.INVALID_ARGUMENT, "longer than 1024"),
    Case("add-key-megabyte", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("k" * 1_000_000))), Code.INVALID_ARGUMENT, "longer than 1024"),
    Case("add-duplicate-keys", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1", "n1"))), Code.INVALID_ARGUMENT, "more than once"),
    Case("add-existing-key", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1", "t0"))), Code.ALREADY_EXISTS, "'t0'"),
    Case("add-feature-nan", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1", x=NAN))), Code.INVALID_ARGUMENT, "not finite"),
    Case("add-feature-inf", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1", x=INF))), Code.INVALID_ARGUMENT, "not finite"),
    Case("add-weak-above-1", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1", weak=1.5))), Code.INVALID_ARGUMENT, "outside [0, 1]"),
    Case("add-strong-negative", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1", strong=-0.5))), Code.INVALID_ARGUMENT, "outside [0, 1]"),
    Case("add-feature-name-nul", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=[pb.Task(key="n1", features={"a\x00": 1.0})])), Code.INVALID_ARGUMENT, "NUL"),
    Case("add-feature-name-empty", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=[pb.Task(key="n1", features={"": 1.0})])), Code.INVALID_ARGUMENT, "feature name is empty"),
    Case("add-too-many-features", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=[pb.Task(key="n1", features={f"f{i}": 1.0 for i in range(65)})])), Code.INVALID_ARGUMENT, "at most 64"),
    Case("add-cut-short", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1"), total_tasks=3)), Code.INVALID_ARGUMENT, "announced 3"),
    Case("add-more-than-announced", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=tasks("n1", "n2"), total_tasks=1)), Code.INVALID_ARGUMENT, "announced 1"),
    # -- SelectBatch -------------------------------------------------------------
    Case("select-size-zero", "SelectBatch", select(size=0), Code.INVALID_ARGUMENT, "batch_size"),
    Case("select-larger-than-pool", "SelectBatch", select(size=11), Code.INVALID_ARGUMENT, "larger than the pool"),
    Case("select-size-max", "SelectBatch", select(size=2**32 - 1), Code.INVALID_ARGUMENT, "larger than the pool"),
    Case("select-more-than-free", "SelectBatch", select(size=8), Code.FAILED_PRECONDITION, "are free"),
    Case("select-key-nul", "SelectBatch", select(key="k\x00"), Code.INVALID_ARGUMENT, "NUL"),
    Case("select-key-long", "SelectBatch", select(key="k" * 257), Code.INVALID_ARGUMENT, "longer than 256"),
    Case("select-key-megabyte", "SelectBatch", select(key=LONG), Code.INVALID_ARGUMENT, "longer than 256"),
    Case("select-key-other-size", "SelectBatch", select(size=2, key="open"), Code.FAILED_PRECONDITION, "already used"),
    Case("select-unknown-experiment", "SelectBatch", select(exp="no-such-exp"), Code.NOT_FOUND, "not found"),
    Case("select-experiment-nul", "SelectBatch", select(exp="a\x00"), Code.INVALID_ARGUMENT, "is invalid"),
    # -- ReportOutcomes ----------------------------------------------------------
    Case("report-empty-batch-id", "ReportOutcomes", report("", ("t0", 1, 2)), Code.INVALID_ARGUMENT, "batch_id is empty"),
    Case("report-batch-id-nul", "ReportOutcomes", report("b\x00", ("t0", 1, 2)), Code.INVALID_ARGUMENT, "NUL"),
    Case("report-batch-id-long", "ReportOutcomes", report("b" * 65, ("t0", 1, 2)), Code.INVALID_ARGUMENT, "longer than 64"),
    Case("report-unknown-batch", "ReportOutcomes", report("no-such-batch", ("t0", 1, 2)), Code.NOT_FOUND, "no-such-batch"),
    Case("report-no-outcomes", "ReportOutcomes", report(None), Code.INVALID_ARGUMENT, "no outcomes"),
    Case("report-key-nul", "ReportOutcomes", report(None, ("t\x00", 1, 2)), Code.INVALID_ARGUMENT, "NUL"),
    Case("report-key-megabyte", "ReportOutcomes", report(None, (LONG, 1, 2)), Code.INVALID_ARGUMENT, "longer than 1024"),
    Case("report-unknown-task", "ReportOutcomes", report(None, ("ghost", 1, 2)), Code.INVALID_ARGUMENT, "'ghost' is not in experiment"),
    Case("report-duplicate-key", "ReportOutcomes", report(None, ("t0", 1, 2), ("t0", 1, 2)), Code.INVALID_ARGUMENT, "more than once"),
    Case("report-trials-zero", "ReportOutcomes", report(None, ("t0", 0, 0)), Code.INVALID_ARGUMENT, "trials = 0"),
    Case("report-trials-2^32-1", "ReportOutcomes", report(None, ("t0", 1, 2**32 - 1)), Code.INVALID_ARGUMENT, "trials = 4294967295"),
    Case("report-successes-above-trials", "ReportOutcomes", report(None, ("t0", 3, 2)), Code.INVALID_ARGUMENT, "successes = 3.0"),
    Case("report-successes-negative", "ReportOutcomes", report(None, ("t0", -1, 2)), Code.INVALID_ARGUMENT, "successes = -1.0"),
    Case("report-successes-nan", "ReportOutcomes", report(None, ("t0", NAN, 2)), Code.INVALID_ARGUMENT, "successes = nan"),
    Case("report-sum-squares-above-successes", "ReportOutcomes", report(None, ("t0", 1, 2, 1.5)), Code.INVALID_ARGUMENT, "sum_squares = 1.5 is outside"),
    Case("report-sum-squares-nan", "ReportOutcomes", report(None, ("t0", 1, 2, NAN)), Code.INVALID_ARGUMENT, "sum_squares = nan"),
    Case("report-unknown-experiment", "ReportOutcomes", lambda e: pb.ReportOutcomesRequest(experiment="no-such-exp", batch_id="b", outcomes=[pb.Outcome(key="a", successes=1, trials=1)]), Code.NOT_FOUND, "not found"),
    # -- ReportAndSelect: the report's checks, the select's, and neither applied ---
    Case("ras-empty-batch-id", "ReportAndSelect", report_and_select("", ("t0", 1, 2)), Code.INVALID_ARGUMENT, "batch_id is empty"),
    Case("ras-unknown-batch", "ReportAndSelect", report_and_select("no-such-batch", ("t0", 1, 2)), Code.NOT_FOUND, "no-such-batch"),
    Case("ras-no-outcomes", "ReportAndSelect", report_and_select(None), Code.INVALID_ARGUMENT, "no outcomes"),
    Case("ras-unknown-task", "ReportAndSelect", report_and_select(None, ("ghost", 1, 2)), Code.INVALID_ARGUMENT, "'ghost' is not in experiment"),
    Case("ras-trials-zero", "ReportAndSelect", report_and_select(None, ("t0", 0, 0)), Code.INVALID_ARGUMENT, "trials = 0"),
    Case("ras-successes-nan", "ReportAndSelect", report_and_select(None, ("t0", NAN, 2)), Code.INVALID_ARGUMENT, "successes = nan"),
    Case("ras-sum-squares-below", "ReportAndSelect", report_and_select(None, ("t0", 1, 2, 0.25)), Code.INVALID_ARGUMENT, "sum_squares = 0.25 is outside"),
    Case("ras-size-zero", "ReportAndSelect", report_and_select(None, ("t0", 1, 2), size=0), Code.INVALID_ARGUMENT, "batch_size"),
    Case("ras-larger-than-pool", "ReportAndSelect", report_and_select(None, ("t0", 1, 2), size=11), Code.INVALID_ARGUMENT, "larger than the pool"),
    Case("ras-key-nul", "ReportAndSelect", report_and_select(None, ("t0", 1, 2), key="k\x00"), Code.INVALID_ARGUMENT, "NUL"),
    Case("ras-key-megabyte", "ReportAndSelect", report_and_select(None, ("t0", 1, 2), key=LONG), Code.INVALID_ARGUMENT, "longer than 256"),
    # The request key of the open batch itself, for another size: the report would apply, the select not.
    Case("ras-key-other-size", "ReportAndSelect", report_and_select(None, (IN_OPEN, 1, 2), key="open"), Code.FAILED_PRECONDITION, "already used"),
    Case("ras-reported-other-outcomes", "ReportAndSelect", report_and_select(REPORTED, ("t0", 1, 2)), Code.FAILED_PRECONDITION, "already reported"),
    Case("ras-reported-more-than-free", "ReportAndSelect", report_and_select(REPORTED, size=8), Code.FAILED_PRECONDITION, "are free"),
    Case("ras-unknown-experiment", "ReportAndSelect", report_and_select("b", ("a", 1, 1), exp="no-such-exp"), Code.NOT_FOUND, "not found"),
    Case("ras-experiment-nul", "ReportAndSelect", report_and_select("b", ("a", 1, 1), exp="a\x00"), Code.INVALID_ARGUMENT, "is invalid"),
    # -- bytes protobuf cannot parse, for every RPC --------------------------------
    *[
        Case(f"undecodable-{method}", f"raw:{method}", lambda e, b=payload: b, Code.INVALID_ARGUMENT, "not a valid bots.v1.")
        for method in (
            "CreateExperiment", "GetExperiment", "ListExperiments", "DeleteExperiment", "ForkExperiment",
            "SelectBatch", "ReportOutcomes", "ReportAndSelect", "Snapshot", "AddTasks", "RestoreExperiment",
            "RetireTasks", "ReactivateTasks", "SetGroupShares", "ListGroups",
        )
        for payload in (b"\xff\xff\xff",)
    ],
    # -- RetireTasks / ReactivateTasks -----------------------------------------
    Case("retire-unknown-key", "RetireTasks", lambda e: pb.RetireTasksRequest(experiment=e, keys=["t1", "nope"]), Code.INVALID_ARGUMENT, "has no tasks 'nope'"),
    Case("retire-no-keys", "RetireTasks", lambda e: pb.RetireTasksRequest(experiment=e), Code.INVALID_ARGUMENT, "no task keys given"),
    Case("retire-repeated-key", "RetireTasks", lambda e: pb.RetireTasksRequest(experiment=e, keys=["t1", "t1"]), Code.INVALID_ARGUMENT, "more than once"),
    Case("retire-empty-key", "RetireTasks", lambda e: pb.RetireTasksRequest(experiment=e, keys=[""]), Code.INVALID_ARGUMENT, "task key is empty"),
    Case("retire-nul-key", "RetireTasks", lambda e: pb.RetireTasksRequest(experiment=e, keys=["t\x001"]), Code.INVALID_ARGUMENT, "NUL"),
    Case("retire-megabyte-key", "RetireTasks", lambda e: pb.RetireTasksRequest(experiment=e, keys=[LONG]), Code.INVALID_ARGUMENT, "longer than"),
    Case("retire-unknown-experiment", "RetireTasks", lambda e: pb.RetireTasksRequest(experiment="nope", keys=["t1"]), Code.NOT_FOUND, "not found"),
    Case("retire-bad-experiment-name", "RetireTasks", lambda e: pb.RetireTasksRequest(experiment="a b", keys=["t1"]), Code.INVALID_ARGUMENT, "is invalid"),
    Case("reactivate-unknown-key", "ReactivateTasks", lambda e: pb.RetireTasksRequest(experiment=e, keys=["zz"]), Code.INVALID_ARGUMENT, "has no tasks 'zz'"),
    Case("reactivate-unknown-experiment", "ReactivateTasks", lambda e: pb.RetireTasksRequest(experiment="nope", keys=["t1"]), Code.NOT_FOUND, "not found"),
    # -- SetGroupShares / ListGroups -------------------------------------------
    Case("shares-unknown-group", "SetGroupShares", lambda e: pb.SetGroupSharesRequest(experiment=e, shares=[pb.GroupShare(group="math", min_share=0.5, max_share=0.5)]), Code.INVALID_ARGUMENT, "no tasks in groups 'math'"),
    Case("shares-empty-group", "SetGroupShares", lambda e: pb.SetGroupSharesRequest(experiment=e, shares=[pb.GroupShare(group="", min_share=1, max_share=1)]), Code.INVALID_ARGUMENT, "group is empty"),
    Case("shares-repeated-group", "SetGroupShares", lambda e: pb.SetGroupSharesRequest(experiment=e, shares=[pb.GroupShare(group="g", max_share=1)] * 2), Code.INVALID_ARGUMENT, "more than once"),
    Case("shares-too-many", "SetGroupShares", lambda e: pb.SetGroupSharesRequest(experiment=e, shares=[pb.GroupShare(group=f"g{i}", max_share=1) for i in range(65)]), Code.INVALID_ARGUMENT, "at most 64 groups"),
    Case("shares-megabyte-group", "SetGroupShares", lambda e: pb.SetGroupSharesRequest(experiment=e, shares=[pb.GroupShare(group=LONG, max_share=1)]), Code.INVALID_ARGUMENT, "longer than"),
    Case("shares-unknown-experiment", "SetGroupShares", lambda e: pb.SetGroupSharesRequest(experiment="nope"), Code.NOT_FOUND, "not found"),
    Case("groups-unknown-experiment", "ListGroups", lambda e: pb.ListGroupsRequest(experiment="nope"), Code.NOT_FOUND, "not found"),
    Case("groups-bad-experiment-name", "ListGroups", lambda e: pb.ListGroupsRequest(experiment=""), Code.INVALID_ARGUMENT, "is invalid"),
    # -- retired flags and groups in restores and uploads ------------------------
    Case("restore-retired-length", "RestoreExperiment", restore({**one(), "retired": [True, False]}), Code.INVALID_ARGUMENT, "2 retired flags"),
    Case("restore-groups-length", "RestoreExperiment", restore({**one(), "groups": ["a", "b"]}), Code.INVALID_ARGUMENT, "2 groups"),
    Case("add-megabyte-group", "AddTasks", add(pb.AddTasksRequest(experiment="EXP", tasks=[pb.Task(key="new", group=LONG)])), Code.INVALID_ARGUMENT, "group"),
    Case("bad-utf8-name", "raw:GetExperiment", lambda e: b"\x0a\x02\xff\xfe", Code.INVALID_ARGUMENT, "UTF-8"),
    Case("bad-utf8-task-key", "raw:AddTasks", lambda e: [pb.AddTasksRequest(experiment=e).SerializeToString(), b"\x12\x04\x0a\x02\xff\xfe"], Code.INVALID_ARGUMENT, "UTF-8"),
]

STREAMS = {"AddTasks": "stream_unary", "RestoreExperiment": "stream_unary", "Snapshot": "unary_stream"}


@pytest.fixture(scope="module")
def victims() -> dict[str, str]:
    return {}


@pytest.fixture
def exp(endpoint: Endpoint, stub: pb_grpc.TaskSelectorStub, victims: dict[str, str]) -> str:
    """One experiment per endpoint: weak/strong features, 10 tasks, a reported
    step and an open batch of 3 under request key "open"."""
    key = f"{endpoint.mode}-{id(endpoint)}"
    if key in victims:
        return victims[key]
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    config = pb.ExperimentConfig(weak_feature="weak", strong_feature="strong")
    stub.CreateExperiment(pb.CreateExperimentRequest(name=name, config=config))
    stub.AddTasks(iter([pb.AddTasksRequest(experiment=name, tasks=tasks(*[f"t{i}" for i in range(10)], weak=0.1, strong=0.6))]))
    batch = stub.SelectBatch(pb.SelectBatchRequest(experiment=name, batch_size=3, request_key="reported"))
    outcomes = [pb.Outcome(key=k, successes=2, trials=4) for k in batch.keys]
    REPORTS[name] = pb.ReportOutcomesRequest(experiment=name, batch_id=batch.batch_id, outcomes=outcomes)
    stub.ReportOutcomes(REPORTS[name])
    open_batch = stub.SelectBatch(pb.SelectBatchRequest(experiment=name, batch_size=3, request_key="open"))
    BATCHES[name], OPEN_KEYS[name] = open_batch.batch_id, list(open_batch.keys)
    victims[key] = name
    return name


def state(stub: pb_grpc.TaskSelectorStub, name: str) -> tuple[object, ...]:
    chunks = list(stub.Snapshot(pb.SnapshotRequest(experiment=name, include_features=True)))
    experiments: list[str] = []
    token = ""
    while True:
        page = stub.ListExperiments(pb.ListExperimentsRequest(page_size=1000, page_token=token))
        experiments += [(e.name, e.step, e.num_tasks, e.open_batches) for e in page.experiments]  # type: ignore[misc]
        token = page.next_page_token
        if not token:
            return tuple(c.SerializeToString(deterministic=True) for c in chunks), tuple(experiments)


def call(endpoint: Endpoint, stub: pb_grpc.TaskSelectorStub, case: Case, exp: str) -> None:
    request = case.request(exp)
    if case.rpc.startswith("raw:"):
        method = case.rpc.removeprefix("raw:")
        channel = endpoint.channel()
        try:
            kind = STREAMS.get(method, "unary_unary")
            multicallable = getattr(channel, kind)(SERVICE + method)
            if kind == "stream_unary":
                multicallable(iter(request if isinstance(request, list) else [request]), timeout=30)
            elif kind == "unary_stream":
                list(multicallable(request, timeout=30))
            else:
                multicallable(request, timeout=30)
        finally:
            channel.close()
        return
    method = getattr(stub, case.rpc)
    if case.rpc in ("AddTasks", "RestoreExperiment"):
        method(iter(request), timeout=30)
    elif case.rpc == "Snapshot":
        list(method(request, timeout=30))
    else:
        method(request, timeout=30)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_is_rejected_with_a_clear_status_and_changes_nothing(
    endpoint: Endpoint, stub: pb_grpc.TaskSelectorStub, exp: str, case: Case
) -> None:
    before = state(stub, exp)
    with pytest.raises(grpc.RpcError) as info:
        call(endpoint, stub, case, exp)
    error = info.value
    assert error.code() == case.code, error.details()[:500]
    assert case.fragment in error.details(), error.details()[:500]
    assert len(error.details()) <= MAX_MESSAGE
    assert state(stub, exp) == before


def test_there_are_at_least_a_hundred_distinct_cases_over_every_rpc() -> None:
    assert len({c.id for c in CASES}) == len(CASES) >= 100
    rpcs = {c.rpc.removeprefix("raw:") for c in CASES}
    assert rpcs == {m.name for m in pb.DESCRIPTOR.services_by_name["TaskSelector"].methods}


