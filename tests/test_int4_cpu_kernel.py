"""quantkit's CPU int4 weight-only kernel (kernels/_int4_cpu.py) against float64 references.

The reference is written here from the definition of the weight, ``(q - zero_point) * scale`` per
group, and a float64 matmul; it shares nothing with the kernel's packing or integer arithmetic.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from quantkit.kernels import int4_cpu_available, int4_linear_cpu, pack_int4_cpu
from quantkit.kernels._int4_cpu import PREFILL_COLUMNS, PREFILL_ROWS, _compiled
from quantkit.kernels._cpu_isa import cpu_has

_needs_kernel = pytest.mark.skipif(not int4_cpu_available(), reason="needs an AVX512-VNNI CPU and a C++ compiler")


def _weights(n, k, group, signed, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 7) if signed else (0, 15)
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8 if signed else torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.05 + 0.001
    zp = torch.randint(lo, hi + 1, (n, k // group), generator=g)
    return q, scale, zp


def _reference_weight(q, scale, zp, group) -> torch.Tensor:
    """float64 ``(q - zp) * scale``, group by group."""
    n, k = q.shape
    w = q.double().view(n, k // group, group) - zp.double().unsqueeze(-1)
    return (w * scale.double().unsqueeze(-1)).view(n, k)


def _rel_err(out, ref) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


@_needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, PREFILL_ROWS - 1])
@pytest.mark.parametrize("n,k,group,signed", [
    (16, 64, 8, True),      # one 16-channel block, the smallest group
    (80, 256, 32, False),   # 5 blocks: the one-row path's 4-block tiles plus a 1-block tail
    (128, 512, 128, True),
    (48, 384, 64, False),
])
def test_matches_float64(m, n, k, group, signed):
    q, scale, zp = _weights(n, k, group, signed)
    packed, sb = pack_int4_cpu(q, scale, zp, group, signed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ _reference_weight(q, scale, zp, group).T
    out = int4_linear_cpu(x, packed, sb, group)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # the activations keep ~15 bits per group: errors ~2e-5 of the output's scale (bf16 activations: ~2e-3)
    assert _rel_err(out, ref) < 1e-4
    # bf16 in, bf16 out: the same product rounded to bf16 at the end
    out16 = int4_linear_cpu(x.bfloat16(), packed, sb, group)
    ref16 = x.bfloat16().double() @ _reference_weight(q, scale, zp, group).T
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), ref16, rtol=1e-2, atol=1e-2 * float(ref16.abs().max()))


@_needs_kernel
@pytest.mark.parametrize("m", [PREFILL_ROWS, 70])
def test_prefill_path_is_bf16_gemm_of_exact_weights(m):
    # N spans two PREFILL_COLUMNS slices, the second partial
    n, k, group = PREFILL_COLUMNS + 48, 256, 64
    q, scale, zp = _weights(n, k, group, signed=True)
    packed, sb = pack_int4_cpu(q, scale, zp, group, True)
    x = torch.randn(2, m // 2 + 1, k)[:, : m // 2 + m % 2]  # 3-D, non-contiguous
    w = _reference_weight(q, scale, zp, group)
    out = int4_linear_cpu(x, packed, sb, group)
    assert out.shape == (*x.shape[:-1], n)
    # the decoded bf16 weight: the exact weight rounded to bf16 (half an ulp: at most 2^-8 relative)
    _, decode = _compiled()
    wt = torch.empty(k, n, dtype=torch.bfloat16)
    decode(packed, sb, wt, n, k, group, 0, n // 16, 1, 0)  # every block at once (the op decodes slices)
    assert bool(((wt.double().T - w).abs() <= w.abs() * 2 ** -8 * (1 + 2 ** -14)).all())
    # bit for bit torch's own rounding of the float32 weight (to nearest even); the AVX512-BF16 variant
    # (35 blocks: pairs and an odd last one) gives the same bits
    torch.testing.assert_close(wt.T, ((q - zp.repeat_interleave(group, 1)).float()
                                      * scale.float().repeat_interleave(group, 1)).to(torch.bfloat16), rtol=0, atol=0)
    if cpu_has("avx512_bf16"):
        native = torch.empty_like(wt)
        decode(packed, sb, native, n, k, group, 0, n // 16, 2, 1)
        assert torch.equal(native, wt)
        part = torch.zeros(k, 3 * 16, dtype=torch.bfloat16)  # a slice of 3 blocks from block 5
        decode(packed, sb, part, n, k, group, 5, 3, 1, 1)
        assert torch.equal(part, wt[:, 80:128])
    # oneDNN's bf16 GEMM on it: bf16 x, float accumulation, a bf16 result
    ref = x.bfloat16().double() @ wt.double()
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -7, atol=1e-4 * float(ref.abs().max()))
    assert _rel_err(out, x.double() @ w.T) < 1e-2


@_needs_kernel
def test_activation_range_within_a_group():
    # one large and many tiny activations in a group: accuracy is relative to the group's largest value
    n, k, group = 32, 64, 32
    q, scale, zp = _weights(n, k, group, signed=False)
    packed, sb = pack_int4_cpu(q, scale, zp, group, False)
    x = torch.randn(1, k) * 1e-3
    x[0, 5] = 300.0
    x[0, 32:] = 0.0  # an all-zero group: scale 0, contributes nothing
    w = _reference_weight(q, scale, zp, group)
    ref = x.double() @ w.T
    out = int4_linear_cpu(x, packed, sb, group)
    bound = float((x.double().abs().max() * w.abs().sum(1)).max()) * 2e-5  # ~ s / 254 per activation
    assert float((out.double() - ref).abs().max()) < bound
    zeros = int4_linear_cpu(torch.zeros(3, k), packed, sb, group)
    assert torch.count_nonzero(zeros) == 0


@_needs_kernel
def test_non_finite_activations_give_nan_rows():
    q, scale, zp = _weights(32, 64, 32, signed=True)
    packed, sb = pack_int4_cpu(q, scale, zp, 32, True)
    x = torch.randn(3, 64)
    x[0, 7], x[2, 40] = float("nan"), float("inf")
    out = int4_linear_cpu(x, packed, sb, 32)
    assert bool(out[0].isnan().all()) and bool(out[2].isnan().all())
    ref = x[1:2].double() @ _reference_weight(q, scale, zp, 32).T
    assert _rel_err(out[1:2], ref) < 1e-4


def test_packing_layout():
    # channel c's dword for inputs k0..k7: byte i = q[k_i] | q[k_{4+i}] << 4 (unsigned nibbles)
    n, k = 16, 8
    q = torch.arange(n * k, dtype=torch.int64).remainder(16).view(n, k).to(torch.uint8)
    packed, sb = pack_int4_cpu(q, torch.ones(n, 1), torch.zeros(n, 1), 8, False)
    assert packed.shape == (1, 1, 16) and packed.dtype == torch.int32
    for c in range(n):
        d = int(packed[0, 0, c]) & 0xFFFFFFFF
        got = [(d >> (8 * (j % 4) + 4 * (j // 4))) & 0xF for j in range(8)]
        assert got == q[c].tolist()
    # signed weights are stored shifted by 8, their zero points too: the same weight either way
    qs = torch.randint(-8, 8, (16, 32), dtype=torch.int8)
    zps = torch.randint(-8, 8, (16, 4))
    p1, sb1 = pack_int4_cpu(qs, torch.ones(16, 4), zps, 8, True)
    p2, sb2 = pack_int4_cpu((qs.to(torch.int16) + 8).to(torch.uint8), torch.ones(16, 4), zps + 8, 8, False)
    assert torch.equal(p1, p2) and torch.equal(sb1, sb2)


def test_bad_input_is_a_clear_error():
    q, scale, zp = _weights(32, 64, 32, signed=True)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        pack_int4_cpu(q[:24], scale[:24], zp[:24], 32, True)
    with pytest.raises(ValueError, match="group_size % 8 == 0"):
        pack_int4_cpu(q, torch.ones(32, 16), torch.zeros(32, 16), 4, True)
    with pytest.raises(ValueError, match="outside the int4 range"):
        pack_int4_cpu(q.to(torch.int16) * 3, scale, zp, 32, True)
    packed, sb = pack_int4_cpu(q, scale, zp, 32, True)
    with pytest.raises(ValueError, match=r"x must be float32 or bfloat16 \[\.\.\., 64\]"):
        int4_linear_cpu(torch.randn(2, 63), packed, sb, 32)
    with pytest.raises(ValueError, match="x must be float32 or bfloat16"):
        int4_linear_cpu(torch.randn(2, 64).half(), packed, sb, 32)
    with pytest.raises(ValueError, match="scale_zero"):
        int4_linear_cpu(torch.randn(2, 64), packed, sb, 16)
    with pytest.raises(ValueError, match="packed must be int32"):
        int4_linear_cpu(torch.randn(2, 64), packed.to(torch.int64), sb, 32)


@_needs_kernel
def test_compiles_and_handles_empty_batches():
    q, scale, zp = _weights(64, 128, 32, signed=True)
    packed, sb = pack_int4_cpu(q, scale, zp, 32, True)
    fn = torch.compile(lambda x: torch.relu(int4_linear_cpu(x, packed, sb, 32)), fullgraph=True)
    x = torch.randn(3, 128)
    torch.testing.assert_close(fn(x), torch.relu(int4_linear_cpu(x, packed, sb, 32)), rtol=0, atol=0)
    assert int4_linear_cpu(torch.randn(0, 128), packed, sb, 32).shape == (0, 64)


def test_isa_cap_turns_it_off():
    # ONEDNN_MAX_CPU_ISA=AVX2 emulates a CPU without AVX-512: the lowering must keep aten's kernel
    code = "from quantkit.kernels import int4_cpu_available; print(int4_cpu_available())"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_importable_twice_under_two_names():
    # with the folder holding kernels/ on sys.path (the source tree, as benchmarks put it there), it is
    # also a top-level package "kernels" (transformers probes for a package of that name): importing
    # both must not define the op twice
    import quantkit.kernels

    parent = os.path.dirname(os.path.dirname(os.path.abspath(quantkit.kernels.__file__)))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import kernels, quantkit.kernels, torch; "
            "print(torch.ops.quantkit.int4_linear_cpu.default)")
    out = subprocess.run([sys.executable, "-c", code, parent], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "int4_linear_cpu" in out.stdout, out.stderr[-2000:]
