"""Pure numpy math of task selection: arrays in, arrays out, no I/O.

Deterministic given (seed, step, request key). Used by the server and usable
in-process (benchmarks compare against it). Strategies live one per module
in `strategies/`; their parameters are declared in `params.py`.
"""

from bots_server.engine.params import SELECTION_MODES, EngineParams, Setting, settings
from bots_server.engine.quotas import GroupQuotas, adapted_quotas, informative_fractions, share_problem
from bots_server.engine.rewards import evidence_of, evidence_successes
from bots_server.engine.rng import step_rng
from bots_server.engine.state import PosteriorState, UpdateResult
from bots_server.engine.steps import apply_outcomes, select
from bots_server.engine.summary import (
    BatchSignals,
    GroupSummary,
    PosteriorSummary,
    batch_signals,
    group_summary,
    posterior_summary,
)

__all__ = [
    "SELECTION_MODES",
    "BatchSignals",
    "EngineParams",
    "GroupQuotas",
    "GroupSummary",
    "PosteriorState",
    "PosteriorSummary",
    "Setting",
    "UpdateResult",
    "adapted_quotas",
    "apply_outcomes",
    "batch_signals",
    "evidence_of",
    "evidence_successes",
    "group_summary",
    "informative_fractions",
    "posterior_summary",
    "select",
    "settings",
    "share_problem",
    "step_rng",
]
