"""The compact key store answers exactly as a list of keys and a dict from key
to index would, whatever the keys (unicode, one character, prefixes of each
other), however they were appended, and even when every hash collides."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bots_server.core import task_keys
from bots_server.core.task_keys import TaskKeys

ALPHABETS = ["abc", "xyz0123456789-_/:", "éüß", "ж中文", "😀\U0001d518", " \t'\""]


def random_keys(rng: np.random.Generator, n: int, ascii_only: bool = False) -> list[str]:
    """n distinct keys of 1 to 40 characters, mixing alphabets, many sharing prefixes."""
    alphabets = ALPHABETS[:2] if ascii_only else ALPHABETS
    keys: dict[str, None] = {}
    while len(keys) < n:
        letters = "".join(alphabets[int(rng.integers(len(alphabets)))] for _ in range(2))
        length = int(rng.choice([1, 2, 3, 12, 40]))
        key = "".join(letters[int(i)] for i in rng.integers(0, len(letters), length))
        keys[key] = None
        if rng.random() < 0.2 and len(keys) < n:
            keys[key + letters[0]] = None  # a key and its extension
    return list(keys)


def near_misses(keys: list[str]) -> list[str]:
    """Keys close to stored ones that are not stored."""
    stored = set(keys)
    candidates = [k + "\x01" for k in keys[:50]] + [k[:-1] for k in keys[:50]] + [k.upper() for k in keys[:50]]
    candidates += ["", "never", "é" * 41]
    return [k for k in dict.fromkeys(candidates) if k not in stored]


def check_against_reference(store: TaskKeys, keys: list[str], rng: np.random.Generator) -> None:
    index = {k: i for i, k in enumerate(keys)}
    assert len(store) == len(keys)
    assert [store[i] for i in range(len(keys))] == keys
    assert [store[-i - 1] for i in range(len(keys))] == keys[::-1]
    assert list(store) == keys
    assert store.tolist() == keys
    picks = rng.integers(0, len(keys), 300).tolist()
    assert store.take(picks) == [keys[i] for i in picks]
    assert store.take(np.asarray(picks)) == [keys[i] for i in picks]
    assert store.take([]) == []
    absent = near_misses(keys)
    asked = [keys[i] for i in picks] + absent
    order = rng.permutation(len(asked))
    asked = [asked[i] for i in order]
    assert store.lookup(asked).tolist() == [index.get(k, -1) for k in asked]
    assert all(k in store for k in keys[:100])
    assert not any(k in store for k in absent)
    with pytest.raises(IndexError):
        store[len(keys)]
    with pytest.raises(IndexError):
        store.take([len(keys)])


@pytest.mark.parametrize("ascii_only", [True, False])
def test_matches_a_list_and_a_dict(ascii_only: bool) -> None:
    rng = np.random.default_rng(7 + ascii_only)
    keys = random_keys(rng, 3000, ascii_only)
    check_against_reference(TaskKeys(keys), keys, rng)


def test_appending_in_pieces_gives_the_same_answers() -> None:
    """Appends of every size, ASCII keys after unicode ones and back."""
    rng = np.random.default_rng(3)
    keys = random_keys(rng, 2500)
    ascii_keys = [k for k in random_keys(rng, 600, ascii_only=True) if k not in set(keys)]
    everything = keys[:1000] + ascii_keys + keys[1000:]
    store = TaskKeys()
    cuts = [0, 1, 2, 10, 700, 1000, 1001, 1600, len(everything)]
    for start, stop in itertools.pairwise(cuts):
        store.extend(everything[start:stop])
        check_against_reference(store, everything[:stop], rng)
    store.extend([])
    assert len(store) == len(everything)


def test_ascii_store_takes_unicode_keys_later() -> None:
    rng = np.random.default_rng(5)
    store = TaskKeys(["t0", "t1"])
    store.extend(["ü", "t2", "中"])
    check_against_reference(store, ["t0", "t1", "ü", "t2", "中"], rng)


def test_colliding_hashes_never_give_a_wrong_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash that maps keys to only three values, lookups compare bytes."""

    def poor_hash(keys: list[str]) -> np.ndarray:
        return np.asarray([len(k) % 3 for k in keys], dtype=np.int64)

    monkeypatch.setattr(task_keys, "_hashes", poor_hash)
    rng = np.random.default_rng(11)
    keys = random_keys(rng, 400)
    store = TaskKeys(keys[:150])
    store.extend(keys[150:])
    check_against_reference(store, keys, rng)


def test_offsets_grow_to_int64_past_the_int32_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(task_keys, "_INT32_LIMIT", 100)
    rng = np.random.default_rng(13)
    keys = random_keys(rng, 300)
    store = TaskKeys(keys[:5])
    store.extend(keys[5:])
    check_against_reference(store, keys, rng)


def test_from_utf8_reads_the_bytes_of_keys_one_after_the_other() -> None:
    rng = np.random.default_rng(17)
    keys = random_keys(rng, 500)
    encoded = [k.encode() for k in keys]
    store = TaskKeys.from_utf8(b"".join(encoded), np.cumsum([len(e) for e in encoded]))
    check_against_reference(store, keys, rng)
    with pytest.raises(ValueError):
        TaskKeys.from_utf8(b"abc", np.array([2, 1, 3]))
    with pytest.raises(ValueError):
        TaskKeys.from_utf8(b"abc", np.array([1, 2]))


def test_memory_is_the_bytes_of_the_keys_plus_a_few_per_key() -> None:
    keys = [f"task-{i:07d}" for i in range(100_000)]  # 12 bytes each
    store = TaskKeys(keys)
    # 12 key bytes + int32 end + int64 hash + int32 task index.
    assert 28 * len(keys) <= store.nbytes <= 28 * len(keys) + 1000
