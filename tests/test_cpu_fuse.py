"""CPU int8 graph clean-ups (lowering/_cpu_fuse.py): op counts of each rewrite and exact numerics
against the reference q/dq graph (both rewrites are exact in float32: same integers, same dot
products), plus the oneDNN kernels Inductor emits from the rewritten graph."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import quantkit
from quantkit.lowering import _cpu_fuse, _onednn, lower
from quantkit._graph import get_attr as attr
from quantkit.quantizers import QuantConfig, W8A8Quantizer

Q = torch.ops.quantized_decomposed
aten = torch.ops.aten


class _BertLikeAttention(torch.nn.Module):
    """BERT's self-attention shape: separate query/key/value linears, SDPA, reshape/transpose back."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.out = torch.nn.Linear(d, d)
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln(x)

        def split(y):
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)))
        return x + self.out(a.transpose(1, 2).reshape(b, t, d))


def _converted(config=None):
    torch.manual_seed(0)
    m, x = _BertLikeAttention().eval(), torch.randn(8, 16, 32)
    p = quantkit.prepare(quantkit.capture(m, (x,)), W8A8Quantizer(config or QuantConfig()))
    quantkit.calibrate(p, [(b,) for b in x.split(4)], progress=False)
    return quantkit.convert(p), x


def _count(gm, target):
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


@pytest.mark.parametrize("activation", ["affine-uint8", "symmetric-int8"])
def test_lowering_collapses_requantize_chains_and_fuses_qkv_exactly(activation):
    c, x = _converted(QuantConfig(activation=activation))
    gm = copy.deepcopy(c)
    counts = lower(gm, "onednn")
    # SDPA output -> transpose -> reshape -> out: convert shares the qparams across both shape ops
    assert counts["requantize_chains"] == 2
    assert _count(c, Q.quantize_per_tensor.default) - _count(gm, Q.quantize_per_tensor.default) == 2
    # q, k, v read one quantized activation: one linear over the concatenated weights + 3 slices
    assert counts["fused_sibling_linears"] == 2
    assert _count(c, aten.linear.default) == 4 and _count(gm, aten.linear.default) == 2
    assert _count(gm, aten.slice.Tensor) == 3
    fused = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    assert attr(gm, fused.args[1].args[0].target).shape == (96, 32)
    # every int8 weight is stored once: the three originals are gone
    assert sum(b.dtype == torch.int8 for b in gm.buffers()) == 2
    # the out projection now dequantizes the reshaped integers directly
    out_lin = [n for n in gm.graph.nodes if n.target is aten.linear.default][-1]
    dq = out_lin.args[0]
    assert dq.target is Q.dequantize_per_tensor.default and dq.args[0].target is aten.reshape.default
    assert all(n.meta["val"].dtype == torch.uint8 for n in (dq.args[0], dq.args[0].args[0]))
    if activation == "symmetric-int8":  # oneDNN's uint8 shift ran first: every quantize is uint8
        assert {n.args[5] for n in gm.graph.nodes if n.target is Q.quantize_per_tensor.default} == {torch.uint8}
    with torch.no_grad():
        ref, y = c(x), gm(x)
    # same integers, same dot products: float32 summation order in the wider GEMM is the only difference
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_fuse_sibling_linears_leaves_different_activations_alone():
    """Linears on different quantized inputs, or a dynamic quantization, are not merged."""
    c, _ = _converted(QuantConfig(dynamic=True))
    gm = copy.deepcopy(c)
    assert _cpu_fuse.fuse_sibling_linears(gm) == 0
    assert _count(gm, aten.linear.default) == 4


@pytest.mark.skipif(not _onednn.exact_on_this_cpu(), reason="oneDNN int8 is exact only with VNNI/AMX")
def test_compile_emits_one_qlinear_for_qkv():
    c, x = _converted()
    torch._dynamo.utils.counters.clear()
    fast = quantkit.compile(c, float_dtype="fp32")
    y, code = run_and_get_code(fast, x)
    assert torch._dynamo.utils.counters["inductor"]["qlinear_weight_prepack_matcher_count"] == 2
    calls = [line for line in "\n".join(code).splitlines() if "torch.ops.onednn.qlinear_pointwise" in line
             and "assert" not in line]
    assert len(calls) == 2, calls
    with torch.no_grad():
        ref = c(x)
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 1e-5, f"compiled int8 vs reference relative error {rel:.2e}"
