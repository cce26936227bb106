"""sensitivity and auto_fallback: variants, rankings and the fallback search on a planted model."""

import json

import matplotlib
import pytest
import torch

import quantkit
from quantkit.pipeline._layers import KeepFloat, find_layers
from quantkit.pipeline._variants import Variants
from quantkit.quantizers import W8A8Quantizer
from tests.models import make_transformer
from tests.outlier_models import make_planted

matplotlib.use("Agg")
QD = torch.ops.quantized_decomposed


def _split(x):
    return list(x[:256].split(64)), list(x[256:384].split(64))


def _count(gm, op):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def _remeasure(model, qmodel, data, metric):
    with torch.no_grad():
        scores = [metric(model(b), qmodel(b)) for b in data]
    return sum(scores) / len(scores)


def test_keep_float_leaves_named_ops_float():
    model, x = make_transformer()
    q = quantkit.quantize(model, (x[:8],), [x[:16]], KeepFloat(W8A8Quantizer(), ["linear_1", "matmul"]), progress=False)
    assert [layer.name for layer in find_layers(q)] == ["linear", "matmul_1", "linear_2", "linear_3"]
    full = quantkit.quantize(model, (x[:8],), [x[:16]], progress=False)
    # linear_1 loses its weight dequantize; matmul its two activation q/dq pairs and the
    # shared ones on the transposes/reshapes that fed only it
    assert _count(q, QD.dequantize_per_channel.default) == _count(full, QD.dequantize_per_channel.default) - 1
    assert _count(q, QD.quantize_per_tensor.default) < _count(full, QD.quantize_per_tensor.default) - 2


def test_variants_reuse_calibration_exactly():
    model, x = make_transformer()
    calib = [x[:16], x[16:]]
    variants = Variants(model, (x[:8],), calib, None)
    names = ["linear_1", "matmul"]
    built = variants.build(names)
    fresh = quantkit.quantize(model, (x[:8],), calib, KeepFloat(W8A8Quantizer(), names), progress=False)
    assert variants.rebuilt == 0
    with torch.no_grad():
        assert torch.equal(built(x), fresh(x))
        assert torch.equal(variants.build([])(x), quantkit.quantize(model, (x[:8],), calib, progress=False)(x))
        # every layer float: the float graph, no quantization left
        everything = variants.build([layer.name for layer in variants.layers])
        assert torch.allclose(everything(x), model(x), atol=1e-5)
    assert not find_layers(everything)


@pytest.mark.parametrize("mode", ["quantize-one", "skip-one"])
def test_sensitivity_ranks_planted_layer_first(mode):
    model, x = make_planted()
    calib, evals = _split(x)
    report = quantkit.sensitivity(model, (x[:8],), calib, evals, "cosine", mode=mode)
    assert report.ranked[0].layer.module == "fc3", str(report)
    assert report.ranked[0].sensitivity > 100 * max(abs(e.sensitivity) for e in report.ranked[1:]), str(report)
    assert report.reference == pytest.approx(1.0, abs=1e-12)
    # each score against an independent measurement of the same configuration
    entry = report.ranked[0]
    others = [e.layer.name for e in report.ranked if e is not entry]
    keep = others if mode == "quantize-one" else [entry.layer.name]
    q = quantkit.quantize(model, (x[:8],), calib, KeepFloat(W8A8Quantizer(), keep), progress=False)
    assert entry.score == pytest.approx(_remeasure(model, q, evals, quantkit.metrics.embedding_cosine), abs=1e-12)
    data = json.loads(report.to_json())
    assert data["mode"] == mode and data["ranked"][0]["module"] == "fc3"
    ax = report.plot()
    assert len(ax.patches) == 4 and ax.get_yticklabels()[-1].get_text() == "fc3 (linear_2)"


def test_auto_fallback_keeps_exactly_the_planted_layer():
    model, x = make_planted()
    calib, evals = _split(x)
    budget = 1e-3
    qmodel, report = quantkit.auto_fallback(model, (x[:8],), calib, evals, "cosine", budget=budget)
    assert [layer.module for layer in report.float_layers] == ["fc3"], str(report)
    assert report.reference - report.quantized_score > 50 * budget  # all-int8 misses the budget by far
    assert report.met and report.drop <= budget
    # the reported score is the returned model's, measured afresh
    assert report.score == _remeasure(model, qmodel, evals, quantkit.metrics.embedding_cosine)
    assert [layer.name for layer in find_layers(qmodel)] == ["linear", "linear_1", "linear_3"]
    # fc3 is 128x128 of 64x128 + 2·128x128 + 128x32 GEMM FLOPs
    assert report.int8_gemm_fraction == pytest.approx(1 - 128 * 128 / (64 * 128 + 2 * 128 * 128 + 128 * 32))
    # the report's quantizer reproduces the model
    again = quantkit.quantize(model, (x[:8],), calib, report.quantizer, progress=False)
    with torch.no_grad():
        assert torch.equal(again(x), qmodel(x))
    assert "fc3 (linear_2)" in str(report) and json.loads(report.to_json())["met"] is True


def test_auto_fallback_within_budget_quantizes_everything():
    model, x = make_planted()
    calib, evals = _split(x)
    qmodel, report = quantkit.auto_fallback(model, (x[:8],), calib, evals, "top1", budget=1.0)
    assert report.float_layers == [] and report.sensitivity is None
    assert report.int8_gemm_fraction == 1.0 and len(report.trials) == 1
    assert report.score == report.quantized_score


def test_auto_fallback_and_sensitivity_errors():
    model, x = make_planted()
    calib, evals = _split(x)
    with pytest.raises(ValueError, match="budget must be a finite number >= 0, got -0.1"):
        quantkit.auto_fallback(model, (x[:8],), calib, evals, "cosine", budget=-0.1)
    with pytest.raises(TypeError, match="budget must be a number"):
        quantkit.auto_fallback(model, (x[:8],), calib, evals, "cosine", budget="0.1")
    with pytest.raises(ValueError, match="unknown sensitivity mode 'drop-one'"):
        quantkit.sensitivity(model, (x[:8],), calib, evals, "cosine", mode="drop-one")
    with pytest.raises(ValueError, match="unknown metric 'acc'"):
        quantkit.sensitivity(model, (x[:8],), calib, evals, "acc")
    with pytest.raises(ValueError, match="nothing to analyse"):
        quantkit.sensitivity(model, (x[:8],), calib, evals, "cosine", quantizer=W8A8Quantizer().set_global(None))
