"""quantkit quantize --scheme w4a16 --algorithm gptq|awq runs the rounding algorithms."""

from __future__ import annotations

import json

import pytest

from quantkit.cli import main
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs

pytestmark = pytest.mark.slow  # three CLI runs on 512 calibration rows (~15 s quiet, minutes under load)


@pytest.fixture
def mlp_inputs(tmp_path):
    return write_mlp_inputs(tmp_path, calib_rows=512)


def _run(weights, calib, out, algorithm):
    args = mlp_quantize_args(weights, calib, out, "--scheme", "w4a16", "--group-size", "32", "--algorithm", algorithm)
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
