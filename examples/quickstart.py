"""A first run: 100 synthetic tasks, 30 training steps, outcomes made up here.

Start a server (`make serve`: 127.0.0.1:50051; BOTS_SERVER=HOST:PORT, or
BOTS_ADDRESS, for another), then run `.venv/bin/python examples/quickstart.py`. Run it again:
it resumes the same experiment where the last run stopped.
"""

import random

import bots_client
from bots_client import ExperimentConfig, Task

NAME, BATCH, ROLLOUTS = "quickstart", 16, 8
# The synthetic policy: task i is solved with probability i/100 (0 = hopeless, 0.99 = trivial).
solve_rate = {f"task-{i:02d}": i / 100 for i in range(100)}

client = bots_client.Connection.from_env().client()
experiment = client.get_or_create_experiment(NAME, ExperimentConfig(rollouts_per_task=ROLLOUTS, seed=0))
if experiment.num_tasks == 0:
    client.add_tasks(NAME, [Task(key) for key in solve_rate])

off_target = []  # per batch: how far its tasks' solve rates are from 0.5, the target, on average
for step in range(experiment.step, experiment.step + 30):  # step: the reports applied so far
    # A request key names the batch: asked again after a crash, the same batch comes back.
    batch = client.select_batch(NAME, batch_size=BATCH, request_key=f"step-{step}")
    rng = random.Random(f"{NAME}/{step}")
    rewards = {key: (sum(rng.random() < solve_rate[key] for _ in range(ROLLOUTS)), ROLLOUTS) for key in batch.keys}
    report = client.report_outcomes(NAME, batch.batch_id, rewards)  # key -> (successes, rollouts)
    off_target.append(sum(abs(solve_rate[key] - 0.5) for key in batch.keys) / BATCH)
    if report.step % 10 == 0:
        recent = sum(off_target[-10:]) / len(off_target[-10:])
        print(f"step {report.step}: batches {recent:.2f} off the target solve rate (random batches: 0.25)")
client.close()
