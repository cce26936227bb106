"""Quantization-aware training: prepare_qat, FakeQuantize (STE, LSQ/LSQ+), train/eval switching,
simulated conv-BN folding, convert to the PTQ artifact, interop with torchao, bit widths."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchao.quantization.pt2e.fake_quantize import FakeQuantizeBase

import quantkit
from quantkit.observers import MinMaxObserver, PerChannelMinMaxObserver
from quantkit.observers._fake_quant import FakeQuantize
from quantkit.quantizers import QuantConfig, W8A8Quantizer

_OPS = torch.ops.quantized_decomposed
aten = torch.ops.aten


class _ConvBN(nn.Module):
    """conv → BN → relu twice, a linear head: the pattern QAT folds by simulation."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 6, 3, bias=False), nn.BatchNorm2d(6)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(6 * 6 * 6, 5)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(self.drop(torch.flatten(x, 1)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _conv_bn(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    m = _ConvBN(dropout)
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for bn in (m.bn1, m.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    return m.eval()


def _x(shape=(8, 1, 8, 8), seed=1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fqs(gm):
    return [m for m in gm.modules() if isinstance(m, FakeQuantizeBase)]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _sqnr(ref, out) -> float:
    return quantkit.metrics.sqnr(ref, out) if hasattr(quantkit.metrics, "sqnr") else quantkit._qmath.sqnr(ref, out)


def _train(qat, x, steps=3, lr=0.05):
    opt = torch.optim.SGD(qat.parameters(), lr=lr)
    for i in range(steps):
        opt.zero_grad()
        qat(x + 0.1 * i).square().mean().backward()
        opt.step()


# --- forward numerics ---------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [(8, 8), (4, 8)])
@pytest.mark.parametrize("kind", ["mlp-train", "convbn-eval"])
def test_fresh_qat_forward_equals_ptq_fake_quant(kind, bits):
    """A freshly prepared QAT model computes what PTQ calibrated on the same batch computes."""
    torch.manual_seed(0)
    model, x = (_mlp().eval(), _x((8, 16))) if kind == "mlp-train" else (_conv_bn(), _x())
    config = QuantConfig(weight_bits=bits[0], activation_bits=bits[1])
    gm = quantkit.capture(model, (x,))
    qat = quantkit.prepare_qat(gm, W8A8Quantizer(config))
    if kind == "convbn-eval":
        qat.eval()  # batch norm on running statistics, as PTQ folds it
    with torch.no_grad():
        out = qat(x)
    prepared = quantkit.prepare(gm, W8A8Quantizer(config))
    quantkit.calibrate(prepared, [(x,)], progress=False)
    ptq = quantkit.convert(prepared)
    with torch.no_grad():
        ref = ptq(x)
    # QAT observes activations computed with fake-quantized inputs and weights, PTQ the float ones
    assert _sqnr(ref, out) >= 40, _sqnr(ref, out)
    assert len([m for m in _fqs(qat)]) >= 3


# --- FakeQuantize: STE and LSQ / LSQ+ gradients against the papers' formulas ----------------------

def _lsq_reference(x, s, z, qmin, qmax):
    """Values and gradients of LSQ (Esser et al. 2020, eq. 1-3) and LSQ+'s offset (Bhalgat et al.
    2020), per tensor, written out element by element in float64: v = x/s + z rounded and clipped."""
    x64, s64 = x.double(), float(s)
    v = torch.round(x64 * (1.0 / s64)) + z
    inside = (v >= qmin) & (v <= qmax)
    q = v.clamp(qmin, qmax)
    out = (q - z) * s64
    dout_ds = torch.where(inside, torch.round(x64 / s64) - x64 / s64, q - z)
    dout_dz = torch.where(inside, torch.zeros_like(x64), torch.full_like(x64, -s64))
    g = 1.0 / (x.numel() * qmax) ** 0.5
    return out, inside.double(), g * dout_ds, g * dout_dz


@pytest.mark.parametrize("affine", [False, True])
def test_lsq_gradients_match_the_paper(affine):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, generator=gen) * 2
    if affine:
        obs = MinMaxObserver(dtype=torch.uint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=15)
    else:
        obs = MinMaxObserver(dtype=torch.int8, qscheme=torch.per_tensor_symmetric, quant_min=-8, quant_max=7)
    fq = FakeQuantize(obs, learnable=True)
    fq(x * 0.5)  # initialise from a narrower batch, so that x below clips on both sides
    s, z = float(fq.scale), float(torch.round(fq.zero_point.detach()))
    assert isinstance(fq.scale, nn.Parameter) and isinstance(fq.zero_point, nn.Parameter) == affine
    xr = x.clone().requires_grad_(True)
    upstream = torch.randn(64, generator=gen)
    out = fq(xr)
    (out * upstream).sum().backward()
    ref, dx, ds, dz = _lsq_reference(x, s, z, obs.quant_min, obs.quant_max)
    assert 0 < dx.sum() < 64  # some elements clip
    assert torch.allclose(out.double(), ref, atol=1e-6)
    assert torch.allclose(xr.grad.double(), upstream.double() * dx)
    assert torch.allclose(fq.scale.grad.double(), (upstream.double() * ds).sum().reshape(1), rtol=1e-4, atol=1e-7)
    if affine:
        assert torch.allclose(fq.zero_point.grad.double(), (upstream.double() * dz).sum().reshape(1), rtol=1e-4, atol=1e-7)


def test_fake_quantize_observes_in_training_only_and_freezes_after_n_steps():
    obs = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8, qscheme=torch.per_channel_symmetric)
    fq = FakeQuantize(obs, freeze_after=2)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    fq(x)
    s1 = fq.calculate_qparams()[0].clone()
    assert torch.allclose(s1, x.abs().amax(1) / 127.5)  # symmetric int8: amax / ((127 + 128) / 2)
    fq(2 * x)
    assert torch.allclose(fq.calculate_qparams()[0], 2 * s1)
    fq(4 * x)  # third step: frozen after two
    assert torch.allclose(fq.calculate_qparams()[0], 2 * s1)
    fq2 = FakeQuantize(PerChannelMinMaxObserver(ch_axis=0, dtype=torch.int8, qscheme=torch.per_channel_symmetric))
    fq2(x)
    fq2.eval()
    out = fq2(4 * x)
    assert torch.allclose(fq2.calculate_qparams()[0], s1)  # eval: frozen
    assert torch.equal(out, torch.fake_quantize_per_channel_affine(4 * x, s1, torch.zeros(3, dtype=torch.int32), 0, -128, 127))


# --- training ------------------------------------------------------------------------------------

def test_gradients_reach_weights_and_learnable_scales():
    model, x = _conv_bn(), _x()
    qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), W8A8Quantizer(QuantConfig(learnable_ranges=True)))
    scales = {n: p for n, p in qat.named_parameters() if n.endswith(".scale")}
    assert len(scales) == 6  # the inputs and weights of conv1, conv2 and head
    before = {n: p.detach().clone() for n, p in qat.named_parameters()}
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    opt.zero_grad()
    qat(x).square().mean().backward()
    for name in ("conv1.weight", "conv2.weight", "head.weight", "bn1.weight", "bn2.weight", *scales):
        p = dict(qat.named_parameters())[name]
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    opt.step()
    changed = [n for n, p in qat.named_parameters() if not torch.equal(p, before[n])]
    assert set(scales) <= set(changed) and "head.weight" in changed
    # the captured model's (and the user's) parameters are untouched
    assert torch.equal(model.conv1.weight, dict(quantkit.capture(model, (x,)).named_parameters())["conv1.weight"])


def test_batch_norm_trains_like_eager_and_freezes_in_eval():
    """Fake quantization off, the QAT graph in .train() is the eager model in .train(): same outputs,
    same running statistics afterwards; .eval() uses them and updates nothing."""
    model, x = _conv_bn(), _x()
    qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), W8A8Quantizer())
    for fq in _fqs(qat):
        fq.disable_fake_quant()
    eager = copy.deepcopy(model).train()
    for i in range(2):
        assert torch.allclose(qat(x + i), eager(x + i), atol=1e-5)
    assert torch.allclose(qat.get_buffer("bn1.running_mean"), eager.bn1.running_mean, atol=1e-6)
    assert torch.allclose(qat.get_buffer("bn2.running_var"), eager.bn2.running_var, atol=1e-6)
    assert not torch.equal(eager.bn1.running_mean, model.bn1.running_mean)
    qat.eval()
    eager.eval()
    stats = qat.get_buffer("bn2.running_mean").clone()
    assert torch.allclose(qat(x * 3), eager(x * 3), atol=1e-5)
    assert torch.equal(qat.get_buffer("bn2.running_mean"), stats)
    bns = [n for n in qat.graph.nodes if n.target is aten.batch_norm.default]
    assert len(bns) == 2 and all(n.args[5] is False for n in bns)
    qat.train()
    assert all(n.args[5] is True for n in bns)


def test_train_eval_switch_dropout_and_fake_quant_observers():
    model, x = _conv_bn(dropout=0.5), _x()
    qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), W8A8Quantizer())
    torch.manual_seed(0)
    a, b = qat(x), qat(x)
    assert not torch.equal(a, b)  # dropout is live in training
    qat.eval()
    scales = [fq.calculate_qparams()[0].clone() for fq in _fqs(qat)]
    c, d = qat(x * 5), qat(x * 5)
    assert torch.equal(c, d)
    assert all(torch.equal(s, fq.calculate_qparams()[0]) for s, fq in zip(scales, _fqs(qat)))
    qat.train()
    qat(x * 5)
    assert any(not torch.equal(s, fq.calculate_qparams()[0]) for s, fq in zip(scales, _fqs(qat)))


def test_freeze_observers_after_n_steps():
    model, x = _mlp().eval(), _x((8, 16))
    qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), W8A8Quantizer(), freeze_observers_after=2)
    qat(x)
    qat(x)
    frozen = [fq.calculate_qparams()[0].clone() for fq in _fqs(qat)]
    qat(10 * x)
    assert all(torch.equal(s, fq.calculate_qparams()[0]) for s, fq in zip(frozen, _fqs(qat)))


# --- convert -----------------------------------------------------------------------------------

@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("bits", [(8, 8), (4, 8)])
def test_convert_after_qat_equals_eval_fake_quant(learnable, bits, tmp_path):
    model, x = _conv_bn(), _x()
    config = QuantConfig(weight_bits=bits[0], activation_bits=bits[1], learnable_ranges=learnable)
    qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), W8A8Quantizer(config))
    _train(qat, x)
    qat.eval()
    with torch.no_grad():
        ref = qat(x)
    qmodel = quantkit.convert(qat)
    with torch.no_grad():
        out = qmodel(x)
    assert _sqnr(ref, out) >= 35, _sqnr(ref, out)
    targets = _targets(qmodel)
    assert aten.batch_norm.default not in targets  # folded for good
    assert targets.count(_OPS.dequantize_per_channel.default) == 3  # conv1, conv2, head weights
    assert targets.count(_OPS.quantize_per_tensor.default) == 3  # conv1, conv2, head inputs
    lo = -(2 ** (bits[0] - 1))
    weights = [b for n, b in qmodel.named_buffers() if n.startswith("_frozen_param")]
    assert len(weights) == 3 and all(w.dtype == torch.int8 and lo <= int(w.min()) and int(w.max()) <= -lo - 1
                                     for w in weights)
    quantkit.save(qmodel, tmp_path / "qat")
    loaded = quantkit.load(tmp_path / "qat")
    assert torch.equal(loaded(x), out)


def test_training_a_converted_model_is_refused():
    model, x = _mlp().eval(), _x((8, 16))
    qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), W8A8Quantizer())
    qat(x)
    qmodel = quantkit.convert(qat)
    with pytest.raises(quantkit.ConvertError, match="converted .* cannot be trained; train the model from quantkit.prepare_qat"):
        qmodel.train()
    with pytest.raises(quantkit.ConvertError, match="converted"):
        quantkit.prepare_qat(qmodel, W8A8Quantizer())


def test_prepare_qat_refuses_a_model_that_is_not_exported():
    model = _mlp()
    with pytest.raises(quantkit.CaptureError, match=r"got Sequential; call quantkit.capture\(model, example_inputs\) first"):
        quantkit.prepare_qat(model, W8A8Quantizer())
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(quantkit.CaptureError, match="captured model"):
        quantkit.prepare_qat(gm, W8A8Quantizer())


@pytest.mark.parametrize("bad", [1, 9, 4.0, True])
def test_bit_widths_are_validated(bad):
    with pytest.raises(ValueError, match="weight_bits must be an integer from 2 to 8"):
        QuantConfig(weight_bits=bad)
    with pytest.raises(ValueError, match="activation_bits must be an integer from 2 to 8"):
        QuantConfig(activation_bits=bad)


def test_ptq_honours_bit_widths():
    """PTQ at W3A5: the q/dq ops carry the reduced ranges, and the weights are the symmetric 3-bit
    per-channel rounding computed here by hand."""
    torch.manual_seed(0)
    model, x = _mlp().eval(), _x((8, 16))
    qmodel = quantkit.quantize(model, (x,), [(x,)], W8A8Quantizer(QuantConfig(weight_bits=3, activation_bits=5)),
                               progress=False)
    ranges = {(n.args[3], n.args[4]) for n in qmodel.graph.nodes if n.target == _OPS.quantize_per_tensor.default}
    assert ranges == {(0, 31)}
    deq = [n for n in qmodel.graph.nodes if n.target == _OPS.dequantize_per_channel.default]
    assert {(n.args[4], n.args[5]) for n in deq} == {(-4, 3)}
    w = model[0].weight.detach()
    scale = w.abs().amax(1, keepdim=True) / 3.5  # amax / ((qmax - qmin) / 2), in float32 as torch computes
    ref = (torch.round(w * (1.0 / scale)).clamp(-4, 3) * scale).double()
    q = qmodel.get_buffer(str(deq[0].args[0].target)) if deq[0].args[0].op == "get_attr" else None
    s = qmodel.get_buffer(str(deq[0].args[1].target))
    got = {tuple(qmodel.get_buffer(str(n.args[0].target)).shape): qmodel.get_buffer(str(n.args[0].target)).double()
           * qmodel.get_buffer(str(n.args[1].target)).double()[:, None] for n in deq}
    assert q is not None and s.numel() == 32
    assert torch.allclose(got[(32, 16)], ref, atol=1e-6)


@pytest.mark.parametrize("symmetric", [False, True])
def test_group_wise_int4_weight_only_qat(symmetric):
    """WeightOnlyQuantizer's int4 group-wise weights train with fake quantization (round to nearest per
    group, straight-through gradient) and convert to packed int4 computing the same outputs."""
    from quantkit.quantizers import WeightOnlyQuantizer

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval(), _x((16, 64))
    qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), WeightOnlyQuantizer(bits=4, group_size=16,
                                                                                  symmetric=symmetric))
    assert len([f for f in _fqs(qat) if isinstance(f, FakeQuantize)]) == 2
    w = model[0].weight.detach()  # fake quantization of the first weight, per group of 16, by hand
    g = w.reshape(32, 4, 16)
    if symmetric:
        scale = g.abs().amax(-1, keepdim=True) / 7.5
        ref = (torch.round(g * (1.0 / scale)).clamp(-8, 7) * scale).reshape(32, 64)
    else:
        lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / 15
        zp = torch.round(-lo / scale)
        ref = ((torch.round(g * (1.0 / scale)) + zp).clamp(0, 15) - zp).mul(scale).reshape(32, 64)
    fq = qat.get_submodule(str(next(n for n in qat.graph.nodes if n.op == "call_module"
                                    and n.args[0].op == "get_attr" and n.args[0].target == "0.weight").target))
    assert torch.allclose(fq(w), ref, atol=1e-6)
    _train(qat, x)
    assert dict(qat.named_parameters())["0.weight"].grad.abs().sum() > 0
    qat.eval()
    with torch.no_grad():
        ref_out = qat(x)
    qmodel = quantkit.convert(qat)
    assert _targets(qmodel).count(_OPS.dequantize_per_channel_group.default) == 2
    with torch.no_grad():
        assert _sqnr(ref_out, qmodel(x)) >= 35


def test_nf4_qat_is_refused():
    from quantkit.quantizers import WeightOnlyQuantizer

    model, x = nn.Sequential(nn.Linear(64, 8)).eval(), _x((4, 64))
    with pytest.raises(ValueError, match="NF4 weights cannot be fake-quantized for QAT; use the int4 scheme"):
        quantkit.prepare_qat(quantkit.capture(model, (x,)), WeightOnlyQuantizer(bits=4, group_size=16, scheme="nf4"))


# --- interop ---------------------------------------------------------------------------------------

def test_quantkit_prepare_qat_accepts_torchao_x86_qat_quantizer():
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer, get_default_x86_inductor_quantization_config)

    model, x = _conv_bn(), _x()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=True))
    qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), quantizer)
    fqs = _fqs(qat)
    assert fqs and not any(isinstance(f, FakeQuantize) for f in fqs)  # torchao's own fake quantizers
    _train(qat, x)
    qat.eval()
    assert all(int(f.observer_enabled[0]) == 0 for f in fqs)
    with torch.no_grad():
        ref = qat(x)
    qmodel = quantkit.convert(qat)
    with torch.no_grad():
        # torchao's fused fake-quant kernel and the quantize ops round a few ties differently; the
        # X86 config quantizes both the batch norm and the relu outputs, so such flips compound
        assert _sqnr(ref, qmodel(x)) >= 25
    assert aten.batch_norm.default not in _targets(qmodel)
    assert _targets(qmodel).count(_OPS.dequantize_per_channel.default) == 3


def test_torchao_prepare_qat_pt2e_accepts_quantkit_quantizer():
    from torchao.quantization.pt2e import move_exported_model_to_eval, move_exported_model_to_train
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    torch.manual_seed(0)
    model, x = _mlp().eval(), _x((8, 16))  # no conv-BN: torchao's QAT conv-BN matcher takes minutes on 2 cores
    gm = torch.export.export(model, (x,)).module()
    qat = prepare_qat_pt2e(gm, W8A8Quantizer(QuantConfig(qat=True, weight_bits=4, learnable_ranges=True)))
    fqs = _fqs(qat)
    assert len(fqs) == 4 and all(isinstance(f, FakeQuantize) for f in fqs)
    move_exported_model_to_train(qat)
    _train(qat, x)
    move_exported_model_to_eval(qat)
    for f in fqs:
        f.eval()  # torchao's switch leaves module flags alone: freeze the observers ourselves
    with torch.no_grad():
        ref = qat(x)
    qmodel = convert_pt2e(qat)
    with torch.no_grad():
        assert _sqnr(ref, qmodel(x)) >= 35
    deq = [n for n in qmodel.graph.nodes if n.target == _OPS.dequantize_per_channel.default]
    assert len(deq) == 2 and {(n.args[4], n.args[5]) for n in deq} == {(-8, 7)}
