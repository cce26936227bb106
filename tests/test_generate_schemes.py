"""Every scheme generates: ``quantize(..., max_cache_len=N)`` gives a program whose compiled greedy
tokens (``generate(compile=True)``: the scheme's lowering passes and kernels) equal those of its
reference q/dq program (``compile=False``: the converted graph as it is).

The model is a tiny random Llama (2 layers, hidden 64, vocab 128). On random weights two logits can
lie within a kernel's rounding of each other (measured: compiled and reference logits differ by up
to 1.5e-5 for w4a16, logits of std 0.16, while the smallest top-1 margin along a w8a8 continuation
is 1e-4), so a flipped near-tie would fail the test without a bug. Scaling the lm_head does not help:
it scales the rounding differences with the margins. Instead the tokens must agree up to the first
step whose reference margin is below ``TIE`` (60x the measured difference), and at least
``MIN_DECISIVE`` of the 8 steps must be decisive, so the test cannot pass on near-ties alone (with
these seeds every scheme's 8 steps are decisive but w8a8's last, margin 1e-4: 7 tokens compared).

Compiling here is ``quantkit.compile(..., backend="eager")``: its FX lowerings (the int4/int8/FP8
kernels, the reference fallbacks) rewrite the graph exactly as for Inductor, and Dynamo traces the
prefill and decode graphs; only Inductor's code generation is left out (measured on 2 loaded cores:
about 100 s for one scheme through Inductor, 7-20 s with the eager backend). ``test_inductor_w4a16`` (slow) runs one scheme through
Inductor itself. The schemes share one captured program (each is prepared from a copy);
``test_quantize_with_max_cache_len`` runs ``quantize(..., max_cache_len=N, kv_cache="int8")`` whole.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import quantkit
from quantkit.generation import _generate as generation_impl
from quantkit.lowering._compile import compile as quantkit_compile
from quantkit.pipeline import kv_cache_info

transformers = pytest.importorskip("transformers")

VOCAB, MAX_LEN, PROMPT, NEW = 128, 24, 6, 8
TIE = 1e-3  # a top-1 margin below this is a near-tie (see the module doc)
MIN_DECISIVE = 4  # of the NEW greedy steps, at least this many before the first near-tie
GROUP = 32  # hidden 64, intermediate 128: groups of 32 divide every linear's input

SCHEMES = [
    ("w8a8", {}), ("w8a8-dynamic", {}), ("w8a8-per-token", {}),
    ("w4a16", {"algorithm": "rtn"}), ("w4a16", {"algorithm": "gptq"}), ("w4a16", {"algorithm": "awq"}),
    ("w8a16", {}), ("nf4", {}), ("fp8", {}), ("fp8-dynamic", {}),
]


@pytest.fixture(scope="module")
def llm():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=g)
    calib = [torch.randint(0, VOCAB, (1, 16), generator=g) for _ in range(4)]
    return prompt, calib


def _config(name: str, extra: dict):
    config = quantkit.get_scheme(name)
    changes = dict(extra)
    if getattr(config, "group_size", None):
        changes["group_size"] = GROUP
    return dataclasses.replace(config, **changes) if changes else config


@pytest.fixture(scope="module")
def program(llm, data):
    return quantkit.capture(llm, data[0], max_cache_len=MAX_LEN)


@pytest.fixture
def eager_backend(monkeypatch):
    """generate()'s compile step: quantkit.compile's lowerings, then Dynamo with the eager backend."""
    monkeypatch.setattr(generation_impl, "quantkit_compile", functools.partial(quantkit_compile, backend="eager"))
    generation_impl.clear_compiled()
    yield
    generation_impl.clear_compiled()


def _margins(program, ids) -> torch.Tensor:
    """The gap between the best and second-best logit at each greedy step of a continuation."""
    with torch.no_grad():
        logits = program(ids, torch.arange(ids.shape[1]))[0, PROMPT - 1:-1]
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def _check_generates(qlm, llm, prompt, what: str) -> int:
    """Compiled greedy tokens equal the reference program's up to its first near-tie; returns how many."""
    reference = quantkit.generate(qlm, prompt, max_new_tokens=NEW, compile=False)
    compiled = quantkit.generate(qlm, prompt, max_new_tokens=NEW, compile=True)
    assert reference.shape == compiled.shape == (1, PROMPT + NEW)
    margins = _margins(qlm, reference)
    ties = (margins < TIE).nonzero()
    decisive = int(ties[0]) if len(ties) else NEW  # the tokens before the first near-tie (it may flip)
    assert decisive >= MIN_DECISIVE, f"{what}: a near-tie at step {decisive} (margins {margins.tolist()})"
    got, want = compiled[0, PROMPT:PROMPT + decisive].tolist(), reference[0, PROMPT:PROMPT + decisive].tolist()
    assert got == want, f"{what}: compiled {got} vs reference {want} (top-1 margins {margins.tolist()})"
    with torch.no_grad():  # and it is quantized: its logits are not the float model's
        ref_logits = llm(reference, use_cache=False).logits
        q_logits = qlm(reference, torch.arange(reference.shape[1]))
    assert not torch.allclose(q_logits, ref_logits, atol=1e-4), what
    return decisive


@pytest.mark.parametrize("name, extra", SCHEMES, ids=[n + ("-" + e["algorithm"] if e else "") for n, e in SCHEMES])
def test_scheme_generates_its_reference_tokens(llm, data, program, eager_backend, name, extra):
    prompt, calib = data
    prepared = quantkit.prepare(program, _config(name, extra).quantizer())
    quantkit.calibrate(prepared, [(ids, torch.arange(ids.shape[1])) for ids in calib], progress=False)
    qlm = quantkit.convert(prepared)
    assert kv_cache_info(qlm) == kv_cache_info(program)
    _check_generates(qlm, llm, prompt, f"{name} {extra}")


def test_quantize_with_max_cache_len(llm, data, eager_backend):
    """quantize(max_cache_len=N, kv_cache="int8"): token-id batches of 4 rows calibrate a batch-1
    program row by row (padding dropped), the int8 cache's scales come from the same data, and the
    result generates."""
    prompt, calib = data
    rows = torch.cat(calib)
    mask = torch.ones_like(rows)
    mask[0, 12:] = 0  # a padded row: its pad tokens are not calibrated on
    qlm = quantkit.quantize(llm, prompt, [{"input_ids": rows, "attention_mask": mask}], scheme="w8a8",
                            max_cache_len=MAX_LEN, kv_cache="int8", progress=False)
    info = kv_cache_info(qlm)
    assert (info["max_cache_len"], info["batch_size"], info["format"]) == (MAX_LEN, 1, "int8")
    assert qlm.meta["quantkit_calibrated_batches"] == 4
    stores = dict(qlm.named_buffers())
    assert all(stores[n].dtype == torch.int8 for n in info["buffers"] if n.endswith(("_keys", "_values")))
    _check_generates(qlm, llm, prompt, "w8a8, int8 cache")


def test_quantize_cache_errors(llm, data):
    prompt, calib = data
    with pytest.raises(quantkit.CaptureError, match="kv_cache and kv_scales need max_cache_len"):
        quantkit.quantize(llm, prompt, calib, kv_cache="int8", progress=False)
    with pytest.raises(quantkit.CalibrationError, match=r"a calibration sequence has 16 tokens, more than "
                                                        r"max_cache_len=8; cut the sequences"):
        quantkit.quantize(llm, prompt, calib, max_cache_len=8, progress=False)
    with pytest.raises(quantkit.CalibrationError, match=r"holds a batch of 2, but a calibration batch has 1"):
        quantkit.quantize(llm, torch.cat([prompt, prompt]), calib, max_cache_len=MAX_LEN, progress=False)
    with pytest.raises(quantkit.CaptureError, match="needs a Hugging Face causal LM with an lm_head, got LlamaModel"):
        quantkit.quantize(llm.model, prompt, calib, max_cache_len=MAX_LEN, progress=False)


@pytest.mark.slow
def test_inductor_w4a16(llm, data):
    """One scheme through Inductor itself (the default generate path): int4 weights through the
    CPU int4 kernel, tokens equal to the reference program's."""
    prompt, calib = data
    qlm = quantkit.quantize(llm, prompt, calib, scheme=_config("w4a16", {}), max_cache_len=MAX_LEN, progress=False)
    generation_impl.clear_compiled()
    _check_generates(qlm, llm, prompt, "w4a16 through Inductor")
    generation_impl.clear_compiled()
