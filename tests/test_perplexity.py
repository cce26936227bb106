"""quantkit.metrics.perplexity against references written here, on tiny random Llamas and on SmolLM2.

Two references: the strided loop of transformers' docs ("Perplexity of fixed-length models",
labels -100 outside the scored tokens, transformers' own loss), and the same windows scored with a
float64 log-softmax written out by hand.
"""

import math

import pytest
import torch

import quantkit
from quantkit._errors import QuantkitError
from quantkit.metrics import perplexity

transformers = pytest.importorskip("transformers")

VOCAB = 112


def _tiny_llama(seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=vocab, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # larger weights than the init's std 0.02, so the logits are far from uniform and windows matter
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


def _hf_docs_ppl(model, ids, window, stride):
    """The loop from transformers' perplexity docs (transformers' own shifted, averaged loss)."""
    seq_len = ids.size(1)
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + window, seq_len)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        # the docs count `valid labels - batch` for the shift inside the model, which is right only when
        # a row's first label is valid (stride == window); the loss averages the shifted labels: count those
        num_loss_tokens = (target_ids[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll_sum / n_tokens)


def _float64_ppl(model, ids, window, stride):
    """Each token t >= 1 scored once, by the first window that holds it with context (t > begin),
    as -log softmax(logits[t - 1])[ids[t]] in float64."""
    ids = ids[0]
    scored = {}
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        with torch.no_grad():
            logits = model(ids[None, begin:end]).logits[0].double()
        for t in range(begin + 1, end):
            if t not in scored:
                row = logits[t - 1 - begin]
                scored[t] = (torch.logsumexp(row, 0) - row[ids[t]]).item()
        if end == len(ids):
            break
    # with stride == window the first token of each window has no context and is not scored
    return math.exp(sum(scored.values()) / len(scored))


@pytest.fixture(scope="module")
def llama():
    return _tiny_llama()


@pytest.fixture(scope="module")
def stream():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (1, 101), generator=g)


@pytest.mark.parametrize("window,stride,batch_size", [(16, None, 1), (16, 8, 1), (16, 5, 3), (32, 32, 4), (200, None, 1)])
def test_equals_the_references(llama, stream, window, stride, batch_size):
    got = perplexity(llama, stream, window=window, stride=stride, batch_size=batch_size)
    s = window if stride is None else stride
    docs = _hf_docs_ppl(llama, stream, window, s)
    ref = _float64_ppl(llama, stream, window, s)
    # the same windows, both in float64; float32 logits of a padded last window differ in the last bits
    assert got == pytest.approx(ref, rel=1e-6), (got, ref)
    assert got == pytest.approx(docs, rel=1e-5), (got, docs)  # transformers' float32 loss
    assert 3 < got < 10 * VOCAB  # a real spread: context windows change it (see below)


def test_more_context_changes_the_score(llama, stream):
    # disjoint windows of 8 and a sliding window with stride 1 differ: context is really used
    ids = stream[:, :40]
    assert perplexity(llama, ids, window=8) != pytest.approx(perplexity(llama, ids, window=8, stride=1), rel=1e-4)


def test_token_id_forms(llama, stream):
    ref = perplexity(llama, stream, window=16)
    assert perplexity(llama, stream[0], window=16) == ref
    assert perplexity(llama, stream[0].tolist(), window=16) == ref


def test_captured_programs(llama, stream):
    # a full-sequence program (batch dynamic, length fixed to the example's) returns a ModelOutput
    ids = stream[:, :96]
    gm = quantkit.capture(llama, (ids[:, :16],))
    ref = perplexity(llama, ids, window=16)
    assert perplexity(gm, ids, window=16, batch_size=2) == pytest.approx(ref, rel=1e-6)
    with pytest.raises(QuantkitError, match="exactly 16 tokens per sequence .*pass window=16"):
        perplexity(gm, ids, window=32)
    # the last window is short (101 % 16 = 5 tokens): padded on the right to the fixed length
    assert perplexity(gm, stream, window=16) == pytest.approx(perplexity(llama, stream, window=16), rel=1e-6)


def test_kv_program(llama, stream):
    gm = quantkit.capture(llama, (stream[:, :8],), max_cache_len=48)
    for window, stride in ((48, None), (20, 7)):
        ref = perplexity(llama, stream, window=window, stride=stride)
        assert perplexity(gm, stream, window=window, stride=stride) == pytest.approx(ref, rel=1e-6)
    with pytest.raises(QuantkitError, match="window=64 does not fit the program's KV cache of max_cache_len=48"):
        perplexity(gm, stream, window=64)


@pytest.mark.parametrize("kwargs,tokens,match", [
    ({"window": 1}, None, "window must be at least 2"),
    ({"window": 8, "stride": 9}, None, r"stride must be 1..window \(8\), got 9"),
    ({"stride": 0}, None, "stride must be"),
    ({"batch_size": 0}, None, "batch_size must be at least 1"),
    ({"window": 8.0}, None, "window must be an int, got float"),
    ({}, torch.tensor([5]), "at least 2 tokens, got 1"),
    ({}, torch.rand(10), "token ids"),
    ({}, torch.zeros(2, 10, dtype=torch.long), r"one stream of token ids .*shape \[2, 10\]"),
])
def test_bad_arguments(llama, stream, kwargs, tokens, match):
    with pytest.raises(QuantkitError, match=match):
        perplexity(llama, stream if tokens is None else tokens, **kwargs)


class _Pooled(torch.nn.Module):
    """A sentence encoder: one vector per sequence, no per-token logits."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 7)

    def forward(self, ids):
        return self.emb(ids).mean(1)


def test_not_a_language_model(stream):
    with pytest.raises(QuantkitError, match=r"next-token logits \[batch, length, vocab\] from _Pooled, got \[1, 7\]"):
        perplexity(_Pooled().eval(), stream, window=8)


SMOLLM2_TOKENS = 512  # 2 windows of 256: ~25 s on 2 busy cores (load 6)


def test_smollm2_on_heldout_web_text(smollm2_dir, web_text):
    """A real model on real held-out text: finite, sane, and far below a random-weight model's."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    ids = tokenizer(web_text.heldout_text()[:20000], return_tensors="pt").input_ids[:, :SMOLLM2_TOKENS]
    assert ids.shape[1] == SMOLLM2_TOKENS
    ppl = perplexity(model, ids, window=256)
    assert math.isfinite(ppl) and 1.5 < ppl < 50, ppl
    # random weights (SmolLM2's vocabulary, a tiny body) predict near-uniformly: about the vocabulary size
    random_lm = _tiny_llama(vocab=model.config.vocab_size)
    with torch.no_grad():
        for p in random_lm.parameters():
            if p.dim() == 2:
                p.div_(4)  # back to the init's scale
    noise = perplexity(random_lm, ids, window=256)
    assert 0.5 * model.config.vocab_size < noise < 2 * model.config.vocab_size, noise
    assert ppl < noise / 500, (ppl, noise)


# --- quantkit eval DIR --data FILE.txt of a causal LM ----------------------------------------

def _one_error_line(stderr: str) -> str:
    lines = [ln.split("\r")[-1] for ln in stderr.split("\n") if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, lines
    return lines[0]


class _KVCalls(torch.nn.Module):
    """A KV program called as the references call a model: model(ids).logits, a fresh sequence each time."""

    def __init__(self, program):
        super().__init__()
        self.program = program

    def forward(self, ids):
        return type("Out", (), {"logits": self.program(ids, torch.arange(ids.shape[1]))})


@pytest.fixture(scope="module")
def lm_artifacts(tmp_path_factory):
    """A tiny Llama folder with MiniLM's tokenizer (vocab 30522), its w8a8 KV-cache program and its
    w8a8 full-sequence program (both saved from Python), and a held-out text file."""
    import shutil

    from quantkit import _hf

    root = tmp_path_factory.mktemp("lm")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=30522, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(root / "llama"))
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(_hf.default_model_path() / f, root / "llama" / f)
    g = torch.Generator().manual_seed(2)
    calib = [torch.randint(0, 30522, (1, 16), generator=g) for _ in range(3)]
    kv = quantkit.capture(model, (calib[0],), max_cache_len=64)
    quantkit.save(quantkit.quantize(kv, (calib[0],), [(c, torch.arange(16)) for c in calib], scheme="w8a8"),
                  str(root / "kv"))
    full = quantkit.capture(model, (calib[0],))
    quantkit.save(quantkit.quantize(full, (calib[0],), [(c,) for c in calib], scheme="w8a8"), str(root / "full"))
    text = root / "held.txt"
    text.write_text("In the beginning God created the heavens and the earth. The earth was formless and empty. " * 12)
    return root, model


def _ids(root, max_tokens):
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "llama"))
    return tok((root / "held.txt").read_text(), return_tensors="pt").input_ids[:, :max_tokens]


def test_eval_kv_artifact(lm_artifacts, capsys):
    import json

    from quantkit.cli import main

    root, model = lm_artifacts
    args = ["eval", str(root / "kv"), "--data", str(root / "held.txt"), "--tokenizer", str(root / "llama"),
            "--model", str(root / "llama"), "--max-tokens", "150", "--no-compile", "--quiet"]
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    ids = _ids(root, 150)
    assert res["tokens"] == 150 and res["window"] == 64  # 256 does not fit the cache of 64
    # the program's and the float model's perplexity, each against the float64 reference written above
    q_ref = _float64_ppl(_KVCalls(quantkit.load(str(root / "kv"))), ids, 64, 64)
    assert res["perplexity"] == pytest.approx(q_ref, rel=1e-6)
    assert res["float_perplexity"] == pytest.approx(_float64_ppl(model, ids, 64, 64), rel=1e-6)
    assert res["perplexity"] != res["float_perplexity"]  # w8a8 moved it
    d = res["decode"]
    assert (d["prompt_tokens"], d["new_tokens"], d["batch_size"]) == (32, 32, 1) and d["decode_tokens_per_s"] > 0
    # the text report, without a float model (saved from Python, no --model)
    assert main(args[:6] + ["--max-tokens", "60", "--window", "32", "--stride", "16", "--no-compile", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "60 tokens, window 32, stride 16" in out
    q = perplexity(quantkit.load(str(root / "kv")), ids[:, :60], window=32, stride=16)
    assert f"quantized: {q:.4f}\n" in out
    assert "no float model to compare with (the artifact was saved from Python): pass --model DIR" in out
    assert "decode: " in out and " tokens/s, prefill " in out


def test_eval_full_sequence_program(lm_artifacts, capsys):
    from quantkit.cli import main

    root, model = lm_artifacts
    assert main(["eval", str(root / "full"), "--data", str(root / "held.txt"), "--tokenizer", str(root / "llama"),
                 "--model", str(root / "llama"), "--max-tokens", "100", "--quiet"]) == 0
    out = capsys.readouterr().out
    # the window defaults to the program's own length (captured from a [1, 16] example)
    assert "100 tokens, window 16, stride 16" in out
    ids = _ids(root, 100)
    q, f = perplexity(quantkit.load(str(root / "full")), ids, window=16), perplexity(model, ids, window=16)
    assert f == pytest.approx(_float64_ppl(model, ids, 16, 16), rel=1e-6)
    assert f"quantized: {q:.4f}   float: {f:.4f}   ({100 * (q / f - 1):+.2f}%)" in out
    assert "decode tokens/s not measured: the program has no KV cache" in out


@pytest.mark.parametrize("content,extra,match,code", [
    (b"", (), "is empty; pass a file of held-out text", 1),
    (b"  \n\t\n", (), "is empty", 1),
    (b"text\x00\x01binary", (), r"is binary \(it holds NUL bytes\)", 1),
    (b"caf\xe9 latin-1", (), r"is not UTF-8 text \(byte 3\)", 1),
    (None, (), "does not exist; pass a UTF-8 text file", 1),
    ("dir", (), "is not a file; perplexity is measured on one UTF-8 text file", 1),
    (b"fine text here", ("--no-tokenizer",), "holds no tokenizer .*pass --tokenizer DIR", 1),
    (b"fine text here", ("--num", "3"), "--num counts samples; a causal LM's perplexity takes --max-tokens N", 2),
    (b"fine text here", ("--window", "1"), "--window must be at least 2, got 1", 2),
    (b"fine text here", ("--window", "8", "--stride", "9"), r"--stride must be at most the window \(8\), got 9", 2),
    (b"fine text here", ("--window", "65"), "window=65 does not fit the program's KV cache of max_cache_len=64", 1),
])
def test_eval_bad_data_and_options(lm_artifacts, tmp_path, capsys, content, extra, match, code):
    import re

    from quantkit.cli import main

    root, _ = lm_artifacts
    data = tmp_path / "data.txt"
    if content == "dir":
        data.mkdir()
    elif content is not None:
        data.write_bytes(content)
    tok = [] if "--no-tokenizer" in extra else ["--tokenizer", str(root / "llama")]
    flags = [e for e in extra if e != "--no-tokenizer"]
    assert main(["eval", str(root / "kv"), "--data", str(data), *tok, *flags, "--no-compile", "--quiet"]) == code
    assert re.search(match, _one_error_line(capsys.readouterr().err))


def test_eval_kv_artifact_needs_data(lm_artifacts, capsys):
    from quantkit.cli import main

    root, _ = lm_artifacts
    assert main(["eval", str(root / "kv"), "--tokenizer", str(root / "llama")]) == 2
    assert "causal LM with a KV cache: pass --data FILE.txt" in _one_error_line(capsys.readouterr().err)
