"""Task groups and their shares of each batch: exact counts when enough tasks
are free (also with several batches leased at once), the documented
degradation when not, per-group signals, bad shares rejected with nothing
changed, groups and shares kept by forks, restores and restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections import Counter

import grpc
import pytest

import bots_client
from bots_client import ExperimentConfig, Task
from tests.api.conftest import Endpoint
from tests.support.servers import ServerProcess

Code = grpc.StatusCode
SIZES = {"math": 40, "code": 20, "logic": 10}


def tasks() -> list[Task]:
    return [Task(f"{group}-{i}", {}, group) for group, n in SIZES.items() for i in range(n)]


def experiment(client: bots_client.Client, **config: object) -> str:
    name = f"groups-{uuid.uuid4().hex[:8]}"
    client.create_experiment(name, ExperimentConfig(seed=2, **config))  # type: ignore[arg-type]
    client.add_tasks(name, tasks())
    return name


def counts(batch: bots_client.Batch) -> dict[str, int]:
    return dict(Counter(key.split("-")[0] for key in batch.keys))


def report(client: bots_client.Client, name: str, batch: bots_client.Batch, step: int) -> None:
    client.report_outcomes(name, batch.batch_id, {k: ((sum(map(ord, k)) + step) % 9, 8) for k in batch.keys})


def test_groups_are_listed_with_sizes_and_signals(client: bots_client.Client) -> None:
    name = experiment(client)
    groups = client.list_groups(name)
    assert [(g.name, g.num_tasks, g.num_retired, g.min_share, g.max_share) for g in groups] == [
        ("math", 40, 0, None, None), ("code", 20, 0, None, None), ("logic", 10, 0, None, None),
    ]  # fmt: skip
    # At the prior Beta(1, 1) every mean is 0.5: the target itself; 16 rollouts at 0.5 all agree
    # with chance 2 * 0.5^16. Without adaptive_shares there is no adaptive share.
    assert all(g.mean_success == 0.5 and g.near_target == 1.0 for g in groups)
    assert all(g.informative == pytest.approx(1 - 2 * 0.5**16, rel=1e-12) and g.adaptive_share is None for g in groups)
    client.retire_tasks(name, ["logic-0", "logic-1"])
    assert client.list_groups(name)[2].num_retired == 2
    snap = client.snapshot(name)
    assert snap.groups == [key.split("-")[0] for key in snap.keys]


def test_fixed_shares_are_exact_over_many_batches_and_with_leases(client: bots_client.Client) -> None:
    name = experiment(client)
    client.set_group_shares(name, {"math": 0.5, "code": 0.3, "logic": 0.2})
    for step in range(25):
        batch = client.select_batch(name, 10, request_key=f"s{step}")
        assert counts(batch) == {"math": 5, "code": 3, "logic": 2}
        report(client, name, batch, step)
    # Three batches leased at once: 30 of 70 tasks, 6 of the 10 logic tasks; each batch exact.
    open_batches = [client.select_batch(name, 10, request_key=f"open-{i}") for i in range(3)]
    assert all(counts(b) == {"math": 5, "code": 3, "logic": 2} for b in open_batches)
    assert len({k for b in open_batches for k in b.keys}) == 30


def test_a_short_group_gives_what_it_has_and_the_batch_is_still_full(client: bots_client.Client) -> None:
    name = experiment(client)
    client.set_group_shares(name, {"math": 0.5, "code": 0.3, "logic": 0.2})
    client.retire_tasks(name, [f"logic-{i}" for i in range(9)])  # one logic task left
    batch = client.select_batch(name, 10, request_key="short")
    got = counts(batch)
    # logic gives its 1; math and code are at their maxima (5, 3), so the last
    # slot goes to the best remaining task of either, beyond its maximum.
    assert got["logic"] == 1 and sum(got.values()) == 10 and got["math"] + got["code"] == 9
    assert got["math"] >= 5 and got["code"] >= 3


def test_minimum_and_maximum_shares(client: bots_client.Client) -> None:
    name = experiment(client)
    groups = client.set_group_shares(name, {"logic": (0.4, 1.0), "math": (0.0, 0.2)})
    assert [(g.name, g.min_share, g.max_share) for g in groups] == [
        ("math", 0.0, 0.2), ("code", None, None), ("logic", 0.4, 1.0),
    ]  # fmt: skip
    for step in range(15):
        batch = client.select_batch(name, 10, request_key=f"s{step}")
        got = counts(batch)
        assert got.get("logic", 0) >= 4 and got.get("math", 0) <= 2, got
        report(client, name, batch, step)
    client.set_group_shares(name, {})  # no quotas again
    assert all(g.min_share is None for g in client.list_groups(name))


def test_adaptive_shares_move_batches_away_from_a_solved_group(client: bots_client.Client) -> None:
    """Groups without shares set, adaptive_shares=1: equal shares while every
    group is at the prior (40, 20 and 10 tasks: the ranking alone would favour
    math's 40), then math, solved (every rollout right, code and logic half
    right), keeps about f_math / sum(f) = 0.05 of a batch: 0 or 1 of 10."""
    name = experiment(client, rollouts_per_task=8, adaptive_shares=1.0)
    per_batch = []
    for step in range(12):
        batch = client.select_batch(name, 10, request_key=f"s{step}")
        client.report_outcomes(name, batch.batch_id, {k: (8 if k.startswith("math") else 4, 8) for k in batch.keys})
        per_batch.append(counts(batch))
    assert sorted(per_batch[0].values()) == [3, 3, 4], per_batch[0]
    assert all(c.get("math", 0) <= 1 for c in per_batch[3:]), per_batch
    # ListGroups shows what the shares follow: math's reports never differ, code's and logic's
    # (4 of 8) do with chance 1 - 2 * 0.5^8; the prior (one report of 8) lifts math's estimate a little.
    groups = {g.name: g for g in client.list_groups(name)}
    assert groups["math"].informative < 0.2 and groups["code"].informative == pytest.approx(1 - 2 * 0.5**8)
    shares = [g.adaptive_share for g in groups.values()]
    assert all(s is not None for s in shares) and sum(shares) == pytest.approx(1.0)  # type: ignore[arg-type]
    f = {n: g.informative for n, g in groups.items()}
    assert groups["math"].adaptive_share == pytest.approx(f["math"] / sum(f.values()))


def test_adaptive_shares_out_of_range_are_rejected(client: bots_client.Client) -> None:
    for value in (1.5, -0.1, float("nan")):
        with pytest.raises(bots_client.InvalidArgumentError) as info:
            client.create_experiment(f"bad-{uuid.uuid4().hex[:8]}", ExperimentConfig(adaptive_shares=value))
        assert "adaptive_shares" in info.value.message


def test_bad_shares_are_rejected_and_change_nothing(client: bots_client.Client) -> None:
    name = experiment(client)
    client.set_group_shares(name, {"math": 0.5, "code": 0.5})
    before = client.list_groups(name)
    cases = [
        ("no tasks in groups 'poetry'", {"math": 0.5, "poetry": 0.5}),
        ("fixed shares of every group sum to 0.9, not 1", {"math": 0.5, "code": 0.3, "logic": 0.1}),
        ("minimum shares sum to 1.2, more than 1", {"math": (0.6, 1.0), "code": (0.6, 1.0)}),
        ("maximum shares sum to 0.6, less than 1", {"math": (0, 0.2), "code": (0, 0.2), "logic": (0, 0.2)}),
        ("0 <= min <= max <= 1", {"math": (0.6, 0.4)}),
        ("0 <= min <= max <= 1", {"math": (0.2, 1.5)}),
        ("0 <= min <= max <= 1", {"math": (float("nan"), 0.5)}),
        ("group is empty", {"": 0.5}),
    ]
    for fragment, shares in cases:
        with pytest.raises(bots_client.InvalidArgumentError) as info:
            client.set_group_shares(name, shares)  # type: ignore[arg-type]
        assert fragment in info.value.message, info.value.message
    with pytest.raises(bots_client.NotFoundError):
        client.set_group_shares("no-such-experiment", {"math": 1.0})
    assert client.list_groups(name) == before


def test_a_repeated_group_is_rejected(stub) -> None:  # type: ignore[no-untyped-def]
    from bots_client.proto import bots_pb2 as pb

    request = pb.SetGroupSharesRequest(experiment="any")
    request.shares.add(group="a", min_share=0.5, max_share=0.5)
    request.shares.add(group="a", min_share=0.5, max_share=0.5)
    with pytest.raises(grpc.RpcError) as info:
        stub.SetGroupShares(request, timeout=10)
    assert info.value.code() == Code.INVALID_ARGUMENT and "appears more than once" in info.value.details()


def test_forks_and_restores_keep_groups_and_shares(client: bots_client.Client) -> None:
    name = experiment(client)
    client.set_group_shares(name, {"math": 0.5, "code": 0.3, "logic": 0.2})
    fork = f"{name}-fork"
    client.fork_experiment(name, fork)
    assert client.list_groups(fork) == client.list_groups(name)
    assert counts(client.select_batch(fork, 10, request_key="f")) == {"math": 5, "code": 3, "logic": 2}
    restored = f"{name}-restored"
    snapshot = client.snapshot(name, include_features=True)
    assert snapshot.shares == {"math": (0.5, 0.5), "code": (0.3, 0.3), "logic": (0.2, 0.2)}
    client.restore_experiment(restored, snapshot)
    # The shares too (they were dropped: a restored mix drew other batches).
    assert client.list_groups(restored) == client.list_groups(name)
    assert client.snapshot(restored).groups == client.snapshot(name).groups
    assert client.snapshot(restored).shares == snapshot.shares
    assert counts(client.select_batch(restored, 10, request_key="r")) == {"math": 5, "code": 3, "logic": 2}


def test_a_restore_with_shares_its_groups_cannot_meet_changes_nothing(client: bots_client.Client) -> None:
    name = experiment(client)
    snapshot = client.snapshot(name, include_features=True)
    for shares, problem in (
        ({"nowhere": (0.1, 0.2)}, "has no tasks in groups 'nowhere'"),
        ({"math": (0.8, 0.8), "code": (0.5, 0.5)}, "minimum shares sum to 1.3, more than 1"),
        ({"math": (0.6, 0.2)}, "shares must satisfy 0 <= min <= max <= 1"),
    ):
        bad = dataclasses.replace(snapshot, shares=shares)
        with pytest.raises(bots_client.InvalidArgumentError, match=re.escape(problem)):
            client.restore_experiment(f"{name}-bad", bad)
        with pytest.raises(bots_client.NotFoundError):
            client.get_experiment(f"{name}-bad")


def test_the_async_client_sets_and_lists_groups(client: bots_client.Client, endpoint: Endpoint) -> None:
    name = experiment(client)

    async def run() -> list[bots_client.GroupInfo]:
        async with endpoint.connect_async(retry_timeout=5) as aclient:
            await aclient.set_group_shares(name, {"math": (0.1, 0.9)})
            return await aclient.list_groups(name)

    groups = asyncio.run(run())
    assert (groups[0].name, groups[0].min_share, groups[0].max_share) == ("math", 0.1, 0.9)


@pytest.mark.parametrize("adaptive", [0.0, 1.0], ids=["shares", "adaptive-shares"])
def test_groups_and_shares_survive_a_crash_and_batches_continue_identically(tmp_path, adaptive: float) -> None:
    """Also with adaptive shares: they read only the replayed posterior."""
    args = ["--checkpoint-every-steps", "3", "--checkpoint-every-seconds", "3600"]
    picks: list[list[list[str]]] = []
    for crash in (False, True):
        db = f"sqlite:///{tmp_path / f'groups-{crash}.db'}"
        server = ServerProcess(db, extra_args=args).start()
        try:
            run: list[list[str]] = []
            with bots_client.Client(server.address) as client:
                client.create_experiment("mix", ExperimentConfig(seed=9, adaptive_shares=adaptive))
                client.add_tasks("mix", tasks())
                client.set_group_shares("mix", {"math": 0.6, "code": (0.2, 0.4)})
                for step in range(5):
                    batch = client.select_batch("mix", 10, request_key=f"s{step}")
                    report(client, "mix", batch, step)
                    run.append(batch.keys)
                before = client.snapshot("mix")
            if crash:
                server.kill()
                server = ServerProcess(db, extra_args=args).start()
            with bots_client.Client(server.address) as client:
                after = client.snapshot("mix")
                assert after.alpha.tobytes() == before.alpha.tobytes() and after.groups == before.groups
                assert [(g.name, g.min_share, g.max_share) for g in client.list_groups("mix")][:2] == [
                    ("math", 0.6, 0.6), ("code", 0.2, 0.4),
                ]  # fmt: skip
                for step in range(5, 9):
                    batch = client.select_batch("mix", 10, request_key=f"s{step}")
                    report(client, "mix", batch, step)
                    run.append(batch.keys)
            picks.append(run)
        finally:
            server.kill()
    assert picks[0] == picks[1]
