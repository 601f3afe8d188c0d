"""MoPPS (arXiv 2507.04632): the same Beta-Bernoulli Thompson selection with
raw counts as explicit evidence only, and only the reported tasks decay."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bots_server.engine.params import EngineParams
from bots_server.engine.scoring import closeness
from bots_server.engine.state import PosteriorState, UpdateResult
from bots_server.engine.strategies.base import Strategy
from bots_server.engine.strategies.bots import SELECTION_SETTINGS


def update(
    params: EngineParams, state: PosteriorState, tasks: np.ndarray, successes: np.ndarray, trials: np.ndarray
) -> UpdateResult:
    lam = params.forgetting
    alpha = state.alpha.copy()
    beta = state.beta.copy()
    alpha[tasks] = (1 - lam) * alpha[tasks] + lam * params.prior_alpha + successes
    beta[tasks] = (1 - lam) * beta[tasks] + lam * params.prior_beta + (trials - successes)
    return UpdateResult(dataclasses.replace(state, alpha=alpha, beta=beta), math.nan)


STRATEGY = Strategy(
    name="mopps",
    doc="explicit evidence only (raw counts), only reported tasks forget",
    settings=SELECTION_SETTINGS + ("forgetting", "prior_alpha", "prior_beta"),
    score=closeness,
    update=update,
)
