"""Every task key of an experiment, in task order, held compactly.

A million keys as Python strings in a list plus a dict from key to index cost
about 137 bytes each beyond their characters, and the strings pin the
allocator's arenas they were loaded into. Here the keys are one UTF-8 byte
string with an end offset per key, and the index from key to task is the
keys' hashes, sorted, with the task of each: about 16 bytes per key beyond
its UTF-8 bytes (an int32 end, an int64 hash, an int32 task index).

A lookup hashes the asked keys, finds them by binary search and compares
the stored bytes, so a hash collision can cost time but never a wrong task.
The hash is Python's own `hash(str)` (SipHash with a per-process key), so
hostile keys cannot be chosen to collide; it is only ever compared within
the process that computed it.

Never changed in place: `extend` builds new arrays and swaps them in with
one assignment, so a reader on another thread sees the old keys or the new.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

_INT32_LIMIT = 2**31 - 1
# Keys decoded at a time when iterating (bounds the temporary strings).
_CHUNK = 65536


@dataclass(frozen=True)
class _Arrays:
    data: bytes  # every key's UTF-8 bytes, in task order
    ends: np.ndarray  # key i is data[ends[i - 1]:ends[i]] (ends[-1] of key 0 read as 0)
    hashes: np.ndarray  # int64, ascending: the hash of every key
    order: np.ndarray  # the task of each entry of `hashes`
    ascii: bool  # every key is ASCII: byte offsets are character offsets


_EMPTY = _Arrays(b"", np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int32), True)


def _index_dtype(limit: int) -> type[np.signedinteger]:
    """The smallest of int32 and int64 that holds values up to `limit`."""
    return np.int32 if limit <= _INT32_LIMIT else np.int64


def _hashes(keys: Sequence[str]) -> np.ndarray:
    return np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys))


def _encode(keys: Sequence[str]) -> tuple[bytes, np.ndarray, bool]:
    """(UTF-8 bytes of all keys, each key's length in bytes, all ASCII)."""
    joined = "".join(keys)
    if joined.isascii():  # the usual case: no per-key encoding
        return joined.encode("ascii"), np.fromiter(map(len, keys), dtype=np.int64, count=len(keys)), True
    encoded = [key.encode("utf-8", "surrogatepass") for key in keys]
    return b"".join(encoded), np.fromiter(map(len, encoded), dtype=np.int64, count=len(keys)), False


class TaskKeys:
    """The keys of tasks 0..n-1: `keys[i]`, `len(keys)`, iteration in task
    order, and `lookup` from keys to task indices. Keys are distinct (the
    caller checks that new keys are new; see `lookup`)."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._arrays = _EMPTY
        if keys:
            self.extend(keys)

    @classmethod
    def from_utf8(cls, data: bytes, ends: np.ndarray) -> TaskKeys:
        """Keys given as their UTF-8 bytes one after the other, key i ending
        at byte ends[i] (how a store may hand them over without a Python
        string per key)."""
        out = cls()
        ends = np.asarray(ends, dtype=np.int64)
        if ends.size and (ends[-1] != len(data) or np.any(np.diff(ends) < 0) or ends[0] < 0):
            raise ValueError("key ends must ascend from 0 to the length of the data")
        text_keys = _decode_range(_Arrays(data, ends, _EMPTY.hashes, _EMPTY.order, data.isascii()), 0, ends.size)
        out.extend(text_keys)
        return out

    def __len__(self) -> int:
        return int(self._arrays.ends.shape[0])

    def __getitem__(self, i: int) -> str:
        a = self._arrays
        n = a.ends.shape[0]
        if not -n <= i < n:
            raise IndexError(f"task index {i} out of range for {n} keys")
        i %= n
        start = int(a.ends[i - 1]) if i else 0
        return a.data[start : int(a.ends[i])].decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        a = self._arrays
        n = a.ends.shape[0]
        for start in range(0, n, _CHUNK):
            yield from _decode_range(a, start, min(n, start + _CHUNK))

    def tolist(self) -> list[str]:
        a = self._arrays
        return _decode_range(a, 0, a.ends.shape[0])

    def take(self, task_idx: Sequence[int] | np.ndarray) -> list[str]:
        """The keys of these tasks, in that order."""
        a = self._arrays
        idx = np.asarray(task_idx, dtype=np.int64)
        if idx.size == 0:
            return []
        if idx.min() < 0 or idx.max() >= a.ends.shape[0]:
            raise IndexError(f"task index out of range for {a.ends.shape[0]} keys")
        ends = a.ends[idx].tolist()
        starts = np.where(idx > 0, a.ends[idx - 1], 0).tolist()
        data = a.data
        return [data[s:e].decode("utf-8", "surrogatepass") for s, e in zip(starts, ends, strict=True)]

    def lookup(self, keys: Sequence[str]) -> np.ndarray:
        """The task index of each key (int64), -1 for keys it does not hold."""
        a = self._arrays
        found = np.full(len(keys), -1, dtype=np.int64)
        n = a.hashes.shape[0]
        if n == 0 or not keys:
            return found
        wanted = _hashes(keys)
        pos = np.minimum(np.searchsorted(a.hashes, wanted), n - 1)
        hit = np.flatnonzero(a.hashes[pos] == wanted)
        task = a.order[pos[hit]].astype(np.int64)
        ends = a.ends[task]
        starts = np.where(task > 0, a.ends[task - 1], 0)
        data = a.data
        rows = zip(hit.tolist(), task.tolist(), starts.tolist(), ends.tolist(), strict=True)
        for j, i, start, end in rows:
            key = keys[j].encode("utf-8", "surrogatepass")
            if data[start:end] == key:
                found[j] = i
            else:  # another key with the same hash came first: try the rest
                found[j] = _scan(a, int(pos[j]) + 1, int(wanted[j]), key)
        return found

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and int(self.lookup([key])[0]) >= 0

    def extend(self, keys: Sequence[str]) -> None:
        """Append tasks with these keys (new and distinct: not checked)."""
        if not keys:
            return
        a = self._arrays
        n = a.ends.shape[0]
        data, lengths, ascii = _encode(keys)
        base = int(a.ends[-1]) if n else 0
        ends = np.cumsum(lengths)
        ends += base
        total = n + len(keys)
        ends_dtype = _index_dtype(int(ends[-1]))
        order_dtype = _index_dtype(total)
        new_hashes = _hashes(keys)
        by_hash = np.argsort(new_hashes)  # equal hashes in any order: lookup compares bytes
        new_hashes = new_hashes[by_hash]
        new_order = (by_hash + n).astype(order_dtype)
        if n:  # merge the new sorted hashes into the old: O(n + m), not a re-sort
            at = np.searchsorted(a.hashes, new_hashes)
            hashes = np.insert(a.hashes, at, new_hashes)
            order = np.insert(a.order.astype(order_dtype, copy=False), at, new_order)
        else:
            hashes, order = new_hashes, new_order
        self._arrays = _Arrays(
            data=a.data + data if n else data,
            ends=np.concatenate([a.ends.astype(ends_dtype, copy=False), ends.astype(ends_dtype)]),
            hashes=hashes,
            order=order,
            ascii=a.ascii and ascii,
        )

    @property
    def nbytes(self) -> int:
        """Memory held: the key bytes, the arrays and their objects' headers."""
        a = self._arrays
        return len(a.data) + a.ends.nbytes + a.hashes.nbytes + a.order.nbytes + _OVERHEAD

    def __repr__(self) -> str:
        return f"TaskKeys({len(self)} keys)"


# The objects themselves: this one, _Arrays, the bytes and three ndarrays.
_OVERHEAD = 600


def _scan(a: _Arrays, p: int, wanted: int, key: bytes) -> int:
    """The task whose hash, from sorted position p on, is `wanted` and
    whose bytes are `key`; -1 if none."""
    while p < a.hashes.shape[0] and a.hashes[p] == wanted:
        i = int(a.order[p])
        if a.data[(int(a.ends[i - 1]) if i else 0) : int(a.ends[i])] == key:
            return i
        p += 1
    return -1


def _decode_range(a: _Arrays, start: int, stop: int) -> list[str]:
    """Keys start..stop-1 as strings."""
    if stop <= start:
        return []
    first = int(a.ends[start - 1]) if start else 0
    ends = a.ends[start:stop].tolist()
    starts = [first, *ends[:-1]]
    if a.ascii:  # one decode, then slices of the text
        text = a.data[first : ends[-1]].decode("ascii")
        return [text[s - first : e - first] for s, e in zip(starts, ends, strict=True)]
    data = a.data
    return [data[s:e].decode("utf-8", "surrogatepass") for s, e in zip(starts, ends, strict=True)]
