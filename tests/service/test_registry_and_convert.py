"""The strategy registry and the settings' declarations are the one source of
the API's config: every strategy has its proto enum value and back, every
setting its proto field and client field with the same default, and the
conversion round-trips."""

from __future__ import annotations

import dataclasses

import pytest

import bots_client
from bots_client.proto import bots_pb2 as pb
from bots_server.core.domain import ExperimentConfig, config_settings
from bots_server.engine import EngineParams, strategies
from bots_server.errors import InvalidArgument
from bots_server.service import convert


def test_every_strategy_has_a_proto_enum_value_and_back() -> None:
    assert set(convert.enum_names("strategy")) == set(strategies.names())
    assert set(bots_client.types.STRATEGIES) == set(strategies.names())


def test_selection_modes_match_the_proto_enum() -> None:
    from bots_server.engine import SELECTION_MODES

    assert set(convert.enum_names("selection_mode")) == set(SELECTION_MODES)


def test_each_strategy_reads_only_declared_settings() -> None:
    params = {f.name for f in dataclasses.fields(EngineParams)}
    for name in strategies.names():
        strategy = strategies.get(name)
        assert strategy.name == name
        assert set(strategy.settings) <= params, name


def test_every_setting_has_a_proto_field_and_a_client_field_with_the_same_default() -> None:
    proto_fields = set(pb.ExperimentConfig.DESCRIPTOR.fields_by_name)
    client_defaults = {f.name: f.default for f in dataclasses.fields(bots_client.ExperimentConfig)}
    names = [name for name, _, _ in config_settings()]
    assert set(names) == proto_fields
    assert set(names) == set(client_defaults)
    for name, _, default in config_settings():
        assert client_defaults[name] == default, name


def test_unset_proto_fields_take_the_defaults() -> None:
    assert convert.config_from_proto(pb.ExperimentConfig()) == ExperimentConfig()


def test_conversion_round_trips_a_config_with_every_field_changed() -> None:
    config = ExperimentConfig(
        strategy="mopps", target_success=0.3, forgetting=0.2, implicit_weight=0.0, rollouts_per_task=8,
        selection_mode="softmax", temperature=0.5, prior_alpha=2.0, prior_beta=3.0, capability_ema=0.7,
        candidate_ratio=2.0, warm_start_scale=8.0, warm_start_position=0.5,
        adaptive_rho_error=0.25, track_prediction=0.5, implicit_reliability=2.0, random_stream=1, keep_successes=0.5,
        adaptive_shares=0.5,
        weak_feature="w", strong_feature="s", seed=7, lease_ttl_seconds=60.0, embedding_dim=8, embedding_weight=4.0,
        uniform_share=0.25, report_weight="rollouts_per_task",
    )  # fmt: skip
    assert all(getattr(config, n) != d for n, _, d in config_settings())
    assert convert.config_from_proto(convert.config_to_proto(config)) == config
    assert ExperimentConfig.from_dict(config.to_dict()) == config


def test_an_unknown_enum_value_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="strategy enum value 99"):
        convert.config_from_proto(pb.ExperimentConfig(strategy=99))  # type: ignore[arg-type]


def test_a_stored_config_without_a_newer_setting_reads_with_its_default() -> None:
    stored = ExperimentConfig(forgetting=0.3).to_dict()
    del stored["capability_ema"]
    stored["setting_of_a_newer_version"] = 1
    assert ExperimentConfig.from_dict(stored) == ExperimentConfig(forgetting=0.3)


def test_a_stored_config_without_random_stream_keeps_the_stream_it_was_created_with() -> None:
    """New experiments draw in stream 2; those stored before it existed in stream 1."""
    assert ExperimentConfig().random_stream == 2
    stored = ExperimentConfig(seed=3).to_dict()
    del stored["random_stream"]
    assert ExperimentConfig.from_dict(stored) == ExperimentConfig(seed=3, random_stream=1)
    assert ExperimentConfig.from_dict(ExperimentConfig(seed=3).to_dict()).random_stream == 2


def test_a_stored_config_without_report_weight_keeps_weighing_reports_by_m() -> None:
    """New experiments weigh a report by its own trials; those stored before
    the setting existed by m, so their stored reports replay as applied."""
    assert ExperimentConfig().report_weight == "trials"
    stored = ExperimentConfig(seed=3).to_dict()
    del stored["report_weight"]
    assert ExperimentConfig.from_dict(stored).report_weight == "rollouts_per_task"
    assert ExperimentConfig.from_dict(ExperimentConfig(seed=3).to_dict()).report_weight == "trials"
