"""Trinity's explore loop in a process of its own, for the SIGKILL test of
the Trinity adapter (tests/integrations/test_trinity.py).

    python -m tests.integrations.trinity_explorer ADDRESS EXPERIMENT DATA_DIR CHECKPOINT STEPS

Builds the real TasksetScheduler of `trinity_config` (BotsSelector, 4
rollouts per task), restores Trinity's explorer state from CHECKPOINT when
the file exists, prints "ready", and explores to the end: each step reads a
batch, rolls it out (the stand-in verifier), feeds the step before back
(lag 1), prints "step N" and writes the explorer state atomically, as
Trinity's explorer saves it. Exits 0 when the taskset is exhausted and every feedback is in.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.integrations.test_trinity import EXACT_4, TrinityExplorer, trinity_config


def main(address: str, experiment: str, data_dir: Path, checkpoint: Path, steps: int) -> int:
    kwargs = {"address": address, "experiment": experiment, "key_field": "id", "experiment_config": EXACT_4}
    config = trinity_config(data_dir, kwargs, repeat_times=4, total_steps=steps)
    state = json.loads(checkpoint.read_text()) if checkpoint.exists() else None
    explorer = TrinityExplorer(config, state)
    print("ready", flush=True)
    while explorer.explore_step():
        print(f"step {explorer.step}", flush=True)
        tmp = checkpoint.with_suffix(".tmp")
        tmp.write_text(json.dumps(explorer.checkpoint()))
        os.replace(tmp, checkpoint)
    while explorer.in_flight:
        explorer.finish_oldest()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])))
