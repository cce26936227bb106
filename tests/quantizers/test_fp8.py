"""FP8Quantizer: float8 qparams and rounding against float64 references, q/dq op counts and
dtypes on a transformer block, the FP8-grid MSE search, KV-cache scales, save/load, errors."""

import json
import math
from collections import Counter

import pytest
import torch

import quantkit
from quantkit._qmath import dequantize_float8, float8_scale, quantize_float8
from quantkit.observers import get as get_observer
from quantkit.observers._fp8 import float8_observer
from quantkit.quantizers import FP8Quantizer
from tests.models import make_transformer

_F8 = [torch.float8_e4m3fn, torch.float8_e5m2]
_AO = torch.ops.torchao


def _grid64(dtype) -> torch.Tensor:
    """Every finite value of the float8 format, built from its bit layout in float64
    (e4m3fn: bias 7, 3 mantissa bits, the all-ones code is NaN; e5m2: bias 15, 2 bits, IEEE)."""
    ebits, mbits, bias = (4, 3, 7) if dtype == torch.float8_e4m3fn else (5, 2, 15)
    vals = [m / 2 ** mbits * 2.0 ** (1 - bias) for m in range(2 ** mbits)]  # zero and subnormals
    top_e = 2 ** ebits - 1 if dtype == torch.float8_e4m3fn else 2 ** ebits - 2  # e5m2: top exponent is inf/NaN
    for e in range(1, top_e + 1):
        for m in range(2 ** mbits):
            if dtype == torch.float8_e4m3fn and e == top_e and m == 2 ** mbits - 1:
                continue  # S.1111.111 is NaN
            vals.append((1 + m / 2 ** mbits) * 2.0 ** (e - bias))
    pos = torch.tensor(sorted(set(vals)), dtype=torch.float64)
    return pos


def _round_to_grid(v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Nearest grid value of ``|v|`` (ties to the even code: even index, as codes are consecutive),
    saturating at the largest value; sign restored."""
    a = v.abs().clamp(max=float(pos[-1]))
    hi = torch.searchsorted(pos, a).clamp(1, len(pos) - 1)
    lo = hi - 1
    d_lo, d_hi = a - pos[lo], pos[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, pos[hi], pos[lo]) * torch.sign(v)


@pytest.mark.parametrize("dtype", _F8, ids=str)
def test_float8_scale_and_observers_match_float64(dtype):
    torch.manual_seed(0)
    fmax = float(_grid64(dtype)[-1])
    assert fmax == {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    w = torch.randn(16, 40) * torch.logspace(-3, 2, 16)[:, None]
    amax64 = w.double().abs().amax(1)
    eps = torch.finfo(torch.float32).eps  # the scale floor (tiny e5m2 rows reach it)
    ref = (amax64 / fmax).float().clamp(min=eps)  # one rounding of the exact quotient
    assert torch.equal(float8_scale(w.abs().amax(1), dtype), ref)
    lo, hi = -int(fmax), int(fmax)
    per_channel = get_observer("per_channel_minmax")(dtype=dtype, qscheme=torch.per_channel_symmetric,
                                                     quant_min=lo, quant_max=hi, ch_axis=0)
    per_channel(w)
    scale, zp = per_channel.calculate_qparams()
    assert torch.equal(scale, ref) and not zp.any()
    per_tensor = float8_observer(get_observer("minmax"))(dtype=dtype, qscheme=torch.per_tensor_symmetric,
                                                         quant_min=lo, quant_max=hi)
    per_tensor(w)
    assert per_tensor.float8_rounding
    assert torch.equal(per_tensor.calculate_qparams()[0], (amax64.max() / fmax).float().clamp(min=eps).reshape(1))
    # an all-zero tensor gets the eps floor, never a zero scale
    assert float(float8_scale(torch.zeros(1), dtype)) == torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtype", _F8, ids=str)
def test_quantize_float8_rounds_to_the_float64_grid(dtype):
    pos = _grid64(dtype)
    g = torch.Generator().manual_seed(1)
    fmax = float(pos[-1])
    x = torch.cat([torch.randn(4000, generator=g) * fmax / 3,
                   torch.randn(4000, generator=g) * 1e-2,  # subnormal territory after scaling
                   (pos[1:-1] + pos[2:]).float() / 2,  # exact midpoints: ties
                   torch.tensor([2 * fmax, -3 * fmax, 0.0])]).float()
    scale = torch.tensor([0.5])
    q = quantize_float8(x, scale, dtype)
    assert q.dtype == dtype
    ref = _round_to_grid((x / scale).double(), pos)  # the float32 quotient, rounded in float64
    assert torch.equal(q.double(), ref)
    assert torch.equal(dequantize_float8(q, scale).double(), ref * 0.5)


def _counts(gm) -> Counter:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _prepared(model, x, quantizer, batches=2):
    gm = quantkit.capture(model, (x[:4],))
    prepared = quantkit.prepare(gm, quantizer)
    quantkit.calibrate(prepared, [x[i:i + 4] for i in range(0, 4 * batches, 4)], progress=False)
    return prepared


@pytest.fixture(scope="module")
def block():
    model, x = make_transformer(d=32)
    return model, x[:8]


@pytest.mark.parametrize("kwargs,q,dq,choose", [
    # 4 linears (weights folded: dequantize only) + 2 attention matmuls; static activation q/dq
    # move above the shape ops before them (one shared scale), as W8A8Quantizer's do
    ({}, 17, 21, 0),
    # dynamic: q/dq at the 4 linear inputs and 4 matmul operands; per-token scales
    # (choose_scale_float8) for the linear inputs and the matmuls' left operands, amax for the rest
    ({"dynamic": True, "granularity": "per-token"}, 8, 12, 6),
], ids=["static", "dynamic-per-token"])
def test_transformer_block_qdq_counts_and_dtypes(block, kwargs, q, dq, choose):
    model, x = block
    conv = quantkit.convert(_prepared(model, x, FP8Quantizer(**kwargs)))
    c = _counts(conv)
    assert c[_AO.quantize_affine_float8_non_decomposed.default] == q
    assert c[_AO.dequantize_affine_float8_non_decomposed.default] == dq
    assert c[_AO.choose_scale_float8.default] == choose
    assert not any("quantized_decomposed" in str(t) for t in c)
    weights = [b for n, b in conv.named_buffers() if n.startswith("_frozen_param")]
    assert len(weights) == 4 and all(w.dtype == torch.float8_e4m3fn for w in weights)
    # per output channel: scale [N, 1], amax / 448 of the float weight
    scale = conv.get_buffer(next(n.args[1].target for n in conv.graph.nodes
                                 if n.target == _AO.dequantize_affine_float8_non_decomposed.default
                                 and n.args[0].target == "_frozen_param0"))
    assert scale.shape == (3 * 32, 1)
    assert torch.equal(scale[:, 0], (model.qkv.weight.double().abs().amax(1) / 448).float())
    with torch.no_grad():
        db = quantkit._qmath.sqnr(model(x), conv(x))
    assert db > 30, f"FP8 block SQNR {db:.1f} dB"


def test_static_per_tensor_weights_and_no_observer_left(block):
    model, x = block
    conv = quantkit.convert(_prepared(model, x, FP8Quantizer(weight_granularity="per-tensor")))
    scales = [conv.get_buffer(n.args[1].target) for n in conv.graph.nodes
              if n.target == _AO.dequantize_affine_float8_non_decomposed.default
              and str(n.args[0].target).startswith("_frozen_param")]
    assert len(scales) == 4 and all(s.shape == (1,) for s in scales)
    assert not [n for n in conv.graph.nodes if n.op == "call_module" and "observer" in str(n.target)]


def test_fp8_mse_observer_searches_the_fp8_grid():
    """The histogram MSE search on the E4M3 grid finds a threshold whose true FP8 error
    (float64 grid rounding of the raw data) is within 1% of the best threshold found by brute
    force (40 coarse, then 40 fine candidates); the integer-grid search of the same histogram
    chooses differently."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) ** 3  # heavy tails: clipping pays off
    pos = _grid64(torch.float8_e4m3fn)

    def err(t: float) -> float:
        s = torch.tensor(t / 448, dtype=torch.float32).double()
        return float(((_round_to_grid(x.double() / s, pos) * s - x.double()) ** 2).mean())

    obs = float8_observer(get_observer("mse"))(dtype=torch.float8_e4m3fn, qscheme=torch.per_tensor_symmetric,
                                               quant_min=-448, quant_max=448)
    obs(x)
    t_fp8 = float(obs.calculate_qparams()[0]) * 448
    amax = float(x.abs().max())
    coarse = min(range(1, 41), key=lambda k: err(amax * k / 40))
    best = min(err(amax * (coarse - 1 + k / 20) / 40) for k in range(1, 41))
    assert err(t_fp8) <= best * 1.01, (err(t_fp8), best)
    integer = get_observer("mse")(dtype=torch.float8_e4m3fn, qscheme=torch.per_tensor_symmetric,
                                  quant_min=-448, quant_max=448)
    integer(x)
    assert not math.isclose(float(integer.calculate_qparams()[0]) * 448, t_fp8, rel_tol=1e-2)
    # percentile: the 99.99th percentile of |x| (within a histogram bin) / 448
    pct = float8_observer(get_observer("percentile"))(dtype=torch.float8_e4m3fn, qscheme=torch.per_tensor_symmetric,
                                                      quant_min=-448, quant_max=448)
    pct(x)
    ref = float(torch.quantile(x.double().abs(), 0.9999))
    assert math.isclose(float(pct.calculate_qparams()[0]) * 448, ref, rel_tol=1e-2)


def test_kv_cache_scales_in_graph_and_quantization_json(block, tmp_path):
    model, x = block
    conv = quantkit.convert(_prepared(model, x, FP8Quantizer(kv_cache="fp8_e5m2", kv_granularity="per-head")))
    kv = [r for r in conv.meta["quantkit_qparams"] if "kv_cache" in r]
    assert sorted(r["kv_cache"] for r in kv) == ["key", "value"]
    assert all(r["dtype"] == "float8_e5m2" and len(r["scale"]) == 4 and r["axis"] == 1 for r in kv)  # 4 heads
    e5m2 = [n for n in conv.graph.nodes if n.target == _AO.quantize_affine_float8_non_decomposed.default
            and n.args[2] == torch.float8_e5m2]
    assert len(e5m2) == 2
    quantkit.save(conv, tmp_path / "a")
    doc = json.loads((tmp_path / "a" / "quantization.json").read_text())
    assert sorted(t["kv_cache"] for t in doc["tensors"] if "kv_cache" in t) == ["key", "value"]
    int8 = quantkit.convert(_prepared(model, x, FP8Quantizer(kv_cache="int8")))
    c = _counts(int8)
    ops = torch.ops.quantized_decomposed
    assert c[ops.quantize_per_tensor.default] == 2 and c[ops.dequantize_per_tensor.default] == 2


@pytest.mark.parametrize("kwargs", [{}, {"dynamic": True, "granularity": "per-token"}], ids=["static", "dynamic"])
def test_save_load_round_trip_keeps_float8_weights(block, tmp_path, kwargs):
    model, x = block
    conv = quantkit.convert(_prepared(model, x, FP8Quantizer(**kwargs)))
    quantkit.save(conv, tmp_path / "a")
    loaded = quantkit.load(tmp_path / "a")
    x2 = torch.randn(3, 16, 32)  # another batch size: the batch stays dynamic
    with torch.no_grad():
        assert torch.equal(loaded(x2), conv(x2))
    f8 = [t for t in loaded.state_dict().values() if t.dtype == torch.float8_e4m3fn]
    assert len(f8) == 4 and sum(t.numel() * t.element_size() for t in f8) == sum(t.numel() for t in f8)


@pytest.mark.parametrize("kwargs,match", [
    ({"granularity": "per-token"}, "static FP8 activations are per tensor.*dynamic=True"),
    ({"kv_cache": "fp4"}, "unknown kv_cache 'fp4'"),
    ({"weight_granularity": "per-group"}, "unknown weight_granularity 'per-group'"),
    ({"act_observer": "kl"}, "'kl' histogram method.*cannot search an FP8 range"),
    ({"act_observer": "per_channel_minmax"}, "cannot measure a static per-tensor FP8 activation"),
    ({"ops": {"add"}}, r"cannot quantize op families \['add'\]"),
    ({"kv_granularity": "per-token"}, "unknown kv_granularity"),
])
def test_bad_configurations_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        FP8Quantizer(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("alpha", [0.5, "auto"])
def test_smoothquant_composes_with_fp8(block, alpha):
    """smooth_quant (fixed α, or α scored on the E4M3 grid with an FP8Config) then FP8Quantizer:
    the smoothed float model equals the original, and the FP8 result stays close to it."""
    model, x = block
    gm = quantkit.capture(model, (x[:4],))
    quantizer = FP8Quantizer()
    smoothed = quantkit.smooth_quant(gm, [x[:4], x[4:]], alpha=alpha, config=quantizer.global_config)
    with torch.no_grad():
        ref = model(x)
        assert torch.allclose(smoothed(x), ref, atol=1e-4)
    prepared = quantkit.prepare(smoothed, quantizer)
    quantkit.calibrate(prepared, [x[:4], x[4:]], progress=False)
    conv = quantkit.convert(prepared)
    with torch.no_grad():
        db = quantkit._qmath.sqnr(ref, conv(x))
    assert db > 30, f"SmoothQuant + FP8 SQNR {db:.1f} dB"
    assert _counts(conv)[_AO.quantize_affine_float8_non_decomposed.default] > 0
