"""quantkit.prepare/convert against torchao's prepare_pt2e/convert_pt2e on the same quantizer and data."""

import copy

import pytest
import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

import quantkit
from quantkit.quantizers import W8A8Quantizer
from tests.models import make_catpool, make_cnn, make_mlp, make_mobile, make_transformer

MODELS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer,
          # depthwise conv, hardswish/ReLU6, squeeze-excite; cat, max/avg pool, transposed conv + BN
          "mobile": make_mobile, "catpool": make_catpool}


def _x86():
    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())


def _both(make, quantizer_factory):
    model, x = make()
    calib = [(b,) for b in x.split(32)]
    ours = quantkit.prepare(quantkit.capture(model, (x[:8],)), quantizer_factory())
    for b in calib:
        ours(*b)
    ours = quantkit.convert(ours)
    theirs = prepare_pt2e(quantkit.capture(copy.deepcopy(model), (x[:8],)), quantizer_factory())
    for b in calib:
        theirs(*b)
    theirs = convert_pt2e(theirs)
    return ours, theirs, x


def _qdq_counts(gm):
    counts = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target.__module__ and "quantized_decomposed" in str(n.target):
            key = str(n.target).split(".")[1]
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("name", list(MODELS))
def test_x86_quantizer_matches_torchao(name):
    ours, theirs, x = _both(MODELS[name], _x86)
    with torch.no_grad():
        diff = (ours(x) - theirs(x)).abs().max().item()
    assert diff <= 1e-6, f"{name}: max abs diff {diff:.3g} between quantkit and torchao"
    assert _qdq_counts(ours) == _qdq_counts(theirs)


@pytest.mark.parametrize("name", list(MODELS))
def test_quantkit_quantizer_works_with_torchao_flow(name):
    ours, theirs, x = _both(MODELS[name], lambda: W8A8Quantizer())
    with torch.no_grad():
        diff = (ours(x) - theirs(x)).abs().max().item()
    assert diff <= 1e-6, f"{name}: max abs diff {diff:.3g}"
    assert _qdq_counts(ours) == _qdq_counts(theirs)


class _SpecZoo(torch.nn.Module):
    """Graph input, a weighted op with an int32 bias, a shared-qparams cat, a sigmoid
    with fixed qparams, and a quantized graph output."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        z = torch.cat([y, x], dim=1)
        return torch.sigmoid(z)


class _ZooQuantizer:
    """Exercises every spec kind and node kind: placeholder output, edge specs,
    SharedQuantizationSpec, DerivedQuantizationSpec and FixedQParamsQuantizationSpec."""

    def __new__(cls):
        from quantkit.quantizers import (
            DerivedQuantizationSpec,
            FixedQParamsQuantizationSpec,
            QuantizationAnnotation,
            QuantizationSpec,
            Quantizer,
            SharedQuantizationSpec,
        )
        from quantkit.observers import MinMaxObserver, PerChannelMinMaxObserver

        act = QuantizationSpec(dtype=torch.uint8, quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine,
                               observer_or_fake_quant_ctr=MinMaxObserver)
        wt = QuantizationSpec(dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric,
                              ch_axis=0, observer_or_fake_quant_ctr=PerChannelMinMaxObserver)

        class Zoo(Quantizer):
            def annotate(self, gm):
                for n in gm.graph.nodes:
                    if n.op == "placeholder":
                        n.meta["quantization_annotation"] = QuantizationAnnotation(output_qspec=act, _annotated=True)
                    elif n.target == torch.ops.aten.linear.default:
                        x, w, b = n.args

                        def derive(obs):
                            s_a, _ = obs[0].calculate_qparams()
                            s_w, _ = obs[1].calculate_qparams()
                            return s_a * s_w, torch.zeros_like(s_w, dtype=torch.int64)

                        bias = DerivedQuantizationSpec(
                            derived_from=[(x, n), (w, n)], derive_qparams_fn=derive, dtype=torch.int32,
                            quant_min=-(2**31), quant_max=2**31 - 1, qscheme=torch.per_channel_symmetric, ch_axis=0)
                        n.meta["quantization_annotation"] = QuantizationAnnotation(
                            input_qspec_map={x: act, w: wt, b: bias}, output_qspec=act, _annotated=True)
                    elif n.target == torch.ops.aten.cat.default:
                        a, b = n.args[0]
                        n.meta["quantization_annotation"] = QuantizationAnnotation(
                            input_qspec_map={a: act, b: SharedQuantizationSpec((a, n))},
                            output_qspec=SharedQuantizationSpec((a, n)), _annotated=True)
                    elif n.target == torch.ops.aten.sigmoid.default:
                        fixed = FixedQParamsQuantizationSpec(dtype=torch.uint8, scale=1 / 256, zero_point=0,
                                                             quant_min=0, quant_max=255,
                                                             qscheme=torch.per_tensor_affine)
                        n.meta["quantization_annotation"] = QuantizationAnnotation(
                            input_qspec_map={n.args[0]: SharedQuantizationSpec(n.args[0])},
                            output_qspec=fixed, _annotated=True)
                    elif n.op == "output":
                        n.meta["quantization_annotation"] = QuantizationAnnotation(
                            input_qspec_map={n.args[0][0]: act}, _annotated=True)
                return gm

            def validate(self, gm):
                pass

        return Zoo()


def test_every_spec_kind_matches_torchao():
    torch.manual_seed(0)
    model = _SpecZoo().eval()
    x = torch.randn(64, 8)
    ours, theirs, _ = _both(lambda: (model, x), _ZooQuantizer)
    with torch.no_grad():
        a, b = ours(x), theirs(x)
    assert (a - b).abs().max().item() <= 1e-6
    assert _qdq_counts(ours) == _qdq_counts(theirs)
    counts = _qdq_counts(ours)
    # int32 bias folded (dequantize only), fixed-qparams sigmoid output, quantized graph input
    assert counts["dequantize_per_channel"] == 2
    q_scales = [n.args[1] for n in ours.graph.nodes if n.target == torch.ops.quantized_decomposed.quantize_per_tensor.default]
    fixed_sigmoid_scale = 1 / 256  # the FixedQParamsQuantizationSpec's scale must reach the graph
    assert fixed_sigmoid_scale in q_scales, q_scales
