"""The metrics of a shared server confirm nothing about its tenants' names:
opaque labels keyed by a server secret, tenant labels opaque as well, and
/metrics behind a bearer token or a TLS client certificate. Real server
processes over sockets; the scraper is urllib."""

from __future__ import annotations

import argparse
import hashlib
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bots_client.proto import bots_pb2 as pb
from bots_client.proto import bots_pb2_grpc as pb_grpc
from bots_server import settings
from bots_server.metric_labels import Labeller
from bots_server.metrics_http import NOT_FOUND, UNAUTHORIZED
from bots_server.testing.tenants import bearer, credentials_file
from tests.ops.support import eventually
from tests.ops.test_tls import pki  # noqa: F401  # the fixture: a CA, a server and a client certificate
from tests.support.servers import ServerProcess

PRINCIPALS = {"a-writer": ("team-a", "writer"), "b-writer": ("team-b", "writer")}
KEY = "metrics-label-key-of-this-test-0123456789"
TOKEN = "metrics-scrape-token-0123456789"


def get(url: str, token: str = "", scheme: str = "Bearer") -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"{scheme} {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def guesses(*names: str) -> set[str]:
    """What a scraper who guessed `names` could look for: each name, and the
    hex digests of it (SHA-256, SHA-1, MD5) cut to 8 digits."""
    found = set(names)
    for name in names:
        for algorithm in ("sha256", "sha1", "md5"):
            found.add(hashlib.new(algorithm, name.encode()).hexdigest()[:8])
    return found


@pytest.fixture(params=["sqlite", "postgresql-2-processes"])
def guarded(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    """A server of two tenants with opaque tenant labels, a label key and a
    metrics token, all from files."""
    creds = credentials_file(tmp_path / "credentials.toml", PRINCIPALS)
    (tmp_path / "label-key").write_text(KEY + "\n")
    (tmp_path / "metrics-token").write_text(f"# the scrapers' token\n{TOKEN}\n")
    args = [
        "--credentials-file", str(creds), "--metrics-tenant-labels", "opaque",
        "--metrics-label-key-file", str(tmp_path / "label-key"), "--metrics-token-file", str(tmp_path / "metrics-token"),
    ]  # fmt: skip
    if request.param == "sqlite":
        server = ServerProcess(f"sqlite:///{tmp_path / 'bots.db'}", extra_args=args)
    else:
        server = ServerProcess(request.getfixturevalue("fresh_pg_url"), extra_args=args, processes=2)
    yield server.start(), tmp_path
    server.stop()


def test_the_metrics_page_confirms_no_tenant_name(guarded: tuple[ServerProcess, Path]) -> None:
    server, _tmp = guarded
    name, group = f"secret-run-{uuid.uuid4().hex[:8]}", f"secret-group-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TaskSelectorStub(channel)
        stub.CreateExperiment(pb.CreateExperimentRequest(name=name), metadata=bearer("b-writer"), timeout=30)
        tasks = [pb.Task(key=f"k{i}", group=group) for i in range(4)]
        stub.AddTasks(iter([pb.AddTasksRequest(experiment=name, tasks=tasks)]), metadata=bearer("b-writer"), timeout=30)
        stub.SelectBatch(pb.SelectBatchRequest(experiment=name, batch_size=2), metadata=bearer("b-writer"), timeout=30)
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    base = f"http://127.0.0.1:{server.metrics_port}"

    # Without the token: 401 and a fixed body, on every path.
    for path, token, scheme in (("/metrics", "", ""), ("/metrics", "wrong-token", "Bearer"),
                                ("/metrics", TOKEN, "Basic"), ("/metrics", TOKEN[:-1], "Bearer"),
                                (f"/{name}", "", ""), ("/team-b", "wrong", "Bearer")):  # fmt: skip
        status, body, headers = get(base + path, token, scheme)
        assert (status, body) == (401, UNAUTHORIZED), path
        assert headers.get("WWW-Authenticate") == 'Bearer realm="metrics"'
    # With it: 404 and a fixed body for any other path.
    for path in (f"/{name}", "/team-b", f"/metrics/{name}", "/favicon.ico"):
        assert get(base + path, TOKEN)[:2] == (404, NOT_FOUND), path

    labels = Labeller(KEY, opaque_tenants=True)
    series = f'bots_batches_selected_total{{experiment="{labels.experiment(f"team-b/{name}")}"'
    text = eventually(lambda: get(url, TOKEN)[1].decode(), lambda page: series in page, what="B's select on the page")
    assert f'group="{labels.group(group)}"' in text
    assert f'tenant="{labels.tenant("team-b")}"' in text  # bots_tenant_calls_total
    leaks = guesses(name, group, f"team-b/{name}", "team-b", "team-a") & set(_words(text))
    assert not leaks, leaks
    for guessed in guesses(name, group, f"team-b/{name}", "team-b", "team-a"):
        assert guessed not in text, guessed
    # Another key labels the same names otherwise: without the server's key
    # a guess cannot be checked.
    other = Labeller("some-other-key-0123456789abcdef", opaque_tenants=True)
    assert other.experiment(f"team-b/{name}").split("/")[1] not in text and other.tenant("team-b") not in text


def _words(text: str) -> list[str]:
    return text.replace('"', " ").replace("/", " ").replace("{", " ").replace("}", " ").replace(",", " ").split()


def test_labels_stay_across_restarts_with_the_same_key(tmp_path: Path) -> None:
    """The key from the environment; the step gauge of an experiment a
    restarted server lists at start carries the label it had."""
    db = f"sqlite:///{tmp_path / 'bots.db'}"
    creds = credentials_file(tmp_path / "credentials.toml", PRINCIPALS)
    env = {"BOTS_METRICS_LABEL_KEY": KEY, "BOTS_METRICS_TOKEN": TOKEN}
    name = f"kept-{uuid.uuid4().hex[:8]}"
    label = Labeller(KEY).experiment(f"team-a/{name}")
    for attempt in range(2):  # create, then restart
        server = ServerProcess(db, extra_args=["--credentials-file", str(creds)], env=env).start()
        try:
            if attempt == 0:
                with grpc.insecure_channel(server.address) as channel:
                    pb_grpc.TaskSelectorStub(channel).CreateExperiment(
                        pb.CreateExperimentRequest(name=name), metadata=bearer("a-writer"), timeout=30
                    )
                continue  # listed (and labelled) at the next start
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            text = eventually(
                lambda: get(url, TOKEN)[1].decode(),
                lambda page: f'bots_experiment_step{{experiment="{label}"}}' in page,
                what="the experiment's step gauge",
            )
            assert name not in text and 'experiment="team-a/' in text  # tenants readable by default
        finally:
            server.stop()


def test_a_client_certificate_is_required_when_a_client_ca_is_set(pki: Path, tmp_path: Path) -> None:  # noqa: F811
    args = [
        "--metrics-tls-cert", str(pki / "server.pem"), "--metrics-tls-key", str(pki / "server.key"),
        "--metrics-tls-client-ca", str(pki / "ca.pem"),
    ]  # fmt: skip
    server = ServerProcess(f"sqlite:///{tmp_path / 'bots.db'}", extra_args=args).start()
    try:
        url = f"https://127.0.0.1:{server.metrics_port}/metrics"
        context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, context=context, timeout=10).read()
        stranger = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        stranger.load_cert_chain(str(pki / "stranger.pem"), str(pki / "stranger.key"))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, context=stranger, timeout=10).read()
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):  # plain HTTP is not served
            urllib.request.urlopen(url.replace("https", "http"), timeout=10).read()
        context.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            assert response.status == 200 and b"grpc_server_started_total" in response.read()
    finally:
        server.stop()


def parse(*argv: str) -> settings.ServerSettings:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    return settings.from_args(parser.parse_args(list(argv)))


def test_metrics_access_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "short").write_text("too-short\n")
    with pytest.raises(SystemExit, match="has 9 characters; at least 16"):
        parse("--metrics-label-key-file", str(tmp_path / "short"))
    with pytest.raises(SystemExit, match="--metrics-label-key-file / BOTS_METRICS_LABEL_KEY_FILE = .*missing"):
        parse("--metrics-label-key-file", str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="--metrics-tenant-labels opaque needs opaque experiment labels"):
        parse("--metrics-tenant-labels", "opaque", "--metrics-labels", "names")
    with pytest.raises(SystemExit, match="--metrics-tenant-labels / BOTS_METRICS_TENANT_LABELS = 'hidden'"):
        parse("--metrics-tenant-labels", "hidden")
    with pytest.raises(SystemExit, match="set both or neither"):
        parse("--metrics-tls-cert", "x.pem")
    with pytest.raises(SystemExit, match="needs --metrics-tls-cert"):
        parse("--metrics-tls-client-ca", "ca.pem")
    monkeypatch.setenv("BOTS_METRICS_TOKEN", "t1, t2")
    (tmp_path / "tokens").write_text("# comment\nt3\n\n")
    (tmp_path / "key").write_text(KEY + "\n")
    parsed = parse("--metrics-token-file", str(tmp_path / "tokens"), "--metrics-label-key-file", str(tmp_path / "key"))
    assert parsed.metrics_tokens == {"t1", "t2", "t3"} and parsed.metrics_label_key == KEY
    assert parsed.metrics_access.restricted
    assert Labeller(KEY).experiment("team-b/x") == Labeller(KEY).experiment("team-b/x") != Labeller(KEY * 2).experiment(
        "team-b/x"
    )
