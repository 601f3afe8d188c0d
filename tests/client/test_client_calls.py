"""The client: its allowed values come from bots.proto."""

from __future__ import annotations

import itertools

from bots_client import ExperimentConfig, _convert
from bots_client.proto import bots_pb2 as pb
from bots_client.types import SELECTION_MODES, STRATEGIES


def test_strategies_and_selection_modes_are_the_proto_enum_values() -> None:
    assert [f"STRATEGY_{s.upper()}" for s in STRATEGIES] == pb.Strategy.keys()[1:]
    assert [f"SELECTION_MODE_{m.upper()}" for m in SELECTION_MODES] == pb.SelectionMode.keys()[1:]
    assert pb.Strategy.Name(0) == "STRATEGY_UNSPECIFIED" and pb.SelectionMode.Name(0) == "SELECTION_MODE_UNSPECIFIED"
    for strategy, mode in itertools.product(STRATEGIES, SELECTION_MODES):
        config = ExperimentConfig(strategy=strategy, selection_mode=mode)
        assert _convert.config_from_proto(_convert.config_to_proto(config)) == config
