"""The checkpoint's format: named arrays and scalars in one byte string.

A checkpoint is written as one value per experiment (stored in chunks:
schema.checkpoint_chunks), so its cost follows its bytes, not its rows. The format knows no field names:
the core stores whatever its state holds, and a field added later rides
along without a change here.

Layout (version 1), all integers little-endian:

    b"BOTSCK"  version: u16  header_length: u32  header: JSON (UTF-8, padded
    with spaces so that the data starts at a multiple of 8)  data: each array
    C-ordered at its header `offset` from the data's start (12 +
    header_length), padded to a multiple of 8 bytes

    header = {"num_tasks": n,
              "arrays": {name: {"dtype": "<f8", "shape": [n], "offset": k}},
              "scalars": {name: {"type": "float" | "int" | "bool", "value": ...}}}

Floats are written as float.hex() (exact, NaN and infinities included).
PostgreSQL's view `task_posteriors` reads alpha and beta straight out of it
(migrations 0006 and 0008: the header from the first chunk, each float from
the chunk holding it). Readers accept every version written so far.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

MAGIC = b"BOTSCK"
VERSION = 1
_PREFIX = struct.Struct("<6sHI")  # magic, version, header length

Scalar = float | int | bool


@dataclass(frozen=True)
class CheckpointContent:
    num_tasks: int
    arrays: dict[str, np.ndarray]  # read-only views into the blob
    scalars: dict[str, Scalar]


def encode(num_tasks: int, arrays: Mapping[str, np.ndarray], scalars: Mapping[str, Scalar]) -> memoryview:
    """One blob holding the arrays (any numeric or bool dtype, stored in
    little-endian byte order) and the scalars.

    Each array is copied once, straight into its place in the blob, by
    numpy, which holds no GIL while it copies (nor while the kernel zeroes
    the pages it allocated, as a bytearray would): a large checkpoint encoded
    in the background does not stall the steps running meanwhile."""
    stored = {name: a.dtype.newbyteorder("<") for name, a in arrays.items()}
    layout: dict[str, dict[str, object]] = {}
    offsets: dict[str, int] = {}
    end = 0
    for name, a in arrays.items():
        offsets[name] = end
        layout[name] = {"dtype": stored[name].str, "shape": list(a.shape), "offset": end}
        end += _padded(a.nbytes)
    header = {"num_tasks": num_tasks, "arrays": layout, "scalars": {k: _scalar(v) for k, v in scalars.items()}}
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text = text.ljust(_padded(_PREFIX.size + len(text)) - _PREFIX.size, b" ")
    data_start = _PREFIX.size + len(text)
    blob = np.zeros(data_start + end, dtype=np.uint8).data  # zeroed: the padding
    _PREFIX.pack_into(blob, 0, MAGIC, VERSION, len(text))
    blob[_PREFIX.size : data_start] = text
    for name, a in arrays.items():
        place = np.frombuffer(blob, dtype=stored[name], count=a.size, offset=data_start + offsets[name])
        np.copyto(place.reshape(a.shape), a, casting="equiv")
    return blob


def data_start(blob: bytes | memoryview) -> int:
    """Where a blob's arrays start: the length of its prefix and header
    (0 for a value that is not a checkpoint: the store keeps any bytes)."""
    if len(blob) < _PREFIX.size or blob[: len(MAGIC)] != MAGIC:
        return 0
    _magic, _version, header_length = _PREFIX.unpack_from(blob)
    return int(_PREFIX.size + header_length)


def decode(blob: bytes | memoryview) -> CheckpointContent:
    """The arrays (read-only, sharing the blob's memory) and scalars of a blob."""
    if len(blob) < _PREFIX.size:
        raise ValueError(f"checkpoint of {len(blob)} bytes is too short")
    magic, version, header_length = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError("not a checkpoint (bad magic)")
    if version > VERSION:
        raise ValueError(f"checkpoint format {version} is newer than this server's ({VERSION}); upgrade the server")
    data_start = _PREFIX.size + header_length
    header = json.loads(bytes(blob[_PREFIX.size : data_start]))
    arrays = {}
    for name, entry in header["arrays"].items():
        dtype = np.dtype(entry["dtype"])
        shape = tuple(entry["shape"])
        count = math.prod(shape)
        flat = np.frombuffer(blob, dtype=dtype, count=count, offset=data_start + entry["offset"])
        arrays[name] = flat.reshape(shape)
    scalars = {name: _unscalar(entry) for name, entry in header["scalars"].items()}
    return CheckpointContent(int(header["num_tasks"]), arrays, scalars)


def _padded(n: int) -> int:
    return (n + 7) // 8 * 8


def _scalar(value: Scalar) -> dict[str, object]:
    # bool before int: bool is an int subclass.
    if isinstance(value, (bool, np.bool_)):
        return {"type": "bool", "value": bool(value)}
    if isinstance(value, (int, np.integer)):
        return {"type": "int", "value": int(value)}
    if isinstance(value, (float, np.floating)):
        return {"type": "float", "value": float(value).hex()}
    raise TypeError(f"checkpoint scalar of type {type(value).__name__}: expected float, int or bool")


def _unscalar(entry: dict[str, object]) -> Scalar:
    kind, value = entry["type"], entry["value"]
    if kind == "bool":
        return bool(value)
    if kind == "int":
        return int(value)  # type: ignore[call-overload]
    if kind == "float":
        return float.fromhex(str(value))
    raise ValueError(f"checkpoint scalar of unknown type {kind!r}")
