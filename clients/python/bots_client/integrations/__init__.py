"""Trainer integrations: delegate a training run's curriculum to a BOTS server.

One module per framework; each imports its framework only when one of its
classes is first used, so `import bots_client` (and this package) never needs
torch:

- `bots_client.integrations.torch`: `BotsSampler` / `BotsBatchSampler`, a
  `torch.utils.data` sampler drawing each batch from SelectBatch (DDP-safe,
  resumable). Extra: `bots-client[torch]`.
- `bots_client.integrations.verl`: `BotsCurriculumSampler`, for verl's
  `data.sampler.class_path` / `class_name`. Extra: `bots-client[verl]`.
- `bots_client.integrations.openrlhf`: a launcher for OpenRLHF 0.11's
  `train_ppo_ray` whose trainer draws every rollout batch from the service
  and reports it, dynamic filtering included.
- `bots_client.integrations.skyrl`: SkyRL 0.3's `RayPPOTrainer` with every
  training batch from the service (`trainer.override_entrypoint`).
- `bots_client.integrations.trl`: `BotsGRPO`, a sampler override and a
  reward-function wrapper for TRL's `GRPOTrainer`. Extra: `bots-client[trl]`.
- `bots_client.integrations.trinity`: `BotsSelector`, a Trinity-RFT data
  selector. Extra: `bots-client[trinity]`.
- `bots_client.integrations.vllm`: roll out a batch with a vLLM `LLM` or an
  OpenAI-compatible endpoint, score it with a verifier and report it.

The shared, framework-free part is `Curriculum` (experiment setup, task key
<-> dataset index, deterministic request keys, reporting from one rank).
"""

from bots_client.integrations._core import (
    Curriculum,
    EmptyReportError,
    GroupSizeMismatchError,
    SelectedBatch,
    UnattributedOutcomesError,
    aggregate_outcomes,
    distributed_rank_and_world,
    merge_outcomes,
)

__all__ = [
    "Curriculum",
    "EmptyReportError",
    "GroupSizeMismatchError",
    "SelectedBatch",
    "UnattributedOutcomesError",
    "aggregate_outcomes",
    "distributed_rank_and_world",
    "merge_outcomes",
]
