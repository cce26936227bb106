"""quantkit.compile and its lowering pass: op counts after the rewrite, numerics against the q/dq reference."""

import copy

import pytest
import torch

import quantkit
from quantkit.lowering import lower
from quantkit._qmath import sqnr
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_mlp, make_transformer

Q = torch.ops.quantized_decomposed
aten = torch.ops.aten
_DQ = (Q.dequantize_per_tensor.default, Q.dequantize_per_tensor.tensor, Q.dequantize_per_channel.default)


def _converted(make, quantizer):
    m, x = make()
    p = quantkit.prepare(quantkit.capture(m, (x[:8],)), quantizer)
    quantkit.calibrate(p, [(b,) for b in x.split(32)], progress=False)
    return quantkit.convert(p), x


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _dq_fed(gm, targets):
    """Nodes of ``targets`` that still read a dequantize (the pattern the rewrite must remove)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets
            and any(isinstance(a, torch.fx.Node) and a.target in _DQ for a in n.args)]


QUANTIZERS = {
    "static": lambda: W8A8Quantizer(),
    "uint7": lambda: W8A8Quantizer(QuantConfig(activation="affine-uint7")),
    "symmetric": lambda: W8A8Quantizer(QuantConfig(activation="symmetric-int8")),
    "dynamic": lambda: W8A8Quantizer(dynamic=True),
    "per-token": lambda: W8A8Quantizer(QuantConfig(dynamic=True, granularity="per-token")),
}


@pytest.mark.parametrize("scheme", sorted(QUANTIZERS))
def test_triton_lowering_mlp_fuses_relu_and_requant(scheme):
    c, x = _converted(make_mlp, QUANTIZERS[scheme]())
    gm = copy.deepcopy(c)
    counts = lower(gm, "triton")
    assert counts == {"linear": 3, "matmul": 0, "quantize_per_token": 3 if scheme == "per-token" else 0}
    assert _dq_fed(gm, {aten.linear.default}) == [] and _count(gm, Q.dequantize_per_channel.default) == 0
    ops = [n for n in gm.graph.nodes if n.target == torch.ops.quantkit.int8_linear.default]
    assert [n.args[6] for n in ops] == ["relu", "relu", "none"]
    if scheme == "uint7":  # the Triton epilogue clamps to the full dtype range: no 0..127 requant fusion
        assert [n.args[7] for n in ops] == [torch.float32] * 3
        assert _count(gm, Q.quantize_per_tensor.default) == 3
    elif scheme == "per-token":  # one scale per row, from the fused one-pass quantize kernel
        assert [n.args[1].args[0].target for n in ops] == [torch.ops.quantkit.quantize_per_token.default] * 3
        assert _count(gm, Q.choose_qparams_per_token.default) == 0 and _count(gm, Q.quantize_per_token.default) == 0
        assert _count(gm, Q.dequantize_per_token.default) == 0
    elif scheme != "dynamic":  # static: the next layer's quantize is fused into fc1 and fc2
        act = torch.int8 if scheme == "symmetric" else torch.uint8
        assert [n.args[7] for n in ops] == [act, act, torch.float32]
        assert _count(gm, Q.quantize_per_tensor.default) == 1  # only the model input's
        assert _count(gm, aten.relu.default) == 0
    with torch.no_grad():  # CPU implementations of the ops (torch._int_mm)
        rel = float((gm(x) - c(x)).norm() / c(x).norm())
    assert rel < 1e-3, f"lowered vs reference relative error {rel:.2e}"


def test_triton_lowering_transformer_uses_int8_bmm_for_attention():
    c, x = _converted(make_transformer, W8A8Quantizer(dynamic=True))
    gm = copy.deepcopy(c)
    assert lower(gm, "triton") == {"linear": 4, "matmul": 2, "quantize_per_token": 0}
    assert _dq_fed(gm, {aten.linear.default, aten.matmul.default}) == []
    assert _count(gm, torch.ops.quantkit.int8_bmm.default) == 2
    gelu = [n for n in gm.graph.nodes if n.target == torch.ops.quantkit.int8_linear.default and n.args[6] == "gelu"]
    assert len(gelu) == 1 and _count(gm, aten.gelu.default) == 0
    with torch.no_grad():
        ref, y = c(x), gm(x)
    assert sqnr(ref, y) > 60, f"lowered vs reference SQNR {sqnr(ref, y):.1f} dB"


def test_triton_lowering_per_token_transformer():
    """Per-token linears become int8_linear with per-row scales, and the attention matmuls
    int8_bmm with a per-row scale for their per-token left operand."""
    cfg = QuantConfig(dynamic=True, granularity="per-token")
    c, x = _converted(make_transformer, W8A8Quantizer(cfg))
    gm = copy.deepcopy(c)
    # the inputs of qkv, proj, fc1, fc2 and the two matmuls' left operands: 6 per-token
    # quantizes, all fused into the one-pass kernel
    assert lower(gm, "triton") == {"linear": 4, "matmul": 2, "quantize_per_token": 6}
    assert _dq_fed(gm, {aten.linear.default, aten.matmul.default}) == []
    assert _count(gm, Q.dequantize_per_token.default) == 0 and _count(gm, aten.matmul.default) == 0
    assert _count(gm, Q.choose_qparams_per_token.default) == 0
    bmm = [n for n in gm.graph.nodes if n.target == torch.ops.quantkit.int8_bmm.default]
    assert [n.args[1].args[0].target for n in bmm] == [torch.ops.quantkit.quantize_per_token.default] * 2
    with torch.no_grad():
        ref, y = c(x), gm(x)
    assert sqnr(ref, y) > 60, f"lowered vs reference SQNR {sqnr(ref, y):.1f} dB"


def test_onednn_prepass_moves_int8_activations_to_uint8_exactly():
    c, x = _converted(make_transformer, QUANTIZERS["symmetric"]())
    gm = copy.deepcopy(c)
    counts = lower(gm, "onednn")
    assert counts["int8_to_uint8"] == _count(c, Q.quantize_per_tensor.default) > 0
    q_dtypes = {n.args[5] for n in gm.graph.nodes if n.target == Q.quantize_per_tensor.default}
    assert q_dtypes == {torch.uint8}
    with torch.no_grad():
        assert torch.equal(gm(x), c(x))


def test_compile_cpu_onednn_rewrites_every_linear():
    # 7-bit weights: oneDNN's int16 pair sums cannot saturate, so the result must match the
    # reference on any x86 CPU, VNNI or not (full-range weights are exact only with VNNI)
    c, x = _converted(make_mlp, W8A8Quantizer())
    for name, buf in c.named_buffers():
        if name.startswith("_frozen_param"):
            buf.clamp_(-63, 63)
    torch._dynamo.utils.counters.clear()
    with pytest.warns(UserWarning, match="saturates") if not quantkit.lowering._onednn.exact_on_this_cpu() else _nothing():
        fast = quantkit.compile(c, cpu_kernels="onednn")
    y = fast(x)
    assert torch._dynamo.utils.counters["inductor"]["qlinear_weight_prepack_matcher_count"] == 3
    with torch.no_grad():
        ref = c(x)
    assert sqnr(ref, y) > 40, f"compiled vs reference SQNR {sqnr(ref, y):.1f} dB"
    assert any(n.target in _DQ for n in c.graph.nodes)  # the user's model is left as it was


@pytest.fixture
def no_vnni(monkeypatch):
    """Make ``auto`` decide as on an AVX2-only CPU, so the tests below mean the same everywhere."""
    monkeypatch.setattr(quantkit.lowering._onednn, "exact_on_this_cpu", lambda: False)
    monkeypatch.setattr(quantkit.lowering._bf16, "bf16_supported", lambda: False)  # nor AVX-512 BF16


def test_exact_for_graph_needs_every_onednn_activation_in_0_127(no_vnni):
    exact = quantkit.lowering._onednn.exact_for_graph
    seven = QuantConfig(activation="affine-uint7")
    assert exact(_converted(make_mlp, W8A8Quantizer(seven))[0])
    assert not exact(_converted(make_mlp, W8A8Quantizer())[0])
    assert not exact(_converted(make_mlp, QUANTIZERS["symmetric"]())[0])  # int8 is shifted to 0..255
    mixed = W8A8Quantizer(seven).set_module_name("fc3", QuantConfig())
    assert not exact(_converted(make_mlp, mixed)[0])  # one 8-bit layer: the whole graph stays reference


@pytest.mark.parametrize("bits", [7, 8])
def test_compile_auto_takes_onednn_for_uint7_activations(no_vnni, bits):
    quantizer = QUANTIZERS["uint7" if bits == 7 else "static"]()
    c, x = _converted(make_mlp, quantizer)
    torch._dynamo.utils.counters.clear()
    fast = quantkit.compile(c)  # cpu_kernels="auto"
    # inputs past the calibrated range: a fused requantize must still clamp to 0..127
    x = torch.cat([x, 3 * x])
    y = fast(x)
    prepacked = torch._dynamo.utils.counters["inductor"]["qlinear_weight_prepack_matcher_count"]
    with torch.no_grad():
        ref = c(x)
    if bits == 8:  # 8-bit activations would saturate without VNNI: reference path, nothing rewritten
        assert prepacked == 0 and fast._orig_mod.meta["quantkit_lowering"] == {}
        return
    assert prepacked == 3 and isinstance(fast, quantkit.lowering._compile._Frozen)
    # calibrated range: int32-exact GEMMs, only float rounding in the epilogues (measured 1.6e-7)
    n = len(x) // 2
    rel = float((y[:n] - ref[:n]).norm() / ref[:n].norm())
    assert rel < 1e-5, f"oneDNN (7-bit) vs reference relative error {rel:.2e}"
    # past it: values clamp at 127; oneDNN's fp32 epilogue rounds differently from the float
    # GEMM of the reference, flipping a few quantized values by 1 LSB (measured 3.3e-4).
    # Without the explicit clamp (requantize fused to 0..255) this is 0.3.
    rel = float((y[n:] - ref[n:]).norm() / ref[n:].norm())
    assert rel < 2e-3, f"oneDNN (7-bit) vs reference relative error past the calibrated range {rel:.2e}"


def test_compile_reference_path_matches_reference():
    c, x = _converted(make_mlp, W8A8Quantizer(dynamic=True))
    fast = quantkit.compile(c, cpu_kernels="reference")
    with torch.no_grad():
        ref, y = c(x), fast(x)
    # Inductor's fused quantize may round a few values the other way (1 LSB)
    assert sqnr(ref, y) > 40, f"compiled vs reference SQNR {sqnr(ref, y):.1f} dB"
    assert fast._orig_mod.meta["quantkit_lowering"] == {}


def test_compile_errors():
    with pytest.raises(TypeError, match="GraphModule returned by quantkit.convert"):
        quantkit.compile(torch.nn.Linear(2, 2))
    c, _ = _converted(make_mlp, W8A8Quantizer())
    with pytest.raises(ValueError, match="unknown cpu_kernels 'mkl'"):
        quantkit.compile(c, cpu_kernels="mkl")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("make", [make_mlp, make_transformer])
def test_compile_cuda_runs_triton_kernels(make):
    c, x = _converted(make, W8A8Quantizer())
    c, x = c.cuda(), x.cuda()
    fast = quantkit.compile(c)
    with torch.no_grad():
        ref, y = c(x), fast(x)
    assert fast._orig_mod.meta["quantkit_lowering"]["linear"] > 0
    assert sqnr(ref, y) > 40, f"compiled vs reference SQNR {sqnr(ref, y):.1f} dB"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_triton_lowering_kn_weights_addmm_and_matmul():
    """addmm (HF Conv1D) and x @ W with [K, N] int8 weights become int8_linear on one
    transposed int8 copy of each weight; the [K, N] originals are dropped."""
    from tests.quantizers.test_w8a8_weights import KNLinear

    torch.manual_seed(0)
    m, x = KNLinear().eval(), torch.randn(64, 16)
    p = quantkit.prepare(quantkit.capture(m, (x[:8],)), W8A8Quantizer())
    quantkit.calibrate(p, [(b,) for b in x.split(16)], progress=False)
    c = quantkit.convert(p)
    gm = copy.deepcopy(c)
    assert lower(gm, "triton") == {"linear": 2, "matmul": 0, "quantize_per_token": 0}
    assert _count(gm, aten.addmm.default) == 0 and _count(gm, aten.matmul.default) == 0
    ops = [n for n in gm.graph.nodes if n.target == torch.ops.quantkit.int8_linear.default]
    assert [n.args[6] for n in ops] == ["relu", "none"]
    weights = [getattr(gm, n.args[3].target) for n in ops]
    assert [tuple(w.shape) for w in weights] == [(32, 16), (8, 32)] and all(w.dtype == torch.int8 for w in weights)
    int8_bytes = lambda g: sum(b.numel() for b in g.buffers() if b.dtype == torch.int8)  # noqa: E731
    assert int8_bytes(gm) == int8_bytes(c)
    with torch.no_grad():
        rel = float((gm(x) - c(x)).norm() / c(x).norm())
    assert rel < 1e-3, f"lowered vs reference relative error {rel:.2e}"
