"""Values stored in pieces or packed: the checkpoint value in chunks, the task
keys and groups in blocks, a step's outcomes and a batch's tasks as one
value each. Byte handling only; the SQL is in sql.py."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

from bots_server.store import checkpoint_blob

# A checkpoint chunk: what one write transaction adds. Small enough that a
# transaction holds SQLite's write lock for a few milliseconds, large enough
# that a 1M-task value (32 MB) is a few dozen rows. A multiple of 8, so that
# no float8 of the value straddles two chunks (the PostgreSQL view reads
# each from one chunk).
CHUNK_BYTES = 1 << 20

# Task keys per block when blocks are made from existing rows (migration,
# copies); AddTasks writes one block per call.
KEY_BLOCK_TASKS = 1 << 16


def chunk_bytes(state: bytes | memoryview) -> int:
    """The chunk size for `state`: CHUNK_BYTES, or more if the value's header
    is longer (the view reads the header from the first chunk alone)."""
    return max(CHUNK_BYTES, (checkpoint_blob.data_start(state) + 7) // 8 * 8)


def chunks(state: bytes | memoryview, size: int) -> Iterator[memoryview]:
    """The value's chunks, as views: the drivers take them without a copy."""
    view = memoryview(state)
    for start in range(0, len(view), size):
        yield view[start : start + size]


def join_texts(values: Sequence[str]) -> bytes:
    """Strings without NUL (keys and group names: validation forbids it) as one value."""
    return "\x00".join(values).encode()


def split_texts(blob: bytes, count: int) -> list[str]:
    """The `count` strings of a join_texts value."""
    if count == 0:
        return []
    values = bytes(blob).decode().split("\x00")
    if len(values) != count:
        raise RuntimeError(f"a block of {count} task keys holds {len(values)}")
    return values


# A step's outcomes and a batch's tasks, each as one value in one row
# (revision 0009): a step inserts a few rows, not one per task. Little-endian
# on every host, so that a database moves between machines as it is.
_INT64 = struct.Struct("<q")
_OUTCOME_BYTES = 24  # task index (int64), successes (float64), trials (int64)


def pack_tasks(task_idx: Sequence[int]) -> bytes:
    """Task indices, in their order, as one value."""
    return struct.pack(f"<{len(task_idx)}q", *task_idx)


def unpack_tasks(blob: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(blob) // _INT64.size}q", blob))


def pack_outcomes(task_idx: Sequence[int], successes: Sequence[float], trials: Sequence[int]) -> bytes:
    """A step's outcomes as one value: the task indices, then the successes,
    then the trials, each an array of the step's length."""
    n = len(task_idx)
    if not n == len(successes) == len(trials):
        raise ValueError(f"{n} task indices, {len(successes)} successes and {len(trials)} trials")
    return struct.pack(f"<{n}q{n}d{n}q", *task_idx, *successes, *trials)


def unpack_outcomes(blob: bytes) -> tuple[list[int], list[float], list[int]]:
    n, extra = divmod(len(blob), _OUTCOME_BYTES)
    if extra:
        raise RuntimeError(f"a step's outcomes are {len(blob)} bytes, not a multiple of {_OUTCOME_BYTES}")
    values = struct.unpack(f"<{n}q{n}d{n}q", blob)
    return list(values[:n]), list(values[n : 2 * n]), list(values[2 * n :])
