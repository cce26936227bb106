"""quantkit.generate and ``quantkit generate``: the decode loop over a static-KV-cache program.

References are independent of the code under test: transformers' own ``generate`` (greedy, eos),
plain Python loops for the top-k / top-p filters, and Dynamo's own compile counter for recompiles.
The main model is a tiny random Llama (2 layers, GQA 4/2, rotary) captured once per module.
"""

from __future__ import annotations


import pytest
import torch

import quantkit
from quantkit.cli._main import main
from quantkit.generation import GenerationError, clear_compiled, generate_with_stats, top_k_filter, top_p_filter
from quantkit.pipeline._kv_capture import KVCacheError

transformers = pytest.importorskip("transformers")

VOCAB, MAX_LEN, BATCH = 96, 32, 2


def _tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama():
    return _tiny_llama()


@pytest.fixture(scope="module")
def program(llama):
    example = torch.randint(0, VOCAB, (BATCH, 4), generator=torch.Generator().manual_seed(1))
    return quantkit.capture(llama, example, max_cache_len=MAX_LEN)


def _prompt(length: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def _hf_greedy(model, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("length", [5, 3, 1])
def test_greedy_equals_transformers(llama, program, length):
    """Token for token, for several prompt lengths on the same program (its cache is reused
    without a reset: stale slots past the position must not matter)."""
    ids = _prompt(length)
    out = quantkit.generate(program, ids, max_new_tokens=10, compile=False)
    ref = _hf_greedy(llama, ids, 10)
    assert out.shape == (BATCH, length + 10)
    assert torch.equal(out, ref), f"quantkit {out.tolist()} vs transformers {ref.tolist()}"


def test_generate_with_stats_is_public_and_counts_tokens(llama, program):
    """quantkit.generate_with_stats (the top-level name) gives transformers' greedy tokens and counts them."""
    assert "generate_with_stats" in quantkit.__all__
    ids = _prompt(4)
    out, stats = quantkit.generate_with_stats(program, ids, 6, compile=False)
    assert torch.equal(out, _hf_greedy(llama, ids, 6))
    assert (stats.batch_size, stats.prompt_tokens, stats.new_tokens, stats.decode_steps) == (BATCH, 4, 6, 5)
    assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.compile_s == 0.0


def _full_prefill_greedy(program, ids, n):
    """Greedy decoding with the program as captured: the prefill computes logits at every position."""
    out, position = ids, ids.shape[1]
    with torch.no_grad():
        logits = program(ids, torch.arange(position))
        assert logits.shape[1] == position
        for _ in range(n):
            token = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, token], dim=1)
            logits = program(token, torch.tensor([position]))
            position += 1
    return out


@pytest.mark.parametrize("scheme", [None, "w8a8"])
def test_last_position_prefill(llama, program, scheme):
    """The prefill's lm_head runs on the last position only (one slice inserted before it, after the
    final norm and before its input's q/dq); greedy tokens equal a full-prefill loop on the program."""
    from quantkit.generation._last_position import LAST_POSITION_META_KEY, last_position_program

    if scheme is not None:
        calib = [(_prompt(6, seed=s), torch.arange(6)) for s in (3, 4)]
        program = quantkit.convert(quantkit.calibrate(quantkit.prepare(
            program, quantkit.get_scheme(scheme).quantizer()), calib, progress=False))
    slices = lambda gm: sum(n.target is torch.ops.aten.slice.Tensor for n in gm.graph.nodes)  # noqa: E731
    last = last_position_program(program)
    assert slices(last) == slices(program) + 1 and last.meta[LAST_POSITION_META_KEY]
    assert last_position_program(last) is None  # not twice
    linear = next(n for n in last.graph.nodes if n.op == "output").args[0][0]
    assert linear.target is torch.ops.aten.linear.default
    chain = linear.args[0]  # the lm_head's input: the slice itself, or its q/dq (W8A8) on the slice
    while chain.target is not torch.ops.aten.slice.Tensor:
        chain = chain.args[0]
    assert len([n for n in last.graph.nodes if n.op == "call_function"]) == \
        len([n for n in program.graph.nodes if n.op == "call_function"]) + 1
    ids = _prompt(7, seed=5)
    with torch.no_grad():
        assert last(ids, torch.arange(7)).shape == (BATCH, 1, VOCAB)
        assert program(ids, torch.arange(7)).shape == (BATCH, 7, VOCAB)  # the program is not changed
    want = _full_prefill_greedy(program, ids, 8)
    assert torch.equal(quantkit.generate(program, ids, max_new_tokens=8, compile=False), want)
    if scheme is None:
        assert torch.equal(want, _hf_greedy(llama, ids, 8))


def test_compiled_once_no_recompiles(llama, program, monkeypatch):
    """compile=True compiles once per program: the dynamic prefill graph and the length-1 decode
    graph, then no recompile per token, for another prompt length, or on a second call.
    Dynamo's guards do not depend on the backend, so a recording backend stands in for Inductor;
    it counts the graphs that run the model (those with its matmuls: the cache's length-check hook
    is a frame of its own)."""
    torch._dynamo.reset()
    clear_compiled()
    model_graphs, calls = [], []
    real = torch.compile

    def recording_backend(gm, example_inputs):
        if any(n.op == "call_function" and "linear" in str(n.target) for n in gm.graph.nodes):
            model_graphs.append(gm)
        return gm.forward

    def recording_compile(model, **kwargs):
        calls.append(model)
        return real(model, backend=recording_backend)

    monkeypatch.setattr(torch, "compile", recording_compile)
    try:
        for length in (6, 4, 9, 1):
            ids = _prompt(length, seed=length)
            # warmup (the CLI's) first calls decode on a token sliced from the prompt: same graph
            out, _ = generate_with_stats(program, ids, 8, warmup=True) if length == 6 else \
                (quantkit.generate(program, ids, max_new_tokens=8), None)
            assert torch.equal(out, _hf_greedy(llama, ids, 8)), f"prompt of {length}"
            assert len(model_graphs) == 2, f"{len(model_graphs)} model graphs after a prompt of {length}"
        # compiled once, reused by the later calls: the program's last-position rewrite, on its own cache
        from quantkit.generation._last_position import LAST_POSITION_META_KEY

        assert len(calls) == 1 and calls[0].meta.get(LAST_POSITION_META_KEY), calls
        own = dict(program.named_buffers())
        shared = dict(calls[0].named_buffers())
        assert [n for n in own if n.startswith("kv_cache")] and all(own[n] is t for n, t in shared.items())
    finally:
        clear_compiled()
        torch._dynamo.reset()


def test_eos_stops_a_row(llama, program):
    """A row that emits eos is padded with it (transformers' default pad) and the loop stops once
    every row has; compared with transformers' generate given the same eos."""
    ids = _prompt(5)
    free = _hf_greedy(llama, ids, 12)
    eos = int(free[0, 5 + 2])  # row 0 emits it as its third new token
    out = quantkit.generate(program, ids, max_new_tokens=12, eos_token_id=eos, compile=False)
    ref = _hf_greedy(llama, ids, 12, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(out, ref), f"quantkit {out.tolist()} vs transformers {ref.tolist()}"
    assert (out[0, 5 + 2:] == eos).all()  # stopped and padded
    # a list of ids: either one ends a row
    other = int(free[1, 5 + 1])
    out2 = quantkit.generate(program, ids, max_new_tokens=12, eos_token_id=[eos, other], compile=False)
    ref2 = _hf_greedy(llama, ids, 12, eos_token_id=[eos, other], pad_token_id=eos)
    assert torch.equal(out2, ref2)
    assert out2.shape[1] <= 5 + 3


def test_sampling_is_reproducible_and_top_k_1_is_greedy(program):
    ids = _prompt(4)

    def sample(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return quantkit.generate(program, ids, max_new_tokens=6, do_sample=True, generator=g, compile=False, **kw)

    a, b = sample(7, temperature=0.8, top_p=0.9), sample(7, temperature=0.8, top_p=0.9)
    assert torch.equal(a, b)
    assert not torch.equal(sample(7), sample(8))  # 12 draws from a near-uniform vocabulary of 96
    greedy = quantkit.generate(program, ids, max_new_tokens=6, compile=False)
    assert torch.equal(sample(3, top_k=1, temperature=0.5), greedy)


def test_top_p_filter_equals_a_plain_nucleus():
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    for p in (0.05, 0.3, 0.75, 0.95):
        got = torch.isfinite(top_p_filter(logits, p))
        for row in range(logits.shape[0]):
            probs = torch.softmax(logits[row].double(), -1).tolist()
            order = sorted(range(len(probs)), key=lambda i: -probs[i])
            keep, total = set(), 0.0
            for i in order:  # most likely first, until the kept mass reaches p
                keep.add(i)
                total += probs[i]
                if total >= p:
                    break
            assert set(torch.nonzero(got[row]).flatten().tolist()) == keep, f"p={p} row {row}"


def test_top_k_filter_keeps_the_k_largest():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    got = torch.isfinite(top_k_filter(logits, 4))
    for row in range(3):
        vals = logits[row].tolist()
        assert set(torch.nonzero(got[row]).flatten().tolist()) == set(sorted(range(20), key=lambda i: -vals[i])[:4])


def test_too_long_prompt_and_wrong_batch_are_one_line_errors(program):
    with pytest.raises(KVCacheError, match=r"33 tokens, more than the program's max_cache_len=32") as exc:
        quantkit.generate(program, _prompt(MAX_LEN + 1), max_new_tokens=1, compile=False)
    assert "\n" not in str(exc.value) and "capture with max_cache_len >= 33" in str(exc.value)
    with pytest.raises(KVCacheError, match=r"needs 37 cache positions.*max_cache_len=32; lower max_new_tokens to "
                                           r"at most 3 or capture with max_cache_len >= 37"):
        quantkit.generate(program, _prompt(30), max_new_tokens=8, compile=False)
    # exactly full: 30 + 3 - 1 = 32 positions
    assert quantkit.generate(program, _prompt(30), max_new_tokens=3, compile=False).shape == (BATCH, 33)
    with pytest.raises(KVCacheError, match="batch of 2, got input_ids of batch 1"):
        quantkit.generate(program, _prompt(4)[:1], max_new_tokens=2, compile=False)


def test_bad_arguments_are_one_line_errors(llama, program):
    ids = _prompt(4)
    with pytest.raises(GenerationError, match="capture it first: quantkit.capture"):
        quantkit.generate(llama, ids)
    with pytest.raises(GenerationError, match="temperature must be a finite number > 0"):
        quantkit.generate(program, ids, do_sample=True, temperature=0.0)
    with pytest.raises(GenerationError, match="top_p must be in"):
        quantkit.generate(program, ids, do_sample=True, top_p=1.5)
    with pytest.raises(GenerationError, match=r"input_ids must be token ids \[batch, length\]"):
        quantkit.generate(program, ids[0])
    with pytest.raises(GenerationError, match="eos_token_id must be"):
        quantkit.generate(program, ids, eos_token_id="</s>")


def test_streamer_gets_prompt_then_each_token(program):
    seen = []

    class Recorder:
        def put(self, value):
            seen.append(value.clone())

        def end(self):
            seen.append("end")

    ids = _prompt(3)
    out = quantkit.generate(program, ids, max_new_tokens=4, compile=False, streamer=Recorder())
    assert torch.equal(seen[0], ids) and seen[-1] == "end" and len(seen) == 6
    assert torch.equal(torch.stack(seen[1:5], dim=1), out[:, 3:])


class _Compiled:
    """Stands for a compiled program (``_orig_mod``: generate runs it as it is) and records, per
    call, whether Dynamo's stance skips the guard check (``torch.compiler.set_stance``)."""

    def __init__(self, program):
        self._orig_mod, self.skipping = program, []

    def __call__(self, ids, positions):
        from torch._dynamo import eval_frame

        self.skipping.append(eval_frame._stance.skip_guard_eval_unsafe)
        return self._orig_mod(ids, positions)


def _skipping_now() -> bool:
    from torch._dynamo import eval_frame

    return eval_frame._stance.skip_guard_eval_unsafe


def test_decode_steps_after_the_first_skip_full_guard_checks(llama, program):
    """With compile=True the prefill and the first decode step run with Dynamo's full guard check
    (they may compile), the later steps only with the differentiating guards; the stance ends with
    the loop (also when a streamer raises), and compile=False never sets it. Tokens stay
    transformers' greedy ones."""
    ids = _prompt(5)
    run = _Compiled(program)
    out = quantkit.generate(run, ids, max_new_tokens=5)
    assert run.skipping == [False, False, True, True, True]
    assert torch.equal(out, _hf_greedy(llama, ids, 5))
    assert not _skipping_now()

    run = _Compiled(program)
    quantkit.generate(run, ids, max_new_tokens=5, compile=False)
    assert run.skipping == [False] * 5

    class Raises:
        def put(self, value):
            if value.dim() == 1 and _skipping_now():
                raise KeyboardInterrupt

        def end(self):
            pass

    run = _Compiled(program)
    with pytest.raises(KeyboardInterrupt):
        quantkit.generate(run, ids, max_new_tokens=5, streamer=Raises())
    assert run.skipping == [False, False] and not _skipping_now()  # raised in the stance, before step 2


# --- the CLI ---------------------------------------------------------------------------------

def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama checkpoint with a word-level tokenizer, and the same without one."""
    model = _tiny_llama(seed=3)
    root = tmp_path_factory.mktemp("gen")
    with_tok, without = root / "llama", root / "llama-no-tok"
    model.save_pretrained(with_tok)
    model.save_pretrained(without)
    _word_tokenizer().save_pretrained(with_tok)
    return with_tok, without


def test_cli_generate_streams_text_and_prints_speed(hf_dir, capsys):
    folder, _ = hf_dir
    prompt = "w5 w17 w3 w40"
    code = main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "6", "--no-compile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "prefill 4 tokens at" in err and "decode 5 tokens at" in err
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = _hf_greedy(model, ids, 6)
    expected = tok.decode(ref[0, ids.shape[1]:])
    assert len(expected.split()) == 6
    assert expected in out, f"stdout {out!r} lacks {expected!r}"
    assert "prefill" in err and "decode" in err and "tokens/s" in err


def test_cli_generate_without_tokenizer_is_one_line(hf_dir, capsys):
    _, folder = hf_dir
    code = main(["generate", str(folder), "--prompt", "w1 w2", "--no-compile"])
    _, err = capsys.readouterr()
    assert code == 1
    assert err.startswith("quantkit: error: no tokenizer in") and err.count("\n") == 1


def test_cli_generate_prompt_too_long_is_one_line(hf_dir, capsys):
    folder, _ = hf_dir
    code = main(["generate", str(folder), "--prompt", "w1 w2 w3 w4 w5", "--max-new-tokens", "4",
                 "--max-cache-len", "6", "--no-compile"])
    _, err = capsys.readouterr()
    assert code == 1 and err.count("\n") == 1
    assert "max_cache_len=6" in err and "--max-cache-len" in err


@pytest.mark.parametrize("extra, words", [(["--top-k", "3"], "apply to sampling; add --sample"),
                                          (["--sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
                                          (["--sample", "--temperature", "0"], "drop --sample for greedy"),
                                          (["--max-new-tokens", "-1"], "--max-new-tokens must be 0 or more")])
def test_cli_generate_bad_options_are_usage_errors(hf_dir, capsys, extra, words):
    folder, _ = hf_dir
    code = main(["generate", str(folder), "--prompt", "w1", "--no-compile", *extra])
    _, err = capsys.readouterr()
    assert code == 2 and words in err and err.count("\n") == 1, err


def test_cli_generate_from_an_artifact(hf_dir, tmp_path, capsys):
    """A saved w8a8 KV-cache program with its tokenizer in DIR/tokenizer: the CLI prints the tokens
    the reference q/dq program generates; without the tokenizer, one line says so."""
    folder, _ = hf_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "w9 w2 w60"
    ids = tok(prompt, return_tensors="pt").input_ids
    lm = quantkit.capture(model, ids, max_cache_len=16)
    prepared = quantkit.prepare(lm, quantkit.get_scheme("w8a8").quantizer())
    g = torch.Generator().manual_seed(4)
    quantkit.calibrate(prepared, [(torch.randint(1, VOCAB, (1, 16), generator=g), torch.arange(16))], progress=False)
    qlm = quantkit.convert(prepared)
    expected = tok.decode(quantkit.generate(qlm, ids, max_new_tokens=5, compile=False)[0, ids.shape[1]:])
    quantkit.save(qlm, tmp_path / "art")
    capsys.readouterr()  # the loading bars above
    code = main(["generate", str(tmp_path / "art"), "--prompt", prompt, "--max-new-tokens", "5", "--no-compile"])
    _, err = capsys.readouterr()
    assert code == 1 and err.startswith("quantkit: error: no tokenizer in") and err.count("\n") == 1
    tok.save_pretrained(tmp_path / "art" / "tokenizer")
    code = main(["generate", str(tmp_path / "art"), "--prompt", prompt, "--max-new-tokens", "5", "--no-compile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert expected in out and len(expected.split()) == 5, f"stdout {out!r} lacks {expected!r}"
    assert "decode 4 tokens at" in err
    code = main(["generate", str(tmp_path / "art"), "--prompt", prompt, "--max-new-tokens", "15", "--no-compile"])
    _, err = capsys.readouterr()
    assert code == 1 and "max_cache_len=16" in err and "--max-new-tokens 14 or less" in err


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers(smollm2_dir):
    """The real model: 16 greedy tokens of SmolLM2-135M (float) equal transformers' generate."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok("The Lord is my shepherd;", return_tensors="pt").input_ids
    lm = quantkit.capture(model, ids, max_cache_len=64)
    out = quantkit.generate(lm, ids, max_new_tokens=16, compile=False)
    ref = _hf_greedy(model, ids, 16, eos_token_id=None)
    assert torch.equal(out, ref), f"{tok.decode(out[0])!r} vs {tok.decode(ref[0])!r}"
