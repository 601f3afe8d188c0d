"""Uploads cancelled at random moments (while streaming, after the last
message, during the commit) commit all of the stream or none of it, never
part: AddTasks and RestoreExperiment over a real socket, on both backends."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import random
import uuid
from collections.abc import AsyncIterator

import grpc
import numpy as np

import bots_client
from bots_client import _calls
from bots_client.proto import bots_pb2_grpc as pb_grpc
from tests.support.servers import ServerProcess

TRIALS = 100  # per backend
SIZES = (1, 40, 3000, 20000)


def snapshot_for(keys: list[str]) -> bots_client.Snapshot:
    experiment = bots_client.Experiment(
        name="source", config=bots_client.ExperimentConfig(), step=4, num_tasks=len(keys), open_batches=0,
        capability=None, create_time=dt.datetime.now(dt.UTC),
    )  # fmt: skip
    n = len(keys)
    return bots_client.Snapshot(experiment, keys, np.full(n, 2.0), np.full(n, 3.0), [{"f": 1.0}] * n)


async def messages(chunks: list[object], rng: random.Random) -> AsyncIterator[object]:
    for chunk in chunks:
        if rng.random() < 0.3:
            await asyncio.sleep(rng.uniform(0, 0.01))
        yield chunk


async def trials(address: str, seed: int) -> collections.Counter[str]:
    rng = random.Random(seed)
    seen: collections.Counter[str] = collections.Counter()
    async with bots_client.AsyncClient(address) as client, grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TaskSelectorStub(channel)
        for trial in range(TRIALS):
            n = rng.choice(SIZES)
            name = f"cancel-{trial}-{uuid.uuid4().hex[:6]}"
            keys = [f"k{i}" for i in range(n)]
            restoring = rng.random() < 0.3
            if restoring:
                chunks: list[object] = _calls.restore_chunks(name, snapshot_for(keys), None, "", chunk_bytes=20_000)
                call = stub.RestoreExperiment(messages(chunks, rng))
            else:
                await client.create_experiment(name)
                chunks = _calls.task_chunks(name, [bots_client.Task(k, {"f": 1.0}) for k in keys], chunk_bytes=20_000)
                call = stub.AddTasks(messages(chunks, rng))
            # Cancel anywhere from mid-stream to well into the commit; a few
            # uploads run to the end, whatever the machine's load.
            cancelled = False
            if rng.random() >= 0.15:
                await asyncio.sleep(rng.uniform(0, 0.02 + n * 2e-5))
                cancelled = call.cancel()
            try:
                await call
                outcome = "completed"
            except asyncio.CancelledError:
                outcome = "cancelled"
            except grpc.RpcError as e:
                outcome = e.code().name.lower()
            try:
                stored = (await client.get_experiment(name)).num_tasks
            except bots_client.NotFoundError:
                stored = 0
            assert stored in (0, n), f"partial commit: {stored} of {n} tasks ({outcome}, cancel() -> {cancelled})"
            if outcome == "completed":
                assert stored == n
            seen[f"{outcome}, {'all' if stored else 'none'} stored"] += 1
    return seen


def test_cancelled_uploads_commit_all_or_nothing(fresh_db_url: str) -> None:
    server = ServerProcess(fresh_db_url).start()
    try:
        seen = asyncio.run(trials(server.address, seed=fresh_db_url.startswith("sqlite")))
    finally:
        server.stop()
    assert sum(seen.values()) == TRIALS
    # The trials did cancel, and the uploads left alone got through. A cancel that
    # arrives after the commit (during COMMIT, or while the answer travels)
    # finds the upload applied in full: "cancelled, all stored".
    assert seen["cancelled, none stored"] > 0 and seen["completed, all stored"] > 0
