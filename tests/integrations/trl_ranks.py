"""One rank of a real GRPOTrainer run on two processes (torch.distributed
with gloo, on CPU), drawing its prompts from a BOTS server; run by
test_trl.py under `torch.distributed.run`.

    python -m torch.distributed.run --nproc_per_node 2 trl_ranks.py ADDRESS EXPERIMENT OVERLAP OUT_DIR

Environment: REPORT_DELAY, seconds the reporting rank's report RPCs wait
before they are sent (a slow network or a busy server); FAIL_REPORT, the
number of the reporting rank's report RPC that fails instead (1 = the
first); MAX_STEPS. Writes OUT_DIR/rank{R}.json: the batches this rank drew
(request key, server step, task keys), the error train() raised, and on the
reporting rank the experiment's posterior and step at the end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import bots_client
from bots_client.integrations.trl import BotsGRPO
from tests.integrations.test_trl import _tiny_model_and_tokenizer, _train_dataset


def _slow_or_failing(method: Any, calls: list[str], delay: float, fail_at: int) -> Any:
    """`method` sent `delay` seconds late; call number `fail_at` of the
    methods sharing `calls` fails instead."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(method.__name__)
        if len(calls) == fail_at:
            raise bots_client.UnavailableError("injected: the service went away")
        time.sleep(delay)
        return method(*args, **kwargs)

    return call


def main() -> None:
    address, experiment, overlap, out = sys.argv[1], sys.argv[2], sys.argv[3] == "1", Path(sys.argv[4])
    delay = float(os.environ.get("REPORT_DELAY", "0"))
    fail_at = int(os.environ.get("FAIL_REPORT", "0"))
    from trl import GRPOConfig, GRPOTrainer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, tokenizer = _tiny_model_and_tokenizer()
    train = _train_dataset()
    config = bots_client.ExperimentConfig(rollouts_per_task=4, seed=7)
    bots = BotsGRPO(address, experiment, dataset=train, key_column="task_key", config=config, overlap=overlap)
    drawn: list[tuple[str, int, list[str]]] = []
    select = bots.curriculum.select

    def recording_select(*args: Any, **kwargs: Any) -> Any:
        batch = select(*args, **kwargs)
        drawn.append((batch.request_key, batch.step, list(batch.keys)))
        return batch

    bots.curriculum.select = recording_select  # type: ignore[method-assign]

    def correct(prompts: list[str], completions: list[str], task_key: list[str], **kwargs: Any) -> list[float]:
        return [1.0 if int(k.split("-")[1]) % 3 == 0 else 0.0 for k in task_key]

    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=3,
        max_steps=int(os.environ.get("MAX_STEPS", "5")), learning_rate=1e-3, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = bots.trainer_class(GRPOTrainer)(
        model=model, processing_class=tokenizer, reward_funcs=[bots.reward(correct)], args=args, train_dataset=train
    )
    rank = trainer.accelerator.process_index
    if rank == 0 and (delay or fail_at):
        client = bots.curriculum.client
        calls: list[str] = []
        for name in ("report_and_select", "report_outcomes"):
            setattr(client, name, _slow_or_failing(getattr(client, name), calls, delay, fail_at))
    result: dict[str, Any] = {"rank": rank, "drawn": drawn, "error": None}
    try:
        trainer.train()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    if rank == 0 and result["error"] is None:
        client = bots.curriculum.client
        snapshot = client.snapshot(experiment)
        result["alpha"] = [float(a) for a in snapshot.alpha]
        result["beta"] = [float(b) for b in snapshot.beta]
        result["step"] = client.get_experiment(experiment).step
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
