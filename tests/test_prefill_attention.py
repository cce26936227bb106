"""A KV-cache program's prompt attention in bf16 (``kernels/_prefill_sdpa.py``,
``lowering/_prefill_attention.py``): the op against float64 SDPA on both of its paths, the pass's
rewrite counted (one shared mask for every layer), logits against float64 transformers, and where
the lowering leaves a program alone."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import quantkit
from quantkit.kernels import sdpa_prefill_bf16
from quantkit.lowering import registered_lowerings
from quantkit.lowering import _prefill_attention as pa
from quantkit.lowering._gqa import group_gqa_attention

transformers = pytest.importorskip("transformers")

aten = torch.ops.aten
OP = torch.ops.quantkit.sdpa_prefill_bf16.default
BF16_TOL = 2 ** -6  # bf16 operands (rounding 2**-9) through softmax and the value sum, unit-scale data


def _sdpa64(q, k, v, mask):
    """float64 attention written out (not aten's SDPA): softmax(q k^T / sqrt(d) + mask) v."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, dim=-1) @ v


def _qkv(rows, cols=24, heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, n, d, generator=g) for n in (rows, cols, cols))
    mask = torch.ones(rows, cols, dtype=torch.bool).tril(cols - rows)  # causal over a cache
    return q, k, v, mask


@pytest.mark.parametrize("mask_kind", ["none", "bool", "bf16_additive"])
def test_op_runs_bf16_from_min_rows_and_float32_below(mask_kind):
    for rows, bf16 in ((8, True), (7, False), (1, False)):
        q, k, v, bmask = _qkv(rows)
        want = _sdpa64(q, k, v, None if mask_kind == "none" else bmask)
        mask = {"none": None, "bool": bmask,
                "bf16_additive": torch.where(bmask, 0.0, float("-inf")).to(torch.bfloat16)}[mask_kind]
        got = sdpa_prefill_bf16(q, k, v, mask, None, min_rows=8)
        assert got.dtype == torch.float32 and got.shape == q.shape
        err = (got.double() - want).abs().max().item()
        if bf16:  # bf16 level, and visibly not float32 arithmetic
            assert 1e-5 < err < BF16_TOL, err
        else:
            assert err < 2e-6, err


def test_op_scale_and_non_float32_inputs():
    q, k, v, mask = _qkv(16)
    got = sdpa_prefill_bf16(q, k, v, mask, 0.5, min_rows=4)
    s = (q.double() @ k.double().transpose(-1, -2) * 0.5).masked_fill(~mask, float("-inf"))
    want = torch.softmax(s, -1) @ v.double()
    assert (got.double() - want).abs().max() < BF16_TOL
    d = sdpa_prefill_bf16(q.double(), k.double(), v.double(), mask, None, min_rows=4)  # float64: computed as given
    assert d.dtype == torch.float64 and torch.allclose(d, _sdpa64(q, k, v, mask), atol=1e-12, rtol=0)


def _llama(heads, kv_heads, layers):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def test_registered_last_on_cpu():
    passes = {p.name: p for p in registered_lowerings()}
    assert passes["prefill_attention_bf16"].order > max(p.order for n, p in passes.items()
                                                        if n != "prefill_attention_bf16")
    assert passes["prefill_attention_bf16"].devices == ("cpu",)


@pytest.mark.parametrize("group", [False, True])
def test_rewrite_shares_one_mask_and_matches_float64_transformers(group):
    model = _llama(4, 2, layers=3)
    gm = quantkit.capture(model, torch.zeros(1, 8, dtype=torch.long), max_cache_len=64)
    if group:
        assert group_gqa_attention(gm) == 3  # per-layer repeated mask chains, as compile builds them
    masks_before = _count(gm, aten.where.Scalar)
    assert pa.prefill_attention_bf16(gm, min_rows=32) == 3
    assert _count(gm, aten.scaled_dot_product_attention.default) == 0 and _count(gm, OP) == 3
    assert _count(gm, aten.where.Scalar) == masks_before + 1  # one additive mask for all three layers
    mask_args = {n.args[3] for n in gm.graph.nodes if n.target is OP}
    assert len(mask_args) == 1 and next(iter(mask_args)).meta["val"].dtype == torch.bfloat16
    gm.graph.lint()

    ref = copy.deepcopy(model).double()
    ids = torch.randint(0, 128, (1, 42), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits.float()
        prompt = gm(ids[:, :40], torch.arange(40))  # 40 rows: bf16 attention
        step = gm(ids[:, 40:41], torch.tensor([40]))  # 1 row (or the grouped 2): float32
        step2 = gm(ids[:, 41:42], torch.tensor([41]))
    err = (prompt - want[:, :40]).abs().max().item()
    assert 1e-5 < err < 5e-2, err  # bf16 attention in three layers, 128-way logits
    for got, pos in ((step, 40), (step2, 41)):  # the cache holds bf16-level K/V of layers 2-3
        assert (got - want[:, pos:pos + 1]).abs().max() < 5e-2


def test_one_layer_decode_steps_stay_float32_exact():
    model = _llama(4, 4, layers=1)  # layer 1's K/V come from the embeddings: no bf16 in the cache
    gm = quantkit.capture(model, torch.zeros(1, 8, dtype=torch.long), max_cache_len=48)
    assert pa.prefill_attention_bf16(gm, min_rows=32) == 1
    ref = copy.deepcopy(model).double()
    ids = torch.randint(0, 128, (1, 36), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits.float()
        gm(ids[:, :34], torch.arange(34))
        steps = torch.cat([gm(ids[:, 34:35], torch.tensor([34])), gm(ids[:, 35:36], torch.tensor([35]))], 1)
    assert torch.allclose(steps, want[:, 34:], atol=2e-5, rtol=0), (steps - want[:, 34:]).abs().max()


def _w4a16_program(layers=2):
    model = _llama(4, 2, layers=layers)
    gm = quantkit.capture(model, torch.zeros(1, 8, dtype=torch.long), max_cache_len=64)
    config = dataclasses.replace(quantkit.get_scheme("w4a16"), group_size=32)
    prepared = quantkit.prepare(gm, config.quantizer())
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    quantkit.calibrate(prepared, [(ids, torch.arange(40))], progress=False)
    return quantkit.convert(prepared), ids


def test_compile_applies_it_on_amx_and_not_for_fp32_or_without_amx(monkeypatch):
    program, ids = _w4a16_program()
    monkeypatch.setattr(pa, "bf16_float_ops_pay", lambda: True)  # the AMX decision, on any CPU
    fast = quantkit.compile(program)
    assert fast._orig_mod.meta["quantkit_lowering"].get("prefill_attention_bf16") == 2
    assert _count(program, OP) == 0  # compile works on a copy
    with torch.no_grad():
        want = program(ids, torch.arange(40))
        got = fast(ids, torch.arange(40))
    assert (got - want).abs().max() < 5e-2
    assert "prefill_attention_bf16" not in quantkit.compile(program, float_dtype="fp32")._orig_mod.meta["quantkit_lowering"]
    monkeypatch.setattr(pa, "bf16_float_ops_pay", lambda: False)
    assert "prefill_attention_bf16" not in quantkit.compile(program)._orig_mod.meta["quantkit_lowering"]


def test_programs_without_a_cache_and_other_sdpas_are_left_alone(monkeypatch):
    monkeypatch.setattr(pa, "bf16_float_ops_pay", lambda: True)
    no_cache = quantkit.capture(_llama(4, 2, layers=1), torch.zeros(1, 8, dtype=torch.long))
    from quantkit.lowering._registry import LoweringContext
    ctx = LoweringContext(device="cpu", target="onednn", cpu_kernels="auto", float_dtype=torch.float32,
                          fp8_kernel="scaled_mm")
    assert pa.lower_prefill_attention(no_cache, ctx) == {}
    assert _count(no_cache, aten.scaled_dot_product_attention.default) == 1

    class Odd(torch.nn.Module):
        def forward(self, q, k):
            return (F.scaled_dot_product_attention(q, k, k, is_causal=True)
                    + F.scaled_dot_product_attention(q.double(), k.double(), k.double()).float())

    gm = torch.export.export(Odd(), (torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8))).module()
    assert pa.prefill_attention_bf16(gm) == 0
