"""w4a16_linear: the Triton W4A16 kernel (interpreter on CPU tensors) and the op against float64."""

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from quantkit.kernels import _w4a16 as k4
from quantkit.kernels import w4a16_linear

# relative error of the norm: fp32 accumulation; the operands are rounded to the compute dtype
# (fp16: 2^-11, bf16: 2^-8 relative per element) before the MMA
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 1.5e-2}


def _case(m, n, k, g, signed, bias, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    groups = -(-k // g)  # a last group of the remainder when g does not divide k
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 0.005
    lo, hi = (-8, 7) if signed else (0, 15)
    zp = torch.randint(lo, hi + 1, (n, groups), generator=gen, dtype=torch.int32).to(torch.int8)
    if signed:
        zp.zero_()
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    # independent float64 reference: nibbles by hand in NumPy
    p = packed.numpy().astype(np.int64)
    q = np.stack([p & 15, p >> 4], -1).reshape(n, k)
    if signed:
        q = np.where(q >= 8, q - 16, q)
    zp_e = np.repeat(zp.numpy().astype(np.int64), g, axis=1)[:, :k]
    w = (q - zp_e) * np.repeat(scale.double().numpy(), g, axis=1)[:, :k]
    ref = x.double() @ torch.from_numpy(w).T
    if b is not None:
        ref = ref + b.double()
    return (x, packed, scale, zp, g, signed, b), ref


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("m,n,k,g", [(1, 32, 64, 32), (5, 24, 128, 64), (17, 40, 96, 32), (3, 16, 256, 128),
                                     (5, 24, 128, 48), (3, 16, 96, 64)])  # the last two: a remainder group
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_kernel_against_float64(m, n, k, g, signed, dtype):
    args, ref = _case(m, n, k, g, signed, bias=(m % 2 == 1), dtype=dtype)
    x, packed, scale, zp, g, signed, b = args
    y = torch.empty(m, n, dtype=dtype)
    k4._launch(x, packed, scale, zp, g, signed, b, y)
    assert _rel(y, ref) < TOL[dtype], _rel(y, ref)


def test_op_cpu_and_fake():
    args, ref = _case(6, 32, 128, 64, False, True, torch.float32)
    x3 = args[0].reshape(2, 3, 128)
    y = w4a16_linear(x3, *args[1:])
    assert y.shape == (2, 3, 32) and y.dtype == torch.float32
    assert _rel(y.reshape(6, 32), ref) < 1e-6
    with FakeTensorMode() as mode:
        fake = w4a16_linear(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in (x3,) + args[1:]])
    assert fake.shape == (2, 3, 32)


@pytest.mark.parametrize("change,message", [
    (dict(group_size=1), "group_size must be >= 2, got 1"),
    (dict(scale=torch.ones(32, 3)), r"scale and zero_point must be \(32, 2\)"),
    # 128 = 2 x 48 + 32: three groups, the last of the remainder
    (dict(group_size=48), r"scale and zero_point must be \(32, 3\) \(one per group\), got \(32, 2\)"),
    (dict(x=torch.randn(2, 100)), "x has 100 features but w_packed holds 128 per row"),
])
def test_bad_arguments(change, message):
    args, _ = _case(2, 32, 128, 64, False, False, torch.float32)
    kw = dict(zip(["x", "w_packed", "scale", "zero_point", "group_size", "signed", "bias"], args))
    kw.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        w4a16_linear(**kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_cuda_against_float64(m):
    args, ref = _case(m, 256, 512, 128, False, True, torch.bfloat16)
    cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    y = w4a16_linear(*cuda)
    assert _rel(y.cpu(), ref) < TOL[torch.bfloat16]
