"""Float fallback layers with int8 weights (issue 28, the 0.30x artifact): a kept layer reads its
input unrounded (the activation rounding is what made it sensitive) and stores its weight in int8
per output channel, read through one ``dequantize_per_channel``.

References are written here in float64: the per-channel symmetric rounding ``q = clamp(round(w / s),
-127, 127)`` with ``s = max|w_row| / 127``, and the layer's GEMM on its unrounded input.
Tolerances: a float32 scale and product differ from float64 by a rounding each (relative 6e-8 of
values up to 127 steps: ~2e-5 of a step), so the dequantized weights agree to 1e-3 of a step (one
integer off would be a whole step); the layer's float32 GEMM against float64 math < 1e-5.
"""

import copy
import os

import pytest
import torch

import quantkit
from quantkit.lowering import _bf16
from quantkit.lowering._onednn import exact_for_graph
from quantkit._graph import DEQUANTIZE_OPS, get_attr
from quantkit.pipeline._float_fallback import (INT8_WEIGHTS_META_KEY, finish_float_layers,
                                               finish_recorded_float_layers, float_gemms, store_float_layers_int8)
from quantkit.pipeline._layers import KeepFloat, source_dequantize
from quantkit.pipeline._variants import Variants
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_mlp, make_transformer
from tests.test_mixed_precision import _node_outputs

aten = torch.ops.aten
DQ_CHANNEL = torch.ops.quantized_decomposed.dequantize_per_channel.default
KEEP = ("linear", "linear_2")  # the block's qkv and fc1


def _calib(x):
    return [(x[i:i + 8],) for i in range(0, 32, 8)]


def _ref_weight(w: torch.Tensor) -> torch.Tensor:
    w = w.detach().double()
    s = w.abs().amax(dim=1, keepdim=True) / 127
    return torch.clamp(torch.round(w / s), -127, 127) * s


@pytest.fixture(scope="module")
def block():
    model, x = make_transformer()
    variants = Variants(model, (x[:4],), _calib(x), None)
    reference = variants.build(KEEP)  # fp32 float layers
    mixed = copy.deepcopy(reference)
    assert finish_float_layers(mixed, KEEP, "int8") == {"stray_qdq_inputs": 0, "int8_weights": 2}
    return model, x, reference, mixed


def test_float_layers_store_int8_weights_read_through_one_dequantize(block):
    model, x, reference, mixed = block
    params = dict(model.named_parameters())
    nodes = {n.name: n for n in mixed.graph.nodes}
    for layer, fqn in zip(KEEP, ("qkv.weight", "fc1.weight")):
        node = nodes[layer]
        dq = node.args[1]
        assert dq.target is DQ_CHANNEL and dq.args[3] == 0 and dq.args[4:7] == (-127, 127, torch.int8)
        assert str(dq.args[0].target) == fqn and get_attr(mixed, fqn).dtype == torch.int8
        assert source_dequantize(node.args[0]) is None  # the input stays unrounded
        w = DQ_CHANNEL(*[get_attr(mixed, a.target) if isinstance(a, torch.fx.Node) else a for a in dq.args])
        ref = _ref_weight(params[fqn])
        step = (params[fqn].detach().double().abs().amax(dim=1, keepdim=True) / 127)
        assert ((w.double() - ref).abs() / step).max() < 1e-3  # a different integer would be 1 step off
        assert get_attr(reference, fqn).dtype == torch.float32  # the graph built before is untouched
    assert mixed.meta[INT8_WEIGHTS_META_KEY] == sorted(KEEP)
    # both layers still count as float GEMMs; the int8 layers are the same two
    assert {n.name for n in float_gemms(mixed)} >= set(KEEP)
    dq_count = lambda gm: sum(n.op == "call_function" and n.target in DEQUANTIZE_OPS for n in gm.graph.nodes)  # noqa: E731
    assert dq_count(mixed) == dq_count(reference) + 2
    # a quarter of the float bytes, plus a float32 scale and an int64 zero point per row
    nbytes = lambda gm: sum(t.nbytes for t in list(gm.parameters()) + list(gm.buffers()))  # noqa: E731
    kept = [params["qkv.weight"], params["fc1.weight"]]
    assert nbytes(reference) - nbytes(mixed) == sum(3 * p.numel() - 12 * p.shape[0] for p in kept)
    assert store_float_layers_int8(mixed) == 0  # nothing left to store
    assert store_float_layers_int8(copy.deepcopy(mixed), ["linear_1", "matmul", "no_such_layer"]) == 0


def test_int8_weight_layer_numerics_against_float64(block):
    model, x, reference, mixed = block
    taps = _node_outputs(mixed, x, {"layer_norm", "linear"})
    expect = taps["layer_norm"].double() @ _ref_weight(model.qkv.weight).T + model.qkv.bias.detach().double()
    rel = float((taps["linear"].double() - expect).norm() / expect.norm())
    assert rel < 1e-5, rel
    with torch.no_grad():
        out, ref, f64 = mixed(x), reference(x), copy.deepcopy(model).double()(x.double())
    # int8 weights on two layers move the output a little from the fp32-weight fallback, never more
    # than the all-int8 model differs from float
    allint8 = Variants(model, (x[:4],), _calib(x), None).build(())
    err = lambda a: float((a.double() - f64).norm() / f64.norm())  # noqa: E731
    with torch.no_grad():
        assert err(ref) <= err(out) < err(allint8(x)), (err(ref), err(out))


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_variants_score_what_the_keep_float_build_computes(weights):
    model, x = make_transformer()
    variants = Variants(model, (x[:4],), _calib(x), None, float_weights=weights)
    cheap = variants.variant(KEEP)
    assert variants.cheap is True  # checked bit for bit against a real build
    real = quantkit.quantize(model, (x[:4],), _calib(x), KeepFloat(W8A8Quantizer(), KEEP, float_weights=weights),
                             progress=False)
    with torch.no_grad():
        assert torch.equal(cheap(x), real(x))
    assert get_attr(real, "fc1.weight").dtype == (torch.int8 if weights == "int8" else torch.bfloat16)
    assert finish_recorded_float_layers(copy.deepcopy(real)).get(f"{weights}_weights") == 0  # done by convert
    with pytest.raises(ValueError, match=r"unknown float layer weights 'fp16'; use 'bf16' or 'int8'"):
        finish_float_layers(copy.deepcopy(real), KEEP, "fp16")


def test_variants_round_each_kept_weight_once_and_share_it(monkeypatch):
    from quantkit.pipeline import _float_fallback

    calls = []
    rounding = _float_fallback.int8_weight
    monkeypatch.setattr(_float_fallback, "int8_weight", lambda w: calls.append(w) or rounding(w))
    model, x = make_transformer()
    variants = Variants(model, (x[:4],), _calib(x), None, float_weights="int8")
    first = variants.variant(KEEP)  # checked against a real build, which rounds for itself
    built = len(calls)
    second, third = variants.variant(KEEP[:1]), variants.variant(KEEP[1:])
    assert variants.cheap is True and len(calls) == built  # the scoring copies' weights: rounded once
    # a kept layer's weight (its int8 rounding, folded to float32) is one object in every copy: dequantized once
    def weight(gm, layer):
        w = {n.name: n for n in gm.graph.nodes}[layer].args[1]
        assert w.op == "get_attr"
        return get_attr(gm, w.target)

    assert weight(first, KEEP[0]) is weight(second, KEEP[0]) and weight(first, KEEP[1]) is weight(third, KEEP[1])
    with torch.no_grad():  # and each still computes its real build
        real = variants.build(KEEP[:1])
        finish_float_layers(real, KEEP[:1], "int8")
        assert torch.equal(second(x), real(x))


def test_calibrate_like_gives_the_observers_a_calibration_gives():
    """The CLI's artifact copies the search's calibrated observers into its own prepared model (the
    --skip layers float) instead of running the data again: the converted model is the same."""
    model, x = make_transformer()
    variants = Variants(model, (x[:4],), _calib(x), None)
    quantizer = KeepFloat(W8A8Quantizer(), KEEP)
    copied, fresh = quantkit.prepare(variants.float_graph, quantizer), quantkit.prepare(variants.float_graph, quantizer)
    assert variants.calibrate_like(copied)
    quantkit.calibrate(fresh, _calib(x), progress=False)
    a, b = quantkit.convert(copied), quantkit.convert(fresh)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.meta["quantkit_qparams"] == b.meta["quantkit_qparams"]
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    # another quantizer's observers (here: a histogram where the search used min-max) do not match
    other = quantkit.prepare(variants.float_graph, W8A8Quantizer(QuantConfig(act_observer="histogram")))
    assert not variants.calibrate_like(other) and "quantkit_calibrated_batches" not in other.meta


def test_artifact_round_trip_keeps_int8_weights_and_the_size_drop(tmp_path):
    model, x = make_mlp()
    variants = Variants(model, (x[:8],), [(b,) for b in x.split(64)], None)
    reference = variants.build(["linear_1"])
    bf16, int8 = copy.deepcopy(reference), copy.deepcopy(reference)
    finish_float_layers(bf16, ["linear_1"], "bf16")
    finish_float_layers(int8, ["linear_1"], "int8")
    quantkit.save(bf16, tmp_path / "bf16")
    quantkit.save(int8, tmp_path / "int8")
    drop = os.path.getsize(tmp_path / "bf16" / "model.pt2") - os.path.getsize(tmp_path / "int8" / "model.pt2")
    fc2 = model.fc2.weight
    # a byte per weight, less a float32 scale and an int64 zero point per row, less the archive entries and nodes of the scales
    low = fc2.numel() - 12 * fc2.shape[0] - 4096  # two more tensors in the archive, and the dequantize nodes
    assert low <= drop <= fc2.numel(), f"model.pt2 shrank by {drop} bytes; fc2 has {tuple(fc2.shape)} weights"
    loaded = quantkit.load(tmp_path / "int8")
    with torch.no_grad():
        assert torch.equal(loaded(x), int8(x))
        # compiled (Inductor folds the weight's dequantize): on a CPU with native BF16 the kept layer
        # computes in bf16 (float_layers_bf16: activation and dequantized weight rounded to bf16,
        # relative 2**-9 each, tolerance as tests/test_mixed_precision.py's bf16 compute); elsewhere
        # the same values within float32 GEMM noise
        fast = quantkit.compile(loaded)
        rel = float((fast(x) - int8(x)).norm() / int8(x).norm())
    lowering = fast._orig_mod.meta["quantkit_lowering"]
    bf16 = lowering.get("float_layers_bf16", 0) + lowering.get("to_bf16", 0)  # the kept layer alone, or every float op
    assert bool(bf16) == (_bf16.bf16_supported() and exact_for_graph(loaded))  # oneDNN int8 + native BF16
    assert rel < (2e-2 if bf16 else 1e-5), (rel, bf16)
