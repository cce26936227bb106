"""GPTQ on every linear of all-MiniLM-L6-v2 (int4 g128 asymmetric, through quantkit.calibrate):
each layer's output error on its calibration inputs is at most round-to-nearest's, both
measured here in NumPy float64 with an independent round-to-nearest."""

from __future__ import annotations

import numpy as np
import pytest

import quantkit
from quantkit import _hf
from quantkit.accuracy.rounding import _gptq_blocks
from quantkit.quantizers import WeightOnlyQuantizer

pytestmark = pytest.mark.slow


def _rtn_int4_asym(w, gs):
    wg = w.reshape(w.shape[0], -1, gs).astype(np.float32)
    mn = np.minimum(wg.min(-1, keepdims=True), np.float32(0))
    mx = np.maximum(wg.max(-1, keepdims=True), np.float32(0))
    scale = np.maximum((mx - mn) / np.float32(15), np.float32(np.finfo(np.float32).eps))
    zp = np.clip(-np.round(mn / scale), 0, 15)
    return ((np.clip(np.round(wg / scale) + zp, 0, 15) - zp) * scale).reshape(w.shape).astype(np.float64)


def test_gptq_layer_error_at_most_rtn_on_minilm(monkeypatch):
    model, tok = _hf.load_hf_model(_hf.default_model_path())
    sents = _hf.read_sentences(_hf.default_calibration_file())[:16]
    calib = _hf.tokenize(tok, sents, seq_len=32, batch_size=8)
    seen = []
    real = _gptq_blocks.gptq_quantize

    def spy(weight, hessian, scheme, config):
        res = real(weight, hessian, scheme, config)
        seen.append((weight.double().numpy(), hessian.double().numpy(), res.dequantized.double().numpy()))
        return res

    monkeypatch.setattr(_gptq_blocks, "gptq_quantize", spy)
    prepared = quantkit.prepare(quantkit.capture(model, calib[0]), WeightOnlyQuantizer(group_size=128, algorithm="gptq"))
    quantkit.calibrate(prepared, calib, progress=False)
    assert len(seen) == 37  # 6 blocks x (q, k, v, attention output, intermediate, output) + pooler
    for i, (w, h, wq) in enumerate(seen):
        err = lambda d: float(np.einsum("ij,jk,ik->", d, h, d))  # noqa: E731  tr(D H D^T)
        gptq, rtn = err(w - wq), err(w - _rtn_int4_asym(w, 128))
        assert gptq <= rtn, f"linear {i}: GPTQ error {gptq:.4g} > RTN {rtn:.4g}"
