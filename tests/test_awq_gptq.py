"""algorithm="awq+gptq": AWQ's scales folded into the norm, then GPTQ's rounding of the scaled
weights, against a NumPy reference on one layer; and its output error against AWQ and GPTQ alone."""

from __future__ import annotations

import numpy as np
import torch

import quantkit
from quantkit import _graph
from quantkit.accuracy.rounding import _base as _rounding
from quantkit.quantizers import WeightOnlyQuantizer
from tests.accuracy.test_gptq import _ref_gptq, _ref_params

K, N, GS, QMIN, QMAX = 32, 24, 16, 0, 15  # int4 asymmetric (uint4 codes 0..15), groups of 16


class _NormLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(K)
        self.fc = torch.nn.Linear(K, N, bias=False)

    def forward(self, x):
        return self.fc(self.ln(x))


def _setup(seed=0):
    torch.manual_seed(seed)
    model = _NormLinear().eval()
    with torch.no_grad():
        model.ln.weight.copy_(1 + 0.2 * torch.randn(K))
        model.ln.weight[[3, 11]] = 25.0  # outlier channels: what AWQ protects
        model.fc.weight.normal_(0, 0.1)
    g = torch.Generator().manual_seed(seed + 1)
    calib = [torch.randn(4, 16, K, generator=g) for _ in range(6)]  # 384 rows < AWQ's 2048: all sampled
    return model, calib


def _np_rtn(w):
    """Group-wise round to nearest (float64 result) with the reference's qparams."""
    n, k = w.shape
    out = np.empty_like(w)
    for g0 in range(0, k, GS):
        blk = w[:, g0:g0 + GS]
        s, z = _ref_params(blk, QMIN, QMAX, False)
        q = np.clip(np.round(blk / s[:, None]) + z[:, None], QMIN, QMAX)
        out[:, g0:g0 + GS] = (q - z[:, None]) * s[:, None]
    return out


def _np_awq_scale(x, w, n_grid=20):
    """AWQ's search written out: paper's x^α and AutoAWQ's duo scaling, each point's output error."""
    x_mean = np.abs(x).mean(0)
    wg = np.abs(w).reshape(w.shape[0], -1, GS)
    w_mean = (wg / wg.max(-1, keepdims=True)).reshape(w.shape).mean(0)
    ref = x @ w.T
    best, best_s, best_alpha = ((ref - x @ _np_rtn(w).T) ** 2).sum(), None, None
    for duo in (False, True):
        for i in range(n_grid):
            a = i / n_grid
            s = np.maximum(x_mean ** a / (w_mean ** (1 - a) + 1e-4), 1e-4) if duo else np.maximum(x_mean, 1e-4) ** a
            s = s / np.sqrt(s.max() * s.min())
            err = ((ref - (x / s) @ _np_rtn(w * s).T) ** 2).sum()
            if err < best:
                best, best_s, best_alpha = err, s, a
    return best_s, best_alpha


def _ln(x, weight, bias):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * weight + bias


def _quantize(model, calib, algorithm):
    prepared = quantkit.prepare(quantkit.capture(model, (calib[0],)), WeightOnlyQuantizer(group_size=GS,
                                                                                         algorithm=algorithm))
    quantkit.calibrate(prepared, calib, progress=False)
    return prepared


def test_awq_gptq_matches_numpy_reference_on_one_layer():
    model, calib = _setup()
    prepared = _quantize(model, calib, "awq+gptq")
    records = prepared.meta[_rounding.ROUNDING_META_KEY]
    assert [r["algorithm"] for r in records] == ["awq+gptq", "gptq"]
    awq_record = records[0]
    assert awq_record["folded_into"].startswith("norm:")  # 1/s went into the LayerNorm, no mul

    x = np.concatenate([_ln(b.double().numpy().reshape(-1, K), model.ln.weight.detach().double().numpy(),
                            model.ln.bias.detach().double().numpy()) for b in calib])
    w = model.fc.weight.detach().double().numpy()
    s, alpha = _np_awq_scale(x, w)
    assert s is not None and awq_record["alpha"] == alpha, (awq_record["alpha"], alpha)
    xs = x / s
    # GPTQ with its default output-error range search of each group
    q_ref = _ref_gptq(w * s, xs.T @ xs / xs.shape[0], QMIN, QMAX, False, GS, act_order=True, clip=True)

    (lin,) = _rounding.find_rounded_linears(prepared)
    got = _graph.get_attr(prepared, lin.weight).detach().double()
    scale, zp = (torch.as_tensor(t).reshape(N, -1).double() for t in lin.observer.calculate_qparams())
    q = torch.round(got / scale.repeat_interleave(GS, 1)) + zp.repeat_interleave(GS, 1)
    same = float((q.numpy() == q_ref).mean())
    assert same >= 0.99, f"{same:.4f} of the integers agree with the NumPy AWQ + GPTQ"
    # the folded LayerNorm weight is the original divided by s
    np.testing.assert_allclose(_graph.get_attr(prepared, "ln.weight").detach().double().numpy(),
                               model.ln.weight.detach().double().numpy() / s, rtol=1e-5)


def test_awq_gptq_output_error_at_most_either_alone():
    model, calib = _setup(seed=3)
    g = torch.Generator().manual_seed(9)
    test = torch.randn(8, 16, K, generator=g)
    with torch.no_grad():
        ref = model(test)
        errs = {}
        for algo in ("rtn", "awq", "gptq", "awq+gptq"):
            converted = quantkit.convert(_quantize(model, calib, algo))
            errs[algo] = float((converted(test) - ref).pow(2).sum())
    assert errs["awq+gptq"] <= min(errs["awq"], errs["gptq"]), errs
    assert errs["awq+gptq"] < 0.7 * errs["rtn"], errs
