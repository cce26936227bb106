"""WeightOnlyQuantizer: group-wise int4/int8 and NF4 weights, float activations.

References are written here independently of quantkit._qmath: NumPy float64 loops over the
groups, the NF4 table rebuilt from the normal quantiles (QLoRA's construction), nibbles
unpacked by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantkit
from quantkit import _qmath
from quantkit.observers import GroupwiseWeightObserver
from quantkit.quantizers import WeightOnlyConfig, WeightOnlyQuantizer

_QD = torch.ops.quantized_decomposed


class _MLP(torch.nn.Module):
    def __init__(self, k=256, h=128, n=64) -> None:
        super().__init__()
        self.up = torch.nn.Linear(k, h)
        self.down = torch.nn.Linear(h, n)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _convert(model, x, quantizer, **kw):
    prepared = quantkit.prepare(quantkit.capture(model, (x,)), quantizer)
    quantkit.calibrate(prepared, [x], progress=False)
    return quantkit.convert(prepared, **kw)


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _ref_int(w: np.ndarray, g: int, qmin: int, qmax: int, symmetric: bool) -> np.ndarray:
    """Float64 round-to-nearest group-wise fake quantization, one group at a time."""
    out = np.empty_like(w)
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], g):
            grp = w[r, c:c + g]
            lo, hi = min(grp.min(), 0.0), max(grp.max(), 0.0)
            if symmetric:
                scale = max(max(-lo, hi) / ((qmax - qmin) / 2), np.finfo(np.float32).eps)
                zp = 0
            else:
                scale = max((hi - lo) / (qmax - qmin), np.finfo(np.float32).eps)
                zp = int(np.clip(qmin - np.round(lo / scale), qmin, qmax))
            # the ecosystem op multiplies by the float32 reciprocal of the float32 scale: at a
            # symmetric group's -amax (exactly -7.5 steps) that decides the rounding
            scale = np.float32(scale)
            q = np.clip(np.round(grp.astype(np.float32) * (np.float32(1.0) / scale)) + zp, qmin, qmax)
            out[r, c:c + g] = (q - zp) * scale
    return out


def _ref_forward(model: _MLP, x, fq) -> torch.Tensor:
    up = torch.from_numpy(fq(model.up.weight.detach().double().numpy()))
    down = torch.from_numpy(fq(model.down.weight.detach().double().numpy()))
    h = torch.relu(x.double() @ up.T + model.up.bias.double())
    return h @ down.T + model.down.bias.double()


@pytest.mark.parametrize("symmetric,group_size", [(False, 128), (True, 128), (False, 32)])
def test_int4_matches_float64_reference(symmetric, group_size):
    model, x = _MLP().eval(), torch.randn(8, 256)
    q = _convert(model, x, WeightOnlyQuantizer(bits=4, group_size=group_size, symmetric=symmetric))
    qmin, qmax = (-8, 7) if symmetric else (0, 15)
    ref = _ref_forward(model, x, lambda w: _ref_int(w, group_size, qmin, qmax, symmetric))
    torch.testing.assert_close(q(x).double(), ref, atol=2e-4, rtol=1e-4)
    # int4 weights: packed (uint8, half the columns), read through unpack_int4 then the ecosystem dequantize
    assert _count(q, torch.ops.quantkit.unpack_int4.default) == 2
    assert _count(q, _QD.dequantize_per_channel_group.default) == 2
    assert _count(q, torch.ops.aten.linear.default) == 2
    packed = [b for n, b in q.named_buffers() if n.startswith("_frozen_param")]
    assert sorted(tuple(b.shape) for b in packed) == [(64, 64), (128, 128)]
    assert all(b.dtype == torch.uint8 for b in packed)


def test_int8_per_channel_and_unfolded_quantize():
    model, x = _MLP().eval(), torch.randn(8, 256)
    quantizer = WeightOnlyQuantizer(bits=8, group_size=None, symmetric=True)
    q = _convert(model, x, quantizer)
    ref = _ref_forward(model, x, lambda w: _ref_int(w, w.shape[1], -128, 127, True))
    torch.testing.assert_close(q(x).double(), ref, atol=2e-5, rtol=1e-5)
    assert _count(q, torch.ops.quantkit.unpack_int4.default) == 0
    unfolded = _convert(model, x, quantizer, fold_quantize=False)
    assert _count(unfolded, _QD.quantize_per_channel_group.default) == 2
    torch.testing.assert_close(unfolded(x), q(x), atol=0, rtol=0)


def _nf4_table_from_quantiles() -> np.ndarray:
    """QLoRA's NF4 construction (Dettmers et al. 2023, appendix E): 8 positive quantiles of
    N(0, 1) from 0.9677 to 0.5, 7 negative ones, and an exact 0, scaled to [-1, 1]."""
    offset = 0.9677083
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1]).numpy()
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1]).numpy()
    v = np.sort(np.concatenate([pos, [0.0], neg]))
    return v / np.abs(v).max()


def test_nf4_table_lookup_against_reference():
    np.testing.assert_allclose(np.array(_qmath.NF4_VALUES), _nf4_table_from_quantiles(), atol=1e-6)
    model, x = _MLP().eval(), torch.randn(8, 256)
    q = _convert(model, x, WeightOnlyQuantizer(bits=4, group_size=64, scheme="nf4"))
    table = _nf4_table_from_quantiles()

    def fq(w):
        out = np.empty_like(w)
        for r in range(w.shape[0]):
            for c in range(0, w.shape[1], 64):
                grp = w[r, c:c + 64]
                absmax = np.abs(grp).max()
                out[r, c:c + 64] = table[np.abs(grp[:, None] / absmax - table[None]).argmin(1)] * absmax
        return out

    torch.testing.assert_close(q(x).double(), _ref_forward(model, x, fq), atol=2e-4, rtol=1e-4)
    assert _count(q, torch.ops.quantkit.dequantize_nf4.default) == 2
    assert _count(q, torch.ops.quantkit.unpack_int4.default) == 2


@pytest.mark.parametrize("signed", [False, True])
def test_int4_packing_round_trips_exactly(signed):
    lo, hi = (-8, 7) if signed else (0, 15)
    q = torch.randint(lo, hi + 1, (3, 5, 64), dtype=torch.int8 if signed else torch.uint8)
    packed = _qmath.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    assert torch.equal(_qmath.unpack_int4(packed, signed), q)
    assert torch.equal(torch.ops.quantkit.unpack_int4(packed, signed), q)
    # layout, by hand: element 2i in the low nibble, 2i + 1 in the high one (two's complement for negatives)
    p = packed.numpy().astype(np.int64)
    manual = np.stack([p & 15, p >> 4], -1).reshape(3, 5, 64)
    if signed:
        manual = np.where(manual >= 8, manual - 16, manual)
    np.testing.assert_array_equal(manual, q.numpy())


def test_int4_artifact_is_small_and_round_trips(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256)).eval()
    x = torch.randn(2, 512)
    q = _convert(model, x, WeightOnlyQuantizer(bits=4, group_size=128))
    quantkit.save(q, tmp_path / "a")
    loaded = quantkit.load(tmp_path / "a")
    torch.testing.assert_close(loaded(x), q(x), atol=0, rtol=0)
    fp32_bytes = sum(m.weight.numel() * 4 for m in model)
    state = loaded.state_dict()
    stored = sum(t.numel() * t.element_size() for name, t in state.items() if not name.endswith("bias"))
    assert stored <= 0.14 * fp32_bytes, f"int4 g128 weights + qparams take {stored / fp32_bytes:.3f}x fp32"
    assert any(t.dtype == torch.uint8 and t.shape == (512, 256) for t in state.values())  # packed in the artifact


def test_observer_contract_and_algorithms_default_to_rtn():
    model, x = _MLP().eval(), torch.randn(8, 256)
    prepared = quantkit.prepare(quantkit.capture(model, (x,)), WeightOnlyQuantizer(group_size=64, algorithm="gptq"))
    observers = [m for m in prepared.modules() if isinstance(m, GroupwiseWeightObserver)]
    assert len(observers) == 2
    for obs in observers:
        assert (obs.weight_algorithm, obs.group_size, obs.quant_min, obs.quant_max, obs.symmetric) == (
            "gptq", 64, 0, 15, False)
        assert obs.granularity == "per-group"
    # the rounding itself (GPTQ/AWQ) is tested with those algorithms; here: the observers' qparams
    # follow the weight they see at convert time
    obs = observers[0]
    obs.observe_weight(model.up.weight.detach() * 2)
    scale2, _ = obs.calculate_qparams()
    obs.observe_weight(model.up.weight.detach())
    scale1, _ = obs.calculate_qparams()
    torch.testing.assert_close(scale2, 2 * scale1)


def test_activations_stay_float_and_scopes():
    model, x = _MLP().eval(), torch.randn(8, 256)
    q = _convert(model, x, WeightOnlyQuantizer(group_size=64).set_module_name("down", None))
    assert _count(q, _QD.dequantize_per_channel_group.default) == 1
    assert _count(q, _QD.quantize_per_tensor.default) == 0 and _count(q, _QD.dequantize_per_tensor.default) == 0
    q = _convert(model, x, WeightOnlyQuantizer(group_size=64).set_module_type(
        torch.nn.Linear, WeightOnlyConfig(bits=8, group_size=32)))
    assert _count(q, torch.ops.quantkit.unpack_int4.default) == 0  # int8 everywhere: nothing packed
    assert _count(q, _QD.dequantize_per_channel_group.default) == 2


def test_embeddings_optional():
    class Emb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(100, 64)
            self.head = torch.nn.Linear(64, 8)

        def forward(self, ids):
            return self.head(self.tok(ids))

    model, ids = Emb().eval(), torch.randint(0, 100, (2, 7))
    assert _count(_convert(model, ids, WeightOnlyQuantizer(group_size=32)), torch.ops.quantkit.unpack_int4.default) == 1
    q = _convert(model, ids, WeightOnlyQuantizer(group_size=32, embeddings=True))
    assert _count(q, torch.ops.quantkit.unpack_int4.default) == 2
    assert _qmath.sqnr(model(ids), q(ids)) > 15


@pytest.mark.parametrize("kwargs,message", [
    (dict(bits=3), "bits must be 4 or 8, got 3"),
    (dict(bits=16), "bits must be 4 or 8, got 16"),
    (dict(scheme="int2"), "unknown weight-only scheme 'int2'"),
    (dict(algorithm="smooth"), "unknown weight algorithm 'smooth'"),
    (dict(bits=8, scheme="nf4"), "scheme 'nf4' is 4-bit, got bits=8"),
    (dict(group_size=1), "group_size must be an int >= 2"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        WeightOnlyQuantizer(**kwargs)
    assert "\n" not in str(info.value)


def test_group_size_wider_than_a_layer_is_refused():
    # a group size that does not divide K leaves a remainder group (tests/test_remainder_groups.py);
    # one wider than the whole row is refused
    model, x = _MLP(k=96).eval(), torch.randn(2, 96)
    with pytest.raises(ValueError, match=r"layer 'up\.weight' has 96 input features, fewer than group_size=128") as info:
        quantkit.prepare(quantkit.capture(model, (x,)), WeightOnlyQuantizer(group_size=128))
    assert "\n" not in str(info.value)


def test_observer_merge_and_qparams_shapes():
    w = torch.randn(16, 64)
    a, b = GroupwiseWeightObserver(group_size=32), GroupwiseWeightObserver(group_size=32)
    a(w[:, :])
    b(w * 2)
    a.merge(b)
    scale, zp = a.calculate_qparams()
    assert scale.shape == (16, 2) and zp.shape == (16, 2)
    lo = torch.minimum(w, 2 * w).reshape(16, 2, 32).amin(-1).clamp(max=0).double()
    hi = torch.maximum(w, 2 * w).reshape(16, 2, 32).amax(-1).clamp(min=0).double()
    torch.testing.assert_close(scale.double(), (hi - lo) / 15, rtol=1e-6, atol=0)
