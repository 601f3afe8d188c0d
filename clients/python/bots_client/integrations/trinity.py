"""Trinity-RFT: a data selector backed by the BOTS service.

Trinity-RFT builds a taskset's selector from `data_selector.selector_type`,
which may be a dotted class path, as `cls(data_source, config)` where
`data_source` is its `_HFBatchReader` (`.dataset`, `.dataset_size`) and
`config` its `DataSelectorConfig` (`selector_type`, `seed`, `feature_keys`,
`kwargs`). It then calls `get_indices(batch_size)` per explore step,
`feedback(indices, values)` with each task's mean reward (from the
`pass_rate_calculator` experience operator), and `state_dict()` /
`load_state_dict()` at checkpoints. In the explorer config:

    buffer:
      explorer_input:
        taskset:
          data_selector:
            selector_type: bots_client.integrations.trinity.BotsSelector
            feature_keys: [qwen2.5_7b_pass_rate, qwen3_30b_pass_rate]  # weak, strong (optional)
            kwargs:
              address: bots.internal:50051
              experiment: math-run-3
              key_field: id          # optional: a unique column; default the row position
              m: 16                  # rollouts per task (= repeat_times)
              lamb: 0.1              # Trinity's BOTS knobs map onto ExperimentConfig
              rho: 0.1
              target_reward: 0.5
              do_sample: true
              tau: 0
    data_processor:
      experience_pipeline:
        operators:
          - name: pass_rate_calculator

The same kwargs as Trinity's own `difficulty_based` selector work here, so the
switch is one line; the posterior then lives in the service (and survives
restarts), not in the explorer process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bots_client.integrations._core import Curriculum, SelectedBatch
from bots_client.types import ExperimentConfig, ReportResult

__all__ = ["BotsSelector", "experiment_config_from_trinity"]

log = logging.getLogger("bots_client.integrations.trinity")

_OWN_KWARGS = {"address", "experiment", "key_field", "experiment_config", "request_prefix", "batch_size"}
_TRINITY_KWARGS = {"m", "lamb", "rho", "target_reward", "do_sample", "tau", "adaptive_rho"}


def experiment_config_from_trinity(
    kwargs: Mapping[str, Any], *, seed: int = 0, with_features: bool = False
) -> ExperimentConfig:
    """Trinity's BOTS selector knobs (examples/bots/bots.yaml) as an
    ExperimentConfig: m -> rollouts_per_task, lamb -> forgetting, rho ->
    implicit_weight, target_reward -> target_success; do_sample picks
    Thompson draws (else posterior means); tau > 0 samples from a softmax."""
    tau = float(kwargs.get("tau", 0.0))
    do_sample = bool(kwargs.get("do_sample", True))
    if tau > 0:
        mode = "softmax"
        if not do_sample:
            log.warning("tau > 0 with do_sample = false: the service's softmax scores Thompson draws")
    else:
        mode = "thompson" if do_sample else "mean"
    if kwargs.get("adaptive_rho"):
        log.warning("adaptive_rho is not supported by the service; rho stays fixed")
    return ExperimentConfig(
        strategy="bots",
        target_success=float(kwargs.get("target_reward", 0.5)),
        forgetting=float(kwargs.get("lamb", 0.1)),
        implicit_weight=float(kwargs.get("rho", 0.1)) if with_features else 0.0,
        rollouts_per_task=int(kwargs.get("m", 16)),
        selection_mode=mode,
        temperature=tau if tau > 0 else 1.0,
        weak_feature="weak" if with_features else "",
        strong_feature="strong" if with_features else "",
        seed=int(seed),
    )


class BotsSelector:
    """A Trinity-RFT selector (`get_indices`, `feedback` / `update`,
    `state_dict`, `load_state_dict`) whose choices come from the service.

    kwargs: address (or env BOTS_ADDRESS), experiment (or env
    BOTS_EXPERIMENT), key_field (a unique column; default the row position),
    experiment_config (a dict of ExperimentConfig fields) or Trinity's own
    knobs (m, lamb, rho, target_reward, do_sample, tau), request_prefix.
    `feature_keys`, if given, name two columns: the weaker and the stronger
    reference model's pass rate (the implicit-evidence plug-in).
    """

    def __init__(self, data_source: Any, config: Any) -> None:
        kwargs = dict(getattr(config, "kwargs", None) or {})
        unknown = set(kwargs) - _OWN_KWARGS - _TRINITY_KWARGS
        if unknown:
            raise ValueError(f"unknown BotsSelector kwargs {sorted(unknown)}")
        address = kwargs.get("address") or os.environ.get("BOTS_ADDRESS")
        experiment = kwargs.get("experiment") or os.environ.get("BOTS_EXPERIMENT")
        if not address or not experiment:
            raise ValueError(
                "BotsSelector needs kwargs.address and kwargs.experiment (or BOTS_ADDRESS, BOTS_EXPERIMENT)"
            )
        self.data_source = data_source
        self.config = config
        dataset = data_source.dataset
        self.dataset_size = int(data_source.dataset_size)
        key_field = kwargs.get("key_field")
        keys: Sequence[Any] = list(dataset[key_field]) if key_field else [str(i) for i in range(self.dataset_size)]
        feature_keys = list(getattr(config, "feature_keys", None) or [])
        features = None
        if feature_keys:
            if len(feature_keys) != 2:
                raise ValueError(f"feature_keys names the weak and the strong pass-rate columns; got {feature_keys}")
            weak, strong = (list(dataset[k]) for k in feature_keys)
            features = [{"weak": float(w), "strong": float(s)} for w, s in zip(weak, strong)]
        seed = int(getattr(config, "seed", 0) or 0)
        if kwargs.get("experiment_config") is not None:
            exp_config = ExperimentConfig(**dict(kwargs["experiment_config"]))
        else:
            exp_config = experiment_config_from_trinity(kwargs, seed=seed, with_features=features is not None)
        self.rollouts_per_task = exp_config.rollouts_per_task
        self.curriculum = Curriculum(
            address,
            str(experiment),
            keys,
            batch_size=int(kwargs.get("batch_size") or 1),
            config=exp_config,
            features=features,
            request_prefix=str(kwargs.get("request_prefix", "step")),
            rank=0,
            world_size=1,  # the explorer owns the taskset
        )
        self.current_index = 0  # samples handed out, as Trinity's selectors count
        self.step = 0  # batches handed out
        self.last_batch: SelectedBatch | None = None

    def get_indices(self, batch_size: int, return_extra_info: bool = False) -> Any:
        """The next batch's dataset indices (and, if asked, its keys and ids)."""
        batch = self.curriculum.select(self.step, batch_size=batch_size)
        self.last_batch = batch
        self.step += 1
        self.current_index += batch_size
        indices = np.asarray(batch.indices, dtype=np.int64)
        if not return_extra_info:
            return indices
        extra = {
            "indices": list(batch.indices),
            "keys": list(batch.keys),
            "batch_id": batch.batch_id,
            "server_step": batch.step,
        }
        return indices, extra

    def feedback(self, indices: Sequence[int], values: Sequence[float]) -> list[ReportResult]:
        """Report each task's mean reward over its rollouts (values in [0, 1],
        as Trinity's pass_rate_calculator gives) as mean * m successes of m
        trials. Tasks already reported, or never drawn, are skipped."""
        if len(indices) != len(values):
            raise ValueError(f"got {len(indices)} indices but {len(values)} values")
        m = self.rollouts_per_task
        outcomes = {}
        for index, value in zip(indices, values):
            rate = min(max(float(value), 0.0), 1.0)
            outcomes[self.curriculum.keys[int(index)]] = (rate * m, m)
        return self.curriculum.report(outcomes, strict=False)

    update = feedback  # the name in the issue and in older Trinity releases

    def state_dict(self) -> dict[str, Any]:
        """What the explorer checkpoints: the position, and the batches drawn
        whose feedback had not arrived yet (the explorer runs ahead of its
        feedback), with the server step of the last acknowledged report."""
        return {
            "current_index": self.current_index,
            "experiment": self.curriculum.experiment,
            "step": self.step,
            **self.curriculum.resume_state(self.step),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        experiment = state_dict.get("experiment", self.curriculum.experiment)
        if experiment != self.curriculum.experiment:
            raise ValueError(
                f"checkpoint is of experiment {experiment!r}, this selector uses {self.curriculum.experiment!r}"
            )
        self.current_index = int(state_dict.get("current_index", 0))
        step = int(state_dict.get("step", 0))
        # A batch drawn before the checkpoint whose feedback never reached the
        # server is drawn again (same request key, same tasks): reported once.
        self.step = self.curriculum.resume_number(state_dict, step)
        self.curriculum.next_number = max(self.curriculum.next_number, self.step)
