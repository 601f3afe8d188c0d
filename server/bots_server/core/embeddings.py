"""Task embeddings: each task's vector of the experiment's embedding_dim
float32 values, as the API carries and the store keeps it (little-endian
bytes, one value per task), and as the engine reads it (one float32 array
of shape (num_tasks, embedding_dim) in PosteriorState.embeddings).

The bytes go from the request to the store unchanged and come back out of
snapshots bit for bit; the array is made once per added block of tasks and
once per rebuild (checkpoints leave it out: the tasks rows hold it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# As the API's bytes are: little-endian float32.
DTYPE = np.dtype("<f4")
_ROWS_PER_BLOCK = 4096


def matrix(vectors: Sequence[bytes], dim: int) -> np.ndarray | None:
    """The (len(vectors), dim) float32 array of validated embeddings; None
    for an experiment without embeddings (dim 0)."""
    if dim == 0:
        return None
    values = np.empty((len(vectors), dim), dtype=np.float32)
    # In blocks: the joined bytes of a block at a time, not a second copy of all.
    for start in range(0, len(vectors), _ROWS_PER_BLOCK):
        block = vectors[start : start + _ROWS_PER_BLOCK]
        values[start : start + len(block)] = np.frombuffer(b"".join(block), dtype=DTYPE).reshape(len(block), dim)
    return values


def as_bytes(values: np.ndarray | None, start: int = 0, stop: int | None = None) -> list[bytes]:
    """Rows start..stop-1 of an embedding array, each as the API's bytes;
    empty when there is no array."""
    if values is None:
        return []
    block = np.ascontiguousarray(values[start:stop], dtype=DTYPE)
    return [row.tobytes() for row in block]


def bytes_per_task(dim: int) -> int:
    """What one task's embedding holds in memory (and in its tasks row)."""
    return dim * DTYPE.itemsize
