"""int8 + bf16 on CPU (lowering/_bf16.py): op counts of the rewrite, numerics against the float32
reference q/dq graph, and the oneDNN int8 kernels Inductor still emits with bf16 around them.

Tolerance: bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.2% per op), and an
activation rounded to bf16 before its quantize may land on the neighbouring int8 level, so
the int8+bf16 model is held to a relative error of the output norm below 2e-2 (measured
3.6e-3 to 4.4e-3 on these models) -- against 1e-5 for the float32 path.
"""

import copy

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import quantkit
from quantkit.lowering import _bf16, _onednn, lower
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_mlp, make_transformer

Q = torch.ops.quantized_decomposed
aten = torch.ops.aten
BF16_REL_TOL = 2e-2


def _converted(make, config=None):
    m, x = make()
    p = quantkit.prepare(quantkit.capture(m, (x[:8],)), W8A8Quantizer(config or QuantConfig()))
    quantkit.calibrate(p, [(b,) for b in x.split(32)], progress=False)
    return quantkit.convert(p), x


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _casts(gm, dtype):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten._to_copy.default
            and n.kwargs.get("dtype") == dtype]


def test_float_ops_to_bf16_casts_every_float_input_and_leaves_qdq_alone():
    c, x = _converted(make_transformer)
    gm = copy.deepcopy(c)
    lower(gm, "onednn")
    before = {n.name: (n.target, n.args) for n in gm.graph.nodes if n.op == "call_function"
              and n.target in (Q.quantize_per_tensor.default, Q.dequantize_per_tensor.default)}
    counts = _bf16.float_ops_to_bf16(gm)
    to_bf16, to_fp32 = _casts(gm, torch.bfloat16), _casts(gm, torch.float32)
    assert counts == {"to_bf16": len(to_bf16), "to_fp32": len(to_fp32)}
    # every linear reads bf16: its activation, weight and bias are casts (of a dequantize / the bias)
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    assert len(linears) == 4
    for lin in linears:
        x_in, w_in, b_in = lin.args[:3]
        assert x_in in to_bf16 and x_in.args[0].target is Q.dequantize_per_tensor.default
        assert w_in in to_bf16 and w_in.args[0].target is Q.dequantize_per_channel.default
        assert b_in in to_bf16 and b_in.args[0].op == "get_attr"
    # one cast per dequantize feeding float ops, one per float parameter, one for the input
    dqs = [n for n in gm.graph.nodes if n.target in (Q.dequantize_per_tensor.default, Q.dequantize_per_channel.default)]
    float_params = [n for n in gm.graph.nodes if n.op == "get_attr" and any(u in to_bf16 for u in n.users)]
    assert len(to_bf16) == len(dqs) + len(float_params) + 1
    assert len(float_params) == 4 + 4  # 2 LayerNorms (weight, bias) + 4 linear biases
    # q/dq ops keep their integer/qparam arguments; quantizes read the bf16 value directly
    after = {n.name: n for n in gm.graph.nodes if n.name in before}
    for name, (target, args) in before.items():
        assert after[name].target is target and after[name].args[1:] == args[1:]
    # the output is cast back once
    assert len(to_fp32) == 1 and to_fp32[0] in next(n for n in gm.graph.nodes if n.op == "output").args[0]
    with torch.no_grad():
        out, ref = gm(x), c(x)
    assert out.dtype == torch.float32
    rel = _rel(out, ref)
    assert 0 < rel < BF16_REL_TOL, f"bf16 vs reference relative error {rel:.2e}"


def test_dynamic_per_token_quantizes_get_float32_back():
    c, x = _converted(make_mlp, QuantConfig(dynamic=True, granularity="per-token"))
    gm = copy.deepcopy(c)
    _bf16.float_ops_to_bf16(gm)
    dynamic = [n for n in gm.graph.nodes
               if n.target in (Q.choose_qparams_per_token.default, Q.quantize_per_token.default)]
    to_fp32 = _casts(gm, torch.float32)
    # the first layer reads the float32 input; the later ones a bf16 activation cast back to float32
    assert len(dynamic) == 6 and all(n.args[0].op == "placeholder" or n.args[0] in to_fp32 for n in dynamic)
    assert sum(n.args[0] in to_fp32 for n in dynamic) == 4
    with torch.no_grad():
        rel = _rel(gm(x), c(x))
    assert rel < BF16_REL_TOL, f"bf16 per-token vs reference relative error {rel:.2e}"


def test_resolve_float_dtype(monkeypatch):
    monkeypatch.setattr(_bf16, "bf16_supported", lambda: True)
    monkeypatch.setattr(_bf16, "cpu_has", lambda flag: flag == "avx512_bf16")  # a Zen 4: BF16, no AMX
    assert _bf16.bf16_float_ops_pay() is False
    assert _bf16.resolve_float_dtype("auto", onednn=True) is torch.float32
    assert _bf16.resolve_float_dtype("bf16", onednn=True) is torch.bfloat16  # asked for: still bf16
    monkeypatch.setattr(_bf16, "cpu_has", lambda flag: flag in ("avx512_bf16", "amx_bf16"))  # an AMX Xeon
    assert _bf16.resolve_float_dtype("auto", onednn=True) is torch.bfloat16
    assert _bf16.resolve_float_dtype("auto", onednn=False) is torch.float32  # reference q/dq path
    assert _bf16.resolve_float_dtype("fp32", onednn=True) is torch.float32
    assert _bf16.resolve_float_dtype(torch.bfloat16, onednn=False) is torch.bfloat16
    monkeypatch.setattr(_bf16, "bf16_supported", lambda: False)  # an AVX2-only CPU
    assert _bf16.resolve_float_dtype("auto", onednn=True) is torch.float32
    c, _ = _converted(make_mlp)
    with pytest.raises(ValueError, match=r"unknown float_dtype 'fp16'; use one of \['auto', 'bf16', 'fp32'\]"):
        quantkit.compile(c, float_dtype="fp16")


@pytest.mark.skipif(not _onednn.exact_on_this_cpu(), reason="oneDNN int8 is exact only with VNNI/AMX")
def test_compile_bf16_keeps_every_int8_kernel():
    c, x = _converted(make_transformer)
    torch._dynamo.utils.counters.clear()
    fast = quantkit.compile(c, float_dtype="bf16")
    y, code = run_and_get_code(fast, x)
    counters = torch._dynamo.utils.counters["inductor"]
    assert counters["qlinear_weight_prepack_matcher_count"] == 4  # every linear is still oneDNN int8
    assert counters["qlinear_binary_matcher_count"] == 2  # residual adds still fused into the qlinear
    qlinears = [line for line in "\n".join(code).splitlines() if "torch.ops.onednn.qlinear_pointwise" in line]
    assert len(qlinears) == 4 and any("torch.bfloat16" in line for line in qlinears), qlinears
    lowering = fast._orig_mod.meta["quantkit_lowering"]
    assert lowering["to_bf16"] > 0 and lowering["to_fp32"] == 1
    with torch.no_grad():
        ref = c(x)
    assert y.dtype == torch.float32
    rel = _rel(y, ref)
    assert rel < BF16_REL_TOL, f"compiled int8+bf16 vs reference relative error {rel:.2e}"


def test_llama_graph_runs_in_bf16():
    """Llama's explicit .to(float32) (RMSNorm, rotary) comes with export's dtype asserts and mixes
    float32 into attention: every float op must still read one dtype (SDPA refuses mixed q/k/v)."""
    from tests.test_architectures import MODELS, _main

    torch.manual_seed(0)
    model, x = MODELS["llama"]()
    qm = quantkit.quantize(model, x, [x], W8A8Quantizer(), progress=False)
    gm = copy.deepcopy(qm)
    counts = _bf16.float_ops_to_bf16(gm)
    assert counts.get("dtype_asserts_dropped", 0) > 0
    assert not [n for n in gm.graph.nodes if n.target is aten._assert_tensor_metadata.default
                and n.kwargs.get("dtype") == torch.float32]
    with torch.no_grad():
        ref, out = _main(qm(**x)), _main(gm(**x))  # eager: a dtype mismatch raises here
    assert out.dtype == torch.float32
    rel = _rel(out, ref)
    assert rel < BF16_REL_TOL, f"Llama bf16 vs reference relative error {rel:.2e}"


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("shape, bf16", [((32, 4, 16, 16), False), ((8, 4, 256, 64), True)])
def test_auto_takes_bf16_only_for_large_attention(monkeypatch, shape, bf16):
    """float_dtype='auto' rule: bf16 from 2**24 multiply-adds per attention op (measured: the
    block's 0.5M-MAC attention is slower in bf16, MiniLM's 403M-MAC SDPA faster), on an AMX CPU."""
    monkeypatch.setattr(_bf16, "bf16_supported", lambda: True)
    monkeypatch.setattr(_bf16, "bf16_float_ops_pay", lambda: True)
    args = tuple(torch.randn(shape) for _ in range(3))
    gm = torch.export.export(_Attention(), args).module()
    b, h, t, d = shape
    assert [_bf16._macs(n) for n in gm.graph.nodes if n.target in _bf16._ATTENTION_OPS] == [2 * b * h * t * t * d]
    assert _bf16.resolve_float_dtype("auto", onednn=True, graph=gm) is (torch.bfloat16 if bf16 else torch.float32)
    assert _bf16.resolve_float_dtype("bf16", onednn=True, graph=gm) is torch.bfloat16  # forcing still forces
    c, _ = _converted(make_mlp)  # no attention at all: float32
    assert _bf16.resolve_float_dtype("auto", onednn=True, graph=c) is torch.float32
