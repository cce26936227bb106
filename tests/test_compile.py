"""quantkit.compile and its lowering pass: op counts after the rewrite, numerics against the q/dq reference."""

import copy

import pytest
import torch

import quantkit
from quantkit._lowering import lower
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
    "symmetric": lambda: W8A8Quantizer(QuantConfig(activation="symmetric-int8")),
    "dynamic": lambda: W8A8Quantizer(dynamic=True),
}


@pytest.mark.parametrize("scheme", sorted(QUANTIZERS))
def test_triton_lowering_mlp_fuses_relu_and_requant(scheme):
    c, x = _converted(make_mlp, QUANTIZERS[scheme]())
    gm = copy.deepcopy(c)
    counts = lower(gm, "triton")
    assert counts == {"linear": 3, "matmul": 0}
    assert _dq_fed(gm, {aten.linear.default}) == [] and _count(gm, Q.dequantize_per_channel.default) == 0
    ops = [n for n in gm.graph.nodes if n.target == torch.ops.quantkit.int8_linear.default]
    assert [n.args[6] for n in ops] == ["relu", "relu", "none"]
    if scheme != "dynamic":  # static: the next layer's quantize is fused into fc1 and fc2
        act = torch.uint8 if scheme == "static" else torch.int8
        assert [n.args[7] for n in ops] == [act, act, torch.float32]
        assert _count(gm, Q.quantize_per_tensor.default) == 1  # only the model input's
        assert _count(gm, aten.relu.default) == 0
    with torch.no_grad():  # CPU implementations of the ops (torch._int_mm)
        rel = float((gm(x) - c(x)).norm() / c(x).norm())
    assert rel < 1e-3, f"lowered vs reference relative error {rel:.2e}"


def test_triton_lowering_transformer_uses_int8_bmm_for_attention():
    c, x = _converted(make_transformer, W8A8Quantizer(dynamic=True))
    gm = copy.deepcopy(c)
    assert lower(gm, "triton") == {"linear": 4, "matmul": 2}
    assert _dq_fed(gm, {aten.linear.default, aten.matmul.default}) == []
    assert _count(gm, torch.ops.quantkit.int8_bmm.default) == 2
    gelu = [n for n in gm.graph.nodes if n.target == torch.ops.quantkit.int8_linear.default and n.args[6] == "gelu"]
    assert len(gelu) == 1 and _count(gm, aten.gelu.default) == 0
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
        if name.startswith("_qk_int_weight_"):
            buf.clamp_(-63, 63)
    torch._dynamo.utils.counters.clear()
    with pytest.warns(UserWarning, match="saturates") if not quantkit._lowering._onednn.exact_on_this_cpu() else _nothing():
        fast = quantkit.compile(c, cpu_kernels="onednn")
    y = fast(x)
    assert torch._dynamo.utils.counters["inductor"]["qlinear_weight_prepack_matcher_count"] == 3
    with torch.no_grad():
        ref = c(x)
    assert sqnr(ref, y) > 40, f"compiled vs reference SQNR {sqnr(ref, y):.1f} dB"
    assert any(n.target in _DQ for n in c.graph.nodes)  # the user's model is left as it was


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
