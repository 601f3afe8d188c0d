"""The checkpoint's bytes hold the whole PosteriorState, exactly, and say
clearly when they cannot be read."""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest

from bots_server.core.checkpoint_state import decode_state, encode_state
from bots_server.core.domain import ExperimentConfig
from bots_server.engine import PosteriorState
from bots_server.store import checkpoint_blob

CONFIG = ExperimentConfig(prior_alpha=2.0, prior_beta=3.0)


def same(a: PosteriorState, b: PosteriorState) -> bool:
    """Field by field, bit for bit (NaN equal to NaN, dtypes equal)."""
    for field in dataclasses.fields(PosteriorState):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or x.tobytes() != y.tobytes():
                return False
        elif not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
            return False
    return True


def test_every_field_round_trips_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    n = 1001  # not a multiple of 8 bytes per array boundary
    state = PosteriorState(
        alpha=rng.gamma(2.0, size=n),
        beta=rng.gamma(2.0, size=n),
        weak=np.where(rng.random(n) < 0.3, math.nan, rng.random(n)),
        strong=rng.random(n),
        capability=0.1 + 0.2,  # not exactly representable in decimal
        rho_halvings=3,
    )
    restored = decode_state(encode_state(state), CONFIG)
    assert same(restored, state)
    assert restored.alpha.flags.writeable and restored.alpha.base is None  # owned, not a view of the bytes


def test_nan_capability_and_no_tasks_round_trip() -> None:
    empty = PosteriorState.from_prior(CONFIG, np.empty(0), np.empty(0))
    assert same(decode_state(encode_state(empty), CONFIG), empty)
    assert same(decode_state(b"", CONFIG), empty)  # before the first checkpoint


def test_a_field_missing_from_an_older_checkpoint_reads_at_its_starting_value() -> None:
    # What migration 0004 writes for a per-row checkpoint: no rho_halvings.
    alpha, beta = np.array([4.0, 5.0]), np.array([6.0, 7.0])
    weak = strong = np.full(2, math.nan)
    blob = checkpoint_blob.encode(2, {"alpha": alpha, "beta": beta, "weak": weak, "strong": strong}, {"capability": 0.5})
    state = decode_state(blob, CONFIG)
    assert state.rho_halvings == 0 and state.capability == 0.5
    assert state.alpha.tolist() == [4.0, 5.0] and state.beta.tolist() == [6.0, 7.0]


def test_state_this_server_does_not_know_is_refused() -> None:
    blob = checkpoint_blob.encode(1, {"alpha": np.ones(1), "beta": np.ones(1), "novel": np.ones(1)}, {})
    with pytest.raises(RuntimeError, match=r"does not know \(novel\); upgrade the server"):
        decode_state(blob, CONFIG)


def test_a_newer_format_or_foreign_bytes_are_refused() -> None:
    blob = bytearray(checkpoint_blob.encode(1, {"alpha": np.ones(1)}, {}))
    struct.pack_into("<H", blob, 6, checkpoint_blob.VERSION + 1)
    with pytest.raises(ValueError, match="newer than this server's"):
        checkpoint_blob.decode(bytes(blob))
    with pytest.raises(ValueError, match="bad magic"):
        checkpoint_blob.decode(b"not a checkpoint at all")


def test_arrays_sit_where_the_header_says_little_endian() -> None:
    """The layout the PostgreSQL view decodes: data at 12 + header length,
    each array at its offset, 8-byte aligned, little-endian."""
    alpha = np.array([1.5, -2.25, 0.1])
    flags = np.array([True, False, True])
    blob = checkpoint_blob.encode(3, {"flags": flags, "alpha": alpha.astype(">f8")}, {"n": 7, "on": True})
    assert blob[:6] == b"BOTSCK"
    (header_length,) = struct.unpack_from("<I", blob, 8)
    start = 12 + header_length
    assert start % 8 == 0
    content = checkpoint_blob.decode(blob)
    offset = start + 8  # flags (3 bytes) padded to 8 come first
    assert struct.unpack_from("<3d", blob, offset) == (1.5, -2.25, 0.1)
    assert content.arrays["alpha"].dtype.str == "<f8" and content.arrays["flags"].tolist() == [True, False, True]
    assert content.scalars == {"n": 7, "on": True}


def test_a_strided_array_is_stored_c_ordered_and_the_padding_is_zero() -> None:
    """The encode copies each array into place: a view with strides (a
    column slice) is written as its C-ordered values, and the bytes padding
    an array to 8 are zero, as the format says."""
    grid = np.arange(12.0).reshape(3, 4)[:, ::2]  # not contiguous
    flags = np.array([True, True, False])
    blob = checkpoint_blob.encode(3, {"flags": flags, "grid": grid}, {})
    (header_length,) = struct.unpack_from("<I", blob, 8)
    start = 12 + header_length
    assert bytes(blob[start : start + 8]) == b"\x01\x01\x00" + bytes(5)
    assert struct.unpack_from("<6d", blob, start + 8) == (0.0, 2.0, 4.0, 6.0, 8.0, 10.0)
    assert checkpoint_blob.decode(blob).arrays["grid"].tolist() == [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]]
