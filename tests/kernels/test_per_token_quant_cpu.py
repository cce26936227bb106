"""quantkit::per_token_quant_cpu against float64 references of the prologue and per-token quantization."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from quantkit.kernels import _per_token_quant_cpu as ptq

pytestmark = pytest.mark.skipif(not ptq.available(), reason=f"per_token_quant_cpu: {ptq.status().reason}")


def _ref(x, steps, row_scale=None, cols=()):
    """float64 prologue, then scale = max(amax, 1e-5) / 127 and q = clamp(round(v / scale)) + 128."""
    v = x.double()
    it = iter(cols)
    for s in steps:
        if s == "mul_row":
            v = v * row_scale.double()
        elif s == "add_col":
            v = v + next(it).double()
        elif s == "mul_col":
            v = v * next(it).double()
        elif s == "relu":
            v = v.clamp_min(0)
        elif s in ("gelu", "gelu_tanh"):
            v = torch.nn.functional.gelu(v, approximate="tanh" if s == "gelu_tanh" else "none")
        elif s == "bf16":
            v = v.float().bfloat16().double()
    scale = v.abs().amax(-1, keepdim=True).clamp_min(1e-5) / 127
    return torch.clamp(torch.round(v / scale), -128, 127) + 128, scale


def _compare(q, s, qr, sr):
    assert q.dtype == torch.uint8 and s.dtype == torch.float32 and q.shape == qr.shape and s.shape == sr.shape
    d = (q.double() - qr).abs()
    return float(d.max()) if d.numel() else 0.0, float((d > 0).double().mean()) if d.numel() else 0.0, \
        float(((s.double() - sr) / sr).abs().max()) if s.numel() else 0.0


@pytest.mark.parametrize("n", [1, 5, 16, 17, 384, 385])
def test_exact_steps_match_float64(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(7, n, generator=gen) * 4
    b = torch.randn(n, generator=gen)
    c = torch.rand(n, generator=gen) + 0.5
    q, s = ptq.per_token_quant_cpu(x, ["add_col", "relu", "mul_col"], cols=[b, c])
    dmax, _, srel = _compare(q, s, *_ref(x, ["add_col", "relu", "mul_col"], cols=[b, c]))
    assert dmax <= 1 and srel < 1e-6


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_gemm_epilogue_and_gelu_match_float64(act):
    gen = torch.Generator().manual_seed(1)
    m, n = 300, 1000
    x = torch.randn(3, m // 3, n, generator=gen) * 40
    rs = torch.rand(3, m // 3, 1, generator=gen) * 0.1 + 0.01
    b = torch.randn(n, generator=gen)
    steps = ["mul_row", "add_col", act]
    q, s = ptq.per_token_quant_cpu(x, steps, row_scale=rs, cols=[b])
    dmax, frac, srel = _compare(q, s, *_ref(x, steps, rs, [b]))
    # erf / tanh are ~1e-7 polynomials: only values within that of a rounding boundary move, by one level
    assert dmax <= 1 and frac < 1e-4 and srel < 1e-6


def test_bf16_input_and_bf16_rounding_step():
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 257, generator=gen) * 3).bfloat16()
    b = torch.randn(257, generator=gen)
    steps = ["add_col", "bf16", "gelu", "bf16"]
    q, s = ptq.per_token_quant_cpu(x, steps, cols=[b])
    dmax, frac, srel = _compare(q, s, *_ref(x, steps, cols=[b]))
    assert dmax <= 1 and frac < 1e-3 and srel < 1e-6
    # the bf16 step is real: without it the fp32 sums give different integers
    q2, _ = ptq.per_token_quant_cpu(x, ["add_col", "gelu"], cols=[b])
    assert (q2 != q).any()


def test_bf16_step_rounds_as_torch_does_bit_for_bit():
    # ties to even included: values halfway between two bf16 numbers, both signs, and a row whose amax
    # is itself a rounded value; with only bf16 steps the kernel's arithmetic is exact
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 96, generator=gen) * 10
    bits = x.view(torch.int32)
    x[:, :32] = ((bits[:, :32] & ~0xFFFF) | 0x8000).view(torch.float32)  # exact ties
    x[:, 32:40] = ((bits[:, 32:40] & ~0xFFFF) | 0x7FFF).view(torch.float32)  # just below a tie
    q, s = ptq.per_token_quant_cpu(x, ["bf16"])
    # torch's own bf16 rounding, then the float32 ops of the reference quantize (_per_token._quantize)
    v = x.bfloat16().float()
    scale = v.abs().amax(-1, keepdim=True).clamp_min(1e-5) / 127
    qr = torch.clamp(torch.round(v * torch.reciprocal(scale)), -128, 127) + 128
    assert torch.equal(s, scale) and torch.equal(q, qr.to(torch.uint8))


def test_no_steps_is_plain_per_token_quantize_and_zero_rows():
    x = torch.randn(9, 33)
    x[3] = 0
    q, s = ptq.per_token_quant_cpu(x)
    dmax, _, srel = _compare(q, s, *_ref(x, []))
    assert dmax == 0 and srel < 1e-6
    assert float(s[3]) == pytest.approx(1e-5 / 127) and (q[3] == 128).all()


def test_empty_and_fake_shapes():
    q, s = ptq.per_token_quant_cpu(torch.empty(0, 8))
    assert q.shape == (0, 8) and s.shape == (0, 1)
    with FakeTensorMode():
        q, s = ptq.per_token_quant_cpu(torch.empty(2, 3, 8), ["gelu"])
        assert q.shape == (2, 3, 8) and q.dtype == torch.uint8 and s.shape == (2, 3, 1)


def test_bad_input_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="unknown step 'silu'"):
        ptq.per_token_quant_cpu(x, ["silu"])
    with pytest.raises(ValueError, match="read 1 column vectors"):
        ptq.per_token_quant_cpu(x, ["add_col"])
    with pytest.raises(ValueError, match="float32 with 8 values"):
        ptq.per_token_quant_cpu(x, ["add_col"], cols=[torch.randn(7)])
    with pytest.raises(ValueError, match="mul_row needs"):
        ptq.per_token_quant_cpu(x, ["mul_row"])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ptq.per_token_quant_cpu(x.double())
