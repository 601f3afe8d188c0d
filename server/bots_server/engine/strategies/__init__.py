"""The registry of strategies: one module each, listed here once.

Everything else (validation, the proto mapping, the client's allowed values)
derives from this registry and the proto enum `bots.v1.Strategy`, whose value
names must match (STRATEGY_<NAME>; a test checks both ways).
"""

from __future__ import annotations

from bots_server.engine.strategies import bots, mopps, uniform
from bots_server.engine.strategies.base import Strategy

_REGISTRY: dict[str, Strategy] = {s.name: s for s in (bots.STRATEGY, mopps.STRATEGY, uniform.STRATEGY)}


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Strategy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; expected one of {list(_REGISTRY)}") from None


__all__ = ["Strategy", "get", "names"]
