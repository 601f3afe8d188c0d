"""An experiment's PosteriorState as the checkpoint's bytes, and back.

Every field of PosteriorState is written, whatever it is: arrays as arrays,
the rest as scalars. A field added to PosteriorState later rides along with
no change here; a checkpoint written before the field existed reads it at its
starting value (the value a new task or experiment gets).

Except the pool's data that the tasks rows hold already: the embeddings
(up to 16 KiB a task, fixed once added) would make every checkpoint as large
as the pool's vectors, written again every few steps. A rebuild reads them
from the tasks rows (LiveExperiment.rebuild); a checkpoint's state has none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from bots_server.engine import PosteriorState
from bots_server.engine.params import EngineParams
from bots_server.store import checkpoint_blob

# Fields a rebuild takes from the tasks rows, never from the checkpoint.
FROM_TASK_ROWS = frozenset({"embeddings"})


def encode_state(state: PosteriorState) -> memoryview:
    """The whole state as one value. Reads the arrays only (they are never
    changed in place), so it may run off the experiment's lock."""
    arrays: dict[str, np.ndarray] = {}
    scalars: dict[str, Any] = {}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if field.name in FROM_TASK_ROWS:
            continue
        if value is None:
            continue  # an optional array the experiment does not have: read back at its starting value
        if isinstance(value, np.ndarray):
            arrays[field.name] = value
        else:
            scalars[field.name] = value
    return checkpoint_blob.encode(state.num_tasks, arrays, scalars)


def decode_state(blob: bytes, params: EngineParams) -> PosteriorState:
    """The state a checkpoint holds (no tasks for an empty one)."""
    if not blob:
        return PosteriorState.from_prior(params, np.empty(0), np.empty(0))
    content = checkpoint_blob.decode(blob)
    names = {f.name for f in dataclasses.fields(PosteriorState)}
    unknown = sorted((content.arrays.keys() | content.scalars.keys()) - names)
    if unknown:
        # A newer server wrote it: dropping a field could change replays.
        raise RuntimeError(
            f"checkpoint holds state this server does not know ({', '.join(unknown)}); upgrade the server"
        )
    n = content.num_tasks
    nan = np.full(n, math.nan)
    start = PosteriorState.from_prior(
        params, _array(content.arrays, "weak", nan), _array(content.arrays, "strong", nan)
    )
    values: dict[str, Any] = {}
    for field in dataclasses.fields(PosteriorState):
        if field.name in FROM_TASK_ROWS:
            values[field.name] = None  # the caller attaches them from the tasks rows
        elif field.name in content.arrays:
            values[field.name] = np.array(content.arrays[field.name])  # owned and writable, not a view of the blob
        elif field.name in content.scalars:
            values[field.name] = content.scalars[field.name]
        else:
            values[field.name] = getattr(start, field.name)
    return PosteriorState(**values)


def _array(arrays: Mapping[str, np.ndarray], name: str, default: np.ndarray) -> np.ndarray:
    return np.asarray(arrays.get(name, default), dtype=np.float64)
