"""Mixed precision that stays fast (issue 28, item 3): float fallback layers without stray q/dq,
with bf16 weights, run in bf16 by the lowering, int8 neighbours' patterns intact.

Tolerances (bf16 keeps 8 significant bits, relative rounding <= 2**-9 ~ 2e-3 per element):
- bf16 weights vs the float32-weight fallback graph: relative error of the output norm < 1e-2
  (measured 1.7e-3 on the transformer block with 2 of 4 linears float); the SQNR against the
  float64 float model stays within 0.2 dB of the float32-weight fallback's (measured 52.30 vs 52.40 dB).
- a kept layer's own output: its float32 GEMM on exactly-bf16 weights against float64 math < 1e-5.
- bf16 compute (activations rounded to bf16 as well) vs the float32 graph: < 2e-2, as in
  tests/test_bf16_lowering.py (an activation rounded to bf16 may move to the next int8 level).
"""

import copy
import os
import warnings

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer, get_default_x86_inductor_quantization_config)

import quantkit
from quantkit._graph import DEQUANTIZE_OPS, QUANTIZE_OPS, get_attr
from quantkit._qmath import sqnr
from quantkit.lowering import Target, _bf16, lower
from quantkit.lowering._registry import LoweringContext, run_lowerings
from quantkit.pipeline._float_fallback import (FLOAT_WEIGHTS_META_KEY, bf16_weight_source, drop_stray_qdq,
                                               finish_float_layers, finish_recorded_float_layers, float_gemms,
                                               store_float_layers_bf16)
from quantkit.pipeline._layers import KeepFloat, source_dequantize
from quantkit.pipeline._variants import Variants
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_catpool, make_mlp, make_transformer

aten = torch.ops.aten
KEEP = ("linear", "linear_2")  # the block's qkv and fc1: 2 of its 4 linears float
BF16_WEIGHT_TOL, BF16_COMPUTE_TOL = 1e-2, 2e-2


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _x86():
    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())


def _calib(x):
    return [(x[i:i + 8],) for i in range(0, 32, 8)]


@pytest.fixture(scope="module")
def block():
    """(float model, input, fp32-weight fallback graph, the same with finish_float_layers applied)."""
    model, x = make_transformer()
    variants = Variants(model, (x[:4],), _calib(x), None)
    reference = variants.build(KEEP)
    mixed = copy.deepcopy(reference)
    counts = finish_float_layers(mixed, KEEP)
    assert counts == {"stray_qdq_inputs": 0, "bf16_weights": 2}  # quantkit's quantizer leaves none
    return model, x, reference, mixed


def _dequantized(a) -> bool:
    """``a`` is a dequantize, seen through view ops and the bf16 cast int8-mixed-bf16 puts after it."""
    if isinstance(a, torch.fx.Node) and a.target is aten._to_copy.default and a.kwargs.get("dtype") is torch.bfloat16:
        a = a.args[0]
    return source_dequantize(a) is not None


def _int8_linears(gm):
    """Linears that read a dequantized activation and a dequantized weight (Inductor's qlinear pattern)."""
    return [n.name for n in gm.graph.nodes if n.target is aten.linear.default and all(map(_dequantized, n.args[:2]))]


def _qdq_count(gm):
    return sum(n.op == "call_function" and n.target in QUANTIZE_OPS | DEQUANTIZE_OPS for n in gm.graph.nodes)


class _TwoHeads(nn.Module):
    """conv -> pool -> flatten read by two heads: torchao's X86 quantizer quantizes the pool and flatten
    outputs, so one dequantize feeds both heads; keeping one head float leaves it reading that q/dq."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        y = torch.flatten(nn.functional.adaptive_avg_pool2d(self.conv(x), 1), 1)
        return self.a(y) + self.b(y)


def test_float_head_reads_the_float_source_and_the_int8_head_keeps_its_qdq():
    torch.manual_seed(0)
    model, x = _TwoHeads().eval(), torch.randn(32, 3, 8, 8)
    gm = Variants(model, (x[:4],), _calib(x), _x86()).build(["linear_1"])  # head b float
    (head_b,) = float_gemms(gm)
    assert head_b.name == "linear_1" and source_dequantize(head_b.args[0]) is not None  # the stray q/dq
    before_qdq, before_out = _qdq_count(gm), gm(x)
    assert drop_stray_qdq(gm) == 1
    assert source_dequantize(head_b.args[0]) is None  # reads flatten(pool(conv)) in float
    assert head_b.args[0].target is aten.flatten.using_ints and head_b.args[0].args[0].target is aten.adaptive_avg_pool2d.default
    assert _int8_linears(gm) == ["linear"]  # head a keeps dq -> linear <- dq(w)
    assert _qdq_count(gm) == before_qdq - 1  # only head b's own dequantize goes (its quantize feeds head a)
    # head b now skips one rounding of its input: the output moves by at most that rounding
    out = gm(x)
    assert 0 < _rel(out, before_out) < 2e-2
    # float64 reference of what head b now computes: the float pool output, with no rounding after it
    taps = _node_outputs(gm, x, ["adaptive_avg_pool2d", "linear_1"])
    with torch.no_grad():
        y = taps["adaptive_avg_pool2d"].double().flatten(1)
        head_b64 = y @ model.b.weight.double().T + model.b.bias.double()
    assert _rel(taps["linear_1"], head_b64) < 1e-5


def _node_outputs(gm, x, names):
    out = {}

    class Tap(torch.fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if n.name in names:
                out[n.name] = r
            return r

    with torch.no_grad():
        Tap(gm).run(x)
    return out


def test_keep_float_with_torchao_x86_quantizer_around_a_cat():
    """KeepFloat's empty annotation must be the X86 quantizer's own class: it asserts so on the
    inputs of a cat / pool it propagates quantization through (a plain one raised AssertionError)."""
    model, x = make_catpool()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:4],)), KeepFloat(_x86(), ["conv2d"]))
    quantkit.calibrate(prepared, _calib(x), progress=False)
    gm = quantkit.convert(prepared)
    assert "conv2d" in [n.name for n in float_gemms(gm)]
    assert _rel(gm(x), model(x)) < 0.1


def test_float_layers_store_bf16_weights(block):
    model, x, reference, mixed = block
    params = dict(model.named_parameters())
    for layer, fqn in zip(KEEP, ("qkv.weight", "fc1.weight")):
        node = next(n for n in mixed.graph.nodes if n.name == layer)
        src = bf16_weight_source(node.args[1])
        assert src is not None and str(src.target) == fqn
        w = get_attr(mixed, fqn)
        assert w.dtype == torch.bfloat16 and w.nbytes == params[fqn].numel() * 2
        assert torch.equal(w, params[fqn].detach().to(torch.bfloat16))  # round to nearest, not truncated
        assert get_attr(reference, fqn).dtype == torch.float32  # the variant built before is untouched
    assert mixed.meta[FLOAT_WEIGHTS_META_KEY] == sorted(KEEP)
    # int8 weights and biases are unchanged; the float weight bytes halve
    nbytes = lambda gm: sum(t.nbytes for t in list(gm.parameters()) + list(gm.buffers()))  # noqa: E731
    kept = params["qkv.weight"].numel() + params["fc1.weight"].numel()
    assert nbytes(reference) - nbytes(mixed) == 2 * kept
    assert _int8_linears(mixed) == _int8_linears(reference) == ["linear_1", "linear_3"]
    assert _qdq_count(mixed) == _qdq_count(reference)
    # a second call stores nothing more; int8 layers and attention matmuls have no float weight to store
    assert store_float_layers_bf16(mixed) == 0
    assert store_float_layers_bf16(copy.deepcopy(mixed), ["linear_1", "matmul", "no_such_layer"]) == 0


def test_bf16_weights_numerics(block):
    model, x, reference, mixed = block
    with torch.no_grad():
        out, ref = mixed(x), reference(x)
        float64 = copy.deepcopy(model).double()(x.double())
    rel = _rel(out, ref)
    assert 0 < rel < BF16_WEIGHT_TOL, f"bf16 weights vs fp32-weight fallback: relative error {rel:.2e}"
    db, ref_db = sqnr(float64, out), sqnr(float64, ref)
    assert db > ref_db - 0.2 and db > 25, f"SQNR vs float64 model {db:.2f} dB (fp32 weights {ref_db:.2f} dB)"
    # the kept qkv linear itself: float32 GEMM of exactly-bf16 weights against float64 math on its input
    taps = _node_outputs(mixed, x, ["layer_norm", "linear"])
    w64 = model.qkv.weight.detach().to(torch.bfloat16).double()
    expect = taps["layer_norm"].double() @ w64.T + model.qkv.bias.detach().double()
    assert _rel(taps["linear"], expect) < 1e-5


def test_bf16_float_ops_read_the_bf16_weights(block):
    """compile(float_dtype="bf16")'s pass: the kept linears read the stored bf16 weight itself (no
    float32 round trip left), the int8 linears keep their q/dq patterns."""
    _, x, reference, mixed = block
    gm = copy.deepcopy(mixed)
    lower(gm, "onednn")
    int8_before = _int8_linears(gm)
    _bf16.float_ops_to_bf16(gm)
    for layer in KEEP:
        node = next(n for n in gm.graph.nodes if n.name == layer)
        w = node.args[1]
        assert w.op == "get_attr" and get_attr(gm, w.target).dtype == torch.bfloat16
    assert not [n for n in gm.graph.nodes if bf16_weight_source(n) is not None]  # the casts went
    assert _int8_linears(gm) == int8_before == ["linear_1", "linear_3"]
    with torch.no_grad():
        out = gm(x)
    assert out.dtype == torch.float32
    assert _rel(out, mixed(x)) < BF16_COMPUTE_TOL


def _bf16_layer_inputs(gm, layer: str) -> tuple:
    """The args of a kept layer that computes in bf16, after checking its activation is cast to bf16
    and its one reader casts the output back to float32."""
    node = next(n for n in gm.graph.nodes if n.name == layer)
    x_in = node.args[0]
    assert x_in.target is aten._to_copy.default and x_in.kwargs["dtype"] is torch.bfloat16
    (back,) = node.users
    assert back.target is aten._to_copy.default and back.kwargs["dtype"] is torch.float32
    return node.args


def test_float_layers_to_bf16_with_float32_float_ops(monkeypatch, block):
    """The registered pass on a BF16 CPU (simulated) with the other float ops in float32: only the
    kept GEMMs compute in bf16; nothing on a CPU without BF16, with the reference graph, or where
    the bf16 pass already runs every float op in bf16."""
    _, x, reference, mixed = block
    ctx = lambda dtype, target=Target.ONEDNN: LoweringContext("cpu", target, "auto", dtype, "scaled_mm")  # noqa: E731
    monkeypatch.setattr(_bf16, "bf16_supported", lambda: False)
    assert "float_layers_bf16" not in run_lowerings(copy.deepcopy(mixed), ctx(torch.float32))
    monkeypatch.setattr(_bf16, "bf16_supported", lambda: True)
    assert "float_layers_bf16" not in run_lowerings(copy.deepcopy(mixed), ctx(torch.float32, None))
    # an explicit compile(float_dtype="fp32") keeps every float op in float32
    fp32_asked = LoweringContext("cpu", Target.ONEDNN, "auto", torch.float32, "scaled_mm", requested_float_dtype="fp32")
    assert "float_layers_bf16" not in run_lowerings(copy.deepcopy(mixed), fp32_asked)
    bf16_all = run_lowerings(copy.deepcopy(mixed), ctx(torch.bfloat16))
    assert "float_layers_bf16" not in bf16_all and bf16_all["to_bf16"] > 0
    gm = copy.deepcopy(mixed)
    counts = run_lowerings(gm, ctx(torch.float32))
    assert counts["float_layers_bf16"] == 2 and "to_bf16" not in counts
    for layer in KEEP:
        w_in, b_in = _bf16_layer_inputs(gm, layer)[1:3]
        assert w_in.op == "get_attr" and get_attr(gm, w_in.target).dtype == torch.bfloat16
        assert b_in.kwargs["dtype"] is torch.bfloat16
    assert _int8_linears(gm) == ["linear_1", "linear_3"]
    with torch.no_grad():
        assert _rel(gm(x), mixed(x)) < BF16_COMPUTE_TOL


def test_int8_weight_float_layers_run_bf16_too(monkeypatch, block):
    """A fallback layer whose weight is stored int8 (float input, ``dequantize_per_channel`` weight:
    ``weights="int8"``) computes in bf16 on a BF16 CPU as a bf16-weight one does: its activation and
    its dequantized weight cast to bf16 (freezing folds the weight's dequantize and cast into one bf16
    constant), its output cast back; the int8 layers keep their pattern. Against the float32 graph:
    within the bf16 compute tolerance, the weight's int8 rounding being the same in both."""
    _, x, reference, _ = block
    int8w = copy.deepcopy(reference)
    assert finish_float_layers(int8w, KEEP, weights="int8") == {"stray_qdq_inputs": 0, "int8_weights": 2}
    monkeypatch.setattr(_bf16, "bf16_supported", lambda: True)
    gm = copy.deepcopy(int8w)
    counts = run_lowerings(gm, LoweringContext("cpu", Target.ONEDNN, "auto", torch.float32, "scaled_mm"))
    assert counts["float_layers_bf16"] == 2 and "to_bf16" not in counts
    for layer in KEEP:
        w_in = _bf16_layer_inputs(gm, layer)[1]
        assert w_in.target is aten._to_copy.default and w_in.kwargs["dtype"] is torch.bfloat16
        dq = w_in.args[0]
        assert dq.target is torch.ops.quantized_decomposed.dequantize_per_channel.default
        assert get_attr(gm, dq.args[0].target).dtype == torch.int8
    assert _int8_linears(gm) == ["linear_1", "linear_3"]
    with torch.no_grad():
        assert _rel(gm(x), int8w(x)) < BF16_COMPUTE_TOL


def test_auto_runs_float_ops_bf16_on_amx_for_a_graph_with_bf16_fallback_layers(monkeypatch, block):
    """On an AMX CPU (simulated) ``"auto"`` runs every float op in bf16 for a graph whose fallback layers
    compute in bf16 anyway (bf16 or int8 weights: no casts around each of them), even where the
    attention alone is too small for bf16 (this block's); float32-weight fallback layers and a
    CPU without AMX keep float32."""
    _, _, reference, mixed = block
    int8w = copy.deepcopy(reference)
    finish_float_layers(int8w, KEEP, weights="int8")
    monkeypatch.setattr(_bf16, "bf16_supported", lambda: True)
    monkeypatch.setattr(_bf16, "cpu_has", lambda flag: flag in ("avx512_bf16", "amx_bf16"))
    assert not _bf16.bf16_attention_faster(reference)
    assert _bf16.resolve_float_dtype("auto", onednn=True, graph=reference) is torch.float32
    for gm in (mixed, int8w):
        assert _bf16.has_bf16_float_layers(gm)
        assert _bf16.resolve_float_dtype("auto", onednn=True, graph=gm) is torch.bfloat16
        assert _bf16.resolve_float_dtype("fp32", onednn=True, graph=gm) is torch.float32
    monkeypatch.setattr(_bf16, "cpu_has", lambda flag: flag == "avx512_bf16")  # a Zen 4
    assert _bf16.resolve_float_dtype("auto", onednn=True, graph=mixed) is torch.float32


def test_compiled_int8_neighbours_keep_their_onednn_kernels(monkeypatch):
    """Inductor on the mixed MLP (fc2 float, bf16 weight, BF16 CPU simulated): fc1 and fc3 are still
    onednn.qlinear_pointwise; fc2 computes in bf16. 7-bit activations make oneDNN exact on any x86
    CPU, so ``auto`` takes it here too."""
    model, x = make_mlp()
    variants = Variants(model, (x[:8],), [(b,) for b in x.split(64)],
                        W8A8Quantizer(QuantConfig(activation="affine-uint7")))
    gm = variants.build(["linear_1"])
    assert finish_float_layers(gm, ["linear_1"])["bf16_weights"] == 1
    monkeypatch.setattr(_bf16, "bf16_supported", lambda: True)
    torch._dynamo.utils.counters.clear()
    fast = quantkit.compile(gm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y, code = run_and_get_code(fast, x)
    lowering = fast._orig_mod.meta["quantkit_lowering"]
    if _bf16.resolve_float_dtype("auto", onednn=True, graph=gm) is torch.bfloat16:  # AMX: every float op bf16
        assert lowering["to_bf16"] > 0 and "float_layers_bf16" not in lowering
    else:  # only the kept GEMM in bf16
        assert lowering["float_layers_bf16"] == 1 and "to_bf16" not in lowering
    assert torch._dynamo.utils.counters["inductor"]["qlinear_weight_prepack_matcher_count"] == 2
    qlinears = [line for line in "\n".join(code).splitlines() if "torch.ops.onednn.qlinear_pointwise" in line]
    assert len(qlinears) == 2, qlinears
    with torch.no_grad():
        ref = gm(x)
    assert _rel(y, ref) < BF16_COMPUTE_TOL


def test_artifact_round_trip_keeps_bf16_and_the_size_drop(tmp_path):
    model, x = make_mlp()
    variants = Variants(model, (x[:8],), [(b,) for b in x.split(64)], None)
    reference = variants.build(["linear_1"])
    mixed = copy.deepcopy(reference)
    finish_float_layers(mixed, ["linear_1"])
    quantkit.save(reference, tmp_path / "fp32")
    quantkit.save(mixed, tmp_path / "bf16")
    drop = os.path.getsize(tmp_path / "fp32" / "model.pt2") - os.path.getsize(tmp_path / "bf16" / "model.pt2")
    fc2 = model.fc2.weight.numel()
    assert 0.9 * 2 * fc2 <= drop <= 2 * fc2 + 4096, f"model.pt2 shrank by {drop} bytes; fc2's weight is {fc2} values"
    loaded = quantkit.load(tmp_path / "bf16")
    params = dict(loaded.named_parameters())
    (w_name,) = [n for n, p in params.items() if p.dtype == torch.bfloat16]
    assert w_name.endswith("fc2.weight")
    with torch.no_grad():
        assert torch.equal(loaded(x), mixed(x))
    # the reloaded graph still shows the cast the bf16 lowering reads the weight through
    assert len([n for n in loaded.graph.nodes if bf16_weight_source(n) is not None]) == 1
    assert _bf16.float_layers_to_bf16(copy.deepcopy(loaded)) == {"float_layers_bf16": 1}


def test_keep_float_bf16_record_reaches_the_converted_model():
    """KeepFloat(float_weights="bf16") leaves a record convert carries over; applying it gives the
    same graph as finishing the float layers by hand. A bad value is one ValueError line."""
    model, x = make_mlp()
    calib = [(b,) for b in x.split(64)]
    with pytest.raises(ValueError, match=r"unknown float_weights 'fp16'; use one of \['fp32', 'bf16', 'int8'\]"):
        KeepFloat(W8A8Quantizer(), ["linear_1"], float_weights="fp16")
    q = KeepFloat(W8A8Quantizer(), ["linear_1"], float_weights="bf16")
    assert "float_weights='bf16'" in repr(q)
    p = quantkit.prepare(quantkit.capture(model, (x[:8],)), q)
    quantkit.calibrate(p, calib, progress=False)
    gm = quantkit.convert(p)  # convert applies the record itself
    assert get_attr(gm, "fc2.weight").dtype == torch.bfloat16
    assert finish_recorded_float_layers(copy.deepcopy(gm))["bf16_weights"] == 0  # nothing left to do
    # without the option nothing is recorded and nothing changes; finishing it by hand gives convert's graph
    p = quantkit.prepare(quantkit.capture(model, (x[:8],)), KeepFloat(W8A8Quantizer(), ["linear_1"]))
    quantkit.calibrate(p, calib, progress=False)
    plain = quantkit.convert(p)
    assert finish_recorded_float_layers(plain) == {} and get_attr(plain, "fc2.weight").dtype == torch.float32
    by_hand = copy.deepcopy(plain)
    assert finish_float_layers(by_hand, ["linear_1"])["bf16_weights"] == 1
    with torch.no_grad():
        assert torch.equal(gm(x), by_hand(x))


def test_an_unfolded_weight_qdq_is_not_a_stray_pair():
    """Where convert did not fold the weights (fold_quantize=False) a weight reads ``dq(q(w))``; a GEMM
    with a float activation and such a weight (a weight-only layer) keeps its weight quantized."""
    model, x = make_mlp()
    p = quantkit.prepare(quantkit.capture(model, (x[:8],)), W8A8Quantizer())
    quantkit.calibrate(p, [(x[:64],)], progress=False)
    gm = quantkit.convert(p, fold_quantize=False)
    layer = next(n for n in gm.graph.nodes if n.name == "linear_1")
    act_dq = layer.args[0]
    layer.replace_input_with(act_dq, act_dq.args[0].args[0])  # a float activation, by hand
    weight_q = layer.args[1].args[0]
    assert weight_q.target in QUANTIZE_OPS and weight_q.args[0].op == "get_attr"
    assert [n.name for n in float_gemms(gm)] == ["linear_1"]
    assert drop_stray_qdq(gm) == 0
    assert layer.args[1].args[0] is weight_q  # still dq(q(w))
