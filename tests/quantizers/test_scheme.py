"""Schemes as registered units: presets, the JSON round trip of every config, and the refusals."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from quantkit.quantizers import (
    FP8Config,
    FP8Quantizer,
    QuantConfig,
    SchemeConfig,
    SchemeError,
    W8A8Quantizer,
    WeightOnlyConfig,
    WeightOnlyQuantizer,
    as_config,
    available_schemes,
    get_scheme,
    register_scheme,
    scheme_info,
    unregister_scheme,
)

BUILT_IN = ["w8a8", "w8a8-dynamic", "w8a8-per-token", "w4a16", "w8a16", "nf4", "fp8", "fp8-dynamic"]


def test_presets_are_registered_in_the_command_lines_order():
    assert available_schemes()[:len(BUILT_IN)] == BUILT_IN
    assert all(scheme_info(n).description for n in BUILT_IN)


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_preset_round_trips_through_json(name):
    config = get_scheme(name)
    d = json.loads(json.dumps(config.to_dict()))  # plain JSON types only
    assert d["type"] == type(config).__name__ and d["version"] == 1
    again = SchemeConfig.from_dict(d)
    assert again == config and type(again) is type(config)
    assert type(config).from_dict(d) == config


@pytest.mark.parametrize("config", [
    QuantConfig(act_observer="histogram", ops=frozenset({"linear", "add"}), weight_bits=4, weight_algorithm="gptq"),
    QuantConfig(activation="affine-uint7", learnable_ranges=True),
    FP8Config(weight_granularity="per-tensor", ops=frozenset({"linear", "conv"}), gptq_percdamp=0.5),
    WeightOnlyConfig(bits=4, group_size=32, symmetric=True, algorithm="awq", embeddings=True),
])
def test_non_default_configs_round_trip(config):
    d = json.loads(json.dumps(config.to_dict()))
    assert SchemeConfig.from_dict(d) == config
    assert all(isinstance(v, (list, str, int, float, bool, type(None))) for v in d["fields"].values())


def test_presets_build_the_quantizers_the_command_line_builds():
    # the same settings as the CLI's --scheme gave before the registry (cli/_quantize.py, _weight_only.py, _fp8.py)
    assert get_scheme("w8a8") == QuantConfig()
    assert get_scheme("w8a8-per-token") == QuantConfig(dynamic=True, granularity="per-token")
    assert get_scheme("w4a16") == WeightOnlyConfig(bits=4, group_size=128, scheme="int4", symmetric=False)
    assert get_scheme("w8a16") == WeightOnlyConfig(bits=8, group_size=None, scheme="int8", symmetric=True)
    assert get_scheme("nf4") == WeightOnlyConfig(bits=4, group_size=64, scheme="nf4", symmetric=True)
    assert get_scheme("fp8-dynamic") == FP8Config(dynamic=True, granularity="per-token")
    q = get_scheme("w8a8-dynamic").quantizer()
    assert type(q) is W8A8Quantizer and q.global_config == QuantConfig(dynamic=True)
    q = get_scheme("w4a16").quantizer()
    assert type(q) is WeightOnlyQuantizer and q.global_config == get_scheme("w4a16")
    q = get_scheme("fp8").quantizer()
    assert type(q) is FP8Quantizer and q.global_config == FP8Quantizer().global_config and q.kv_cache is None


def test_as_config():
    config = WeightOnlyConfig(group_size=64)
    assert as_config(config) is config
    assert as_config("nf4") == get_scheme("nf4") == as_config(" NF4 ")
    with pytest.raises(ValueError, match=r"unknown scheme 'w5a5'; known: w8a8, w8a8-dynamic, .*fp8-dynamic"):
        as_config("w5a5")
    with pytest.raises(SchemeError, match="preset name .* or a SchemeConfig, got int"):
        as_config(3)


@pytest.mark.parametrize("d, needle", [
    ("junk", "a dictionary with 'type', 'version' and 'fields'"),
    ({"type": "QuantConfig", "version": 1}, "a dictionary with 'type', 'version' and 'fields'"),
    ({"type": "MXFP4Config", "version": 1, "fields": {}}, "unknown scheme config type 'MXFP4Config'; known: "),
    ({"type": "QuantConfig", "version": 2, "fields": {}}, "version 2 is newer than this quantkit reads .1.; upgrade"),
    ({"type": "QuantConfig", "version": "1", "fields": {}}, "version must be a positive integer"),
    ({"type": "QuantConfig", "version": 1, "fields": {"bitz": 4}}, r"unknown QuantConfig config fields \['bitz'\]"),
    ({"type": "QuantConfig", "version": 1, "fields": {"dynamic": "yes"}}, "dynamic must be True or False"),
    ({"type": "WeightOnlyConfig", "version": 1, "fields": {"bits": 3}}, "bits must be 4 or 8"),
])
def test_from_dict_refuses_in_one_line(d, needle):
    with pytest.raises(SchemeError, match=needle) as info:
        SchemeConfig.from_dict(d)
    assert "\n" not in str(info.value)


def test_from_dict_on_a_subclass_refuses_another_type():
    with pytest.raises(SchemeError, match="config type 'FP8Config' is not a QuantConfig"):
        QuantConfig.from_dict(FP8Config().to_dict())


def test_register_scheme_refusals():
    with pytest.raises(SchemeError, match="already registered"):
        register_scheme("w8a8", QuantConfig(dynamic=True), description="not the preset")
    register_scheme("w8a8", QuantConfig(), description="static int8")  # the same config again: allowed
    with pytest.raises(SchemeError, match="lower-case word"):
        register_scheme("W8 A8", QuantConfig(), description="x")
    with pytest.raises(SchemeError, match="must be a SchemeConfig"):
        register_scheme("not-a-config", {"bits": 4}, description="x")
    with pytest.raises(SchemeError, match="one-line description"):
        register_scheme("no-description", QuantConfig(), description=" ")
    assert "not-a-config" not in available_schemes()


def test_unregister_scheme():
    register_scheme("w8a8-for-a-while", QuantConfig(act_observer="histogram"), description="a test's preset")
    assert get_scheme("w8a8-for-a-while").act_observer == "histogram"
    unregister_scheme("w8a8-for-a-while")
    unregister_scheme("w8a8-for-a-while")  # absent: a no-op
    assert "w8a8-for-a-while" not in available_schemes()


def test_a_config_type_name_is_taken_once():
    with pytest.raises(SchemeError, match="config type 'QuantConfig' is already"):
        @dataclass(frozen=True)
        class QuantConfig(SchemeConfig):  # noqa: F811 - another class under a registered name
            bits: int = 4


def test_a_config_without_a_quantizer_says_so():
    @dataclass(frozen=True)
    class _Bare(SchemeConfig):
        TYPE = "tests.quantizers._Bare"
        bits: int = 4

    assert SchemeConfig.from_dict(_Bare().to_dict()) == _Bare()
    with pytest.raises(SchemeError, match="_Bare names no quantizer"):
        _Bare().quantizer()
