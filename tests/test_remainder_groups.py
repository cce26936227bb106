"""Group sizes that do not divide the input features (issue 31, item 3): groups of ``group_size``
along K and a last group of the remainder (576 = 4 x 128 + 64), through the observer math, convert,
the CPU int4 kernel, save/load, and the exports that cannot hold one (one-line refusals).

References are NumPy loops over the groups in float64, written here from the definitions (a group's
min/max widened to include 0, ``scale = (hi - lo) / 15``, ``zp = -round(lo / scale)``; NF4: absmax
and the nearest of the 16 table values), never our qparams.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import quantkit
from quantkit import _qmath
from quantkit.kernels import int4_cpu_available
from quantkit.lowering._weight_only import lower_weight_only
from quantkit.quantizers import GroupSizeError, WeightOnlyQuantizer

aten = torch.ops.aten
QK = torch.ops.quantkit
GROUP_DQ = torch.ops.quantized_decomposed.dequantize_per_channel_group.default


def _np_groups(k: int, g: int) -> list[slice]:
    return [slice(i, min(i + g, k)) for i in range(0, k, g)]


def _np_affine(w: np.ndarray, g: int, qmin: int = 0, qmax: int = 15):
    """``(lo, hi, scale, zp, q, dequantized)`` per group, float64 (zp: ``qmin - round(min(lo, 0) / scale)``)."""
    n, k = w.shape
    cols = _np_groups(k, g)
    lo = np.stack([w[:, c].min(1) for c in cols], 1)
    hi = np.stack([w[:, c].max(1) for c in cols], 1)
    neg, pos = np.minimum(lo, 0), np.maximum(hi, 0)
    scale = np.maximum((pos - neg) / (qmax - qmin), np.finfo(np.float32).eps)
    zp = np.clip(qmin - np.round(neg / scale), qmin, qmax)
    q = np.empty_like(w)
    for j, c in enumerate(cols):
        q[:, c] = np.clip(np.round(w[:, c] / scale[:, j:j + 1]) + zp[:, j:j + 1], qmin, qmax)
    deq = np.empty_like(w)
    for j, c in enumerate(cols):
        deq[:, c] = (q[:, c] - zp[:, j:j + 1]) * scale[:, j:j + 1]
    return lo, hi, scale, zp, q, deq


def _weight(n=32, k=576, seed=0) -> torch.Tensor:
    """A weight whose remainder group differs from the full ones: all-positive and 100x smaller
    (zero padding or a merged last group would change its min, max and scale)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, 512:] = w[:, 512:].abs() * 0.01 + 0.001
    return w


def test_group_math_matches_a_numpy_reference_including_the_remainder_group():
    w = _weight()
    lo, hi = _qmath.group_min_max(w, 128)
    ref_lo, ref_hi, ref_scale, ref_zp, ref_q, ref_deq = _np_affine(w.double().numpy(), 128)
    assert lo.shape == (32, 5)  # 4 groups of 128 and one of 64
    np.testing.assert_array_equal(lo.numpy(), ref_lo.astype(np.float32))
    np.testing.assert_array_equal(hi.numpy(), ref_hi.astype(np.float32))
    assert float(lo[:, 4].min()) > 0  # the small all-positive last group keeps its own minimum
    scale, zp = _qmath.choose_qparams_group(lo, hi, quant_min=0, quant_max=15, symmetric=False, dtype=torch.uint8)
    np.testing.assert_allclose(scale.double().numpy(), ref_scale, rtol=1e-6)
    np.testing.assert_array_equal(zp.numpy(), ref_zp)
    q = _qmath.quantize_group(w, scale, zp, 0, 15, torch.uint8, 128)
    np.testing.assert_array_equal(q.numpy(), ref_q)
    deq = _qmath.dequantize_group(q, scale, zp, 0, 15, torch.uint8, 128)
    np.testing.assert_allclose(deq.double().numpy(), ref_deq, rtol=1e-6, atol=1e-9)
    # the last group's error is its own scale's, 100x below the full groups'
    err = (deq - w).abs()
    assert float(err[:, 512:].max()) <= float(scale[:, 4].max()) / 2 * (1 + 1e-6) < float(err[:, :512].max()) / 20


def test_nf4_remainder_group_matches_a_numpy_reference():
    w = _weight(k=160)  # 2 groups of 64 and one of 32
    absmax = _qmath.nf4_scales(w, 64)
    wn = w.double().numpy()
    cols = _np_groups(160, 64)
    ref_absmax = np.stack([np.abs(wn[:, c]).max(1) for c in cols], 1)
    np.testing.assert_array_equal(absmax.numpy(), ref_absmax.astype(np.float32))
    table = np.array(_qmath.NF4_VALUES)
    codes = _qmath.quantize_nf4(w, absmax, 64)
    ref_codes = np.empty(wn.shape, np.int64)
    for j, c in enumerate(cols):
        ref_codes[:, c] = np.abs(wn[:, c, None] / ref_absmax[:, j, None, None] - table).argmin(-1)
    np.testing.assert_array_equal(codes.numpy(), ref_codes)
    deq = _qmath.dequantize_nf4(codes, torch.tensor(_qmath.NF4_VALUES), absmax, 64)
    ref = np.concatenate([table[ref_codes[:, c]] * ref_absmax[:, j:j + 1] for j, c in enumerate(cols)], 1)
    np.testing.assert_allclose(deq.double().numpy(), ref, rtol=1e-6)


class _MLP(torch.nn.Module):
    """576 -> 160 -> 32: groups of 128 leave remainders of 64 and 32."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(576, 160)
        self.down = torch.nn.Linear(160, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _count(gm, target) -> int:
    return sum(n.op == "call_function" and n.target == target for n in gm.graph.nodes)


def _sqnr(ref, got) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - got).norm()))


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    model, x = _MLP().eval(), torch.randn(3, 576)
    prepared = quantkit.prepare(quantkit.capture(model, (x,)), WeightOnlyQuantizer(bits=4, group_size=128))
    quantkit.calibrate(prepared, [x], progress=False)
    return model, x, quantkit.convert(prepared)


def test_convert_stores_remainder_groups_and_computes_the_reference(converted):
    model, x, qmodel = converted
    assert _count(qmodel, QK.dequantize_group.default) == 2 and _count(qmodel, GROUP_DQ) == 0
    assert _count(qmodel, QK.unpack_int4.default) == 2  # int4 packed two per byte
    # the converted model computes with the NumPy reference's dequantized weights
    w_up = _np_affine(model.up.weight.detach().double().numpy(), 128)[5]
    w_down = _np_affine(model.down.weight.detach().double().numpy(), 128)[5]
    h = np.maximum(x.double().numpy() @ w_up.T + model.up.bias.detach().double().numpy(), 0)
    np.testing.assert_allclose(qmodel(x).detach().double().numpy(), h @ w_down.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("int4_kernel", ["auto", "aten"])
def test_remainder_groups_lower_to_the_cpu_int4_kernels(converted, int4_kernel):
    _, x, qmodel = converted
    gm = copy.deepcopy(qmodel)
    assert lower_weight_only(gm, "cpu", int4_kernel=int4_kernel)["weight_only_int4"] == 2
    ours = int4_kernel == "auto" and int4_cpu_available()
    kernel = QK.int4_linear_cpu.default if ours else aten._weight_int4pack_mm_for_cpu.default
    assert _count(gm, kernel) == 2 and _count(gm, aten.linear.default) == 0
    assert _count(gm, QK.dequantize_group.default) == 0
    for batch in (x, torch.randn(1, 576), torch.randn(40, 576)):  # 40 rows: the kernel's prefill path
        assert _sqnr(qmodel(batch), gm(batch)) >= 40


def test_compile_runs_the_int4_kernel_on_remainder_groups(converted):
    _, x, qmodel = converted
    fast = quantkit.compile(qmodel)
    kernel = QK.int4_linear_cpu.default if int4_cpu_available() else aten._weight_int4pack_mm_for_cpu.default
    assert fast._orig_mod.meta["quantkit_lowering"]["weight_only_int4"] == 2
    assert _count(fast._orig_mod, kernel) == 2
    assert _sqnr(qmodel(x), fast(x)) >= 40


@pytest.mark.skipif(not int4_cpu_available(), reason="quantkit's int4 CPU kernel needs AVX512-VNNI")
@pytest.mark.parametrize("m", [1, 3, 40])
def test_int4_cpu_kernel_remainder_group_against_float64(m):
    from quantkit.kernels._int4_cpu import int4_linear_cpu, pack_int4_cpu

    g = torch.Generator().manual_seed(m)
    n, k, gs = 48, 200, 64  # 3 groups of 64 and one of 8
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, 4, generator=g) * 0.1 + 0.01
    zp = torch.randint(0, 16, (n, 4), generator=g).to(torch.int8)
    scale[:, 3] *= 30  # the short last group weighs as much as a full one
    x = torch.randn(m, k, generator=g)
    packed, sz = pack_int4_cpu(q, scale, zp, gs, signed=False)
    w = np.concatenate([(q[:, c].double().numpy() - zp[:, j:j + 1].double().numpy()) * scale[:, j:j + 1].double().numpy()
                        for j, c in enumerate(_np_groups(k, gs))], 1)
    ref = x.double().numpy() @ w.T
    got = int4_linear_cpu(x, packed, sz, gs).double().numpy()
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < (1e-2 if m >= 32 else 1e-4), rel  # from 32 rows on: bf16 activations and weights


def test_save_load_round_trip(converted, tmp_path):
    _, x, qmodel = converted
    quantkit.save(qmodel, tmp_path / "art")
    loaded = quantkit.load(tmp_path / "art")
    assert _count(loaded, QK.dequantize_group.default) == 2
    assert torch.equal(loaded(x), qmodel(x))
    mine = qmodel.state_dict()
    theirs = {k.removeprefix("model."): v for k, v in loaded.state_dict().items()}
    assert set(mine) <= set(theirs) and all(torch.equal(theirs[k], v) for k, v in mine.items())


def test_group_size_error_now_means_wider_than_the_layer():
    model, x = _MLP().eval(), torch.randn(2, 576)
    with pytest.raises(GroupSizeError) as info:
        quantkit.prepare(quantkit.capture(model, (x,)), WeightOnlyQuantizer(group_size=256))
    assert info.value.layers == (("down.weight", 160),)
    assert "fewer than group_size=256" in str(info.value) and "\n" not in str(info.value)


def test_gptq_refuses_a_remainder_group_in_one_line():
    model, x = _MLP().eval(), torch.randn(2, 576)
    with pytest.raises(GroupSizeError, match=r"^layer 'up.weight' has 576 input features, not a multiple of "
                                             r"group_size=128.*algorithm='gptq' rounds whole groups") as info:
        quantkit.prepare(quantkit.capture(model, (x,)), WeightOnlyQuantizer(group_size=128, algorithm="gptq"))
    assert info.value.algorithm == "gptq" and "\n" not in str(info.value)


# --- exports that cannot hold a remainder group -------------------------------------------------

@pytest.fixture(scope="module")
def llama_g64(tmp_path_factory):
    """A tiny Llama with hidden size 96 (MLP 192) in int4 groups of 64: 96 = 64 + 32."""
    pytest.importorskip("transformers")
    from quantkit import _hf
    from tests._ct_helpers import tiny_llama

    model, path, batches = tiny_llama(tmp_path_factory, hidden_size=96, n_batches=2)
    gm = quantkit.capture(model, batches[0], dynamic_shapes=_hf.dynamic_shapes(batches[0]))
    prepared = quantkit.prepare(gm, WeightOnlyQuantizer(bits=4, group_size=64).set_module_name("lm_head", None))
    quantkit.calibrate(prepared, batches[:1], progress=False)
    return path, batches, quantkit.convert(prepared)


def test_compressed_tensors_refuses_a_remainder_group(llama_g64, tmp_path):
    pytest.importorskip("compressed_tensors")
    path, batches, qmodel = llama_g64
    out = tmp_path / "ct"
    with pytest.raises(quantkit.QuantkitError) as err:
        quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], float_dtype="float32",
                                           engine="transformers")
    msg = str(err.value)
    assert "\n" not in msg and not out.exists(), msg
    assert msg.startswith("compressed-tensors cannot express a remainder group (96 input features in groups of 64 "
                          "leave a last group of 32) (model.layers.0.self_attn."), msg
    assert "a group size that divides 96, e.g. 32 or 16" in msg, msg


def test_gguf_refuses_a_remainder_group(llama_g64, tmp_path):
    pytest.importorskip("gguf")
    path, _, qmodel = llama_g64
    out = tmp_path / "x.gguf"
    with pytest.raises(quantkit.QuantkitError) as err:
        quantkit.export_gguf(qmodel, out, model=path)
    msg = str(err.value)
    assert "\n" not in msg and not out.exists(), msg
    assert msg.startswith("GGUF cannot hold model.layers.0.self_attn."), msg
    assert "a remainder group (96 input features in groups of 64 leave a last group of 32)" in msg, msg
