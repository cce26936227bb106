"""quantkit.quantize(scheme=...) and the config an artifact records: quantization.json's "config"
is the scheme's ``SchemeConfig.to_dict()`` and ``quantkit.load`` rebuilds it."""

from __future__ import annotations

import json

import pytest
import torch

import quantkit
from quantkit.quantizers import SchemeError, W8A8Quantizer, WeightOnlyConfig, WeightOnlyQuantizer, get_scheme
from tests.models import make_mlp


def _data():
    model, x = make_mlp()
    return model, (x[:8],), [(b,) for b in x.split(32)]


@pytest.mark.parametrize("name", ["w8a16", "w8a8-dynamic"])
def test_a_preset_name_quantizes_as_its_quantizer_does(name):
    model, example, calib = _data()
    by_name = quantkit.quantize(model, example, calib, scheme=name, progress=False)
    by_quantizer = quantkit.quantize(model, example, calib, get_scheme(name).quantizer(), progress=False)
    assert by_name.meta["quantkit_config"] == get_scheme(name)
    assert "quantkit_config" not in by_quantizer.meta
    assert by_name.meta["quantkit_qparams"] == by_quantizer.meta["quantkit_qparams"]
    x = example[0]
    torch.testing.assert_close(by_name(x), by_quantizer(x), rtol=0, atol=0)


def test_a_config_object_is_a_scheme_too():
    model, example, calib = _data()
    config = WeightOnlyConfig(bits=4, group_size=32, symmetric=True)
    qmodel = quantkit.quantize(model, example, calib, scheme=config, progress=False)
    ref = quantkit.quantize(model, example, calib, WeightOnlyQuantizer(bits=4, group_size=32, symmetric=True),
                            progress=False)
    assert qmodel.meta["quantkit_config"] is config
    torch.testing.assert_close(qmodel(example[0]), ref(example[0]), rtol=0, atol=0)


def test_quantizer_and_scheme_together_or_an_unknown_name_are_one_line():
    model, example, calib = _data()
    with pytest.raises(SchemeError, match=r"^pass quantizer= or scheme=, not both"):
        quantkit.quantize(model, example, calib, W8A8Quantizer(), scheme="w8a8", progress=False)
    with pytest.raises(ValueError, match=r"^unknown scheme 'w3a16'; known: w8a8, ") as info:
        quantkit.quantize(model, example, calib, scheme="w3a16", progress=False)
    assert "\n" not in str(info.value)


def test_save_records_the_config_and_load_rebuilds_it(tmp_path):
    model, example, calib = _data()
    qmodel = quantkit.quantize(model, example, calib, scheme="w8a16", progress=False)
    path = quantkit.save(qmodel, tmp_path / "w8")
    doc = json.loads((path / "quantization.json").read_text())
    assert doc["config"] == get_scheme("w8a16").to_dict()
    loaded = quantkit.load(path)
    assert loaded.meta["quantkit_config"] == get_scheme("w8a16")
    again = quantkit.save(loaded, tmp_path / "again")  # a loaded model saves its config again
    assert json.loads((again / "quantization.json").read_text())["config"] == doc["config"]
    plain = quantkit.save(quantkit.quantize(model, example, calib, progress=False), tmp_path / "plain")
    assert "config" not in json.loads((plain / "quantization.json").read_text())
    assert quantkit.load(plain).meta["quantkit_config"] is None


@pytest.mark.parametrize("config, needle", [
    ({"type": "MXFP4Config", "version": 1, "fields": {}}, "unknown scheme config type 'MXFP4Config'"),
    ({"type": "WeightOnlyConfig", "version": 9, "fields": {}}, "version 9 is newer"),
    ({"type": "WeightOnlyConfig", "version": 1, "fields": {"bits": "four"}}, "bits must be 4 or 8"),
    ("w4a16", "a dictionary with 'type', 'version' and 'fields'"),
])
def test_a_damaged_or_unknown_config_is_one_line(tmp_path, config, needle):
    model, example, calib = _data()
    path = quantkit.save(quantkit.quantize(model, example, calib, scheme="w8a16", progress=False), tmp_path / "m")
    doc = json.loads((path / "quantization.json").read_text())
    (path / "quantization.json").write_text(json.dumps({**doc, "config": config}))
    with pytest.raises(quantkit.QuantkitError, match="scheme config cannot be read back: .*" + needle) as info:
        quantkit.load(path)
    assert "\n" not in str(info.value)


def test_quantize_pretrained_recorded_config_goes_with_a_quantizer_only(tmp_path):
    """Refused before the model directory is even read (it does not exist here)."""
    cfg = get_scheme("w8a8")
    with pytest.raises(SchemeError, match="recorded_config= goes with quantizer="):
        quantkit.quantize_pretrained(tmp_path / "none", [], config="w8a8", recorded_config=cfg)
    with pytest.raises(SchemeError, match="recorded_config= goes with quantizer="):
        quantkit.quantize_pretrained(tmp_path / "none", [], recorded_config=cfg)
    with pytest.raises(SchemeError, match="recorded_config must be a SchemeConfig, got dict"):
        quantkit.quantize_pretrained(tmp_path / "none", [], W8A8Quantizer(), recorded_config=cfg.to_dict())
