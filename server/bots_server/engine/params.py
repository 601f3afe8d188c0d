"""Algorithm parameters (DESIGN.md section 2)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Strategy(enum.Enum):
    BOTS = "bots"
    MOPPS = "mopps"
    UNIFORM = "uniform"


class SelectionMode(enum.Enum):
    THOMPSON = "thompson"
    MEAN = "mean"
    SOFTMAX = "softmax"


@dataclass(frozen=True)
class EngineParams:
    strategy: Strategy = Strategy.BOTS
    target_success: float = 0.5  # p*
    forgetting: float = 0.1  # lambda
    implicit_weight: float = 0.1  # rho
    rollouts_per_task: int = 16  # m
    selection_mode: SelectionMode = SelectionMode.THOMPSON
    temperature: float = 1.0  # softmax only
    prior_alpha: float = 1.0  # a0
    prior_beta: float = 1.0  # b0
    capability_ema: float = 0.9
