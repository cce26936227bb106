"""GPTQ on the float8 grid (E4M3 weights, ``WeightScheme(float8=True)``) against an independent
NumPy float64 implementation of the paper's Algorithm 1 rounding onto a table of every float8
value built here from the bit layout; and FP8Quantizer(weight_algorithm="gptq") end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantkit
from quantkit.accuracy._gptq import GPTQConfig, gptq_quantize
from quantkit.accuracy._wscheme import WeightScheme
from quantkit.quantizers import FP8Quantizer
from tests.accuracy.test_gptq import _layer as gptq_layer

_AO = torch.ops.torchao


def _table(dtype) -> np.ndarray:
    """Non-negative finite values of the format from its bit layout (e4m3fn: bias 7, 3 mantissa
    bits, S.1111.111 is NaN, no inf; e5m2: bias 15, 2 bits, top exponent inf/NaN), ascending."""
    ebits, mbits, bias = (4, 3, 7) if dtype == torch.float8_e4m3fn else (5, 2, 15)
    vals = [m / 2 ** mbits * 2.0 ** (1 - bias) for m in range(2 ** mbits)]
    top = 2 ** ebits - 1 if dtype == torch.float8_e4m3fn else 2 ** ebits - 2
    for e in range(1, top + 1):
        for m in range(2 ** mbits):
            if dtype == torch.float8_e4m3fn and e == top and m == 2 ** mbits - 1:
                continue
            vals.append((1 + m / 2 ** mbits) * 2.0 ** (e - bias))
    return np.array(sorted(set(vals)), dtype=np.float64)


def _round(v: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Nearest table value of each ``v`` (ties to the even mantissa = even index), saturating."""
    a = np.minimum(np.abs(v), pos[-1])
    hi = np.clip(np.searchsorted(pos, a), 1, len(pos) - 1)
    lo = hi - 1
    d_lo, d_hi = a - pos[lo], pos[hi] - a
    pick = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(pick, pos[hi], pos[lo]) * np.sign(v)


def _ref_gptq_fp8(W, H, dtype, act_order, percdamp=0.01):
    """Algorithm 1 (Frantar et al. 2022), one column at a time, float64; the grid: per output row
    ``scale = amax / fmax`` (float32, as stored), values ``scale * table``. Returns the grid values."""
    pos = _table(dtype)
    W = W.astype(np.float64).copy()
    H = H.astype(np.float64).copy()
    n, k = W.shape
    amax = np.abs(W).max(1).astype(np.float32)
    scale = np.maximum(amax / np.float32(pos[-1]), np.float32(np.finfo(np.float32).eps)).astype(np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(k)
    inv = np.argsort(perm)
    W, H = W[:, perm], H[perm][:, perm]
    H = H + percdamp * np.mean(np.diag(H)) * np.eye(k)
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    Q = np.zeros((n, k))
    for j in range(k):
        q = _round(W[:, j] / scale, pos)
        e = (W[:, j] - q * scale) / U[j, j]
        W[:, j:] -= np.outer(e, U[j, j:])
        Q[:, j] = q
    return Q[:, inv], scale


def _layer(seed=0):
    """test_gptq's layer (correlated inputs, strong and dead features), smaller, with a weight outlier."""
    w, x = gptq_layer(seed, n=32, k=128, rows=400)
    w[3, 5] = 0.9  # an outlier that sets its row's scale
    return w, x


def _scheme(dtype=torch.float8_e4m3fn) -> WeightScheme:
    fmax = int(torch.finfo(dtype).max)
    return WeightScheme(-fmax, fmax, True, None, dtype=dtype, float8=True)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_gptq_float8_matches_numpy_reference(dtype, act_order):
    w, x = _layer()
    h = (x.double().T @ x.double()) / x.shape[0]
    res = gptq_quantize(w, h, _scheme(dtype), GPTQConfig(block_size=32, act_order=act_order))
    ref, ref_scale = _ref_gptq_fp8(w.numpy(), h.numpy(), dtype, act_order)
    assert np.array_equal(res.scale[:, 0].double().numpy(), ref_scale)
    values = res.q.to(torch.uint8).view(dtype).double().numpy()  # codes are the stored bytes
    same = float((values == ref).mean())
    assert same >= 0.999, f"{same:.5f} of the float8 codes agree with the reference"
    assert torch.equal(res.dequantized, (res.q.to(torch.uint8).view(dtype).double()
                                         * res.scale.double()).float())
    assert int(res.q.min()) >= 0 and int(res.q.max()) <= 255


def test_gptq_float8_layer_error_below_rtn():
    w, x = _layer(seed=1)
    h = (x.double().T @ x.double()) / x.shape[0]
    scheme = _scheme()
    gptq = gptq_quantize(w, h, scheme).dequantized
    rtn = scheme.rtn(w)
    # RTN written here: the nearest E4M3 value of w / (amax / 448), row by row
    pos = _table(torch.float8_e4m3fn)
    s = np.maximum(np.abs(w.numpy()).max(1, keepdims=True).astype(np.float32) / np.float32(448), 1e-30)
    assert np.allclose(rtn.double().numpy(), _round(w.numpy() / s, pos) * s.astype(np.float64), rtol=1e-6, atol=0)
    err = lambda wq: float((x.double() @ (w - wq).double().T).pow(2).sum())  # noqa: E731
    assert err(gptq) < 0.8 * err(rtn), (err(gptq), err(rtn))


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(64, 96)
        self.fc2 = torch.nn.Linear(96, 32)
        with torch.no_grad():
            mix = torch.randn(64, 64, generator=g) / 8 + torch.eye(64)
            self.fc1.weight.copy_(torch.randn(96, 64, generator=g) @ mix * 0.1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _convert(model, batches, **kw):
    gm = quantkit.capture(model, batches[0])
    prepared = quantkit.prepare(gm, FP8Quantizer(**kw))
    quantkit.calibrate(prepared, batches, progress=False)
    return prepared, quantkit.convert(prepared)


def _float8_weights(qmodel) -> list[torch.Tensor]:
    """Dequantized float8 weights of the converted graph (folded float8 buffers x their scales)."""
    out = []
    for node in qmodel.graph.nodes:
        if node.target in (_AO.dequantize_affine_float8_non_decomposed.default,) and node.args[0].op == "get_attr":
            q = getattr(qmodel, node.args[0].target)
            s = getattr(qmodel, node.args[1].target)
            assert q.dtype == torch.float8_e4m3fn
            out.append(q.double() * s.double())
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_fp8_quantizer_gptq_end_to_end(dynamic):
    torch.manual_seed(0)
    model = _MLP().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 64, generator=g) @ (torch.eye(64) + torch.randn(64, 64, generator=g) / 8),)
               for _ in range(4)]
    kw = dict(dynamic=True, granularity="per-token") if dynamic else {}
    prepared, q_gptq = _convert(model, batches, weight_algorithm="gptq", **kw)
    _, q_rtn = _convert(model, batches, **kw)
    records = prepared.meta["quantkit_weight_rounding"]
    assert [r["algorithm"] for r in records] == ["gptq", "gptq"]
    # the artifact stores GPTQ's codes: float8 buffer x scale == the rounded weight calibrate left
    w_gptq, w_rtn = _float8_weights(q_gptq), _float8_weights(q_rtn)
    assert len(w_gptq) == 2
    rounded = [prepared.fc1.weight, prepared.fc2.weight]
    for wq, r in zip(w_gptq, rounded):
        assert torch.allclose(wq, r.double(), rtol=1e-6, atol=0)
    assert not torch.equal(w_gptq[0], w_rtn[0])
    # same scales as round-to-nearest (amax / 448 of the float weight): codes differ, not the grid
    scales = [getattr(q_gptq, n.args[1].target) for n in q_gptq.graph.nodes
              if n.target == _AO.dequantize_affine_float8_non_decomposed.default and n.args[0].op == "get_attr"]
    ref_scale = (model.fc1.weight.detach().double().abs().amax(1) / 448).float()
    assert torch.equal(scales[0].reshape(-1), ref_scale)
    held = torch.randn(64, 64, generator=g)
    with torch.no_grad():
        ref = model(held)
        e_gptq = float((q_gptq(held) - ref).pow(2).sum())
        e_rtn = float((q_rtn(held) - ref).pow(2).sum())
    assert e_gptq < e_rtn, (e_gptq, e_rtn)


def test_fp8_gptq_dampening_reaches_gptq():
    """fc1's input is the data itself: its rounded weight is gptq_quantize on the data's Hessian with
    the quantizer's dampening."""
    torch.manual_seed(0)
    model = _MLP().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 64, generator=g) @ (torch.eye(64) + torch.randn(64, 64, generator=g) / 8),)
               for _ in range(2)]
    x = torch.cat([b[0] for b in batches]).double()
    h = x.T @ x / x.shape[0]
    w = model.fc1.weight.detach()
    for damp in (0.5, 0.01):
        prepared, _ = _convert(model, batches, weight_algorithm="gptq", gptq_percdamp=damp)
        ref = gptq_quantize(w, h, _scheme(), GPTQConfig(percdamp=damp)).dequantized
        # (the observer's Hessian sums batch by batch: float64 summation order may flip a rare tie)
        same = float((prepared.fc1.weight.detach() == ref).float().mean())
        assert same >= 0.999, (damp, same)
    assert not torch.equal(ref, gptq_quantize(w, h, _scheme(), GPTQConfig(percdamp=0.5)).dequantized)


def test_fp8_config_weight_algorithm_errors():
    with pytest.raises(ValueError, match="unknown weight_algorithm 'gtpq'; use one of"):
        FP8Quantizer(weight_algorithm="gtpq")
    with pytest.raises(ValueError, match="a float8 weight scheme is symmetric with a float8 dtype"):
        WeightScheme(-448, 448, True, None, dtype=torch.int8, float8=True)
    with pytest.raises(ValueError, match=r"gptq_percdamp must be in \(0, 1\], got 0"):
        FP8Quantizer(weight_algorithm="gptq", gptq_percdamp=0)


def test_fp8_quantizer_awq_runs_on_the_e4m3_grid():
    """AWQ's scales on FP8 (no accuracy claim: its alpha search scores weights-only error)."""
    torch.manual_seed(0)
    model = _MLP().eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 64, generator=g),) for _ in range(4)]
    prepared, q_awq = _convert(model, batches, weight_algorithm="awq")
    assert [r["algorithm"] for r in prepared.meta["quantkit_weight_rounding"]] == ["awq", "awq"]
    assert len(_float8_weights(q_awq)) == 2
    held = torch.randn(64, 64, generator=g)
    with torch.no_grad():
        assert quantkit._qmath.sqnr(model(held), q_awq(held)) > 25
