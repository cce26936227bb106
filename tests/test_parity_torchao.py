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
from tests.models import make_cnn, make_mlp, make_transformer

MODELS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer}


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


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_quantkit_quantizer_works_with_torchao_flow(name):
    ours, theirs, x = _both(MODELS[name], lambda: W8A8Quantizer())
    with torch.no_grad():
        diff = (ours(x) - theirs(x)).abs().max().item()
    assert diff <= 1e-6, f"{name}: max abs diff {diff:.3g}"
    assert _qdq_counts(ours) == _qdq_counts(theirs)
