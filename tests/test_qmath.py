"""quantkit._qmath: the per-tensor fast path of choose_qparams against the tensor formula."""

import random

import pytest
import torch

from quantkit._qmath import choose_qparams

_RANGES = [  # dtype, quant_min, quant_max, customized range
    (torch.int8, -128, 127, False),
    (torch.uint8, 0, 255, False),
    (torch.uint8, 0, 127, True),
    (torch.int8, -64, 63, True),
    (torch.uint16, 0, 65535, False),
    (torch.int16, -32768, 32767, False),
]


def _values() -> list[float]:
    rng = random.Random(0)
    edge = [0.0, -0.0, 1e-9, -1e-9, 1.0, -1.0, 3.3, -7.25, 1e-30, 123456.7, -0.4999999, 2.5e-7, -2.5e-7]
    return edge + [rng.uniform(-10, 10) for _ in range(100)] + [rng.uniform(-1e-5, 1e-5) for _ in range(50)]


@pytest.mark.parametrize("scheme,channel_scheme", [
    (torch.per_tensor_symmetric, torch.per_channel_symmetric),
    (torch.per_tensor_affine, torch.per_channel_affine),
], ids=["symmetric", "affine"])
@pytest.mark.parametrize("dtype,qmin,qmax,custom", _RANGES, ids=[f"{r[0]}-{r[1]}-{r[2]}" for r in _RANGES])
def test_per_tensor_fast_path_is_bit_identical_to_the_tensor_formula(scheme, channel_scheme, dtype, qmin,
                                                                     qmax, custom):
    # one range goes through Python floats rounded to float32 after each operation; the
    # per-channel scheme on one channel runs the tensor ops (torchao's formula)
    rng = random.Random(1)
    vals = _values()
    for eps in (torch.finfo(torch.float32).eps, torch.tensor([1e-4]), 1e-12):
        for _ in range(60):
            a, b = sorted([rng.choice(vals), rng.choice(vals)])
            for make in (lambda v: torch.tensor(v), lambda v: torch.tensor([v], dtype=torch.float64)):
                fast = choose_qparams(make(a), make(b), qscheme=scheme, dtype=dtype, quant_min=qmin,
                                      quant_max=qmax, eps=eps, customized_qrange=custom)
                ref = choose_qparams(torch.tensor([a]).float(), torch.tensor([b]).float(), qscheme=channel_scheme,
                                     dtype=dtype, quant_min=qmin, quant_max=qmax, eps=eps, customized_qrange=custom)
                assert fast[0].dtype == torch.float32 and fast[1].dtype == torch.int64
                assert fast[0].shape == (1,) and fast[1].shape == (1,)
                assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1]), (a, b, eps, fast, ref)


def test_non_finite_ranges_take_the_tensor_path():
    scale, zp = choose_qparams(torch.tensor(float("nan")), torch.tensor(1.0), qscheme=torch.per_tensor_affine,
                               dtype=torch.uint8, quant_min=0, quant_max=255)
    ref = choose_qparams(torch.tensor([float("nan")]), torch.tensor([1.0]), qscheme=torch.per_channel_affine,
                         dtype=torch.uint8, quant_min=0, quant_max=255)
    assert torch.equal(scale, ref[0], ) or (scale.isnan().all() and ref[0].isnan().all())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_float8_quantize_matches_a_float64_reference(dtype):
    """float8 quantize/dequantize: integer rounding (half to even), zero point, clamp to the
    finite range, then a round-to-nearest cast, as torch's quantized_decomposed ops."""
    from quantkit._qmath import default_qrange, dequantize, quantize

    fi = torch.finfo(dtype)
    qmin, qmax = default_qrange(dtype)
    assert (qmin, qmax) == (int(fi.min), int(fi.max))
    torch.manual_seed(0)
    scale, zp = 0.125, 3  # a power of two: x / scale is exact in float32 and float64
    x = torch.cat([torch.randn(500) * 40, torch.tensor([0.3125, -0.3125, 2.5 * scale, 1e9, -1e9, 0.0])])
    q = quantize(x, scale, zp, qmin, qmax, dtype)
    assert q.dtype == dtype
    v = torch.clamp(torch.round(x.double() / scale) + zp, qmin, qmax)
    ref = (v.to(dtype).double() - zp) * scale
    torch.testing.assert_close(dequantize(q, scale, zp, qmin, qmax, dtype).double(), ref, rtol=0, atol=0)
    # rounded to an integer before the cast: 2.5 -> 2, not float8's 2.5
    assert float(quantize(torch.tensor([2.5 * scale]), scale, 0, qmin, qmax, dtype)) == 2.0
    assert float(q[-3]) == qmax and float(q[-2]) == qmin
