"""The convert emitters (quantkit.pipeline.emit): kinds declared by observers, a new kind added
from outside the library, refusals."""

import pytest
import torch
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

import quantkit
from quantkit import observers
from quantkit._errors import ConvertError
from quantkit.pipeline.emit import ConvertContext, Emitter, emitter_for, qkind_of, register_emitter, \
    registered_emitters
from tests.models import make_mlp

STEP = 0.125  # the toy kind's grid


class _StepObserver(observers.MinMaxObserver):
    """A toy observer of a kind of its own: convert rounds its input to multiples of ``STEP``."""

    qkind = "test-round-to-step"


@register_emitter("test-round-to-step")
class _StepEmitter(Emitter):
    def emit(self, ctx, node, obs):
        aten = torch.ops.aten
        with ctx.graph.inserting_before(node):
            scaled = ctx.graph.call_function(aten.div.Tensor, (node.args[0], STEP))
            out = ctx.graph.call_function(aten.mul.Tensor, (ctx.graph.call_function(aten.round.default, (scaled,)),
                                                            STEP))
        ctx.records.append({"node": obs.node_name, "kind": "activation", "dtype": "step"})
        ctx.finish(node, obs, out)


class _LinearInputs(Quantizer):
    """Annotates the activation input of every linear with ``ctor``'s observers."""

    def __init__(self, ctor):
        super().__init__()
        self.spec = QuantizationSpec(dtype=torch.int8, observer_or_fake_quant_ctr=ctor,
                                     qscheme=torch.per_tensor_symmetric)

    def annotate(self, model):
        for node in model.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[0]: self.spec}, _annotated=True)
        return model

    def validate(self, model):
        pass


def _quantized(ctor):
    model, x = make_mlp()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), _LinearInputs(ctor))
    quantkit.calibrate(prepared, [(b,) for b in x.split(32)], progress=False)
    return model, x, quantkit.convert(prepared)


def test_builtin_kinds_are_registered():
    assert {"affine", "dynamic", "float8", "float16", "groupwise", "passthrough", "observer-convert"} <= \
        set(registered_emitters())


@pytest.mark.parametrize("obs,kind", [
    (lambda: observers.MinMaxObserver(dtype=torch.int8), "affine"),
    (lambda: observers.PerChannelMinMaxObserver(dtype=torch.int8, qscheme=torch.per_channel_symmetric), "affine"),
    (lambda: observers.PlaceholderObserver(dtype=torch.int8), "dynamic"),
    (lambda: observers.GroupwiseWeightObserver(group_size=32), "groupwise"),
    (lambda: observers.FakeQuantize(observers.MinMaxObserver, dtype=torch.int8), "affine"),
])
def test_quantkit_observers_declare_their_kind(obs, kind):
    o = obs()
    assert o.qkind == kind and qkind_of(o) == kind and emitter_for(o).qkind == kind


@pytest.mark.parametrize("name", observers.available())
def test_every_registered_observer_has_an_emitter(name):
    ctor = observers.get(name)
    obs = ctor(group_size=32) if name == "groupwise_minmax" else ctor()
    assert emitter_for(obs).qkind == obs.qkind


def test_float8_marked_observer_is_float8():
    from quantkit.observers._fp8 import Float8DynamicObserver, float8_observer

    assert qkind_of(Float8DynamicObserver()) == "float8"
    marked = float8_observer(observers.MinMaxObserver)(dtype=torch.float8_e4m3fn, qscheme=torch.per_tensor_symmetric)
    assert qkind_of(marked) == "float8"


def test_foreign_observers_get_an_inferred_kind():
    from torchao.quantization.pt2e.observer import MinMaxObserver, PlaceholderObserver

    assert qkind_of(MinMaxObserver(dtype=torch.int8)) == "affine"
    assert qkind_of(PlaceholderObserver(dtype=torch.int8, is_dynamic=True)) == "dynamic"
    assert qkind_of(PlaceholderObserver(dtype=torch.float32)) == "passthrough"
    assert qkind_of(PlaceholderObserver(dtype=torch.float16)) == "float16"

    class _OwnConvert(MinMaxObserver):
        def convert(self, model, node):  # torchao's protocol
            raise AssertionError("not called here")

    assert qkind_of(_OwnConvert(dtype=torch.int8)) == "observer-convert"


def test_a_new_kind_converts_through_its_own_emitter():
    model, x, qmodel = _quantized(_StepObserver)
    # 3 linears: each input rounded to the toy grid, no quantized_decomposed op
    targets = [n.target for n in qmodel.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.round.default) == 3
    assert not any("quantized_decomposed" in str(t) for t in targets)
    assert [r["dtype"] for r in qmodel.meta["quantkit_qparams"]] == ["step"] * 3

    def reference(inp):  # tests/models.py's MLP in float64, each linear's input on the grid
        def lin(h, layer):
            return torch.nn.functional.linear(torch.round(h / STEP) * STEP, layer.weight.double(), layer.bias.double())
        h = torch.relu(lin(inp.double(), model.fc1))
        return lin(torch.relu(lin(h, model.fc2)), model.fc3)

    with torch.no_grad():
        torch.testing.assert_close(qmodel(x).double(), reference(x), atol=1e-4, rtol=1e-4)


def test_unknown_kind_is_refused_before_anything_is_rewritten():
    class _Unknown(observers.MinMaxObserver):
        qkind = "test-no-such-kind"

    model, x = make_mlp()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), _LinearInputs(_Unknown))
    quantkit.calibrate(prepared, [(x,)], progress=False)
    before = str(prepared.graph)
    with pytest.raises(ConvertError, match="no convert emitter for observer kind 'test-no-such-kind'"):
        quantkit.convert(prepared)
    assert str(prepared.graph) == before


def test_a_kind_keeps_its_emitter():
    with pytest.raises(ValueError, match="already has the emitter"):
        @register_emitter("affine")
        class _Other(Emitter):
            pass
    with pytest.raises(ValueError, match="non-empty string"):
        register_emitter("")


def test_context_names_new_attributes_as_convert_does():
    model, x = make_mlp()
    gm = quantkit.capture(model, (x[:8],))
    ctx = ConvertContext(gm)
    names = [ctx.new_attr("_frozen_param", torch.zeros(1)).target for _ in range(3)]
    assert names == ["_frozen_param0", "_frozen_param1", "_frozen_param2"]


def test_block_path_api():
    w = torch.randn(16, 64)
    obs = observers.PerChannelMinMaxObserver(dtype=torch.int8, qscheme=torch.per_channel_symmetric)
    obs(w)
    emitter = emitter_for(obs)
    assert emitter.folds_weight(obs) and not emitter.emits_from_weight(obs)
    scale, zp = obs.calculate_qparams()
    expected = torch.ops.quantized_decomposed.quantize_per_channel.default(w, scale, zp, 0, -128, 127, torch.int8)
    torch.testing.assert_close(emitter.quantized_weight(obs, w), expected, atol=0, rtol=0)
    g = observers.GroupwiseWeightObserver(group_size=32)
    assert emitter_for(g).emits_from_weight(g) and not emitter_for(g).folds_weight(g)
