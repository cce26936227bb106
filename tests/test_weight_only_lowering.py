"""Lowering of weight-only layers (quantkit/lowering/_weight_only.py): op counts and numerics
against the reference q/dq graph (SQNR >= 40 dB, the issue's bar)."""

from __future__ import annotations

import copy

import pytest
import torch

import quantkit
from quantkit.kernels import int4_cpu_available
from quantkit.lowering._weight_only import has_quant_ops, lower_weight_only
from quantkit.quantizers import WeightOnlyQuantizer

aten = torch.ops.aten


class _Block(torch.nn.Module):
    def __init__(self, d=256, h=512) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _sqnr_db(ref, out) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - out).norm()))


def _converted(quantizer, x):
    model = _Block().eval()
    prepared = quantkit.prepare(quantkit.capture(model, (x,)), quantizer)
    quantkit.calibrate(prepared, [x], progress=False)
    return quantkit.convert(prepared)


_HAS_QK_INT4 = int4_cpu_available()
_QK_INT4 = torch.ops.quantkit.int4_linear_cpu.default
_needs_qk_int4 = pytest.mark.skipif(not _HAS_QK_INT4, reason="quantkit's int4 CPU kernel needs AVX512-VNNI")


@pytest.mark.parametrize("kwargs,int4_kernel,kernel,key", [
    (dict(bits=4, group_size=128), "aten", aten._weight_int4pack_mm_for_cpu.default, "weight_only_int4"),
    (dict(bits=4, group_size=32, symmetric=True), "aten", aten._weight_int4pack_mm_for_cpu.default, "weight_only_int4"),
    pytest.param(dict(bits=4, group_size=128), "quantkit", _QK_INT4, "weight_only_int4", marks=_needs_qk_int4),
    pytest.param(dict(bits=4, group_size=32, symmetric=True), "quantkit", _QK_INT4, "weight_only_int4",
                 marks=_needs_qk_int4),
    pytest.param(dict(bits=4, group_size=16), "auto", _QK_INT4, "weight_only_int4", marks=_needs_qk_int4),
    (dict(bits=8, group_size=None, symmetric=True), "auto", aten._weight_int8pack_mm.default, "weight_only_int8"),
])
def test_cpu_lowering_counts_and_numerics(kwargs, int4_kernel, kernel, key):
    x = torch.randn(2, 5, 256)  # 3-D input: reshaped to 2-D around the kernel
    ref = _converted(WeightOnlyQuantizer(**kwargs), x)
    gm = copy.deepcopy(ref)
    counts = lower_weight_only(gm, "cpu", int4_kernel=int4_kernel)
    assert counts[key] == 2 and sum(counts.values()) == 2
    assert _count(gm, kernel) == 2
    assert _count(gm, aten.linear.default) == 0
    assert _count(gm, torch.ops.quantized_decomposed.dequantize_per_channel_group.default) == 0
    assert _count(gm, torch.ops.quantkit.unpack_int4.default) == 0
    for batch in (x, torch.randn(3, 5, 256), torch.randn(1, 5, 256)):  # batch stays dynamic
        db = _sqnr_db(ref(batch), gm(batch))
        assert db >= 40, f"{kwargs}: lowered vs q/dq reference {db:.1f} dB"
    # only the kernel's packed weights remain: no unpacked/float copy of the weights
    assert not any(n.startswith("_frozen_param") for n, _ in gm.named_buffers())


@_needs_qk_int4
def test_quantkit_int4_kernel_is_closer_to_the_reference_than_aten():
    # aten rounds activations to bf16; quantkit's kernel keeps ~15 bits per group
    x = torch.randn(4, 256)
    ref = _converted(WeightOnlyQuantizer(bits=4, group_size=64), x)
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    lower_weight_only(ours, "cpu", int4_kernel="quantkit")
    lower_weight_only(theirs, "cpu", int4_kernel="aten")
    assert _sqnr_db(ref(x), ours(x)) >= 80 > _sqnr_db(ref(x), theirs(x))


def test_unknown_int4_kernel_is_refused():
    gm = _converted(WeightOnlyQuantizer(bits=4, group_size=64), torch.randn(2, 256))
    with pytest.raises(ValueError, match="unknown int4_kernel 'fast'"):
        lower_weight_only(gm, "cpu", int4_kernel="fast")


def test_unsupported_layers_keep_reference():
    x = torch.randn(4, 256)
    for quantizer in (WeightOnlyQuantizer(scheme="nf4", group_size=64),          # NF4: reference path
                      WeightOnlyQuantizer(bits=8, group_size=64, symmetric=True),  # int8 groups: reference
                      WeightOnlyQuantizer(bits=4, group_size=16)):                 # group 16: no aten kernel
        ref = _converted(quantizer, x)
        gm = copy.deepcopy(ref)
        assert sum(lower_weight_only(gm, "cpu", int4_kernel="aten").values()) == 0
        assert _count(gm, aten.linear.default) == 2
        torch.testing.assert_close(gm(x), ref(x), atol=0, rtol=0)


def test_quantkit_compile_lowers_int4():
    x = torch.randn(3, 256)
    ref = _converted(WeightOnlyQuantizer(bits=4, group_size=128), x)
    fast = quantkit.compile(ref)
    out = fast(x)
    counts = fast._orig_mod.meta["quantkit_lowering"]
    assert counts["weight_only_int4"] == 2
    assert _sqnr_db(ref(x), out) >= 40
    # one kernel per layer, no q/dq left, so no per-call freezing wrapper around the compiled graph
    kernel = _QK_INT4 if _HAS_QK_INT4 else aten._weight_int4pack_mm_for_cpu.default
    assert _count(fast._orig_mod, kernel) == 2
    assert not has_quant_ops(fast._orig_mod)
    assert not isinstance(fast, quantkit.lowering._compile._Frozen)


def test_has_quant_ops_sees_reference_layers():
    x = torch.randn(4, 256)
    nf4 = _converted(WeightOnlyQuantizer(scheme="nf4", group_size=64), x)  # no CPU kernel: keeps its dequantize
    int4 = _converted(WeightOnlyQuantizer(bits=4, group_size=64), x)
    assert has_quant_ops(nf4) and has_quant_ops(int4)
    lower_weight_only(nf4, "cpu")
    lower_weight_only(int4, "cpu")
    assert has_quant_ops(nf4) and not has_quant_ops(int4)


def test_cuda_lowering_rewrites_to_w4a16_op():
    # the rewrite itself is device independent: the op's CPU implementation runs the rewritten graph here
    x = torch.randn(2, 3, 256)
    ref = _converted(WeightOnlyQuantizer(bits=4, group_size=64, symmetric=True), x)
    gm = copy.deepcopy(ref)
    assert lower_weight_only(gm, "cuda")["weight_only_int4"] == 2
    assert _count(gm, torch.ops.quantkit.w4a16_linear.default) == 2 and _count(gm, aten.linear.default) == 0
    assert _sqnr_db(ref(x), gm(x)) >= 80  # same dequantized weights, fp32 matmul on CPU
