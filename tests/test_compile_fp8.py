"""FP8 lowering: FP8 linears become torch._scaled_mm (op counts) with the reference q/dq
graph's numerics (SQNR), eagerly for every scale layout and through quantkit.compile."""

import copy
from collections import Counter

import pytest
import torch

import quantkit
from quantkit._qmath import sqnr
from quantkit.lowering._fp8 import lower_fp8
from quantkit.quantizers import FP8Quantizer
from tests.models import make_transformer

_AO = torch.ops.torchao
_LAYOUTS = {  # activation scales x weight scales
    "static-tensor x channel": {},
    "static-tensor x tensor": {"weight_granularity": "per-tensor"},
    "token x channel": {"dynamic": True, "granularity": "per-token"},
    "token x tensor": {"dynamic": True, "granularity": "per-token", "weight_granularity": "per-tensor"},
    "dynamic-tensor x channel": {"dynamic": True},
}


@pytest.fixture(scope="module")
def block():
    model, x = make_transformer(d=32)
    return model, x[:8], quantkit.capture(model, (x[:4],))


def _converted(block, kwargs):
    _, x, gm = block
    prepared = quantkit.prepare(gm, FP8Quantizer(**kwargs))
    quantkit.calibrate(prepared, [x[:4], x[4:]], progress=False)
    return quantkit.convert(prepared)


def _ops(gm) -> Counter:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("kwargs", list(_LAYOUTS.values()), ids=list(_LAYOUTS))
def test_fp8_linears_become_scaled_mm(block, kwargs):
    _, x, _ = block
    conv = _converted(block, kwargs)
    lowered = copy.deepcopy(conv)
    assert lower_fp8(lowered) == {"fp8_linear": 4}
    ops = _ops(lowered)
    assert ops[torch.ops.aten._scaled_mm.default] == 4 and ops[torch.ops.aten.linear.default] == 0
    # the 4 linears' 8 float8 dequantizes are gone; every other float8 q/dq is now aten ops
    # (x.float() * scale; x.float() / scale, clamped, cast), which Inductor fuses
    dq, q = _AO.dequantize_affine_float8_non_decomposed.default, _AO.quantize_affine_float8_non_decomposed.default
    assert ops[dq] == ops[q] == 0
    before = _ops(conv)
    assert ops[torch.ops.aten.mul.Tensor] - before[torch.ops.aten.mul.Tensor] == before[dq] - 8
    assert ops[torch.ops.aten.clamp.default] - before[torch.ops.aten.clamp.default] == before[q]
    weights = [b for n, b in lowered.named_buffers() if n.startswith("_frozen_param")]
    assert len(weights) == 4 and all(w.dtype == torch.float8_e4m3fn for w in weights)
    x2 = torch.randn(3, 16, 32)
    with torch.no_grad():
        for inp in (x, x2):  # another batch size: the reshapes follow the batch
            db = sqnr(conv(inp), lowered(inp))
            assert db >= 40, f"_scaled_mm vs reference q/dq: {db:.1f} dB"


def test_a_loaded_artifact_lowers_too(block, tmp_path):
    _, x, _ = block
    quantkit.save(_converted(block, _LAYOUTS["token x channel"]), tmp_path / "a")
    loaded = quantkit.load(tmp_path / "a")  # a torch.export program: constants under nested names
    lowered = copy.deepcopy(loaded)
    assert lower_fp8(lowered) == {"fp8_linear": 4}
    with torch.no_grad():
        assert sqnr(loaded(x), lowered(x)) >= 40


@pytest.mark.parametrize("kwargs", [_LAYOUTS["static-tensor x channel"], _LAYOUTS["token x tensor"]],
                         ids=["static", "dynamic-per-token"])
def test_quantkit_compile_runs_fp8_as_scaled_mm(block, kwargs):
    _, x, _ = block
    conv = _converted(block, kwargs)
    compiled = quantkit.compile(conv)
    with torch.no_grad():
        db = sqnr(conv(x), compiled(x))
    assert compiled._orig_mod.meta["quantkit_lowering"]["fp8_linear"] == 4
    assert db >= 40, f"compiled FP8 vs reference q/dq: {db:.1f} dB"
    assert quantkit.compile(conv, cpu_kernels="reference")._orig_mod.meta["quantkit_lowering"].get("fp8_linear", 0) == 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 _scaled_mm needs a CUDA GPU with sm_89+")
@pytest.mark.parametrize("kwargs", [_LAYOUTS["static-tensor x channel"], _LAYOUTS["token x channel"]],
                         ids=["static", "dynamic-per-token"])
def test_cuda_lowering_runs_rowwise_scaled_mm(block, kwargs):
    """CUDA: row-wise _scaled_mm with a bf16 output (cast back to float32) against the q/dq graph."""
    _, x, _ = block
    conv = _converted(block, kwargs).to("cuda")
    lowered = copy.deepcopy(conv)
    assert lower_fp8(lowered, "cuda") == {"fp8_linear": 4}
    with torch.no_grad():
        ref = conv(x.cuda())
        db = sqnr(ref, lowered(x.cuda()))
        db_compiled = sqnr(ref, quantkit.compile(conv)(x.cuda()))
    # bf16 output: relative rounding 2**-9 (about 54 dB), accumulation order aside
    assert db >= 40 and db_compiled >= 40, (db, db_compiled)



def test_decomposed_per_token_quantize_is_bit_identical_to_torchaos_op():
    from quantkit.lowering._fp8 import _decompose_quantize

    op = torch.ops.torchao.quantize_affine_float8_non_decomposed.default
    graph = torch.fx.Graph()
    x, scale = graph.placeholder("x"), graph.placeholder("scale")
    graph.output(graph.call_function(op, (x, scale, torch.float8_e4m3fn)))
    reference = torch.fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph))
    node = next(n for n in graph.nodes if n.target == op)
    _decompose_quantize(graph, node)
    decomposed = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert op not in {n.target for n in decomposed.graph.nodes}
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(3, 5, 64, generator=gen) * torch.logspace(-3, 3, 64)
    sc = xs.abs().amax(-1, keepdim=True) / 448 * 0.5  # half the range: some values saturate
    a, b = reference(xs, sc), decomposed(xs, sc)
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    from quantkit.lowering._fp8 import _decompose_dequantize

    op = torch.ops.torchao.dequantize_affine_float8_non_decomposed.default
    graph = torch.fx.Graph()
    q, scale = graph.placeholder("q"), graph.placeholder("scale")
    graph.output(graph.call_function(op, (q, scale, torch.float32)))
    reference = torch.fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph))
    _decompose_dequantize(graph, next(n for n in graph.nodes if n.target == op))
    decomposed = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert op not in {n.target for n in decomposed.graph.nodes}
    assert torch.equal(reference(a, sc), decomposed(a, sc))


def test_per_token_fp8_compiles_after_torchao_x86_inductor_passes_are_imported(block):
    """Importing torchao's X86 Inductor quantizer registers an Inductor lowering for its float8 quantize
    op that asserts on per-token scales ("Only support per-tensor quantization for float8 now"); the
    FP8 lowering hands Inductor the decomposed aten ops instead."""
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401  (registers the lowering)

    _, x, _ = block
    conv = _converted(block, _LAYOUTS["token x tensor"])
    compiled = quantkit.compile(conv)
    with torch.no_grad():
        db = sqnr(conv(x), compiled(x))
    assert compiled._orig_mod.meta["quantkit_lowering"]["fp8_linear"] == 4
    assert db >= 40, f"compiled FP8 vs reference q/dq: {db:.1f} dB"
