"""NF4 double quantization (QLoRA, Dettmers et al. 2023, section 3; issue 31, item 5).

The reference is written here in NumPy from the paper's description, not from quantkit's code:
NF4 codes from each group's fp32 absmax; the absmax scales, minus their mean, quantized as 8-bit
floats (E4M3: 4 exponent bits, bias 7, 3 mantissa bits, max 448; nearest, ties to even) in blocks
of 256 with one fp32 scale (block absmax / 448) each. The converted graph must compute with exactly
those weights, and the artifact must store the 8-bit scales (bits per weight ~4.127 at groups of 64).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantkit
from quantkit import _qmath
from quantkit.quantizers import WeightOnlyConfig, WeightOnlyQuantizer

QK = torch.ops.quantkit
NF4 = np.array(_qmath.NF4_VALUES, np.float32)  # the published NF4 code book (QLoRA appendix E)
EPS = np.float32(np.finfo(np.float32).eps)


def _e4m3_values() -> tuple[np.ndarray, np.ndarray]:
    """The non-negative finite E4M3 values, ascending, and whether each has an even mantissa."""
    vals, even = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:  # the NaN encoding: no infinities in E4M3
                continue
            vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
            even.append(m % 2 == 0)
    return np.array(vals), np.array(even)


def _round_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest E4M3 value of each float32 in ``x`` (|x| <= 448), ties to the even mantissa."""
    vals, even = _e4m3_values()
    a = np.abs(x.astype(np.float64))
    i = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = vals[i - 1], vals[i]
    pick_hi = (hi - a < a - lo) | ((hi - a == a - lo) & even[i])
    return (np.sign(x) * np.where(pick_hi, hi, lo)).astype(np.float32)


def _reference(w: np.ndarray, g: int, block: int = 256):
    """``(nf4 codes, fp8 scale values, block scales, offset, dequantized weight)`` in float32."""
    n, k = w.shape
    groups = w.reshape(n, k // g, g)
    absmax = np.maximum(np.abs(groups).max(-1), EPS)
    x = groups.astype(np.float64) / absmax[..., None]
    codes = np.abs(x[..., None] - NF4.astype(np.float64)).argmin(-1)  # nearest; a tie takes the lower value
    flat = absmax.reshape(-1)
    offset = np.float32(flat.astype(np.float64).mean())
    centred = flat - offset
    nblocks = -(-flat.size // block)
    padded = np.zeros(nblocks * block, np.float32)
    padded[:flat.size] = centred
    block_scale = np.maximum(np.abs(padded.reshape(nblocks, block)).max(-1) / np.float32(448), EPS)
    per = np.repeat(block_scale, block)[:flat.size]
    fp8 = _round_e4m3(np.clip(centred / per, -448, 448).astype(np.float32))
    scale = (fp8 * per + offset).astype(np.float32).reshape(n, k // g)
    weight = (NF4[codes] * scale[..., None]).reshape(n, k)
    return codes.reshape(n, k), fp8.reshape(n, k // g), block_scale, offset, weight


def _convert(model, x, **kw):
    prepared = quantkit.prepare(quantkit.capture(model, (x,)), WeightOnlyQuantizer(scheme="nf4", **kw))
    quantkit.calibrate(prepared, [x], progress=False)
    return quantkit.convert(prepared)


def _buffers(gm, prefix: str) -> list[torch.Tensor]:
    return [b for name, b in gm.named_buffers() if name.rpartition(".")[2].startswith(prefix)]


@pytest.mark.parametrize("n,k,g", [(64, 512, 64), (48, 320, 64), (40, 96, 32)])  # 512, 240, 120 scales
def test_double_quant_is_bit_exact_against_the_paper(n, k, g):
    torch.manual_seed(n)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).eval()
    with torch.no_grad():
        model[0].weight[:3] *= 20  # a few large groups: the scales' mean is not their typical value
    x = torch.randn(4, k)
    qmodel = _convert(model, x, group_size=g, double_quant=True)
    codes, fp8, block_scale, offset, weight = _reference(model[0].weight.detach().numpy(), g)
    # what is stored: 4-bit codes, 8-bit float scales, one fp32 per block of 256 scales, one offset
    (stored_fp8,) = _buffers(qmodel, "_qk_scale_fp8_")
    (stored_block,) = _buffers(qmodel, "_qk_scale_block_")
    (stored_offset,) = _buffers(qmodel, "_qk_scale_offset_")
    assert stored_fp8.dtype == torch.float8_e4m3fn
    assert not [name for name, _ in qmodel.named_buffers() if name.rstrip("0123456789").endswith("_qk_scale_")]
    np.testing.assert_array_equal(stored_fp8.float().numpy(), fp8)
    np.testing.assert_array_equal(stored_block.numpy(), block_scale)
    assert stored_block.numel() == -(-(n * k // g) // 256)
    np.testing.assert_array_equal(stored_offset.numpy(), [offset])
    (packed,) = _buffers(qmodel, "_frozen_param")
    np.testing.assert_array_equal(_qmath.unpack_int4(packed, False).numpy(), codes)
    # what runs: the graph dequantizes with the double-quantized scales, bit for bit
    ops = [nd.target for nd in qmodel.graph.nodes if nd.op == "call_function"]
    assert ops.count(QK.dequantize_scales.default) == 1 and ops.count(QK.dequantize_nf4.default) == 1
    expected = torch.nn.functional.linear(x, torch.from_numpy(weight))
    assert torch.equal(qmodel(x), expected)
    # and the scales it uses are not the fp32 ones (the test would not see a graph ignoring them)
    assert not np.array_equal(weight, _reference_fp32(model[0].weight.detach().numpy(), g))


def _reference_fp32(w, g):
    n, k = w.shape
    groups = w.reshape(n, k // g, g)
    absmax = np.maximum(np.abs(groups).max(-1), EPS)
    codes = np.abs(groups[..., None] / absmax[..., None, None] - NF4).argmin(-1)
    return (NF4[codes] * absmax[..., None]).reshape(n, k)


def _bits_per_weight(path) -> float:
    """Bits the saved artifact spends per weight of its one layer: codes and every scale tensor (the
    16-entry NF4 table is shared code book, not per-weight storage)."""
    loaded = quantkit.load(path)
    used = sum(b.numel() * b.element_size() for name, b in loaded.named_buffers()
               if "nf4_table" not in name)
    return used * 8 / (64 * 512)


def test_bits_per_weight_of_the_saved_artifact(tmp_path):
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(512, 64, bias=False)).eval(), torch.randn(2, 512)
    quantkit.save(_convert(model, x, group_size=64), tmp_path / "plain")
    quantkit.save(_convert(model, x, group_size=64, double_quant=True), tmp_path / "dq")
    plain, dq = _bits_per_weight(tmp_path / "plain"), _bits_per_weight(tmp_path / "dq")
    assert plain == pytest.approx(4 + 32 / 64)                           # 4.5
    # 4 + 8/64 + 32/(64*256), plus one fp32 offset for the layer: 4.1279
    assert dq == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / (64 * 512)), dq


def test_round_trip_and_compile_keep_the_double_quantized_weights(tmp_path):
    torch.manual_seed(1)
    model, x = torch.nn.Sequential(torch.nn.Linear(256, 32)).eval(), torch.randn(3, 256)
    qmodel = _convert(model, x, group_size=64, double_quant=True)
    quantkit.save(qmodel, tmp_path / "a")
    loaded = quantkit.load(tmp_path / "a")
    assert torch.equal(loaded(x), qmodel(x))
    torch.testing.assert_close(quantkit.compile(qmodel)(x), qmodel(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(bits=4, scheme="int4", double_quant=True),
                                    dict(bits=8, double_quant=True)])
def test_double_quant_needs_nf4(kwargs):
    with pytest.raises(ValueError, match="double_quant quantizes NF4's absmax scales") as info:
        WeightOnlyConfig(**kwargs)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="double_quant must be True or False"):
        WeightOnlyConfig(scheme="nf4", double_quant="yes")


def test_cli_double_quant(tmp_path):
    from quantkit.cli import main
    from tests.cli_factories import mlp_quantize_args, write_mlp_inputs

    import json

    weights, calib = write_mlp_inputs(tmp_path, calib_rows=8)
    out = tmp_path / "out"
    assert main(mlp_quantize_args(weights, calib, out, "--scheme", "nf4", "--double-quant")) == 0
    doc = json.loads((out / "quantization.json").read_text())
    weights_only = [t for t in doc["tensors"] if t.get("dtype") == "nf4"]
    assert weights_only and all(t.get("double_quant") is True for t in weights_only)
    loaded = quantkit.load(out)
    assert sum(n.target == QK.dequantize_scales.default for n in loaded.graph.nodes) == len(weights_only)
