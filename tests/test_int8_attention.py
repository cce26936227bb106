"""Int8 attention: the opt-in "attention" op family of W8A8Quantizer (q, k, v of SDPA per tensor),
its lowering to quantkit::int8_sdpa_cpu (op counts), and the kernel's numerics: the integer
Q.K^T bit-exact against int64, the float part against float64 and against the reference q/dq graph."""

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import quantkit
from quantkit.kernels._int8_sdpa_cpu import MAX_HEAD_DIM, int8_scores_cpu, int8_sdpa_cpu, status
from quantkit.lowering._qsdpa import lower_int8_sdpa, torchao_qsdpa_status
from quantkit.quantizers import FP8Config, QuantConfig, W8A8Quantizer

pytestmark = pytest.mark.skipif(not status().available, reason=f"int8 SDPA kernel: {status().reason}")

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_KERNEL = torch.ops.quantkit.int8_sdpa_cpu.default
_DQ = torch.ops.quantized_decomposed.dequantize_per_tensor.default
# float32 softmax and P.V against float64 on the same integers: |err| / |out| (norms). Measured
# ~4e-8 at these sizes; 1e-6 leaves room for longer rows (S up to a few hundred) and other compilers
_FLOAT_TOL = 1e-6


def _rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _ints(shape, dtype, gen):
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    return torch.randint(lo, hi, shape, dtype=torch.int16, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("d", [1, 7, 32, 64])
def test_integer_scores_are_exact(dtype, d):
    gen = torch.Generator().manual_seed(d)
    q = _ints((2, 9, 3, d), dtype, gen).transpose(1, 2)  # [B, H, T, D] as a head-split view
    k = _ints((2, 3, 11, d), dtype, gen)
    zq, zk = (128, 127) if dtype == torch.uint8 else (-3, 5)
    got = int8_scores_cpu(q, k, q_zp=zq, k_zp=zk)
    want = (q.long() - zq) @ (k.long() - zk).transpose(-1, -2)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)


@pytest.mark.parametrize("d", [258, 259, 4096], ids=["float-sums-edge", "int32-sums", "int32-large"])
def test_integer_scores_at_the_edges(d):
    """Every product 255 * 255 (uint8 0 against zero point 255): up to D = 258 the kernel sums in float
    (every partial sum an integer below 2**24, so exact), from 259 on in int32; both exact."""
    q = torch.zeros(1, 1, 2, d, dtype=torch.uint8)
    k = torch.zeros(1, 1, 3, d, dtype=torch.uint8)
    got = int8_scores_cpu(q, k, q_zp=255, k_zp=255)
    assert torch.equal(got.long(), torch.full((1, 1, 2, 3), 255 * 255 * d))


def _dq(x, scale, zp):
    return (x.double() - zp) * scale


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "all-masked-row"])
def test_kernel_matches_float64_attention(mask_kind):
    gen = torch.Generator().manual_seed(1)
    b, h, t, s, d = 2, 3, 13, 21, 16
    q, k, v = (_ints(shape, torch.uint8, gen) for shape in ((b, h, t, d), (b, h, s, d), (b, h, s, d)))
    qp = dict(q_scale=0.031, q_zp=131, k_scale=0.027, k_zp=120, v_scale=0.011, v_zp=128)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, 1, s, generator=gen) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(b, h, t, s, generator=gen)
    elif mask_kind == "causal":
        mask = torch.ones(t, s, dtype=torch.bool).tril()
    elif mask_kind == "all-masked-row":
        mask = torch.ones(b, 1, t, s, dtype=torch.bool)
        mask[:, :, 4] = False  # torch's SDPA gives zeros there
    scale = 0.2 if mask_kind == "float" else None
    got = int8_sdpa_cpu(q, k, v, mask, scale=scale, **qp)
    want = F.scaled_dot_product_attention(
        _dq(q, qp["q_scale"], qp["q_zp"]), _dq(k, qp["k_scale"], qp["k_zp"]), _dq(v, qp["v_scale"], qp["v_zp"]),
        attn_mask=mask.double() if mask is not None and mask.is_floating_point() else mask, scale=scale)
    assert got.dtype == torch.float32 and got.shape == (b, h, t, d)
    assert _rel(want, got) <= _FLOAT_TOL, f"relative error {_rel(want, got):.2e}"
    if mask_kind == "all-masked-row":
        assert torch.equal(got[:, :, 4], torch.zeros_like(got[:, :, 4]))


def test_kernel_refuses_bad_inputs_in_one_line():
    q = torch.zeros(1, 1, 2, 4, dtype=torch.uint8)
    qp = dict(q_scale=1.0, q_zp=0, k_scale=1.0, k_zp=0, v_scale=1.0, v_zp=0)
    with pytest.raises(ValueError, match="must all be uint8 or all int8"):
        int8_sdpa_cpu(q, q.to(torch.int8), q, **qp)
    with pytest.raises(ValueError, match=r"must be \[B, H, T, D\]"):
        int8_sdpa_cpu(q[0], q[0], q[0], **qp)
    wide = torch.zeros(1, 1, 1, MAX_HEAD_DIM + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int32 Q.K\\^T could overflow"):
        int8_sdpa_cpu(wide, wide, wide, **qp)


class _Attention(torch.nn.Module):
    """q, k, v projections, the head split, SDPA with a padding mask; the SDPA output is returned
    as it is (no output projection whose input quantize would hide the float part's differences)."""

    def __init__(self, d: int = 32, heads: int = 4, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _ops(gm) -> Counter:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _convert(config: QuantConfig, causal: bool = False):
    torch.manual_seed(0)
    model = _Attention(causal=causal).eval()
    x = torch.randn(4, 16, 32)
    mask = torch.ones(4, 1, 1, 16, dtype=torch.bool)
    mask[1, ..., 11:] = mask[3, ..., 6:] = False  # padding
    gm = quantkit.capture(model, (x, mask))
    prepared = quantkit.prepare(gm, W8A8Quantizer(config))
    quantkit.calibrate(prepared, [(x, mask)], progress=False)
    return quantkit.convert(prepared), (x, mask)


def _sdpa_inputs_dequantized(gm, node) -> int:
    """How many of q, k, v reach ``node`` from a dequantize through shape ops."""
    count = 0
    for a in node.args[:3]:
        while a.target in (torch.ops.aten.view.default, torch.ops.aten.transpose.int):
            a = a.args[0]
        count += a.target is _DQ
    return count


def test_attention_is_opt_in():
    assert "attention" not in QuantConfig().ops
    conv, _ = _convert(QuantConfig(ops=frozenset({"linear"})))
    sdpa = next(n for n in conv.graph.nodes if n.target is _SDPA)
    assert _sdpa_inputs_dequantized(conv, sdpa) == 0
    conv, _ = _convert(QuantConfig(ops=frozenset({"linear", "attention"})))
    sdpa = next(n for n in conv.graph.nodes if n.target is _SDPA)
    assert _sdpa_inputs_dequantized(conv, sdpa) == 3


@pytest.mark.parametrize("causal", [False, True], ids=["padding-mask", "is_causal"])
def test_lowering_counts_and_numerics(causal):
    conv, (x, mask) = _convert(QuantConfig(ops=frozenset({"linear", "attention"})), causal)
    lowered = copy.deepcopy(conv)
    assert lower_int8_sdpa(lowered) == {"int8_sdpa": 1}
    before, after = _ops(conv), _ops(lowered)
    assert after[_SDPA] == 0 and after[_KERNEL] == 1
    assert before[_DQ] - after[_DQ] == 3  # q, k and v now reach the kernel as integers
    with torch.no_grad():
        ref, out = conv(x, mask), lowered(x, mask)
    assert _rel(ref, out) <= _FLOAT_TOL, f"lowered vs reference q/dq graph: relative error {_rel(ref, out):.2e}"


def test_quantkit_compile_runs_the_kernel_unless_reference():
    import quantkit.lowering._qsdpa  # noqa: F401  (registers the pass)

    conv, (x, mask) = _convert(QuantConfig(ops=frozenset({"linear", "attention"})))
    compiled = quantkit.compile(conv)
    assert compiled._orig_mod.meta["quantkit_lowering"].get("int8_sdpa") == 1
    with torch.no_grad():
        ref, out = conv(x, mask), compiled(x, mask)
    # compiled: Inductor's own float32 kernels around it too (linears, q/dq): same tolerance
    assert _rel(ref, out) <= _FLOAT_TOL, f"compiled vs reference q/dq graph: relative error {_rel(ref, out):.2e}"
    assert "int8_sdpa" not in quantkit.compile(conv, cpu_kernels="reference")._orig_mod.meta["quantkit_lowering"]


def test_dynamic_attention_keeps_its_reference_attention():
    conv, (x, mask) = _convert(QuantConfig(dynamic=True, ops=frozenset({"linear", "attention"})))
    assert lower_int8_sdpa(copy.deepcopy(conv)) == {"int8_sdpa": 0}


def test_config_errors_are_one_line():
    with pytest.raises(ValueError, match="'attention' quantizes q, k and v per tensor"):
        QuantConfig(dynamic=True, granularity="per-token", ops=frozenset({"linear", "attention"}))
    with pytest.raises(ValueError, match=r"unknown op families \['atention'\]; choose from .*'attention'"):
        QuantConfig(ops=frozenset({"atention"}))
    with pytest.raises(ValueError, match="FP8Quantizer cannot quantize op families \\['attention'\\]"):
        FP8Config(ops=frozenset({"linear", "attention"}))


def test_torchao_probe_says_why_it_is_not_used():
    line = torchao_qsdpa_status()
    assert line.startswith("torchao::qscaled_dot_product") and "\n" not in line
