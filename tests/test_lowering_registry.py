"""The lowering seam (quantkit/lowering/_registry.py): quantkit's own passes are registered in order, and a
pass registered from another file (here, this test's) runs inside ``quantkit.compile`` at its place."""

from __future__ import annotations

import pytest
import torch

import quantkit
from quantkit.lowering import (LoweringContext, LoweringError, register_lowering, registered_lowerings,
                               unregister_lowering)
from quantkit.quantizers import WeightOnlyQuantizer
from tests.models import make_mlp

aten = torch.ops.aten


def _converted():
    """An int4 weight-only MLP (three linears, two relus) and its input."""
    model, x = make_mlp(d_in=128, d_hidden=256, d_out=128)
    prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), WeightOnlyQuantizer(bits=4, group_size=128))
    quantkit.calibrate(prepared, [x], progress=False)
    return quantkit.convert(prepared), x


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def test_quantkits_passes_are_registered_in_order():
    names = [p.name for p in registered_lowerings()]
    assert [n for n in names if n in ("int8", "weight_only", "fp8", "bf16")] == ["int8", "weight_only", "fp8", "bf16"]
    assert [(p.order, p.devices) for p in registered_lowerings() if p.name == "bf16"] == [(400, ("cpu",))]
    assert "bf16" not in [p.name for p in registered_lowerings("cuda")]  # int8-mixed-bf16 is a CPU pass


@pytest.fixture
def toy_passes():
    """Two passes from this file: one before every quantkit pass, one between weight-only and FP8."""
    seen: dict[str, dict] = {}

    @register_lowering("test_first", order=10, devices=("cpu",))
    def first(gm, ctx):
        seen["test_first"] = dict(ctx.counts)
        return {}  # nothing rewritten: nothing recorded

    @register_lowering("test_relu_to_clamp", order=250, devices=("cpu",))
    def relu_to_clamp(gm, ctx):
        """relu(x) -> clamp_min(x, 0) (the same values)."""
        assert isinstance(ctx, LoweringContext) and ctx.device == "cpu"
        seen["test_relu_to_clamp"] = dict(ctx.counts)
        count = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is aten.relu.default:
                with gm.graph.inserting_before(node):
                    out = gm.graph.call_function(aten.clamp_min.default, (node.args[0], 0.0))
                out.meta.update(node.meta)
                node.replace_all_uses_with(out)
                gm.graph.erase_node(node)
                count += 1
        gm.recompile()
        return {"test_relu_to_clamp": count}

    yield seen
    unregister_lowering("test_first")
    unregister_lowering("test_relu_to_clamp")


def test_a_registered_pass_runs_in_compile_at_its_order(toy_passes):
    names = [p.name for p in registered_lowerings("cpu")]
    assert names.index("test_first") < names.index("int8") < names.index("weight_only") \
        < names.index("test_relu_to_clamp") < names.index("fp8")
    assert "test_relu_to_clamp" not in [p.name for p in registered_lowerings("cuda")]
    converted, x = _converted()
    compiled = quantkit.compile(converted)
    gm = compiled._orig_mod
    counts = gm.meta["quantkit_lowering"]
    assert counts["weight_only_int4"] == 3 and counts["test_relu_to_clamp"] == 2
    assert list(counts)[-1] == "test_relu_to_clamp" and "test_first" not in counts
    # order: the first pass saw nothing yet; the 250 one saw the weight-only counts, not FP8's or bf16's
    assert toy_passes["test_first"] == {}
    seen = toy_passes["test_relu_to_clamp"]
    assert {k: v for k, v in seen.items() if v} == {"weight_only_int4": 3}  # int8 (oneDNN) rewrote nothing here
    assert "fp8_linear" not in seen and "to_bf16" not in seen
    assert _count(gm, aten.relu.default) == 0 and _count(gm, aten.clamp_min.default) == 2
    assert _count(converted, aten.relu.default) == 2  # compile rewrites a copy
    unregister_lowering("test_relu_to_clamp")
    plain = quantkit.compile(converted)._orig_mod
    assert "test_relu_to_clamp" not in plain.meta["quantkit_lowering"]
    with torch.no_grad():  # the lowered graphs eagerly (no Inductor): the rewrite keeps the values
        torch.testing.assert_close(gm(x), plain(x), rtol=0, atol=0)


def test_reference_cpu_kernels_still_run_a_registered_pass(toy_passes):
    gm = quantkit.compile(_converted()[0], cpu_kernels="reference")._orig_mod
    # the pass decides itself whether it applies; quantkit's passes stand aside for "reference"
    assert gm.meta["quantkit_lowering"] == {"test_relu_to_clamp": 2}
    assert toy_passes["test_relu_to_clamp"] == {}


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="", order=1), "non-empty string"),
    (dict(name="x", order=1.5), "order must be an int"),
    (dict(name="x", order=True), "order must be an int"),
    (dict(name="x", order=1, devices=("tpu",)), "devices must be some of"),
    (dict(name="x", order=1, devices=()), "devices must be some of"),
])
def test_bad_registrations_are_refused(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(LoweringError, match=match):
        register_lowering(name, **kwargs)


def test_a_taken_name_is_refused():
    with pytest.raises(LoweringError, match="'weight_only' is already registered"):
        @register_lowering("weight_only", order=1)
        def other(gm, ctx):
            return {}
    assert [p.order for p in registered_lowerings() if p.name == "weight_only"] == [200]


def test_context_is_frozen_and_checked():
    ctx = LoweringContext("cpu", None, "auto", torch.float32, "scaled_mm", {"a": 1})
    with pytest.raises(Exception):
        ctx.device = "cuda"
    with pytest.raises(TypeError):
        ctx.counts["a"] = 2  # a read-only view
    with pytest.raises(LoweringError, match="unknown lowering device"):
        LoweringContext("tpu", None, "auto", torch.float32, "scaled_mm")
