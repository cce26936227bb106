"""AWQ's block loss (``quantkit.accuracy.rounding._region``): the blocks found in an exported HF
Llama without module names, their output error against HF's own attention and MLP modules run
in float64 with the same weights, the query/key test for eager and SDPA attention, the whole
batches kept for attention (a function of the multiset of batches), and AWQ choosing by it."""

from __future__ import annotations

import copy

import pytest
import torch

import quantkit
from quantkit import _hf
from quantkit._graph import module_scopes
from quantkit.accuracy.rounding import ROUNDING_META_KEY
from quantkit.accuracy.rounding._awq import AWQConfig, awq_scales
from quantkit.accuracy.rounding._region import BatchSample, RegionScorer, feeds_attention_scores, output_region
from quantkit.accuracy._wscheme import WeightScheme
from quantkit.quantizers import WeightOnlyQuantizer

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten


def _llama(attn="sdpa", seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg).eval()


def _batch(seed, length=24):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 96, (1, length), generator=g),
            "attention_mask": torch.ones(1, length, dtype=torch.long)}


def _capture(model):
    b = _batch(0)
    return quantkit.capture(model, b, dynamic_shapes=_hf.dynamic_shapes(b))


def _linears(gm):
    """module name (model.layers.0.self_attn.q_proj) -> its aten.linear node."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.linear.default:
            out[module_scopes(n)[-1][0]] = n
    return out


def _values(gm, batch):
    """Every node's value on ``batch`` (an fx Interpreter that keeps them)."""
    env = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n):
            env[n] = super().run_node(n)
            return env[n]

    Keep(gm).run(*[batch[k] for k in ("input_ids", "attention_mask")])
    return env


def test_blocks_of_a_llama_layer():
    gm = _capture(_llama())
    lin = _linears(gm)
    p = "model.layers.0."
    qkv = [lin[p + f"self_attn.{n}_proj"] for n in "qkv"]
    o = lin[p + "self_attn.o_proj"]
    gate, up, down = (lin[p + f"mlp.{n}_proj"] for n in ("gate", "up", "down"))
    # "merge": up to where the group's outputs meet
    attn = output_region(qkv[0].args[0], qkv, gm)
    assert attn is not None and not attn.separable and not attn.trivial
    assert attn.out.target is aten.scaled_dot_product_attention.default and attn.out is attn.nodes[-1]
    assert all(n in attn.nodes for n in qkv) and o not in attn.nodes
    assert attn.inputs  # the mask and the rotary tables come in
    mlp = output_region(gate.args[0], [gate, up], gm)
    assert mlp.separable and not mlp.inputs and mlp.out.target is aten.mul.Tensor and down not in mlp.nodes
    (silu,) = [n for n in mlp.nodes if n.target is aten.silu.default]
    assert set(mlp.out.args) == {up, silu}
    # "residual": the module output, the residual add left out (it cancels in the error)
    attn = output_region(qkv[0].args[0], qkv, gm, end="residual")
    assert attn.out is o and sum(n.target is aten.scaled_dot_product_attention.default for n in attn.nodes) == 1
    mlp = output_region(gate.args[0], [gate, up], gm, end="residual")
    assert mlp.separable and mlp.out is down and not mlp.inputs
    assert sum(n.target is aten.linear.default for n in mlp.nodes) == 3
    for end in ("merge", "residual"):
        assert output_region(o.args[0], [o], gm, end=end).trivial
        assert output_region(down.args[0], [down], gm, end=end).trivial
        head = lin["lm_head"]
        assert output_region(head.args[0], [head], gm, end=end).trivial  # no residual after it
    with pytest.raises(ValueError, match="end must be 'merge' or 'residual'"):
        output_region(o.args[0], [o], gm, end="module")


def test_blocks_of_a_fused_qkv_block():
    """One fused qkv linear: its outputs meet at ``softmax(q kᵀ) v``; a lone fc1 ends at its GELU."""
    from tests.models import TransformerBlock

    gm = quantkit.capture(TransformerBlock(d=32, heads=4).eval(), (torch.randn(2, 8, 32),))
    lin = {module_scopes(n)[-1][0]: n for n in gm.graph.nodes
           if n.op == "call_function" and n.target is aten.linear.default}
    qkv = output_region(lin["qkv"].args[0], [lin["qkv"]], gm)
    assert qkv.out.target in (aten.matmul.default, aten.bmm.default) and not qkv.separable
    assert sum(n.target in (aten.softmax.int, aten._softmax.default) for n in qkv.nodes) == 1
    assert lin["proj"] not in qkv.nodes
    fc1 = output_region(lin["fc1"].args[0], [lin["fc1"]], gm)
    assert [n.target for n in fc1.nodes] == [aten.linear.default, aten.gelu.default] and fc1.separable
    assert output_region(lin["proj"].args[0], [lin["proj"]], gm).trivial
    assert output_region(lin["fc2"].args[0], [lin["fc2"]], gm).trivial
    res = output_region(lin["fc1"].args[0], [lin["fc1"]], gm, end="residual")
    assert res.out is lin["fc2"]


def _hf_block_error(model, layer, kind, weights, batch, end):
    """‖block(W') - block(W)‖² of HF's own modules (float64), on the input HF gives them: the
    module's output (``end="residual"``) or the input of its last linear (``o_proj``,
    ``down_proj``: ``end="merge"``)."""
    ref = copy.deepcopy(model).double()
    seen = {}
    block = getattr(ref.model.layers[layer], kind)
    last = block.o_proj if kind == "self_attn" else block.down_proj
    handles = [block.register_forward_pre_hook(lambda m, a, kw: seen.update(args=a, kwargs=kw), with_kwargs=True),
               last.register_forward_pre_hook(lambda m, a: seen.setdefault("last", []).append(a[0]))]
    with torch.no_grad():
        ref(**batch, use_cache=False)  # a cache would take in the k/v of every call
        outs = []
        for ws in (None, weights):
            for name, w in (ws or {}).items():
                getattr(block, name).weight.copy_(w.double())
            out = block(*seen["args"], **seen["kwargs"])
            outs.append(out[0] if isinstance(out, tuple) else out)
    for h in handles:
        h.remove()
    if end == "merge":  # the last linear's inputs of the two block calls (the first was the model's)
        outs = seen["last"][1:]
    return float((outs[1] - outs[0]).pow(2).sum())


@pytest.mark.parametrize("end", ["merge", "residual"])
@pytest.mark.parametrize("kind", ["self_attn", "mlp"])
def test_block_error_matches_hf_modules(kind, end):
    model = _llama()
    gm = _capture(model)
    lin = _linears(gm)
    names = ["q_proj", "k_proj", "v_proj"] if kind == "self_attn" else ["gate_proj", "up_proj"]
    nodes = [lin[f"model.layers.1.{kind}.{n}"] for n in names]
    region = output_region(nodes[0].args[0], nodes, gm, end=end)
    batches = [_batch(s) for s in (1, 2)]
    captured = []
    for b in batches:
        env = _values(gm, b)
        src = env[region.src]
        item = {"src": src if not region.separable else src.reshape(-1, src.shape[-1])}
        item.update({f"in{i}": env[n] for i, n in enumerate(region.inputs)})
        captured.append(item)
    targets = [str(n.args[1].target) for n in nodes]
    scorer = RegionScorer(gm, region, targets, captured)
    g = torch.Generator().manual_seed(3)
    floats = [getattr(getattr(model.model.layers[1], kind), n).weight.detach() for n in names]
    cands = [[w + 0.02 * c * torch.randn(w.shape, generator=g) for w in floats] for c in (1, 2, 4)]
    got = scorer.errors(cands)
    want = [sum(_hf_block_error(model, 1, kind, dict(zip(names, ws)), b, end) for b in batches) for ws in cands]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=2e-3, atol=0)
    assert got[0] < got[1] < got[2]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_query_and_key_projections_are_found(attn):
    lin = _linears(_capture(_llama(attn)))
    found = {name.rsplit(".", 1)[-1] for name, n in lin.items() if feeds_attention_scores(n)}
    assert found == {"q_proj", "k_proj"}


def _sample_of(batches, budget, seed=0):
    sample = BatchSample(budget, seed)
    for b in batches:
        with sample.batch((b,), {}):
            sample.store((0, "src"), b)
            sample.store((0, "in0"), b.sum())
    return sample


def test_batch_sample_depends_on_the_batches_not_their_order_or_shards():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(1, 8 + i, 4, generator=g) for i in range(10)]
    one = _sample_of(batches, budget=30)
    rows = [it[1] for it in one.kept]
    assert sum(rows) <= 30 and len(rows) >= 2
    keys = [it[0] for it in one.kept]
    assert keys == sorted(keys)
    # any batch left out has a larger key than every kept one, or would overflow the budget
    shuffled = _sample_of(batches[::-1], budget=30)
    assert [it[0] for it in shuffled.kept] == keys
    a, b = _sample_of(batches[:4], budget=30), _sample_of(batches[4:], budget=30)
    a.merge(b.kept)
    assert [it[0] for it in a.kept] == keys
    assert all(torch.equal(x[2][(0, "src")], y[2][(0, "src")]) for x, y in zip(a.kept, one.kept))
    assert one.values(0)[0].keys() == {"src", "in0"} and one.values(1) == [{}] * len(keys)
    assert len(_sample_of(batches, budget=1).kept) == 1  # one batch even when it alone is over budget


class _Scorer:
    """Block errors that favour one candidate, whatever the linear error says."""

    def __init__(self, favourite, dtype=torch.float32):
        self.favourite, self.calls = favourite, 0
        self._dtype = dtype

    def dtype(self, i):
        return self._dtype

    def errors(self, candidates):
        n = len(list(candidates))
        self.calls += n
        e = torch.ones(n, dtype=torch.float64)
        e[self.favourite] = 0.0
        return e


def test_awq_scales_picks_the_least_block_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    x[:, 3] *= 20
    w = torch.randn(16, 32, generator=g)
    scheme = WeightScheme(-8, 7, False, 16)  # int4 asymmetric, groups of 16
    xm = x.abs().mean(0)
    linear_s, linear_alpha = awq_scales(x, xm, [w], [scheme])
    scorer = _Scorer(favourite=7)
    s, alpha = awq_scales(x, xm, [w], [scheme], scorer=scorer)
    assert scorer.calls == 41 and alpha == 6 / 20  # row 7: the paper's grid, α = 6/20
    few = _Scorer(favourite=0)
    assert awq_scales(x, xm, [w], [scheme], scorer=few, candidates=4) == (None, None) and few.calls == 5
    assert linear_alpha is not None and linear_s is not None


def test_awq_uses_the_block_loss_and_leaves_query_and_key_unclipped():
    model = _llama()
    batches = [_batch(s, 32) for s in range(6)]
    gm = _capture(model)
    q = quantkit.quantize(gm, batches[0], batches, WeightOnlyQuantizer(bits=4, group_size=16, algorithm="awq"),
                          progress=False)
    names = {n.name: module_scopes(n)[-1][0].rsplit(".", 1)[-1] for n in gm.graph.nodes
             if n.op == "call_function" and n.target is aten.linear.default}
    by_kind = {}
    for r in q.meta[ROUNDING_META_KEY]:
        by_kind.setdefault(names[r["layer"]], set()).add((r["loss"], r["clipped"]))
    assert by_kind["q_proj"] == by_kind["k_proj"] == {("block", False)}
    assert by_kind["v_proj"] == by_kind["gate_proj"] == by_kind["up_proj"] == {("block", True)}
    assert by_kind["o_proj"] == by_kind["down_proj"] == by_kind["lm_head"] == {("linear", True)}
    # AWQ+GPTQ: scales by the linears' own outputs (loss="auto"), the ranges left to GPTQ
    q = quantkit.quantize(gm, batches[0], batches, WeightOnlyQuantizer(bits=4, group_size=16, algorithm="awq+gptq"),
                          progress=False)
    awq = [r for r in q.meta[ROUNDING_META_KEY] if r["algorithm"] == "awq+gptq"]
    assert len(awq) == 15 and {(r["loss"], r["clipped"]) for r in awq} == {("linear", False)}


def test_config_errors():
    with pytest.raises(ValueError, match="loss must be 'auto', 'block' or 'linear'"):
        AWQConfig(loss="module")
    with pytest.raises(ValueError, match="block_candidates must be a positive int or None"):
        AWQConfig(block_candidates=0)
    with pytest.raises(ValueError, match="block_end must be 'merge' or 'residual'"):
        AWQConfig(block_end="module")
    with pytest.raises(ValueError, match="block_rows must be a positive int"):
        AWQConfig(block_rows=0)
