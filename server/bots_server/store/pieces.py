"""Large values stored in pieces: the checkpoint value in chunks, the task
keys and groups in blocks. Byte handling only; the SQL is in sql.py."""

from __future__ import annotations

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


def chunk_bytes(state: bytes) -> int:
    """The chunk size for `state`: CHUNK_BYTES, or more if the value's header
    is longer (the view reads the header from the first chunk alone)."""
    return max(CHUNK_BYTES, (checkpoint_blob.data_start(state) + 7) // 8 * 8)


def chunks(state: bytes, size: int) -> Iterator[bytes]:
    view = memoryview(state)
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])


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
