"""quantkit quantize --scheme fp8 | fp8-dynamic [--kv-cache FORMAT] (FP8 recipes)."""

from __future__ import annotations

import json

import pytest
import torch

import quantkit
from quantkit.cli import main
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs


@pytest.fixture
def mlp_inputs(tmp_path):
    return write_mlp_inputs(tmp_path, calib_rows=24)


_args = mlp_quantize_args


def test_fp8_scheme_writes_float8_weights_and_records_the_recipe(mlp_inputs, tmp_path):
    weights, calib = mlp_inputs
    out = tmp_path / "out"
    # (an MLP has no attention, so no --kv-cache: tests/test_hostile_small.py covers it on one that has)
    assert main(_args(weights, calib, out, "--scheme", "fp8")) == 0
    doc = json.loads((out / "quantization.json").read_text())
    recipe = doc["recipe"]
    assert (recipe["scheme"], recipe["fp8"], recipe["dynamic"], recipe["kv_cache"]) == ("fp8", True, False, None)
    weights_ = [t for t in doc["tensors"] if t["kind"] == "weight"]
    assert len(weights_) == 3 and all(t["dtype"] == "float8_e4m3fn" for t in weights_)
    report = json.loads((out / "report.json").read_text())
    assert report["metric"]["mean_cosine"] > 0.99, report["metric"]
    assert "E4M3 weights" in (out / "report.md").read_text()
    qmodel = quantkit.load(out)
    f8 = [t for t in qmodel.state_dict().values() if t.dtype == torch.float8_e4m3fn]
    assert len(f8) == 3


def test_fp8_gptq_per_head_kv_recipe_and_inspect(mlp_inputs, tmp_path, capsys):
    weights, calib = mlp_inputs
    out = tmp_path / "out"
    assert main(_args(weights, calib, out, "--scheme", "fp8-dynamic", "--algorithm", "gptq")) == 0
    doc = json.loads((out / "quantization.json").read_text())
    recipe = doc["recipe"]
    assert (recipe["weight_algorithm"], recipe["kv_cache"], recipe["kv_granularity"]) == ("gptq", None, None)
    weights_ = [t for t in doc["tensors"] if t["kind"] == "weight"]
    assert len(weights_) == 3 and all(t["algorithm"] == "gptq" for t in weights_)
    assert "gptq rounding" in (out / "report.md").read_text()  # per-head KV: tests/test_hostile_small.py
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    said = capsys.readouterr().out
    assert "3 float8_e4m3fn weights" in said and "int8 weights" not in said, said


@pytest.mark.parametrize("extra,message", [
    (["--kv-granularity", "per-head"], "--kv-granularity applies to the FP8 schemes' --kv-cache"),
    (["--scheme", "fp8", "--kv-granularity", "per-head"], "--kv-granularity needs --kv-cache FORMAT"),
    # other schemes store a cache only on a generating artifact (issue 29)
    (["--kv-cache", "int8"], "--kv-cache with --scheme w8a8 stores the KV cache of a generating artifact: "
                                 "add --max-cache-len N"),
    (["--scheme", "fp8", "--dynamic"], "--dynamic has no effect with --scheme fp8"),
    (["--scheme", "fp8-dynamic", "--observer", "mse"], "--observer has no effect with --scheme fp8-dynamic"),
    (["--scheme", "fp8", "--observer", "kl"], "cannot search an FP8 range"),
    (["--scheme", "fp8", "--activation", "symmetric-int8"], "--activation has no effect with --scheme fp8"),
    (["--scheme", "fp8", "--kv-cache", "fp4"], "invalid choice: 'fp4'"),
])
def test_fp8_usage_errors(mlp_inputs, tmp_path, capsys, extra, message):
    weights, calib = mlp_inputs
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(_args(weights, calib, out, *extra))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()
