"""The per_token_quant_fuse lowering (lowering/_per_token_fuse.py): which chains it replaces (op counts),
the program it writes, and the lowered graph's output against the same graph lowered without it."""

import copy

import pytest
import torch
from torch import nn

import quantkit
from quantkit.kernels import _per_token_quant_cpu
from quantkit.lowering import _per_token_fuse
from quantkit.lowering._lower import Target
from quantkit.lowering._registry import LoweringContext, registered_lowerings, run_lowerings
from quantkit.quantizers import QuantConfig, W8A8Quantizer

pytestmark = pytest.mark.skipif(not _per_token_quant_cpu.available(), reason="per_token_quant_cpu does not build here")
PER_TOKEN = QuantConfig(dynamic=True, granularity="per-token")
KERNEL = torch.ops.quantkit.per_token_quant_cpu.default
aten = torch.ops.aten


class _MLP(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(64, 128), nn.Linear(128, 32), act

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _converted(model, x):
    p = quantkit.prepare(quantkit.capture(model.eval(), (x[:2],)), W8A8Quantizer(PER_TOKEN))
    quantkit.calibrate(p, [(b,) for b in x.split(4)], progress=False)
    return quantkit.convert(p)


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def test_registered_after_the_bf16_passes():
    p = next(p for p in registered_lowerings() if p.name == "per_token_quant_fuse")
    bf16 = max(q.order for q in registered_lowerings() if q.name in ("bf16", "float_layers_bf16"))
    assert p.order > bf16 and p.devices == ("cpu",)


@pytest.mark.parametrize("act, step", [(nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), "gelu_tanh"),
                                       (nn.ReLU(), "relu")])
def test_gemm_epilogue_and_activation_fused(act, step):
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    c = _converted(_MLP(act), x)
    gm = copy.deepcopy(c)
    ctx = LoweringContext("cpu", Target.ONEDNN, "auto", torch.float32, "scaled_mm", requested_float_dtype="fp32")
    ref = copy.deepcopy(c)
    counts = run_lowerings(gm, ctx)
    assert counts["per_token_quant_fused"] == 1
    calls = [n for n in gm.graph.nodes if n.target == KERNEL]
    assert len(calls) == 1 and calls[0].args[4] == ["mul_row", "add_col", step]
    assert calls[0].args[0].target is aten.linear.default  # reads the up GEMM's int32-product output
    # the activation and the second quantize chain are gone: one amax left (the first GEMM's input)
    assert _count(gm, aten.amax.default) == 1
    assert _count(gm, aten.gelu.default) + _count(gm, aten.relu.default) == 0
    # against the converted reference q/dq graph (torch's own per-token ops, ATen's erf)
    with torch.no_grad():
        y, y_ref = gm(x), ref(x)
    rel = float((y.double() - y_ref.double()).norm() / y_ref.double().norm())
    assert rel < 5e-3


def test_bare_quantize_left_to_inductor():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    c = _converted(nn.Sequential(nn.Linear(64, 32)), x)
    gm = copy.deepcopy(c)
    ctx = LoweringContext("cpu", Target.ONEDNN, "auto", torch.float32, "scaled_mm", requested_float_dtype="fp32")
    assert run_lowerings(gm, ctx).get("per_token_quant_fused", 0) == 0 and _count(gm, KERNEL) == 0


def test_compiled_matches_eager():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    c = _converted(_MLP(nn.GELU()), x)
    out = quantkit.compile(c)
    with torch.no_grad():
        y, y_ref = out(x), c(x)
    assert float((y.double() - y_ref.double()).norm() / y_ref.double().norm()) < 5e-3


@pytest.mark.parametrize("act", [nn.GELU(), nn.ReLU()])
def test_same_output_as_the_unfused_lowering(act, monkeypatch):
    """The fused graph computes what the graph lowered without the pass computes (Inductor-free, eager):
    the same GEMMs, the prologue once instead of twice; an integer may move by one level where erf's
    polynomial lands a value at a rounding boundary, so the outputs agree to far better than int8 noise."""
    torch.manual_seed(1)
    x = torch.randn(48, 64) * 3
    c = _converted(_MLP(act), x)
    ctx = LoweringContext("cpu", Target.ONEDNN, "auto", torch.float32, "scaled_mm", requested_float_dtype="fp32")
    fused, plain = copy.deepcopy(c), copy.deepcopy(c)
    assert run_lowerings(fused, ctx)["per_token_quant_fused"] == 1
    monkeypatch.setattr(_per_token_quant_cpu, "available", lambda: False)
    assert run_lowerings(plain, ctx).get("per_token_quant_fused", 0) == 0
    with torch.no_grad():
        y, y_plain, y_ref = fused(x).double(), plain(x).double(), c(x).double()
    assert _count(plain, KERNEL) == 0 and _count(plain, aten.amax.default) == 2
    assert float((y - y_plain).norm() / y_plain.norm()) < 1e-4
    # and both are int8-close to the reference q/dq graph, which neither pass touched
    assert float((y - y_ref).norm() / y_ref.norm()) < 5e-3
