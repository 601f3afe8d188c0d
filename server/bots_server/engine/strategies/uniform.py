"""Uniform random batches, the baseline; the posterior is still tracked with
the BOTS update, for monitoring."""

from __future__ import annotations

import numpy as np

from bots_server.engine.params import EngineParams
from bots_server.engine.strategies import bots
from bots_server.engine.strategies.base import Strategy


def score(params: EngineParams, alpha: np.ndarray, beta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return rng.random(size=(alpha.shape[0],))


STRATEGY = Strategy(
    name="uniform",
    doc="uniform random selection; the posterior is tracked with the BOTS update",
    settings=bots.UPDATE_SETTINGS,
    score=score,
    update=bots.update,
)
