"""Pure numpy math of task selection: arrays in, arrays out, no I/O.

Deterministic given (seed, step, request key). Used by the server and usable
in-process (benchmarks compare against it).
"""

from bots_server.engine.params import EngineParams, SelectionMode, Strategy
from bots_server.engine.posterior import PosteriorState, UpdateResult, apply_outcomes
from bots_server.engine.rng import step_rng
from bots_server.engine.selection import select

__all__ = [
    "EngineParams",
    "PosteriorState",
    "SelectionMode",
    "Strategy",
    "UpdateResult",
    "apply_outcomes",
    "select",
    "step_rng",
]
