"""quantkit quantize --scheme w4a16 | w8a16 | nf4 --group-size N --algorithm NAME (weight-only recipes)."""

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


@pytest.mark.parametrize("extra,expected", [
    (["--scheme", "w4a16", "--group-size", "32"],
     dict(scheme="w4a16", bits=4, weights="int4", group_size=32, symmetric=False, algorithm="rtn")),
    (["--scheme", "nf4"], dict(scheme="nf4", bits=4, weights="nf4", group_size=64, algorithm="rtn")),
    (["--scheme", "w8a16"], dict(scheme="w8a16", bits=8, weights="int8", group_size=None, symmetric=True)),
    (["--scheme", "w4a16", "--group-size", "32", "--algorithm", "gptq"],  # the range search is GPTQ's default
     dict(scheme="w4a16", group_size=32, algorithm="gptq", clip_search=True)),
    (["--scheme", "w4a16", "--group-size", "32", "--algorithm", "gptq", "--no-clip-search"],
     dict(scheme="w4a16", group_size=32, algorithm="gptq", clip_search=False)),
])
def test_weight_only_schemes_are_recorded(mlp_inputs, tmp_path, extra, expected):
    weights, calib = mlp_inputs
    out = tmp_path / "out"
    assert main(_args(weights, calib, out, *extra)) == 0
    recipe = json.loads((out / "quantization.json").read_text())["recipe"]
    report = json.loads((out / "report.json").read_text())
    for key, value in expected.items():
        assert recipe[key] == value, (key, recipe)
        assert report["recipe"][key] == value, (key, report["recipe"])
    assert recipe["weight_only"] is True and recipe["activation"] is None
    assert report["metric"]["mean_cosine"] > 0.99, report["metric"]
    tensors = json.loads((out / "quantization.json").read_text())["tensors"]
    assert len(tensors) == 3 and all(t["qscheme"] == "per_channel_group" for t in tensors)
    assert "weights (" in (out / "report.md").read_text()  # the recipe sentence names the weight-only scheme
    qmodel = quantkit.load(out)
    dq = torch.ops.quantized_decomposed.dequantize_per_channel_group.default
    nf4 = torch.ops.quantkit.dequantize_nf4.default
    assert sum(n.target in (dq, nf4) for n in qmodel.graph.nodes) == 3


@pytest.mark.parametrize("extra,code,message", [
    (["--group-size", "32"], 2, "--group-size applies to the weight-only schemes"),
    (["--scheme", "w4a16", "--dynamic"], 2, "--dynamic has no effect with --scheme w4a16"),
    (["--scheme", "nf4", "--activation", "symmetric-int8"], 2, "--activation has no effect with --scheme nf4"),
    (["--scheme", "w4a16", "--group-size", "1"], 2, "--group-size must be at least 2, got 1"),
    (["--scheme", "w4a16", "--algorithm", "bogus"], 2, "invalid choice: 'bogus'"),
    (["--scheme", "w4a16", "--group-size", "96"], 1, "has 64 input features, fewer than --group-size 96"),
    (["--scheme", "w4a16", "--group-size", "48", "--algorithm", "gptq"], 1,
     "has 64 input features, not a multiple of --group-size 48 (nor do 2 more layers), and --algorithm gptq rounds"),
    (["--scheme", "w4a16", "--double-quant"], 2, "--double-quant quantizes NF4's scales; --scheme w4a16 has none"),
    (["--scheme", "w4a16", "--clip-search"], 2,
     "--clip-search searches the group ranges GPTQ rounds to; --algorithm rtn has none: add --algorithm gptq"),
    (["--clip-search"], 2, "--clip-search sets the group range search of weight-only GPTQ; add --scheme"),
    (["--no-clip-search"], 2, "--no-clip-search sets the group range search of weight-only GPTQ; add --scheme"),
])
def test_weight_only_usage_errors(mlp_inputs, tmp_path, capsys, extra, code, message):
    weights, calib = mlp_inputs
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(_args(weights, calib, out, *extra))
    err = capsys.readouterr().err
    assert rc == code, err
    assert message in err, err
    assert not out.exists()



def _cpu_has_vnni() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True  # unknown: no expectation
    return "avx512_vnni" in flags


def test_int4_report_and_inspect_say_whether_the_cpu_kernel_runs(mlp_inputs, tmp_path, capsys):
    """No silent fallback (issue 26): an int4 artifact's report and ``inspect`` say whether
    quantkit::int4_linear_cpu runs here and why not; a scheme without int4 weights says nothing."""
    weights, calib = mlp_inputs
    out, nf4 = tmp_path / "int4", tmp_path / "nf4"
    assert main(_args(weights, calib, out, "--scheme", "w4a16", "--group-size", "32")) == 0
    assert main(_args(weights, calib, nf4, "--scheme", "nf4")) == 0
    k = json.loads((out / "report.json").read_text())["kernels"]["int4_cpu"]
    assert k["kernel"] == "quantkit::int4_linear_cpu" and k["reason"]
    if not _cpu_has_vnni():  # independent of the kernel's own check: the CPU's flags
        assert k["available"] is False and "VNNI" in k["reason"].upper(), k
    assert f"Kernel quantkit::int4_linear_cpu: {'available' if k['available'] else 'unavailable'}" \
        in (out / "report.md").read_text()
    assert "kernels" not in json.loads((nf4 / "report.json").read_text())
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "  kernel:   quantkit::int4_linear_cpu: " in capsys.readouterr().out
    assert main(["inspect", str(nf4)]) == 0
    assert "kernel:" not in capsys.readouterr().out
