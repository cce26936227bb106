"""``quantkit quantize MODEL --max-cache-len N``: a generating artifact, run by ``quantkit generate``
and ``quantkit eval --data`` as it is (no capture there), with a float or a stored int8 KV cache.

References: ``quantkit.generate`` on the loaded artifact's program (``compile=False``, the reference
q/dq graph) for the CLI's tokens; ``quantkit.metrics.perplexity`` of the loaded program for eval's
number; the stored buffers' dtypes for the quantized cache.
"""

from __future__ import annotations

import json

import pytest
import torch

import quantkit
from quantkit.cli._main import main
from quantkit.pipeline import kv_cache_info

transformers = pytest.importorskip("transformers")

VOCAB, N = 96, 32


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama folder with a word-level tokenizer, calibration and held-out text."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    root = tmp_path_factory.mktemp("lmq")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(root / "llama")
    _word_tokenizer().save_pretrained(root / "llama")
    g = torch.Generator().manual_seed(1)
    lines = [" ".join(f"w{int(t)}" for t in torch.randint(1, VOCAB, (int(n),), generator=g))
             for n in torch.randint(6, 16, (10,), generator=g)]
    (root / "calib.txt").write_text("\n".join(lines) + "\n")
    (root / "held.txt").write_text(" ".join(f"w{int(t)}" for t in torch.randint(1, VOCAB, (80,), generator=g)))
    return root


def _quantize(root, out, *extra):
    return main(["quantize", str(root / "llama"), "--out", str(root / out), "--calib", str(root / "calib.txt"),
                 "--seq-len", "16", "--batch-size", "4", "--max-cache-len", str(N), *extra])


def test_quantize_generate_eval(folders, capsys):
    assert _quantize(folders, "w8a8", "--scheme", "w8a8") == 0
    out, err = capsys.readouterr()
    assert "KV cache of 32 positions (float); held-out perplexity" in out, (out, err)
    doc = json.loads((folders / "w8a8" / "quantization.json").read_text())
    assert doc["kv_cache"]["max_cache_len"] == N and doc["kv_cache"]["batch_size"] == 1
    assert (folders / "w8a8" / "tokenizer" / "tokenizer.json").is_file()
    program = quantkit.load(folders / "w8a8")
    assert kv_cache_info(program)["max_cache_len"] == N

    tok = transformers.AutoTokenizer.from_pretrained(folders / "llama")
    prompt = "w9 w2 w60 w7"
    ids = tok(prompt, return_tensors="pt").input_ids
    expected = tok.decode(quantkit.generate(program, ids, max_new_tokens=5, compile=False)[0, ids.shape[1]:])
    assert main(["generate", str(folders / "w8a8"), "--prompt", prompt, "--max-new-tokens", "5", "--no-compile"]) == 0
    out, err = capsys.readouterr()
    assert expected in out and len(expected.split()) == 5, (out, err)

    assert main(["eval", str(folders / "w8a8"), "--data", str(folders / "held.txt"), "--window", "32",
                 "--no-compile", "--quiet", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    held = tok((folders / "held.txt").read_text(), return_tensors="pt").input_ids
    assert res["perplexity"] == pytest.approx(quantkit.metrics.perplexity(program, held, window=32), rel=1e-6)
    assert res["float_perplexity"] != res["perplexity"]  # the recorded float model, rebuilt


def test_int8_cache_is_stored_int8(folders, capsys):
    assert _quantize(folders, "fp8-kv", "--scheme", "fp8", "--kv-cache", "int8", "--kv-granularity", "per-head") == 0
    out, _ = capsys.readouterr()
    assert "KV cache of 32 positions (int8 per-head)" in out, out
    program = quantkit.load(folders / "fp8-kv")
    info = kv_cache_info(program)
    assert (info["format"], info["granularity"]) == ("int8", "per-head")
    buffers = dict(program.named_buffers())
    stores = [buffers[n] for n in info["buffers"] if n.endswith(("_keys", "_values"))]
    assert len(stores) == 4 and all(t.dtype == torch.int8 for t in stores)
    # the store is the K/V quantization: no q/dq on K and V in the graph on top of it
    doc = json.loads((folders / "fp8-kv" / "quantization.json").read_text())
    # (FP8Quantizer(kv_cache="int8") would record int8 activations at the attention's K and V)
    assert doc["recipe"]["kv_cache"] == "int8" and doc["tensors"]
    assert not [t for t in doc["tensors"] if t["kind"] == "activation" and t["dtype"] == "int8"]


@pytest.mark.parametrize("scheme", [["--scheme", "w8a8"], ["--scheme", "w4a16", "--group-size", "16"]])
def test_int8_cache_with_the_int8_and_int4_schemes(folders, capsys, scheme):
    """--kv-cache int8 with --max-cache-len stores the cache in int8 whatever the scheme; the graph has
    no int8 q/dq on K and V on top of the store, and the artifact generates what its program does."""
    name = f"kv-{scheme[1]}"
    assert _quantize(folders, name, *scheme, "--kv-cache", "int8") == 0
    out, err = capsys.readouterr()
    assert "KV cache of 32 positions (int8 per-tensor)" in out, (out, err)
    program = quantkit.load(folders / name)
    info = kv_cache_info(program)
    assert (info["format"], info["granularity"]) == ("int8", "per-tensor")
    buffers = dict(program.named_buffers())
    stores = [buffers[n] for n in info["buffers"] if n.endswith(("_keys", "_values"))]
    assert len(stores) == 4 and all(t.dtype == torch.int8 for t in stores)
    doc = json.loads((folders / name / "quantization.json").read_text())
    assert (doc["recipe"]["scheme"], doc["recipe"]["kv_cache"]) == (scheme[1], "int8")
    acts = [t["node"] for t in doc["tensors"] if t["kind"] == "activation"]
    assert bool(acts) == (scheme[1] == "w8a8")  # W8A8 records its linears' inputs, weight-only none
    assert not [a for a in acts if "-> scaled_dot_product_attention" in a], acts  # K/V: the store only
    ids = torch.tensor([[9, 2, 60, 7, 11, 3]])
    assert quantkit.generate(program, ids, max_new_tokens=4, compile=False).shape == (1, 10)
    # against the float HF model (independent of the capture): int8 weights and an int8 cache stay close
    float_model = transformers.AutoModelForCausalLM.from_pretrained(folders / "llama").eval()
    with torch.no_grad():
        got, want = program(ids, torch.arange(6)).float(), float_model(ids).logits
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert cos > 0.99, f"cosine {cos:.5f} to the float model"


def test_kv_cache_of_an_int8_scheme_needs_max_cache_len(folders, capsys):
    code = main(["quantize", str(folders / "llama"), "--out", str(folders / "bad-kv"), "--calib",
                 str(folders / "calib.txt"), "--scheme", "w4a16", "--kv-cache", "int8", "--quiet"])
    assert code == 2
    line = _one_line(capsys.readouterr().err)
    assert "--kv-cache with --scheme w4a16" in line and "--max-cache-len N" in line and "fp8-dynamic" in line


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("extra, code, words", [
    (["--seq-len", "40"], 2, "--seq-len 40 is longer than --max-cache-len 32"),
    (["--smoothquant", "0.5"], 2, "--max-cache-len cannot be combined with --smoothquant"),
    (["--task", "feature-extraction"], 1, "--max-cache-len needs a causal LM with an lm_head"),
    # the block-by-block path quantizes full-sequence blocks: it would write no generating artifact
    (["--sequential"], 2, "--max-cache-len is not available with layer-by-layer quantization"),
    (["--max-memory", "64KiB"], 2, "--max-cache-len is not available with layer-by-layer quantization"),
])
def test_errors_are_one_line(folders, capsys, extra, code, words):
    assert _quantize(folders, "bad", "--quiet", *extra) == code
    assert words in _one_line(capsys.readouterr().err)
