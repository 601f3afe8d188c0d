"""Seeding: every replica draws the same numbers for the same request."""

from __future__ import annotations

import hashlib

import numpy as np


def step_rng(seed: int, step: int, request_key: str) -> np.random.Generator:
    """A generator seeded from (experiment seed, step, request key).

    The key is hashed with SHA-256 (Python's hash() is salted per process).
    """
    digest = hashlib.sha256(request_key.encode("utf-8")).digest()
    words = np.frombuffer(digest, dtype="<u4").tolist()
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, *words])))
