"""``quantkit quantize --scheme NAME`` resolves through the scheme registry: the same recipes as the
hand-written ``Scheme`` branches gave, and quantization.json records the config.

``data/cli_recipes_pre_registry.json`` maps each set of recipe flags to
``Recipe.from_args(parse_args(["quantize", "--out", DIR, *flags])).to_json()`` as the command line of
commit 24617de (the last before the registry) wrote it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.cli import main
from quantkit.cli._main import _build_parser
from quantkit.cli._quantize import Recipe
from quantkit.quantizers import FP8Config, SchemeConfig, available_schemes, get_scheme
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs

RECORDED = json.loads((Path(__file__).with_name("data") / "cli_recipes_pre_registry.json").read_text())
# changes made on purpose since that commit, each with its reason
INTENDED = {
    # issue 31: GPTQ's output-error range search is weight-only GPTQ's default (measured on SmolLM2)
    "--scheme w4a16 --group-size 32 --algorithm gptq": {"clip_search": True},
}


def _recipe(extra: list[str]) -> Recipe:
    return Recipe.from_args(_build_parser().parse_args(["quantize", "--out", "/tmp/unused", *extra]))


@pytest.mark.parametrize("line", sorted(RECORDED))
def test_recipes_are_the_pre_registry_ones(line):
    assert _recipe(line.split()).to_json() == {**RECORDED[line], **INTENDED.get(line, {})}


def test_scheme_choices_are_the_registry():
    action = next(a for a in _build_parser()._subparsers._group_actions[0].choices["quantize"]._actions
                  if "--scheme" in a.option_strings)
    assert list(action.choices) == available_schemes()


@pytest.mark.parametrize("extra, expected", [
    (["--scheme", "w8a16"], get_scheme("w8a16")),
    (["--scheme", "fp8-dynamic", "--algorithm", "gptq"], FP8Config(dynamic=True, granularity="per-token",
                                                                   weight_algorithm="gptq")),
    (["--scheme", "w8a8", "--ops", "linear"], None),
])
def test_recipe_scheme_config(extra, expected):
    config = _recipe(extra).scheme_config()
    if expected is not None:
        assert config == expected
    assert SchemeConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("scheme", ["w8a8-dynamic", "w8a16"])
def test_quantization_json_records_the_config_and_load_rebuilds_it(tmp_path, scheme):
    import quantkit

    out = tmp_path / scheme
    assert main(mlp_quantize_args(*write_mlp_inputs(tmp_path, 48), out, "--scheme", scheme)) == 0
    doc = json.loads((out / "quantization.json").read_text())
    assert doc["recipe"]["scheme"] == scheme
    assert doc["config"] == get_scheme(scheme).to_dict()
    assert quantkit.load(out).meta["quantkit_config"] == get_scheme(scheme)


def test_eval_of_an_artifact_whose_config_is_damaged_is_one_line(tmp_path, capsys):
    out = tmp_path / "w8a16"
    assert main(mlp_quantize_args(*write_mlp_inputs(tmp_path, 48), out, "--scheme", "w8a16")) == 0
    doc = json.loads((out / "quantization.json").read_text())
    (out / "quantization.json").write_text(json.dumps({**doc, "config": {**doc["config"], "version": 7}}))
    capsys.readouterr()
    assert main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--no-compile", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scheme config cannot be read back: WeightOnlyConfig config version 7 is newer" in err[0]
