"""The grouped-query attention lowering (``lowering/_gqa.py``): repeated K/V copies removed from a
captured Llama, the same logits as transformers' own model in float64, and what it leaves alone."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import quantkit
from quantkit.lowering import registered_lowerings
from quantkit.lowering._gqa import group_gqa_attention

transformers = pytest.importorskip("transformers")

aten = torch.ops.aten


def _llama(heads, kv_heads, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _sdpa_inputs(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.scaled_dot_product_attention.default]


def test_registered_after_int8_sdpa():
    passes = {p.name: p for p in registered_lowerings()}
    assert passes["gqa_attention"].order > passes["int8_sdpa"].order
    assert passes["gqa_attention"].devices == ("cpu", "cuda")


def test_grouped_attention_reads_the_cache_once_and_matches_float64_transformers():
    model = _llama(6, 2)
    gm = quantkit.capture(model, torch.zeros(1, 8, dtype=torch.long), max_cache_len=32)
    grouped = copy.deepcopy(gm)
    assert group_gqa_attention(grouped) == 2
    for node in _sdpa_inputs(grouped):  # K and V are the [1, 2, 32, 16] cache itself, q has 2 groups of 3 heads
        q, k, v = node.args[:3]
        assert tuple(k.meta["val"].shape) == (1, 2, 32, 16) and tuple(v.meta["val"].shape) == (1, 2, 32, 16)
        assert k.target is aten.index_copy_.default and v.target is aten.index_copy_.default
    five_d = [n for n in grouped.graph.nodes if n.target is aten.expand.default and len(n.args[1]) == 5
              and n.args[0].args[0].target is aten.index_copy_.default]
    assert five_d == []  # no repeat_kv of the cache is left
    ref = copy.deepcopy(model).double()
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits.float()
        prefill = grouped(ids[:, :7], torch.arange(7))
        step1 = grouped(ids[:, 7:8], torch.tensor([7]))
        step2 = grouped(ids[:, 8:9], torch.tensor([8]))
    got = torch.cat([prefill, step1, step2], dim=1)
    assert torch.allclose(got, want, atol=2e-5, rtol=0), (got - want).abs().max()


def test_compiled_w4a16_program_uses_it_and_generates_the_reference_tokens():
    model = _llama(4, 2, layers=1)
    gm = quantkit.capture(model, torch.zeros(1, 8, dtype=torch.long), max_cache_len=40)
    config = dataclasses.replace(quantkit.get_scheme("w4a16"), group_size=32)
    prepared = quantkit.prepare(gm, config.quantizer())
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    quantkit.calibrate(prepared, [(ids, torch.arange(8))], progress=False)
    program = quantkit.convert(prepared)
    fast = quantkit.compile(program)
    assert fast._orig_mod.meta["quantkit_lowering"].get("gqa_attention") == 1
    eager = quantkit.generate(program, ids, max_new_tokens=6, compile=False)
    quantkit.generation.clear_compiled()
    compiled = quantkit.generate(program, ids, max_new_tokens=6)
    assert torch.equal(eager, compiled)


def test_no_gqa_and_causal_sdpa_are_left_alone():
    gm = quantkit.capture(_llama(4, 4, layers=1), torch.zeros(1, 8, dtype=torch.long), max_cache_len=16)
    assert group_gqa_attention(gm) == 0  # heads == kv heads: nothing is repeated

    class Causal(torch.nn.Module):
        def forward(self, q, k):
            kk = k[:, :, None].expand(1, 2, 3, 8, 4).reshape(1, 6, 8, 4)
            return F.scaled_dot_product_attention(q, kk, kk, is_causal=True)

    ep = torch.export.export(Causal(), (torch.randn(1, 6, 8, 4), torch.randn(1, 2, 8, 4)))
    causal = ep.module()
    assert group_gqa_attention(causal) == 0
