"""Tenants and roles against real server processes with a credentials file,
on SQLite and PostgreSQL: every RPC x (own tenant's experiment, another
tenant's) x (reader, writer, tenant-admin, admin) answers as
docs/security.md says.

    own tenant     reader: reads OK, changes PERMISSION_DENIED; writer: OK but
                   DeleteExperiment PERMISSION_DENIED; tenant-admin and admin: OK
    other tenant   reader, writer and tenant-admin: PERMISSION_DENIED (named "b/x"),
                   NOT_FOUND (named "x": a plain name never leaves the caller's
                   tenant); admin: OK
"""

from __future__ import annotations

import hashlib
import logging
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_client.security import bearer as bearer_metadata
from bots_server.metric_labels import Labeller
from bots_server.service.auth import REQUIRED_ROLE
from bots_server.testing.tenants import bearer, credentials_file
from tests.support.servers import ServerProcess

# name -> (tenant, role); tokens: see bots_server.testing.tenants.token().
PRINCIPALS = {
    "a-reader": ("team-a", "reader"),
    "a-writer": ("team-a", "writer"),
    "a-tenant-admin": ("team-a", "tenant-admin"),
    "a-admin": ("team-a", "admin"),
    "b-writer": ("team-b", "writer"),
    "b-tenant-admin": ("team-b", "tenant-admin"),
}
# A plain token (BOTS_AUTH_TOKENS) beside the credentials file.
PLAIN_TOKEN = "plain-token-of-the-default-tenant"
LABEL_KEY = "metrics-label-key-of-the-tenant-tests"
READS = {"GetExperiment", "Snapshot", "ListGroups"}
CHANGES = {
    "CreateExperiment", "ForkExperiment", "RestoreExperiment", "DeleteExperiment", "AddTasks", "SelectBatch",
    "ReportOutcomes", "ReportAndSelect", "RetireTasks", "ReactivateTasks", "SetGroupShares",
}  # fmt: skip
TENANT_ADMIN_CALLS = {"DeleteExperiment"}  # of CHANGES: a writer may not
RPCS = sorted(READS | CHANGES)
OK = grpc.StatusCode.OK
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def tenant_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("tenants")
    url = f"sqlite:///{tmp / 'tenants.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    creds = credentials_file(tmp / "credentials.toml", PRINCIPALS)
    server = ServerProcess(
        url,
        extra_args=["--credentials-file", str(creds)],
        env={"BOTS_AUTH_TOKENS": PLAIN_TOKEN, "BOTS_METRICS_LABEL_KEY": LABEL_KEY},
    ).start()
    yield server
    server.stop()


@dataclass
class Caller:
    stub: pb_grpc.TaskSelectorStub
    principal: str

    def call(self, rpc: str, request: object) -> tuple[grpc.StatusCode, object]:
        method = getattr(self.stub, rpc)
        metadata = bearer(self.principal)
        try:
            if rpc in ("AddTasks", "RestoreExperiment"):
                response = method(iter([request]), metadata=metadata, timeout=20)
            elif rpc == "Snapshot":
                response = list(method(request, metadata=metadata, timeout=20))
            else:
                response = method(request, metadata=metadata, timeout=20)
        except grpc.RpcError as e:
            return e.code(), e.details()
        return OK, response


@pytest.fixture
def callers(tenant_server: ServerProcess) -> Iterator[Callable[[str], Caller]]:
    with grpc.insecure_channel(tenant_server.address) as channel:
        stub = pb_grpc.TaskSelectorStub(channel)
        yield lambda principal: Caller(stub, principal)


def make_experiment(admin: Caller, reference: str) -> tuple[str, list[str]]:
    """A fresh experiment of 6 tasks (made by an admin) with one open batch
    of 2: (its batch id, its keys)."""
    assert admin.call("CreateExperiment", pb.CreateExperimentRequest(name=reference))[0] == OK
    tasks = [pb.Task(key=f"k{i}") for i in range(6)]
    assert admin.call("AddTasks", pb.AddTasksRequest(experiment=reference, tasks=tasks))[0] == OK
    code, batch = admin.call("SelectBatch", pb.SelectBatchRequest(experiment=reference, batch_size=2))
    assert code == OK
    return batch.batch_id, list(batch.keys)  # type: ignore[attr-defined]


def request_for(rpc: str, reference: str, tenant_prefix: str, batch_id: str, batch_keys: list[str]) -> object:
    """The request of `rpc` aimed at experiment `reference` (or, for create
    and restore, at a new name in the same tenant)."""
    fresh = f"{tenant_prefix}new-{uuid.uuid4().hex[:8]}"
    return {
        "GetExperiment": pb.GetExperimentRequest(name=reference),
        "Snapshot": pb.SnapshotRequest(experiment=reference),
        "CreateExperiment": pb.CreateExperimentRequest(name=fresh),
        "ForkExperiment": pb.ForkExperimentRequest(source=reference, name=f"fork-{uuid.uuid4().hex[:8]}"),
        "RestoreExperiment": pb.RestoreExperimentRequest(
            name=fresh, keys=["r0"], alpha=[1.0], beta=[1.0], features=[pb.Features()]
        ),
        "DeleteExperiment": pb.DeleteExperimentRequest(name=reference),
        "AddTasks": pb.AddTasksRequest(experiment=reference, tasks=[pb.Task(key="extra")]),
        "SelectBatch": pb.SelectBatchRequest(experiment=reference, batch_size=1),
        "RetireTasks": pb.RetireTasksRequest(experiment=reference, keys=["k5"]),
        "ReactivateTasks": pb.RetireTasksRequest(experiment=reference, keys=["k5"]),
        "SetGroupShares": pb.SetGroupSharesRequest(experiment=reference),
        "ListGroups": pb.ListGroupsRequest(experiment=reference),
        "ReportOutcomes": pb.ReportOutcomesRequest(
            experiment=reference, batch_id=batch_id, outcomes=[pb.Outcome(key=k, successes=1, trials=2) for k in batch_keys]
        ),
        "ReportAndSelect": pb.ReportAndSelectRequest(
            experiment=reference,
            batch_id=batch_id,
            outcomes=[pb.Outcome(key=k, successes=1, trials=2) for k in batch_keys],
            batch_size=2,
        ),
    }[rpc]


def test_the_role_test_covers_every_rpc() -> None:
    """Every method is in the role table (a method missing there needs
    admin) and, but ListExperiments (tested on its own), in RPCS below."""
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["TaskSelector"].methods}
    assert set(REQUIRED_ROLE) == methods
    assert set(RPCS) | {"ListExperiments"} == methods


def expected(role: str, own: bool, rpc: str) -> grpc.StatusCode:
    if role == "admin":
        return OK
    if not own:
        return DENIED
    if rpc in READS or role == "tenant-admin":
        return OK
    return OK if role == "writer" and rpc not in TENANT_ADMIN_CALLS else DENIED


@pytest.mark.parametrize("rpc", RPCS)
@pytest.mark.parametrize("role", ["reader", "writer", "tenant-admin", "admin"])
@pytest.mark.parametrize("target", ["own", "other"])
def test_every_rpc_by_role_and_tenant(callers: Callable[[str], Caller], rpc: str, role: str, target: str) -> None:
    admin, caller = callers("a-admin"), callers(f"a-{role}")
    own = target == "own"
    plain = f"x-{uuid.uuid4().hex[:8]}"
    # The admin of team-a names team-b's experiment "team-b/x"; so must everyone else.
    reference = plain if own else f"team-b/{plain}"
    batch_id, keys = make_experiment(admin, reference)
    request = request_for(rpc, reference, "" if own else "team-b/", batch_id, keys)

    before = admin.call("GetExperiment", pb.GetExperimentRequest(name=reference))[1]
    code, details = caller.call(rpc, request)
    want = expected(role, own, rpc)
    assert code == want, details
    after_code, after = admin.call("GetExperiment", pb.GetExperimentRequest(name=reference))
    if want != OK:
        # A denied call changes nothing and names the reason.
        assert after_code == OK and after == before
        assert ("role" in str(details)) or ("tenant" in str(details)), details
    if not own and role != "admin":
        # By its plain name the other tenant's experiment does not exist for this caller.
        plain_request = request_for(rpc, plain, "", batch_id, keys)
        code, details = caller.call(rpc, plain_request)
        may_call = expected(role, True, rpc) == OK
        if rpc in READS or (may_call and rpc not in ("CreateExperiment", "RestoreExperiment")):
            assert code == grpc.StatusCode.NOT_FOUND, details
            assert "team-b" not in str(details), details


def test_same_name_in_two_tenants_is_two_experiments(callers: Callable[[str], Caller]) -> None:
    a, b, admin = callers("a-writer"), callers("b-writer"), callers("a-admin")
    name = f"shared-{uuid.uuid4().hex[:8]}"
    for caller, tasks in ((a, 3), (b, 5)):
        assert caller.call("CreateExperiment", pb.CreateExperimentRequest(name=name))[0] == OK
        added = [pb.Task(key=f"k{i}") for i in range(tasks)]
        assert caller.call("AddTasks", pb.AddTasksRequest(experiment=name, tasks=added))[0] == OK
    for caller, tasks in ((a, 3), (b, 5)):
        code, experiment = caller.call("GetExperiment", pb.GetExperimentRequest(name=name))
        assert code == OK and experiment.num_tasks == tasks and experiment.name == name  # type: ignore[attr-defined]
    # The admin of team-a sees its own plainly and team-b's with the tenant.
    assert admin.call("GetExperiment", pb.GetExperimentRequest(name=name))[1].num_tasks == 3  # type: ignore[attr-defined]
    code, other = admin.call("GetExperiment", pb.GetExperimentRequest(name=f"team-b/{name}"))
    assert code == OK and other.num_tasks == 5 and other.name == f"team-b/{name}"  # type: ignore[attr-defined]


def test_list_shows_a_tenant_only_its_own(callers: Callable[[str], Caller]) -> None:
    a, b, admin, reader = callers("a-writer"), callers("b-writer"), callers("a-admin"), callers("a-reader")
    team_admin = callers("a-tenant-admin")
    mine, theirs = f"mine-{uuid.uuid4().hex[:8]}", f"theirs-{uuid.uuid4().hex[:8]}"
    assert a.call("CreateExperiment", pb.CreateExperimentRequest(name=mine))[0] == OK
    assert b.call("CreateExperiment", pb.CreateExperimentRequest(name=theirs))[0] == OK

    def names(caller: Caller) -> set[str]:
        seen: set[str] = set()
        token = ""
        while True:
            code, page = caller.call("ListExperiments", pb.ListExperimentsRequest(page_size=7, page_token=token))
            assert code == OK, page
            seen |= {e.name for e in page.experiments}  # type: ignore[attr-defined]
            token = page.next_page_token  # type: ignore[attr-defined]
            if not token:
                return seen

    for caller in (a, reader, team_admin):  # a tenant's administrator is no platform administrator
        listed = names(caller)
        assert mine in listed and theirs not in listed and f"team-b/{theirs}" not in listed
        assert all("/" not in n for n in listed)
    listed_b = names(b)
    assert theirs in listed_b and mine not in listed_b and all("/" not in n for n in listed_b)
    everything = names(admin)
    assert mine in everything and f"team-b/{theirs}" in everything


def test_a_plain_token_is_the_default_tenants_admin_and_no_other_tenants(
    tenant_server: ServerProcess, callers: Callable[[str], Caller]
) -> None:
    # It was the platform's admin: a shared trainer token listed and read
    # every team's experiments once a credentials file added teams.
    theirs = f"theirs-{uuid.uuid4().hex[:8]}"
    assert callers("b-writer").call("CreateExperiment", pb.CreateExperimentRequest(name=theirs))[0] == OK
    plain = bearer_metadata(PLAIN_TOKEN)
    with grpc.insecure_channel(tenant_server.address) as channel:
        stub = pb_grpc.TaskSelectorStub(channel)
        with pytest.raises(grpc.RpcError) as denied:
            stub.GetExperiment(pb.GetExperimentRequest(name=f"team-b/{theirs}"), metadata=plain, timeout=20)
        assert denied.value.code() == DENIED
        own = f"own-{uuid.uuid4().hex[:8]}"
        stub.CreateExperiment(pb.CreateExperimentRequest(name=own), metadata=plain, timeout=20)
        stub.DeleteExperiment(pb.DeleteExperimentRequest(name=own), metadata=plain, timeout=20)  # its tenant's admin
        listed = stub.ListExperiments(pb.ListExperimentsRequest(page_size=1000), metadata=plain, timeout=20)
        assert all("/" not in e.name for e in listed.experiments) and theirs not in {e.name for e in listed.experiments}


def test_lineage_is_shown_like_any_name_and_withheld_across_tenants(callers: Callable[[str], Caller]) -> None:
    """forked_from is translated like every name: plain in the caller's
    tenant, "tenant/name" for an administrator elsewhere, and withheld from
    a caller who may not enter the source's tenant. A restore's source is
    the caller's word, so it must name an experiment the caller may use."""
    admin, a_reader, b_writer = callers("a-admin"), callers("a-reader"), callers("b-writer")
    src, tag = f"src-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]
    assert admin.call("CreateExperiment", pb.CreateExperimentRequest(name=src))[0] == OK  # team-a/src
    fork = pb.ForkExperimentRequest(source=src, name=f"copy-{tag}")
    assert admin.call("ForkExperiment", fork)[0] == OK
    code, copy = a_reader.call("GetExperiment", pb.GetExperimentRequest(name=f"copy-{tag}"))
    assert code == OK and copy.forked_from == src  # type: ignore[attr-defined]
    across = pb.ForkExperimentRequest(source=src, name=f"team-b/dst-{tag}")  # an administrator, across tenants
    code, made = admin.call("ForkExperiment", across)
    assert code == OK and made.forked_from == src  # type: ignore[attr-defined]
    code, dst = b_writer.call("GetExperiment", pb.GetExperimentRequest(name=f"dst-{tag}"))
    assert code == OK and (dst.forked_from, dst.forked_at_step) == ("", 0)  # type: ignore[attr-defined]

    def restore(source: str) -> tuple[grpc.StatusCode, object]:
        request = pb.RestoreExperimentRequest(
            name=f"r-{tag}", keys=["r0"], alpha=[1.0], beta=[1.0], features=[pb.Features()], source=source
        )
        return b_writer.call("RestoreExperiment", request)

    code, details = restore(f"team-a/{src}")
    assert code == DENIED and "tenant 'team-a'" in str(details)
    code, details = restore("s3://bucket/snap.json")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "restore source" in str(details)
    assert b_writer.call("GetExperiment", pb.GetExperimentRequest(name=f"r-{tag}"))[0] == grpc.StatusCode.NOT_FOUND
    code, restored = restore(f"dst-{tag}")
    assert code == OK and restored.forked_from == f"dst-{tag}"  # type: ignore[attr-defined]
    code, seen = admin.call("GetExperiment", pb.GetExperimentRequest(name=f"team-b/r-{tag}"))
    assert code == OK and seen.forked_from == f"team-b/dst-{tag}"  # type: ignore[attr-defined]


def test_metrics_show_no_tenant_names(tenant_server: ServerProcess, callers: Callable[[str], Caller]) -> None:
    """With a credentials file the metrics label an experiment
    tenant/<16 hex digits of an HMAC of its stored name, keyed by the
    server's label key> and a group g-<12 hex digits>: series per
    experiment, no names (tests/ops/test_metrics_access.py: nor anything a
    guess could be checked against)."""
    writer = callers("b-writer")
    name, group = f"secret-run-{uuid.uuid4().hex[:8]}", f"secret-group-{uuid.uuid4().hex[:8]}"
    assert writer.call("CreateExperiment", pb.CreateExperimentRequest(name=name))[0] == OK
    tasks = [pb.Task(key=f"k{i}", group=group) for i in range(4)]
    assert writer.call("AddTasks", pb.AddTasksRequest(experiment=name, tasks=tasks))[0] == OK
    assert writer.call("SelectBatch", pb.SelectBatchRequest(experiment=name, batch_size=2))[0] == OK
    labels = Labeller(LABEL_KEY)
    label = labels.experiment(f"team-b/{name}")
    series = f'bots_batches_selected_total{{experiment="{label}"}} 1.0'
    deadline = time.monotonic() + 10  # the metrics hooks run on a worker thread, after the call returns
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{tenant_server.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        if series in text or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert series in text
    assert f'group="{labels.group(group)}"' in text
    assert hashlib.sha256(f"team-b/{name}".encode()).hexdigest()[:12] not in text
    assert name not in text and group not in text and "secret-" not in text


def test_metrics_labels_setting() -> None:
    import argparse

    from bots_server import settings
    from bots_server.metric_labels import opaque

    assert opaque("auto", tenants=True) and not opaque("auto", tenants=False)
    assert opaque("opaque", tenants=False) and not opaque("names", tenants=True)
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    assert settings.from_args(parser.parse_args(["--metrics-labels", "names"])).metrics_labels == "names"
    with pytest.raises(SystemExit, match="--metrics-labels / BOTS_METRICS_LABELS = 'hashed': expected one of auto, names"):
        settings.from_args(parser.parse_args(["--metrics-labels", "hashed"]))


def test_unknown_and_missing_credentials_are_unauthenticated(tenant_server: ServerProcess) -> None:
    with grpc.insecure_channel(tenant_server.address) as channel:
        stub = pb_grpc.TaskSelectorStub(channel)
        for metadata in ((), (("authorization", "Bearer not-a-known-token"),), (("authorization", "Basic abc"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.ListExperiments(pb.ListExperimentsRequest(), metadata=metadata, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata


def test_every_denial_leaves_a_rate_limited_audit_line(tenant_server: ServerProcess, callers: Callable[[str], Caller]) -> None:
    """UNAUTHENTICATED and PERMISSION_DENIED (by role, and by tenant) each log
    an audit line on their first occurrence; repeats of the same principal,
    status and method within a minute are counted, not logged; the token is
    never in a line."""
    reader, writer = callers("a-reader"), callers("a-writer")
    tag = uuid.uuid4().hex[:8]
    for _ in range(5):  # a reader's write, again and again
        assert reader.call("CreateExperiment", pb.CreateExperimentRequest(name=f"no-{tag}"))[0] == DENIED
    for _ in range(3):  # another tenant's experiment
        assert writer.call("SelectBatch", pb.SelectBatchRequest(experiment=f"team-b/x-{tag}", batch_size=1))[0] == DENIED
    bad_token = f"wrong-{tag}-0123456789abcdef"
    with grpc.insecure_channel(tenant_server.address) as channel:
        stub = pb_grpc.TaskSelectorStub(channel)
        for _ in range(4):
            with pytest.raises(grpc.RpcError) as e:
                stub.GetExperiment(pb.GetExperimentRequest(name="x"), metadata=(("authorization", f"Bearer {bad_token}"),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    def denials() -> list[dict[str, object]]:
        return [e for e in list(tenant_server.log_lines) if e.get("logger") == "bots_server.audit.denials"]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        mine = [e for e in denials() if f"no-{tag}" in str(e) or f"x-{tag}" in str(e)]
        if len(mine) >= 1 and any(e.get("method") == "GetExperiment" for e in denials()):
            break
        time.sleep(0.1)
    lines = denials()
    by_role = [e for e in lines if e.get("who") == "a-reader@team-a" and e.get("method") == "CreateExperiment"]
    assert len(by_role) == 1 and by_role[0]["level"] == "WARNING" and by_role[0]["code"] == "PERMISSION_DENIED"
    assert "needs writer" in str(by_role[0]["reason"])
    by_tenant = [e for e in lines if e.get("who") == "a-writer@team-a" and e.get("method") == "SelectBatch"]
    assert len(by_tenant) == 1 and "tenant 'team-b'" in str(by_tenant[0]["reason"])
    unknown = [e for e in lines if e.get("code") == "UNAUTHENTICATED" and e.get("method") == "GetExperiment"]
    assert len(unknown) == 1 and str(unknown[0]["who"]).startswith("ipv") and unknown[0]["reason"] == "invalid bearer token"
    assert all(bad_token not in str(e) and "secret-token" not in str(e) for e in lines)


def test_denial_lines_count_what_they_suppressed() -> None:
    from bots_server.service.denials import DenialLog, peer_host

    now = [0.0]
    log = DenialLog(interval_s=60.0, max_tracked=2, clock=lambda: now[0])
    records: list[dict[str, object]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append({k: getattr(record, k) for k in ("who", "method", "suppressed")})

    handler = Keep()
    logging.getLogger("bots_server.audit.denials").addHandler(handler)
    try:
        for t in (0.0, 1.0, 59.0, 60.0, 61.0):
            now[0] = t
            log.note("w@a", "PERMISSION_DENIED", "AddTasks", "why")
        now[0] = 61.0
        for who in ("x@a", "y@a"):  # two more keys: the oldest is forgotten (max_tracked = 2)
            log.note(who, "PERMISSION_DENIED", "AddTasks", "why")
        log.note("w@a", "PERMISSION_DENIED", "AddTasks", "why")
    finally:
        logging.getLogger("bots_server.audit.denials").removeHandler(handler)
    assert [(r["who"], r["suppressed"]) for r in records] == [("w@a", 0), ("w@a", 2), ("x@a", 0), ("y@a", 0), ("w@a", 0)]
    assert peer_host("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7" and peer_host("ipv6:[::1]:5") == "ipv6:[::1]"


def test_the_audit_line_names_the_principal(tenant_server: ServerProcess, callers: Callable[[str], Caller]) -> None:
    name = f"audited-{uuid.uuid4().hex[:8]}"
    writer = callers("b-writer")
    assert writer.call("CreateExperiment", pb.CreateExperimentRequest(name=name))[0] == OK
    assert writer.call("AddTasks", pb.AddTasksRequest(experiment=name, tasks=[pb.Task(key="t")]))[0] == OK
    code, batch = writer.call("SelectBatch", pb.SelectBatchRequest(experiment=name, batch_size=1))
    assert code == OK
    report = pb.ReportOutcomesRequest(
        experiment=name, batch_id=batch.batch_id, outcomes=[pb.Outcome(key="t", successes=1, trials=1)]  # type: ignore[attr-defined]
    )
    assert writer.call("ReportOutcomes", report)[0] == OK
    assert callers("b-tenant-admin").call("DeleteExperiment", pb.DeleteExperimentRequest(name=name))[0] == OK
    stored = f"team-b/{name}"
    deadline = time.monotonic() + 10
    wanted = ["experiment created", "tasks added", "batch selected", "report applied", "experiment deleted"]
    while True:
        lines = [e for e in list(tenant_server.log_lines) if e.get("experiment") == stored]
        seen = [e["message"] for e in lines]
        if all(m in seen for m in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for message in wanted:
        line = next(e for e in lines if e["message"] == message)
        who = "b-tenant-admin@team-b" if message == "experiment deleted" else "b-writer@team-b"
        assert line["principal"] == who and line["logger"].startswith("bots_server.audit"), line


def test_sqlite_shared_by_tenants_warns_at_start(tenant_server: ServerProcess) -> None:
    """Every write holds an SQLite database: one tenant's large upload
    stalls the others' reports, so the operator is told at start."""
    warned = [m for m in tenant_server.messages() if "share this server on SQLite" in m]
    if tenant_server.db_url.startswith("sqlite"):
        assert warned and warned[0].startswith("3 tenants"), tenant_server.messages()[:5]  # team-a, team-b and the plain token's default
    else:
        assert not warned
