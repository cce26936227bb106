"""capture(max_cache_len=N): one program with a static KV cache for prefill and decode.

References are transformers' own eager forward of the full sequence (no cache), and for quantized
programs their own full-sequence forward: a prefill of L tokens then one-token decode steps must
give the logits a single forward gives at the same positions.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch

import quantkit
from quantkit import CaptureError
from quantkit.pipeline import KVCacheError, kv_cache_info

transformers = pytest.importorskip("transformers")

VOCAB, N, B = 128, 12, 2
ATOL = 1e-5  # fp32: a cached attention sums the same products as the full one, in another order


@pytest.fixture(scope="module")
def llm():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (B, N), generator=g)


@pytest.fixture(scope="module")
def program(llm, tokens):
    return quantkit.capture(llm, tokens[:, :5], max_cache_len=N)


def prefill_then_decode(gm, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of a prefill of ``prompt`` tokens then one decode step per remaining token."""
    with torch.no_grad():
        out = [gm(ids[:, :prompt], torch.arange(prompt))]
        for p in range(prompt, ids.shape[1]):
            out.append(gm(ids[:, p:p + 1], torch.tensor([p])))
    return torch.cat(out, dim=1)


def full_forward(llm, ids):
    with torch.no_grad():
        return llm(ids, use_cache=False).logits


def ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_prefill_then_decode_equals_full_forward(llm, program, tokens):
    got = prefill_then_decode(program, tokens[:, :9], prompt=5)
    ref = full_forward(llm, tokens[:, :9])
    assert got.shape == (B, 9, VOCAB)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("length", [1, 5, N])
def test_one_program_serves_every_length(llm, program, tokens, length):
    # a new sequence starts at position 0 whatever the cache held before (stale slots are masked)
    with torch.no_grad():
        got = program(tokens[:, :length], torch.arange(length))
    torch.testing.assert_close(got, full_forward(llm, tokens[:, :length]), atol=ATOL, rtol=0)


def test_meta_and_cache_buffers(llm, program, tokens):
    info = kv_cache_info(program)
    cfg = llm.config
    assert {k: info[k] for k in ("max_cache_len", "batch_size", "num_layers", "num_kv_heads", "head_dim",
                                 "format", "granularity")} == {
        "max_cache_len": N, "batch_size": B, "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": cfg.num_key_value_heads, "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "format": None, "granularity": None}
    buffers = dict(program.named_buffers())
    assert len(info["buffers"]) == 2 * cfg.num_hidden_layers  # keys and values per layer
    for name in info["buffers"]:
        assert buffers[name].shape == (B, info["num_kv_heads"], N, info["head_dim"])
        assert buffers[name].dtype == torch.float32
    # the only in-place ops write the cache: one index_copy_ per K and per V store, no counter update
    counts = ops(program)
    assert counts["aten.index_copy_.default"] == 2 * cfg.num_hidden_layers
    assert not [t for t in counts if t.startswith("aten.add_.")]
    # a call writes K/V at its positions, in place, and leaves its inputs as they were
    keys = buffers[info["buffers"][0]]
    keys.zero_()
    pos = torch.arange(3)
    with torch.no_grad():
        program(tokens[:, :3], pos)
    assert torch.equal(pos, torch.arange(3))
    assert bool((keys[:, :, :3] != 0).any()) and bool((keys[:, :, 3:] == 0).all())
    # layer names are those of a capture without cache (recipes and skip lists apply to both)
    names = {n for n, _ in program.named_parameters()}
    assert {"model.layers.0.self_attn.q_proj.weight", "lm_head.weight"} <= names


def test_tokenizer_dict_and_one_token_example(llm, tokens):
    example = {"input_ids": tokens[:, :1], "attention_mask": torch.ones(B, 1, dtype=torch.long)}
    gm = quantkit.capture(llm, example, max_cache_len=6)
    assert kv_cache_info(gm)["max_cache_len"] == 6
    got = prefill_then_decode(gm, tokens[:, :6], prompt=3)  # lengths 3 and 1: the dim stayed dynamic
    torch.testing.assert_close(got, full_forward(llm, tokens[:, :6]), atol=ATOL, rtol=0)


def _scheme(name):
    config = quantkit.get_scheme(name)
    if getattr(config, "group_size", None):
        config = dataclasses.replace(config, group_size=32)  # hidden 64: groups of 32
    return config


@pytest.fixture(scope="module")
def converted(program, tokens):
    """Quantized programs, by scheme; calibration feeds full sequences at positions 0..L-1."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, VOCAB, (B, N), generator=g), torch.arange(N)) for _ in range(3)]
    out = {}

    def get(name):
        if name not in out:
            prepared = quantkit.prepare(program, _scheme(name).quantizer())
            quantkit.calibrate(prepared, batches, progress=False)
            out[name] = quantkit.convert(prepared)
        return out[name]

    return get


@pytest.mark.parametrize("scheme, dequantized", [("w8a8", "dequantize_per_tensor"),
                                                 ("w4a16", "dequantize_per_channel_group")])
def test_quantized_program_decodes_like_its_full_forward(converted, program, llm, tokens, scheme, dequantized):
    qgm = converted(scheme)
    assert kv_cache_info(qgm) == kv_cache_info(program)  # prepare/convert keep the record
    n_deq = sum(c for t, c in ops(qgm).items() if dequantized in t)
    assert n_deq >= 7 * llm.config.num_hidden_layers + 1, ops(qgm)  # every linear and lm_head
    got = prefill_then_decode(qgm, tokens[:, :9], prompt=5)
    with torch.no_grad():
        ref = qgm(tokens[:, :9], torch.arange(9))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert not torch.allclose(ref, full_forward(llm, tokens[:, :9]), atol=1e-4)  # it is quantized


def test_save_load_round_trip(converted, tokens, tmp_path):
    qgm = converted("w8a8")
    expected = prefill_then_decode(qgm, tokens[:, :8], prompt=5)  # prefill then 3 decode steps
    quantkit.save(qgm, tmp_path / "lm")
    doc = json.loads((tmp_path / "lm" / "quantization.json").read_text())
    assert doc["max_cache_len"] == N and doc["kv_cache"]["max_cache_len"] == N
    loaded = quantkit.load(tmp_path / "lm")
    info = kv_cache_info(loaded)
    assert {k: v for k, v in info.items() if k != "buffers"} == \
        {k: v for k, v in kv_cache_info(qgm).items() if k != "buffers"}
    buffers = dict(loaded.named_buffers())
    assert all(buffers[name].shape == (B, info["num_kv_heads"], N, info["head_dim"]) for name in info["buffers"])
    torch.testing.assert_close(prefill_then_decode(loaded, tokens[:, :8], prompt=5), expected, atol=0, rtol=0)
    with pytest.raises(KVCacheError, match=f"a prompt of {N + 1} tokens does not fit the KV cache of "
                                           f"max_cache_len={N}"):
        loaded(torch.zeros(B, N + 1, dtype=torch.long), torch.arange(N + 1))
    # saved again from the loaded program: the same record
    quantkit.save(loaded, tmp_path / "again")
    assert kv_cache_info(quantkit.load(tmp_path / "again"))["max_cache_len"] == N


def test_errors(llm, program, tokens):
    with pytest.raises(CaptureError, match=r"max_cache_len needs a Hugging Face causal LM with an lm_head, "
                                           r"got LlamaModel"):
        quantkit.capture(llm.model, tokens[:, :4], max_cache_len=N)
    with pytest.raises(CaptureError, match=r"max_cache_len must be 1\.\.64 \(the model's max_position_embeddings\), "
                                           r"got 0"):
        quantkit.capture(llm, tokens[:, :4], max_cache_len=0)
    with pytest.raises(CaptureError, match=r"max_cache_len must be 1\.\.64 .*got 65"):
        quantkit.capture(llm, tokens[:, :4], max_cache_len=65)
    with pytest.raises(CaptureError, match=r"the example has 12 tokens, more than max_cache_len=8"):
        quantkit.capture(llm, tokens, max_cache_len=8)
    with pytest.raises(CaptureError, match="kv_cache and kv_scales need max_cache_len"):
        quantkit.capture(llm, tokens, kv_cache="int8")
    # at call time: longer than the cache, or another batch, is one line (not torch.export's guard)
    with pytest.raises(KVCacheError, match=f"a prompt of {N + 1} tokens does not fit"):
        program(torch.zeros(B, N + 1, dtype=torch.long), torch.arange(N + 1))
    with pytest.raises(KVCacheError, match=f"holds a batch of {B}, got 1"):
        program(tokens[:1, :3], torch.arange(3))
    for err in (CaptureError, KVCacheError):
        assert issubclass(err, ValueError)


def test_quantized_cache_save_load(llm, tokens, tmp_path):
    """An int8 per-head cache (``pipeline._kv_cache``) is stored int8 with its scales as buffers,
    and its artifact decodes bit for bit as the program it was saved from. GPTQ's block-cached
    calibration replays each block on stored values: the cache's write positions must not drift."""
    from quantkit.pipeline._kv_cache import calibrate_kv_scales

    g = torch.Generator().manual_seed(3)
    scales = calibrate_kv_scales(llm, [torch.randint(0, VOCAB, (B, N), generator=g)], kv_cache="int8",
                                 granularity="per-head")
    gm = quantkit.capture(llm, tokens[:, :5], max_cache_len=N, kv_cache="int8", kv_scales=scales)
    prepared = quantkit.prepare(gm, dataclasses.replace(_scheme("w4a16"), algorithm="gptq").quantizer())
    quantkit.calibrate(prepared, [(tokens, torch.arange(N)), (tokens.flip(1), torch.arange(N))], progress=False)
    qgm = quantkit.convert(prepared)
    expected = prefill_then_decode(qgm, tokens[:, :8], prompt=5)
    quantkit.save(qgm, tmp_path / "lm")
    loaded = quantkit.load(tmp_path / "lm")
    info = kv_cache_info(loaded)
    assert (info["format"], info["granularity"]) == ("int8", "per-head")
    buffers = dict(loaded.named_buffers())
    stores = [buffers[n] for n in info["buffers"] if n.endswith(("_keys", "_values"))]
    assert len(stores) == 2 * llm.config.num_hidden_layers and all(t.dtype == torch.int8 for t in stores)
    torch.testing.assert_close(prefill_then_decode(loaded, tokens[:, :8], prompt=5), expected, atol=0, rtol=0)


def test_prepared_and_converted_keep_the_length_check(program, converted):
    """prepare and convert build new modules: the too-long call is still a one-line KVCacheError
    (not torch.export's guard error) on each, and on a fresh prepare of the same program."""
    prepared = quantkit.prepare(program, _scheme("w8a8").quantizer())
    too_long = (torch.zeros(B, N + 1, dtype=torch.long), torch.arange(N + 1))
    for gm in (prepared, converted("w8a8")):
        with pytest.raises(KVCacheError, match=f"a prompt of {N + 1} tokens does not fit the KV cache of "
                                               f"max_cache_len={N}"):
            gm(*too_long)
