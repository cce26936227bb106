"""The fallback search without a prepare + convert per variant (issue 28, item 4).

``Variants.variant(keep)`` rewires the one converted graph (kept-float layers read their float
weights, the quantize/dequantize pairs that served only them are bypassed): it must compute
exactly what the real ``KeepFloat`` build computes (bit for bit, the same ops), for several
keep sets on small models, and the searches must use it (real builds counted).
"""

import pytest
import torch

import quantkit
from quantkit.accuracy import _autotune as at
from quantkit.accuracy._metrics import Evaluator
from quantkit.pipeline._layers import KeepFloat, find_layers
from quantkit.pipeline._variants import Variants, fuse_qdq, scoring_copy
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_cnn, make_transformer

QD = torch.ops.quantized_decomposed


def _ops(gm):
    return sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _keep_sets(names):
    return [[n] for n in names] + [names[:2], names[1:4], names[::2], names[-2:]]


@pytest.mark.parametrize("make", [make_transformer, make_cnn])
def test_variants_are_bit_equal_to_the_keep_float_build(make):
    model, x = make()
    calib = [x[:16], x[16:32]]
    variants = Variants(model, (x[:8],), calib, None)
    names = [layer.name for layer in variants.layers]
    assert len(names) >= 5
    for keep in _keep_sets(names):
        cheap = variants._rewire(frozenset(keep))
        # an independent real build: prepare with KeepFloat, calibrate on the same data, convert
        real = quantkit.quantize(model, (x[:8],), calib, KeepFloat(W8A8Quantizer(), keep), progress=False)
        assert _ops(cheap) == _ops(real), keep
        with torch.no_grad():
            assert torch.equal(cheap(x), real(x)), keep
        # the kept layers read no dequantized input, the others still do
        assert {layer.name for layer in find_layers(cheap)} == set(names) - set(keep)
    # the shortcut checks its first variant against a real build, then builds nothing more
    before = variants.built
    for keep in _keep_sets(names):
        variants.variant(keep)
    assert variants.cheap is True and variants.built == before + 1


def test_a_variant_that_is_not_exact_falls_back_to_the_real_build(monkeypatch):
    model, x = make_transformer()
    variants = Variants(model, (x[:8],), [x[:16]], None)
    # a broken rewiring (every q/dq left in place): the first check catches it, every later
    # variant is built the real way
    monkeypatch.setattr(Variants, "_rewire", lambda self, names: self.quantized)
    first = variants.variant(["linear_1"])
    assert variants.cheap is False and variants.built == 1
    second = variants.variant(["linear_2"])
    assert variants.built == 2
    with torch.no_grad():
        for keep, got in ((["linear_1"], first), (["linear_2"], second)):
            real = quantkit.quantize(model, (x[:8],), [x[:16]], KeepFloat(W8A8Quantizer(), keep), progress=False)
            assert torch.equal(got(x), real(x))


def test_dynamic_graphs_take_the_shortcut_bit_equal_to_real_builds():
    """Per-token graphs: a float layer's input bypasses its choose_qparams -> quantize -> dequantize;
    every variant computes exactly what its real KeepFloat build computes (checked here for each,
    not only the first the shortcut checks itself), with fewer run-time quantizations."""
    model, x = make_transformer()
    variants = Variants(model, (x[:8],), [x[:16]], W8A8Quantizer(QuantConfig(dynamic=True, granularity="per-token")))
    assert variants.cheap is None
    names = [layer.name for layer in variants.layers]
    for keep in (["linear"], names[1:3], names[-2:], names[::2]):
        got = variants.variant(keep)
        assert variants.cheap is True and "quantkit_variant_of" in got.meta  # the rewired graph, not a build
        real = variants.build(keep)
        with torch.no_grad():
            assert torch.equal(got(x), real(x)), keep
        assert _count(got, QD.choose_qparams_per_token.default) < _count(
            variants.quantized, QD.choose_qparams_per_token.default)
    assert variants.built == 1 + 4  # the shortcut's one check, then the real builds made here


def _count(gm, op):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def test_fallback_search_builds_two_models_only():
    model, x = make_transformer()
    calib, held = [x[:16]], [x[16:]]
    variants = Variants(model, (x[:8],), calib, None)
    evaluator = Evaluator(model, held, "cosine")
    # a budget the all-int8 model misses: the ranking (one variant per layer), prefix and prune run
    budget = (evaluator.reference - evaluator.score(variants.quantized)) / 3
    q, keep, score = at.fallback_search(variants, evaluator, budget)
    assert keep and variants.built == 2  # the shortcut's one check, and the returned model
    assert not set(keep) & {layer.name for layer in find_layers(q)}
    real = quantkit.quantize(model, (x[:8],), calib, KeepFloat(W8A8Quantizer(), keep), progress=False)
    with torch.no_grad():
        assert torch.equal(q(x), real(x))
    assert score == evaluator.score(real) and evaluator.reference - score <= budget


@pytest.mark.parametrize("make", [make_transformer, make_cnn])
@pytest.mark.parametrize("observer", ["minmax", "histogram"])
def test_fused_qdq_scores_exactly_what_the_reference_graph_computes(make, observer):
    model, x = make()
    q = quantkit.quantize(model, (x[:8],), [x[:16]], W8A8Quantizer(QuantConfig(act_observer=observer)), progress=False)
    fused = scoring_copy(q)
    pairs = _count(q, QD.dequantize_per_tensor.default)
    assert pairs > 0 and _count(fused, QD.dequantize_per_tensor.default) == 0
    assert _count(fused, QD.quantize_per_tensor.default) == 0
    # the original is untouched (its graph still has every pair: the lowering and the latency need them)
    assert _count(q, QD.dequantize_per_tensor.default) == pairs
    with torch.no_grad():
        for batch in (x, 4 * x):  # 4x: far outside the calibrated ranges, the clamp at work
            assert torch.equal(fused(batch), q(batch))
    # the same math written plainly, for one pair: round(x / s) + zp, clamped, - zp, * s
    from quantkit.pipeline._variants import _fake_quant

    v = torch.randn(1000) * 3
    s, zp = 0.0123, 117
    ref = (torch.clamp(torch.round(v * (1.0 / s)) + zp, 0, 255).to(torch.uint8).to(torch.float32) - zp) * s
    assert torch.equal(_fake_quant(v, 1.0 / s, s, zp, 0, 255), ref)


@pytest.mark.parametrize("smoothquant", [False, True])
def test_fused_per_token_qdq_scores_exactly_what_the_reference_graph_computes(smoothquant):
    """Per-token graphs: each ``choose_qparams_per_token -> quantize -> dequantize`` of the scoring
    copy is one fake_quantize_per_token call computing the same values as torch's decomposed ops."""
    model, x = make_transformer()
    config = QuantConfig(dynamic=True, granularity="per-token")
    graph = quantkit.smooth_quant(model, [x[:16]], alpha="auto", config=config) if smoothquant else model
    q = quantkit.quantize(graph, (x[:8],), [x[:16]], W8A8Quantizer(config), progress=False)
    from quantkit._qmath import fake_quantize_per_token

    fused = scoring_copy(q)
    triples = _count(q, QD.dequantize_per_token.default)
    assert triples > 0 and _count(fused, fake_quantize_per_token) == triples
    for op in (QD.choose_qparams_per_token.default, QD.quantize_per_token.default, QD.dequantize_per_token.default):
        assert _count(fused, op) == 0 and _count(q, op) == triples
    with torch.no_grad():
        for batch in (x, 1e3 * x, 1e-7 * x):  # 1e-7: rows under the 1e-5 amax floor
            assert torch.equal(fused(batch), q(batch))


def test_fake_quantize_per_token_equals_torch_decomposed_ops():
    from quantkit._qmath import fake_quantize_per_token

    g = torch.Generator().manual_seed(0)
    v = torch.randn(7, 5, 33, generator=g) * torch.logspace(-8, 3, 33)  # rows of every magnitude
    v[0, 0] = 0.0  # an all-zero row: scale at the floor
    scale, zp = QD.choose_qparams_per_token(v, torch.int8)
    for qmin, qmax in ((-128, 127), (-127, 127), (-64, 63)):
        q = QD.quantize_per_token(v, scale, zp, qmin, qmax, torch.int8)
        ref = QD.dequantize_per_token(q, scale, zp, qmin, qmax, torch.int8, torch.float32)
        assert torch.equal(fake_quantize_per_token(v, qmin, qmax), ref)
    # and the math written plainly in float64 (s rounded to float32 as the op stores it)
    s = (v.double().abs().amax(-1, keepdim=True).clamp(min=1e-5) / 127).float().double()
    plain = (torch.round(v.double() / s).clamp(-128, 127) * s).float()
    assert (fake_quantize_per_token(v) - plain).abs().max() <= 1e-6 * v.abs().max()


def test_bf16_variants_score_the_bf16_artifact():
    """Variants(float_weights="bf16"): each scoring copy computes what the artifact computes
    (KeepFloat(float_weights="bf16"): kept layers' weights stored in bf16, read unrounded)."""
    model, x = make_transformer()
    calib = [x[:16], x[16:32]]
    variants = Variants(model, (x[:8],), calib, None, float_weights="bf16")
    names = [layer.name for layer in variants.layers]
    for keep in [names[1:4], names[::2]]:
        got = variants.variant(keep)
        real = quantkit.quantize(model, (x[:8],), calib, KeepFloat(W8A8Quantizer(), keep, float_weights="bf16"),
                                 progress=False)
        bf16 = [t for t in real.state_dict().values() if t.dtype == torch.bfloat16]
        assert bf16, keep  # the artifact does hold bf16 weights
        assert sum(t.dtype == torch.bfloat16 for t in got.state_dict().values()) == len(bf16), keep
        with torch.no_grad():
            assert torch.equal(got(x), real(x)), keep
    # and the bf16 weights do change the values: the fp32-weight variant differs
    fp32 = Variants(model, (x[:8],), calib, None).variant(keep)
    with torch.no_grad():
        assert not torch.equal(fp32(x), got(x))
    assert variants.cheap is True and variants.built == 1
    assert variants.quantizer_for(names[:1]).float_weights == "bf16"
    with pytest.raises(ValueError, match="float_weights"):
        Variants(model, (x[:8],), calib, None, float_weights="fp16")


def test_weights_float_keeps_every_activation_rounding_and_the_float_weights():
    """Variants.weights_float (the bound that lets the CLI skip GPTQ): every layer reads its float
    weight (the model's own parameter, bit for bit), every activation is rounded as in the int8 model."""
    model, x = make_transformer()
    variants = Variants(model, (x[:8],), [x[:16]], None)
    bound = variants.weights_float()
    int8 = scoring_copy(variants.quantized)
    from quantkit.pipeline._variants import _fake_quant

    # the same activation fake-quant calls (weights are folded int8 attributes: no fake-quant of theirs)
    assert _count(bound, _fake_quant) == _count(int8, _fake_quant) > 0
    assert _count(bound, QD.dequantize_per_channel.default) == 0 < _count(variants.quantized,
                                                                          QD.dequantize_per_channel.default)
    params = [p.detach() for p in model.parameters()]
    nodes = {n.name: n for n in bound.graph.nodes}
    linears = [layer for layer in variants.layers if layer.op == "linear"]
    assert linears
    for layer in linears:
        w = nodes[layer.name].args[1]
        assert w.op == "get_attr"
        tensor = getattr(bound, w.target)
        assert any(tensor.shape == p.shape and torch.equal(tensor, p) for p in params), layer.name
    with torch.no_grad():
        assert not torch.equal(bound(x), int8(x))


@pytest.mark.parametrize("make", [make_transformer, make_cnn])
def test_resumed_variants_are_bit_equal_and_run_only_what_changed(make):
    from quantkit.pipeline._variants import Resumed

    model, x = make()
    variants = Variants(model, (x[:8],), [x[:16]], None, float_weights="bf16")
    names = [layer.name for layer in variants.layers]
    resumed = Resumed(variants.variant(()))
    keeps = [[n] for n in names] + [names[1:3]]
    direct = [variants.variant(k) for k in keeps]
    plans = [resumed.plan(m) for m in direct]  # every plan first: the base keeps what they need
    # every node of the first variant's own graph (its weights are constants, fetched as get_attr)
    total = sum(1 for n in direct[0].graph.nodes if n.op not in ("placeholder", "output"))
    with torch.no_grad():
        for keep, d, p in zip(keeps, direct, plans):
            for batch in (x, x[:16]):
                assert torch.equal(p(batch), d(batch)), keep
        # the last layer's variant recomputes far less than the whole graph; the first one more
        assert 0 < plans[len(names) - 1].ran < plans[0].ran <= total


@pytest.mark.parametrize("config, one", [
    (QuantConfig(dynamic=True, granularity="per-token"), True),
    (QuantConfig(dynamic=True), True),
    (QuantConfig(), False),  # activation observers: every batch counts
    (QuantConfig(dynamic=True, weight_observer="moving_average_per_channel_minmax"), False),
    (QuantConfig(dynamic=True, weight_observer="per_channel_mse"), False),
])
def test_one_batch_calibrates_a_graph_that_observes_weights_only(config, one):
    """one_batch_suffices: where every statistics-recording observer watches a weight with a running
    min/max, one batch gives the very qparams that every batch gives (checked: the converted
    models are equal tensor for tensor); anywhere else it says no."""
    from quantkit.pipeline._calibrate import one_batch_suffices

    model, x = make_transformer()
    calib = [x[:16], 3 * x[16:32], x[32:]]
    prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), W8A8Quantizer(config))
    assert one_batch_suffices(prepared) is one
    if not one:  # every batch runs
        quantkit.calibrate(prepared, calib, progress=False)
        assert prepared.meta["quantkit_calibrated_batches"] == len(calib)
    if one:
        models = []
        for batches in (calib, calib[:1]):
            prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), W8A8Quantizer(config))
            quantkit.calibrate(prepared, batches, progress=False)
            assert prepared.meta["quantkit_calibrated_batches"] == 1  # calibrate itself stopped after one
            models.append(quantkit.convert(prepared).state_dict())
        assert models[0].keys() == models[1].keys() and all(torch.equal(models[0][k], models[1][k]) for k in models[0])


@pytest.mark.parametrize("algorithm", ["gptq", "awq", "awq+gptq"])
def test_weight_only_rounding_calibrates_one_batch_and_rounds_on_all(algorithm, monkeypatch):
    """GPTQ/AWQ weight-only: calibrate's own pass observes weights only, so it stops after one
    batch, while the rounding still sees every batch (GPTQ's Hessian rows); the converted model is
    the one that a pass over every batch gives, tensor for tensor."""
    from quantkit.accuracy.rounding import ROUNDING_META_KEY
    from quantkit.pipeline import _calibrate
    from quantkit.quantizers import WeightOnlyQuantizer

    model, x = make_transformer()
    calib = [x[:8], 3 * x[8:16], x[16:]]

    def run():
        prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)),
                                    WeightOnlyQuantizer(bits=4, group_size=16, algorithm=algorithm))
        quantkit.calibrate(prepared, calib, progress=False)
        return prepared, quantkit.convert(prepared).state_dict()

    prepared, fast = run()
    assert prepared.meta["quantkit_calibrated_batches"] == 1
    gptq_rows = {r["rows"] for r in prepared.meta[ROUNDING_META_KEY] if r["algorithm"] == "gptq"}
    assert gptq_rows == ({x.shape[0] * x.shape[1]} if "gptq" in algorithm else set())
    monkeypatch.setattr(_calibrate, "one_batch_suffices", lambda prepared: False)
    prepared, full = run()
    assert prepared.meta["quantkit_calibrated_batches"] == len(calib)
    assert fast.keys() == full.keys() and all(torch.equal(fast[k], full[k]) for k in fast)
