"""quantkit quantize --scheme w4a16 --algorithm gptq|awq runs the rounding algorithms."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.cli import main

pytestmark = pytest.mark.slow  # three CLI runs on 512 calibration rows (~15 s quiet, minutes under load)


@pytest.fixture
def mlp_inputs(tmp_path):
    from safetensors.torch import save_file

    from tests.cli_factories import mlp

    torch.manual_seed(1)
    weights = tmp_path / "mlp.safetensors"
    save_file(mlp().state_dict(), str(weights))  # 64 -> 128 -> 128 -> 32 linears
    calib = tmp_path / "calib"
    calib.mkdir()
    torch.save(torch.randn(512, 64, generator=torch.Generator().manual_seed(0)), calib / "b.pt")
    return weights, calib


def _run(weights, calib, out, algorithm):
    args = ["quantize", "tests.cli_factories:mlp", "--weights", str(weights), "--example-input", "8x64:float32",
            "--calib", str(calib), "--out", str(out), "--quiet", "--scheme", "w4a16", "--group-size", "32",
            "--algorithm", algorithm]
    assert main(args) == 0
    return json.loads((out / "report.json").read_text())


def test_cli_algorithms(mlp_inputs, tmp_path):
    weights, calib = mlp_inputs
    cos = {}
    for algorithm in ("rtn", "gptq", "awq"):
        report = _run(weights, calib, tmp_path / algorithm, algorithm)
        assert report["recipe"]["algorithm"] == algorithm
        cos[algorithm] = report["metric"]["mean_cosine"]
    # on its calibration data GPTQ's rounding is at least as good as round-to-nearest's
    assert cos["gptq"] >= cos["rtn"] - 1e-4, cos
    assert cos["awq"] > 0.99, cos
