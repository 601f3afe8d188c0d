"""A trainer that reports in the background and checkpoints after every step,
for the crash test of the overlapped report (tests/integrations/test_torch.py).

    python -m tests.support.overlap_trainer ADDRESS EXPERIMENT CHECKPOINT STEPS

It resumes from CHECKPOINT (a JSON sampler state) when the file exists, prints
"ready" once its imports are done, and exits 0 after STEPS reported batches.
Each step: draw a batch, report deterministic outcomes (in the background),
stand in for the gradient step (20 ms, while the report runs), then write the
checkpoint (which waits for the report) atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import bots_client
from bots_client.integrations.torch import BotsSampler

KEYS = [f"task-{i:02d}" for i in range(24)]
CONFIG = bots_client.ExperimentConfig(strategy="mopps", forgetting=0.0, implicit_weight=0.0, seed=7, rollouts_per_task=4)


def outcome(key: str, number: int) -> tuple[float, int]:
    """The same rollouts for a batch however often it is drawn again."""
    h = int.from_bytes(hashlib.sha256(f"{key}/{number}".encode()).digest()[:4], "little")
    return float(h % 5), 4


def main(address: str, experiment: str, checkpoint: Path, steps: int) -> int:
    sampler = BotsSampler(address, experiment, KEYS, batch_size=4, num_batches=6, config=CONFIG)
    if checkpoint.exists():
        sampler.load_state_dict(json.loads(checkpoint.read_text()))
    print("ready", flush=True)
    epochs = iter(lambda: iter(sampler), None)
    indices = (i for epoch in epochs for i in epoch)
    while sampler.step < steps:
        for _ in range(sampler.local_batch_size):
            next(indices)
        batch = sampler.last_batch
        assert batch is not None
        sampler.report({k: outcome(k, batch.number) for k in batch.keys}, batch=batch)
        time.sleep(0.02)  # the gradient step: the report runs meanwhile
        tmp = checkpoint.with_suffix(".tmp")
        tmp.write_text(json.dumps(sampler.state_dict()))
        os.replace(tmp, checkpoint)
    sampler.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])))
