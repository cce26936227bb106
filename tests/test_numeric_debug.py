"""quantkit.debug.compare: per-layer SQNR, ranges and clipping against references."""

import json
import math

import pytest
import torch

import quantkit
from quantkit._qmath import fake_quantize, sqnr
from tests.models import make_cnn, make_mlp, make_transformer
from tests.outlier_models import make_planted

QD = torch.ops.quantized_decomposed


def _quantize(model, x, calib):
    return quantkit.quantize(model, (x[:8],), calib, progress=False)


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def _eval_const(gm, node):
    """Value of a node computed from get_attr constants only (a dequantized weight)."""
    if isinstance(node, torch.fx.Node):
        if node.op == "get_attr":
            return gm.get_buffer(node.target) if node.target in dict(gm.named_buffers()) else gm.get_parameter(node.target)
        return node.target(*[_eval_const(gm, a) for a in node.args])
    return node


def test_planted_outlier_layer_ranks_worst():
    model, x = make_planted()
    calib, data = list(x[:256].split(64)), list(x[256:384].split(64))
    report = quantkit.debug.compare(model, _quantize(model, x, calib), data)
    assert [r.layer.module for r in report.rows] == ["fc1", "fc2", "fc3", "fc4"]
    worst = report.worst
    assert worst.layer.module == "fc3" and worst.layer.name == "linear_2"
    others = [r.sqnr for r in report.rows if r is not worst]
    assert worst.sqnr < 10 and min(others) > 30, f"fc3 {worst.sqnr:.1f} dB, others {others}"
    # the outlier shows in the ranges: fc3's int8 range is ~1000x the others'
    assert worst.inputs[0].q_range[1] > 100 * report.rows[1].inputs[0].q_range[1]
    assert report.batches == 2


def test_first_layer_sqnr_matches_reference():
    model, x = make_mlp()
    calib = [x[:128]]
    qmodel = _quantize(model, x, calib)
    batch = x[128:]
    report = quantkit.debug.compare(model, qmodel, [batch])
    lin = _node(qmodel, "linear")
    q = lin.args[0].args[0]
    assert q.target is QD.quantize_per_tensor.default
    _, scale, zp, qmin, qmax, dtype = q.args
    weight = _eval_const(qmodel, lin.args[1])
    with torch.no_grad():
        ref = model.fc1(batch)
        approx = torch.nn.functional.linear(fake_quantize(batch, scale, zp, qmin, qmax, dtype), weight, model.fc1.bias)
    row = report.rows[0]
    assert row.layer.name == "linear"
    assert row.sqnr == pytest.approx(sqnr(ref, approx), abs=1e-9)
    assert row.sqnr_cumulative == pytest.approx(row.sqnr, abs=1e-9)  # nothing upstream
    assert row.max_abs_error == pytest.approx(float((ref - approx).abs().max()), rel=1e-6)


def test_ranges_and_clipping_match_reference():
    model, x = make_mlp()
    qmodel = _quantize(model, x, [x[:128]])
    data = [2 * x[128:]]  # twice the calibrated range: the input clips
    report = quantkit.debug.compare(model, qmodel, data)
    _, scale, zp, qmin, qmax, _ = _node(qmodel, "linear").args[0].args[0].args
    lo, hi = (qmin - zp) * scale, (qmax - zp) * scale
    r = report.rows[0].inputs[0]
    assert r.tensor == "x"
    assert r.q_range == pytest.approx((lo, hi), rel=1e-6)
    assert r.observed == (float(data[0].min()), float(data[0].max()))
    expected = float(((data[0] < lo - scale / 2) | (data[0] > hi + scale / 2)).double().mean())
    assert expected > 0.01
    assert r.clipped == pytest.approx(expected, abs=1e-12)
    # on the calibration data itself nothing clips
    assert quantkit.debug.compare(model, qmodel, [x[:128]]).rows[0].clipped == 0.0


@pytest.mark.parametrize("make", [make_transformer, make_cnn])
def test_compare_covers_every_quantized_op(make):
    model, x = make()
    qmodel = _quantize(model, x, [x[:32]])
    report = quantkit.debug.compare(model, qmodel, [x[:16], x[16:32]])
    ops = [r.layer.op for r in report.rows]
    if make is make_transformer:
        assert ops == ["linear", "matmul", "matmul", "linear", "linear", "linear"]
        assert all(len(r.inputs) == 2 for r in report.rows if r.layer.op == "matmul")
    else:
        assert ops == ["conv"] * 5 + ["linear"]  # conv + folded batch norm matched by name
    assert all(25 < r.sqnr < 80 and math.isfinite(r.sqnr_cumulative) for r in report.rows), str(report)
    text = str(report)
    assert text.splitlines()[0].startswith("layer") and "worst:" in text
    rows = json.loads(report.to_json())["rows"]
    assert [r["name"] for r in rows] == [r.layer.name for r in report.rows]
    assert rows[0]["inputs"][0]["q_range"] is not None


def test_compare_errors():
    model, x = make_mlp()
    qmodel = _quantize(model, x, [x[:64]])
    with pytest.raises(TypeError, match="quantized_model must be the GraphModule"):
        quantkit.debug.compare(model, model, [x[:8]])
    with pytest.raises(TypeError, match="must be the float model"):
        quantkit.debug.compare(qmodel, qmodel, [x[:8]])
    other, y = make_transformer()
    with pytest.raises(ValueError, match="not in float_model's graph"):
        quantkit.debug.compare(model, _quantize(other, y, [y[:8]]), [x[:8]])
    with pytest.raises(ValueError, match="comparison data is empty"):
        quantkit.debug.compare(model, qmodel, [])
    with pytest.raises(TypeError, match="iterable of batches"):
        quantkit.debug.compare(model, qmodel, x[:8])


@pytest.mark.parametrize("granularity", ["per-tensor", "per-token"])
def test_compare_dynamic_quantization(granularity):
    from quantkit.quantizers import QuantConfig, W8A8Quantizer

    model, x = make_mlp()
    quantizer = W8A8Quantizer(QuantConfig(dynamic=True, granularity=granularity))
    qmodel = quantkit.quantize(model, (x[:8],), [x[:64]], quantizer, progress=False)
    report = quantkit.debug.compare(model, qmodel, [x[64:128]])
    assert [r.layer.module for r in report.rows] == ["fc1", "fc2", "fc3"]
    assert all(r.inputs[0].q_range is None and r.clipped == 0.0 for r in report.rows)  # ranges chosen per batch
    assert all(30 < r.sqnr < 80 for r in report.rows), str(report)
