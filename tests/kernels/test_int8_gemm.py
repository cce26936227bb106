"""int8_linear / int8_bmm against float64 references: the Triton kernel (interpreter on CPU) and the CPU op."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from quantkit._qmath import default_qrange, quantize
from quantkit.kernels import _int8_gemm as g
from quantkit.kernels import int8_bmm, int8_linear

# relative error of the norm: int32 accumulation is exact, the fp32 epilogue rounds at ~1e-7
TOL = {torch.float32: 1e-3, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _act64(y, activation):
    if activation == "relu":
        return y.clamp_min(0)
    if activation in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    return y


def _linear_case(m, k, n, a_dtype, per_row, zp, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = default_qrange(a_dtype)
    a = torch.randint(lo, hi + 1, (m, k), generator=gen, dtype=torch.int16).to(a_dtype)
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int16).to(torch.int8)
    a_scale = torch.rand(m if per_row else 1, generator=gen) * 0.05 + 0.01
    w_scale = torch.rand(n, generator=gen) * 0.01 + 0.001
    a_zp = torch.tensor([zp]) if zp is not None else None
    b = torch.randn(n, generator=gen) if bias else None
    za = zp or 0
    ref = ((a.double() - za) @ w.double().t()) * a_scale.double().reshape(-1, 1) * w_scale.double()
    if b is not None:
        ref = ref + b.double()
    return (a, a_scale, a_zp, w, w_scale, b), ref


def _run_triton(a, a_scale, a_zp, w, w_scale, b, activation="none", out_dtype=torch.float32, out_scale=1.0, out_zp=0):
    c = torch.empty((1, a.shape[0], w.shape[0]), dtype=out_dtype)
    g._launch(a.unsqueeze(0), w.t().unsqueeze(0), c, a_scale, w_scale, a_zp, None, b,
              activation=activation, out_scale=out_scale, out_zp=out_zp)
    return c[0]


def _run_op(*args, **kw):
    return int8_linear(*args, **kw)


RUNNERS = {"triton": _run_triton, "cpu_op": lambda *a, **kw: int8_linear(*a, **kw)}

# (M, K, N, activation dtype, per-row scale, zero point, bias, activation, out dtype); ragged M/N/K
# against the 16x16x32 interpreter tiles, and each epilogue option at least once
CASES = [
    (37, 70, 45, torch.uint8, False, 117, True, "none", torch.float32),
    (1, 8, 8, torch.int8, True, None, False, "none", torch.float32),
    (16, 32, 16, torch.int8, True, None, True, "relu", torch.float32),
    (19, 40, 23, torch.uint8, False, 0, True, "gelu", torch.float32),
    (19, 40, 23, torch.int8, False, 5, False, "gelu_tanh", torch.float32),
    (33, 64, 17, torch.uint8, True, 130, True, "none", torch.float16),
    (33, 64, 17, torch.int8, True, None, True, "gelu", torch.bfloat16),
]


@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-{c[7]}-{c[8]}")
def test_int8_linear_float_out(runner, case):
    m, k, n, a_dtype, per_row, zp, bias, activation, out_dtype = case
    args, ref = _linear_case(m, k, n, a_dtype, per_row, zp, bias)
    ref = _act64(ref, activation)
    y = RUNNERS[runner](*args, activation=activation, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n)
    rel = _rel(y, ref)
    assert rel <= TOL[out_dtype], f"relative error {rel:.2e} > {TOL[out_dtype]}"


@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize("out_dtype,activation", [(torch.uint8, "relu"), (torch.int8, "none")])
def test_int8_linear_requantized_out(runner, out_dtype, activation):
    args, ref = _linear_case(29, 48, 21, torch.uint8, False, 120, True, seed=1)
    ref = _act64(ref, activation)
    out_scale, out_zp = float(ref.abs().max() / 120), (3 if out_dtype == torch.uint8 else -2)
    y = RUNNERS[runner](*args, activation=activation, out_dtype=out_dtype, out_scale=out_scale, out_zero_point=out_zp) \
        if runner == "cpu_op" else _run_triton(*args, activation=activation, out_dtype=out_dtype,
                                               out_scale=out_scale, out_zp=out_zp)
    qmin, qmax = default_qrange(out_dtype)
    expected = quantize(ref.float(), out_scale, out_zp, qmin, qmax, out_dtype)
    diff = (y.int() - expected.int()).abs()
    assert y.dtype == out_dtype
    # equal except where the fp32 epilogue and the float64 reference fall on opposite sides of a .5
    assert int(diff.max()) <= 1 and float(diff.float().mean()) < 0.01, f"max {int(diff.max())}, mean {float(diff.float().mean()):.3f}"


def _bmm_case(batch, m, k, n, dtype, zps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = default_qrange(dtype)
    a = torch.randint(lo, hi + 1, (*batch, m, k), generator=gen, dtype=torch.int16).to(dtype)
    # b is a transposed view, as k.transpose(-2, -1) in attention
    b = torch.randint(lo, hi + 1, (*batch, n, k), generator=gen, dtype=torch.int16).to(dtype).transpose(-2, -1)
    sa, sb = torch.tensor([0.02]), torch.tensor([0.03])
    za, zb = (torch.tensor([zps[0]]), torch.tensor([zps[1]])) if zps else (None, None)
    ref = (a.double() - (zps[0] if zps else 0)) @ (b.double() - (zps[1] if zps else 0)) * 0.02 * 0.03
    return (a, sa, za, b, sb, zb), ref


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "cpu_op"])
@pytest.mark.parametrize("batch,m,k,n,dtype,zps,out_dtype", [
    ((2, 3), 9, 16, 9, torch.int8, None, torch.float32),
    ((2,), 17, 20, 33, torch.uint8, (128, 60), torch.float32),
    ((3,), 5, 8, 18, torch.uint8, (0, 200), torch.bfloat16),
])
def test_int8_bmm(use_triton, batch, m, k, n, dtype, zps, out_dtype):
    (a, sa, za, b, sb, zb), ref = _bmm_case(batch, m, k, n, dtype, zps)
    if use_triton:
        c = torch.empty((a.numel() // (m * k), m, n), dtype=out_dtype)
        g._launch(a.reshape(-1, m, k), b.reshape(-1, k, n), c, sa, sb, za, zb, None)
        y = c.reshape(*batch, m, n)
    else:
        y = int8_bmm(a, sa, za, b, sb, zb, out_dtype)
    assert y.shape == (*batch, m, n) and y.dtype == out_dtype
    rel = _rel(y, ref)
    assert rel <= TOL[out_dtype], f"relative error {rel:.2e}"


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "cpu_op"])
@pytest.mark.parametrize("batch,m,k,n", [((2, 3), 9, 16, 9), ((3,), 17, 20, 33)])
def test_int8_bmm_per_row_scales(use_triton, batch, m, k, n):
    """Per-token left operand (attention with per-token activations): one scale per row of
    each batch, ``a_scale`` shaped ``[..., M, 1]`` as choose_qparams_per_token returns it."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (*batch, m, k), generator=gen, dtype=torch.int16).to(torch.int8)
    b = torch.randint(-128, 128, (*batch, n, k), generator=gen, dtype=torch.int16).to(torch.int8).transpose(-2, -1)
    sa = torch.rand(*batch, m, 1, generator=gen) * 0.05 + 0.01
    sb = torch.tensor([0.03])
    ref = (a.double() @ b.double()) * sa.double() * 0.03
    if use_triton:
        c = torch.empty((a.numel() // (m * k), m, n), dtype=torch.float32)
        g._launch(a.reshape(-1, m, k), b.reshape(-1, k, n), c, sa.reshape(-1), sb, None, None, None)
        y = c.reshape(*batch, m, n)
    else:
        y = int8_bmm(a, sa, None, b, sb, None)
    rel = _rel(y, ref)
    assert rel <= TOL[torch.float32], f"relative error {rel:.2e}"
    with pytest.raises(ValueError, match=r"a_scale has 5 elements; expected 1 \(per tensor\) or"):
        int8_bmm(a, torch.ones(5), None, b, sb, None)


def test_fake_impls_give_shapes_without_computing():
    with FakeTensorMode():
        a = torch.empty(4, 7, 32, dtype=torch.uint8)
        w = torch.empty(48, 32, dtype=torch.int8)
        y = int8_linear(a, torch.empty(1), torch.empty(1, dtype=torch.int64), w, torch.empty(48), None, "relu", torch.int8, 0.1, 0)
        assert y.shape == (4, 7, 48) and y.dtype == torch.int8
        s = int8_bmm(torch.empty(2, 5, 8, dtype=torch.int8), torch.empty(1), None,
                     torch.empty(2, 8, 3, dtype=torch.int8), torch.empty(1), None, torch.bfloat16)
        assert s.shape == (2, 5, 3) and s.dtype == torch.bfloat16


def test_argument_errors_name_the_problem():
    a, w = torch.zeros(4, 8, dtype=torch.int8), torch.zeros(6, 8, dtype=torch.int8)
    s1, sw = torch.ones(1), torch.ones(6)
    with pytest.raises(TypeError, match="a must be"):
        int8_linear(a.float(), s1, None, w, sw)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        int8_linear(torch.zeros(4, 5, dtype=torch.int8), s1, None, w, sw)
    with pytest.raises(ValueError, match="a_scale has 3 elements"):
        int8_linear(a, torch.ones(3), None, w, sw)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        int8_linear(a, s1, None, w, sw, None, "tanh")
    with pytest.raises(ValueError, match="out_dtype torch.int32 is not supported"):
        int8_linear(a, s1, None, w, sw, None, "none", torch.int32)
    with pytest.raises(ValueError, match="equal batch dims"):
        int8_bmm(torch.zeros(2, 4, 8, dtype=torch.int8), s1, None, torch.zeros(3, 8, 4, dtype=torch.int8), s1, None)
