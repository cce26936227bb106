"""GPTQ and AWQ through quantkit.prepare / calibrate / convert: exact integers in the converted
model, sequential block order, AWQ's gain over round-to-nearest, and one-line errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import quantkit
from quantkit import _graph
from quantkit._errors import CalibrationError, ConvertError
from quantkit.accuracy.rounding import _base as _rounding
from quantkit.accuracy._gptq import GPTQConfig, gptq_quantize
from quantkit.accuracy._wscheme import WeightScheme
from quantkit.quantizers import QuantConfig, W8A8Quantizer, WeightOnlyQuantizer
from tests.models import TwoBlockNet


def _setup(seed=0):
    torch.manual_seed(seed)
    model = TwoBlockNet().eval()
    x = torch.randn(8, 12, 32)
    x[..., :3] *= 5  # a few strong input channels
    return model, x, [x[i:i + 2] for i in range(0, 8, 2)]


def _weights(prepared):
    return {lin.node.name: (lin, _graph.get_attr(prepared, lin.weight).detach().clone())
            for lin in _rounding.find_rounded_linears(prepared)}


def test_w8a8_gptq_converted_integers_are_gptqs():
    model, x, calib = _setup()
    before = copy.deepcopy(model.state_dict())
    prepared = quantkit.prepare(quantkit.capture(model, (x[:2],)), W8A8Quantizer(QuantConfig(weight_algorithm="gptq")))
    quantkit.calibrate(prepared, calib, progress=False)
    rounded = _weights(prepared)
    assert len(rounded) == 4 and len(prepared.meta[_rounding.ROUNDING_META_KEY]) == 4
    converted = quantkit.convert(prepared)
    ints = [r for r in converted.meta["quantkit_qparams"] if r["kind"] == "weight"]
    folded = [b for n, b in converted.named_buffers() if n.startswith("_frozen_param")]
    assert len(folded) == len(ints) == 4
    for (lin, w), q, rec in zip(rounded.values(), folded, ints):
        scale, zp = (np.array(rec["scale"], dtype=np.float64)[:, None], np.array(rec["zero_point"])[:, None])
        w64 = w.numpy().astype(np.float64)
        # the stored weight lies on the grid, and convert's integers are exactly those
        ref = np.round(w64 / scale) + zp
        assert np.array_equal(((ref - zp) * scale).astype(np.float32), w.numpy())
        assert np.array_equal(q.numpy().astype(np.int64), ref.astype(np.int64))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # caller's model untouched


@pytest.mark.parametrize("scheme", ["int4", "nf4"])
def test_weight_only_gptq_convert_keeps_the_rounded_weights(scheme):
    model, x, calib = _setup()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:2],)),
                                WeightOnlyQuantizer(group_size=16, scheme=scheme, algorithm="gptq"))
    quantkit.calibrate(prepared, calib, progress=False)
    rounded = _weights(prepared)
    converted = quantkit.convert(prepared)
    # a float copy of the model with the rounded weights computes what the int4 model computes
    ref = copy.deepcopy(model)
    names = ["layers.0.fc1", "layers.0.fc2", "layers.1.fc1", "layers.1.fc2"]
    for name, (_, w) in zip(names, rounded.values()):
        ref.get_submodule(name).weight.data.copy_(w)
    with torch.no_grad():
        torch.testing.assert_close(converted(x), ref(x), rtol=0, atol=1e-5)


def test_clip_search_reaches_gptq_through_the_pipeline():
    """``WeightOnlyQuantizer(clip_search=True)``: the observers declare ``gptq_clip_search`` and the
    first linear's converted integers are GPTQ's with the range search, from that linear's inputs
    (its Hessian computed here in float64), not those of plain GPTQ."""
    from quantkit.accuracy._gptq import GPTQConfig

    model, x, calib = _setup()
    seen = []
    hook = model.layers[0].fc1.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    with torch.no_grad():
        for batch in calib:
            model(batch)
    hook.remove()
    rows = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen]).double()
    h = rows.T @ rows / rows.shape[0]
    w = model.layers[0].fc1.weight.detach()
    results = {}
    for clip in (False, True):
        prepared = quantkit.prepare(quantkit.capture(model, (x[:2],)),
                                    WeightOnlyQuantizer(group_size=16, symmetric=True, algorithm="gptq", clip_search=clip))
        lin = next(iter(_weights(prepared).values()))[0]
        assert getattr(lin.observer, "gptq_clip_search", None) is clip
        quantkit.calibrate(prepared, calib, progress=False)
        results[clip] = next(iter(_weights(prepared).values()))[1]
    scheme = WeightScheme(-8, 7, True, 16)
    want = gptq_quantize(w, h, scheme, GPTQConfig(clip_search=True)).dequantized
    plain = gptq_quantize(w, h, scheme, GPTQConfig()).dequantized
    agree = lambda a, b: float(torch.isclose(a, b, rtol=1e-5, atol=0).float().mean())  # noqa: E731
    assert agree(results[True], want) >= 0.999
    assert agree(results[False], plain) >= 0.999 and agree(want, plain) < 0.9
    with pytest.raises(ValueError, match="clip_search chooses the group ranges GPTQ rounds to; algorithm='awq'"):
        WeightOnlyQuantizer(group_size=16, algorithm="awq", clip_search=True)


def test_gptq_is_sequential():
    """Block 1 is rounded for its inputs computed with block 0 already rounded."""
    model, x, calib = _setup()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:2],)), WeightOnlyQuantizer(group_size=16, algorithm="gptq"))
    quantkit.calibrate(prepared, calib, progress=False)
    rounded = list(_weights(prepared).values())
    scheme = WeightScheme.of(rounded[2][0].observer)

    def fc1_input(blk0):
        h = []
        m = copy.deepcopy(model)
        m.layers[0].fc1.weight.data.copy_(blk0[0])
        m.layers[0].fc2.weight.data.copy_(blk0[1])
        m.layers[1].fc1.register_forward_hook(lambda mod, inp, out: h.append(inp[0].reshape(-1, 32).double()))
        with torch.no_grad():
            for b in calib:
                m(b)
        rows = torch.cat(h)
        return rows.T @ rows / rows.shape[0]

    clip = GPTQConfig(clip_search=True)  # weight-only GPTQ's default range search
    seq = gptq_quantize(model.layers[1].fc1.weight.detach(), fc1_input((rounded[0][1], rounded[1][1])), scheme, clip)
    flt = gptq_quantize(model.layers[1].fc1.weight.detach(),
                        fc1_input((model.layers[0].fc1.weight, model.layers[0].fc2.weight)), scheme, clip)
    # the passes sum one float32 xᵀx per batch (HessianObserver(product_dtype=float32)), the reference
    # float64 rows: a rounding near a tie may flip and carry on (measured 99.6% equal; float inputs: 52%)
    assert float((seq.dequantized == rounded[2][1]).float().mean()) >= 0.98
    assert float((flt.dequantized == rounded[2][1]).float().mean()) < 0.8


def test_awq_beats_rtn_on_planted_outliers():
    """One input channel 30x larger than the others: AWQ protects it, RTN does not."""
    torch.manual_seed(0)
    model = TwoBlockNet().eval()
    x = torch.randn(8, 12, 32)
    with torch.no_grad():
        model.layers[0].ln.weight[5] = 30.0  # fc1's input channel 5 is an outlier
    calib = [x[i:i + 2] for i in range(0, 8, 2)]
    prepared = quantkit.prepare(quantkit.capture(model, (x[:2],)),
                                WeightOnlyQuantizer(group_size=16, algorithm="awq").set_module_name("layers.1", None))
    quantkit.calibrate(prepared, calib, progress=False)
    records = prepared.meta[_rounding.ROUNDING_META_KEY]
    assert records[0]["folded_into"].startswith("norm:") and records[0]["alpha"] > 0
    converted = quantkit.convert(prepared)
    with torch.no_grad():
        ref = model(x)
        rtn = quantkit.quantize(model, (x[:2],), calib,
                                WeightOnlyQuantizer(group_size=16).set_module_name("layers.1", None), progress=False)
        err_awq, err_rtn = float((converted(x) - ref).pow(2).sum()), float((rtn(x) - ref).pow(2).sum())
    assert err_awq < 0.8 * err_rtn, (err_awq, err_rtn)


def test_errors():
    model, x, calib = _setup()
    q = WeightOnlyQuantizer(group_size=16, algorithm="gptq")
    prepared = quantkit.prepare(quantkit.capture(model, (x[:2],)), q)
    with pytest.raises(ConvertError, match="is to be rounded by gptq, which needs calibration data"):
        quantkit.convert(prepared)
    with pytest.raises(CalibrationError, match="one-shot iterator; pass a list of batches"):
        quantkit.calibrate(prepared, iter(calib), progress=False)
    with pytest.raises(CalibrationError, match="calibration data is empty"):
        quantkit.quantize(model, (x[:2],), [], WeightOnlyQuantizer(group_size=16, algorithm="awq"), progress=False)
    quantkit.calibrate(prepared, calib, progress=False)
    with pytest.raises(CalibrationError, match="already rounded by an earlier calibrate call"):
        quantkit.calibrate(prepared, calib, progress=False)
    with pytest.raises(ValueError, match="unknown weight_algorithm 'gtpq'"):
        QuantConfig(weight_algorithm="gtpq")
