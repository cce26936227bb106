"""GGUF export (issue 30): quantkit's group-wise integers in Q4_0 / Q4_1 / Q8_0 blocks, names,
metadata and tokenizer as llama.cpp's converter writes them, one-line refusals, the CLI.

The references are independent of the export: quantkit's integers are read from the converted
graph (torch's ``dequantize_per_channel_group`` nodes, quantkit's two-per-byte int4 buffers
unpacked here), the files are read with the ``gguf`` package's ``GGUFReader``, the raw block
bytes decoded here from ggml's layout, and ``gguf.quants.dequantize`` decodes them too. Where
llama-cpp-python is installed, llama.cpp itself runs the file.
"""

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit._errors import QuantkitError  # noqa: E402
from quantkit.accuracy.rounding import ROUNDING_META_KEY  # noqa: E402
from quantkit.cli import main  # noqa: E402
from quantkit.quantizers import W8A8Quantizer, WeightOnlyQuantizer  # noqa: E402

GROUP_DQ = torch.ops.quantized_decomposed.dequantize_per_channel_group.default
LINEAR = torch.ops.aten.linear.default
TEXT = ["In the beginning God created the heavens and the earth.", "Now the earth was formless and empty.",
        "God said, Let there be light, and there was light.", "Numbers 1 2 3 and 42, the quick brown fox."]


def _tokenizer():
    """A byte-level BPE trained here (SmolLM2's pre-tokenizer: single digits, then byte-level)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TEXT * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>",
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                                chat_template="{{ messages }}")


def _tiny(tmp_path_factory, arch: str):
    torch.manual_seed(0)
    tok = _tokenizer()
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=320)  # vocab > the tokenizer's: [PAD] placeholders
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False))
    path = tmp_path_factory.mktemp(arch) / arch
    model.eval().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, len(tok), (2, 16), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    gm = quantkit.capture(model, batch, dynamic_shapes=_hf.dynamic_shapes(batch))
    return model, path, batch, gm


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _tiny(tmp_path_factory, "qwen2")


def _quantize(gm, batch, quantizer):
    prepared = quantkit.prepare(gm, quantizer)
    quantkit.calibrate(prepared, [batch], progress=False)
    return quantkit.convert(prepared)


def _get(qmodel, name):
    obj = qmodel
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _graph_weights(qmodel) -> dict:
    """HF module -> (integers [out, in] int32, scale, zero point) as quantkit's graph holds them."""
    out = {}
    for node in qmodel.graph.nodes:
        if node.target != LINEAR or getattr(node.args[1], "target", None) != GROUP_DQ:
            continue
        dq = node.args[1]
        src = dq.args[0]
        if src.op == "get_attr":
            q = _get(qmodel, src.target).to(torch.int32)
        else:  # quantkit::unpack_int4(packed, signed): two per byte, element 2i in the low nibble
            packed = _get(qmodel, src.args[0].target)
            lo, hi = (packed & 0xF).to(torch.int32), (packed >> 4).to(torch.int32)
            q = torch.stack([lo, hi], -1).reshape(*packed.shape[:-1], -1)
            q = torch.where(q > 7, q - 16, q) if src.args[1] else q
        stack = list(node.meta["nn_module_stack"].values())
        out[stack[-1][0].removeprefix("L['self'].")] = (
            q, _get(qmodel, dq.args[1].target).float(), _get(qmodel, dq.args[2].target).to(torch.int32),
            dq.args[3])
    return out


def _decode_raw(data: np.ndarray, kind: str):
    """ggml's block bytes, decoded here: (integers on the block's own grid, d, m or None), per block."""
    raw = data.reshape(data.shape[0], -1, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        return raw[..., 2:].copy().view(np.int8).astype(np.int32), d, None
    off = 4 if kind == "Q4_1" else 2
    qs = raw[..., off:off + 16].astype(np.int32)
    q = np.concatenate([qs & 0xF, qs >> 4], -1)  # weights 0..15 in the low nibbles, 16..31 in the high
    m = raw[..., 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else None
    return q, d, m


def _llama_perm(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp converter's Q/K row order, written out: within each head, rows i and i + d/2 adjacent."""
    half = rows // heads // 2
    return torch.tensor([h * 2 * half + j + k * half for h in range(heads) for j in range(half) for k in (0, 1)])


def _hf_to_gguf(arch: str, n_layers: int):
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2, n_layers)


@pytest.mark.parametrize("arch, bits, symmetric, kind, group", [
    ("llama", 4, True, "Q4_0", 32), ("llama", 4, False, "Q4_1", 32), ("llama", 8, True, "Q8_0", 32),
    ("qwen2", 4, True, "Q4_0", 32), ("qwen2", 4, False, "Q4_1", 32),
    ("llama", 4, False, "Q4_1", 64), ("llama", 8, True, "Q8_0", None),  # scales repeated per 32-block
])
def test_blocks_hold_quantkit_integers(request, tmp_path, arch, bits, symmetric, kind, group):
    """Every quantized linear's GGUF blocks hold quantkit's integers bit for bit (Llama's Q/K rows in
    the converter's order), its scales as fp16 (Q4_1's min as fp16 of -zp * s; a group of 64 or a
    row is blocks of 32 with the same scale), and ``gguf.quants.dequantize`` gives quantkit's
    dequantized weight to fp16 tolerance."""
    model, path, batch, gm = request.getfixturevalue(arch)
    qmodel = _quantize(gm, batch, WeightOnlyQuantizer(bits=bits, group_size=group, symmetric=symmetric))
    out = tmp_path / "m.gguf"
    res = quantkit.export_gguf(qmodel, out, model=path)
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    names = _hf_to_gguf(arch, 2)
    ours = _graph_weights(qmodel)
    assert len(ours) == 2 * 7 + 1  # 7 linears per layer and lm_head
    assert res.fp16_scale_error < 1e-3
    for module, (q, scale, zp, qmin) in ours.items():
        t = tensors[names.get_name(module + ".weight", try_suffixes=(".weight",))]
        assert t.tensor_type.name == kind, module
        n, k = q.shape
        assert list(t.shape) == [k, n]  # GGUF lists ne0 (the row length) first
        perm = torch.arange(n)
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            perm = _llama_perm(n, 4 if module.endswith("q_proj") else 2)
        reps = 32 * scale.reshape(n, -1).shape[1] // k  # blocks per group, inverted: 32 / group size
        expand = lambda t: t.reshape(n, -1).repeat_interleave(k // 32 // t.reshape(n, -1).shape[1], 1)  # noqa: E731
        assert reps in (0, 1)
        q, scale, zp = q[perm], expand(scale)[perm], expand(zp)[perm]
        got_q, d, m = _decode_raw(np.asarray(t.data), kind)
        unsigned = 8 if qmin == -8 else 0  # int4 on Q4's [0, 15]
        if kind == "Q4_0":
            want = (q - zp.repeat_interleave(32, 1) + 8).reshape(n, -1, 32)
        elif kind == "Q4_1":
            want = (q + unsigned).reshape(n, -1, 32)
        else:
            want = (q - zp.repeat_interleave(32, 1)).reshape(n, -1, 32)
        assert np.array_equal(got_q, want.numpy()), module
        assert np.array_equal(d.view(np.uint16), scale.half().numpy().view(np.uint16)), module
        if kind == "Q4_1":
            want_m = (-(zp + unsigned).float() * scale).half().numpy()
            assert np.array_equal(m.view(np.uint16), want_m.view(np.uint16)), module
        deq = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).copy()).reshape(n, k)
        ref = ((q - zp.repeat_interleave(32, 1)).float() * scale.repeat_interleave(32, 1))
        # fp16 rounding (2^-11 relative) of d times |q - zp|, plus Q4_1's m (|m| <= 15 s)
        steps = (q - zp.repeat_interleave(32, 1)).abs().max() + (16 if kind == "Q4_1" else 0)
        assert (deq - ref).abs().max() <= 2 ** -11 * steps * scale.max() * 1.01, module
    if arch == "qwen2":  # biases F32, untied lm_head as output.weight
        assert tensors["blk.0.attn_q.bias"].tensor_type.name == "F32" and "output.weight" in tensors
    else:  # tied: the embedding stays F32, the quantized lm_head is its own output.weight
        assert tensors["token_embd.weight"].tensor_type.name == "F32"
        assert tensors["output.weight"].tensor_type.name == kind


def _fields(reader) -> dict:
    out = {}
    for name, f in reader.fields.items():
        if not f.types:
            continue
        if f.types[0] == gguf.GGUFValueType.STRING:
            out[name] = bytes(f.parts[f.data[0]]).decode()
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            out[name] = len(f.data)
        else:
            out[name] = f.parts[f.data[0]].tolist()[0]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_export_metadata_and_tokenizer(request, tmp_path, arch):
    """The float HF model exports as F32 (2-d tensors F16 with float_dtype='float16'), with the
    hyperparameters and gpt2 tokenizer llama.cpp reads, values read back from config.json and the
    tokenizer themselves; F32 values equal the HF weights (Llama's Q rows permuted)."""
    model, path, _, _ = request.getfixturevalue(arch)
    out = tmp_path / "f.gguf"
    res = quantkit.export_gguf(model, out, model=path)
    assert set(res.tensors.values()) == {"F32"}
    f = _fields(gguf.GGUFReader(str(out)))
    cfg = json.loads((path / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    a = arch
    assert f["general.architecture"] == a
    assert (f[f"{a}.block_count"], f[f"{a}.embedding_length"], f[f"{a}.feed_forward_length"]) == (2, 64, 128)
    assert (f[f"{a}.attention.head_count"], f[f"{a}.attention.head_count_kv"]) == (4, 2)
    assert f[f"{a}.rope.freq_base"] == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert f[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
    assert f["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == ("smollm" if arch == "llama" else "qwen2")
    assert f["tokenizer.ggml.tokens"] == 320 and f["tokenizer.ggml.merges"] == len(
        json.loads((path / "tokenizer.json").read_text())["model"]["merges"])
    assert f["tokenizer.ggml.bos_token_id"] == tok.convert_tokens_to_ids("<|im_start|>")
    assert f["tokenizer.ggml.eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert f["tokenizer.chat_template"] == "{{ messages }}"
    if arch == "llama":
        assert f["llama.rope.dimension_count"] == 16 and f["llama.vocab_size"] == 320
    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    assert ("output.weight" in tensors) == (arch == "qwen2")  # tied: llama.cpp reuses token_embd
    wq = model.model.layers[0].self_attn.q_proj.weight.detach()
    got = torch.from_numpy(np.asarray(tensors["blk.0.attn_q.weight"].data).copy())
    assert torch.equal(got, wq[_llama_perm(64, 4)] if arch == "llama" else wq)
    half = quantkit.export_gguf(model, tmp_path / "h.gguf", model=path, float_dtype="float16")
    assert half.tensors["blk.0.attn_q.weight"] == "F16" and half.tensors["blk.0.attn_norm.weight"] == "F32"


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq"])
def test_llamacpp_runs_it(llama, tmp_path, algorithm):
    """llama.cpp itself loads the Q4_0 file and computes quantkit's logits (its 8-bit activations
    aside: measured min cosine 0.99996 on this model), GPTQ's rounding included."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model, path, batch, gm = llama
    qmodel = _quantize(gm, batch, WeightOnlyQuantizer(bits=4, group_size=32, symmetric=True, algorithm=algorithm,
                                                      awq_fold_only=algorithm == "awq"))
    out = tmp_path / "q.gguf"
    quantkit.export_gguf(qmodel, out, model=path)
    llm = llama_cpp.Llama(str(out), logits_all=True, n_threads=2, n_ctx=32, verbose=False)
    ids = batch["input_ids"][0]
    llm.eval(ids.tolist())
    got = torch.from_numpy(np.array(llm.scores[:ids.numel()], dtype=np.float32))
    with torch.no_grad():
        ref = qmodel(input_ids=ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long))["logits"][0]
    cos = torch.nn.functional.cosine_similarity(got.double(), ref.double(), -1)
    assert cos.min() >= 0.9995, cos.min()


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=4, group_size=16), "group size 16 (GGUF's Q4_0/Q4_1/Q8_0 blocks hold 32 weights: use a multiple"),
    (dict(bits=8, group_size=32, symmetric=False), "asymmetric int8 weights"),
    (dict(bits=4, group_size=32, scheme="nf4"), "NF4 weights"),
])
def test_refuses_weights_gguf_cannot_hold(llama, tmp_path, kwargs, message):
    """One line naming the layer and the reason, nothing written; with skip_unsupported those
    weights are written F16 of quantkit's dequantized values and listed."""
    _, path, batch, gm = llama
    qmodel = _quantize(gm, batch, WeightOnlyQuantizer(**kwargs))
    out = tmp_path / "x.gguf"
    with pytest.raises(QuantkitError) as exc:
        quantkit.export_gguf(qmodel, out, model=path)
    msg = _one_line(exc)
    assert message in msg and not out.exists()
    if kwargs.get("scheme") == "nf4":  # no GGUF type: refused with or without skip_unsupported
        assert "--scheme w4a16" in msg
        return
    assert "skip_unsupported=True" in msg
    res = quantkit.export_gguf(qmodel, out, model=path, skip_unsupported=True)
    assert res.kept_float and res.tensors["blk.0.attn_q.weight"] == "F32"


def test_refuses_awq_scales_left_as_a_mul(llama, tmp_path):
    """AWQ's default keeps 1/s as an explicit mul where it folds into no op: before grouped-query
    attention's o_proj (the other groups fold into the decomposed RMSNorms and the gated MLP's up
    rows); GGUF has no tensor for it: refused, one line naming the layer and awq_fold_only."""
    _, path, batch, gm = llama
    qmodel = _quantize(gm, batch, WeightOnlyQuantizer(bits=4, group_size=32, symmetric=True, algorithm="awq"))
    kinds = {r["folded_into"].split(":")[0] for r in qmodel.meta[ROUNDING_META_KEY] if r.get("folded_into")}
    assert kinds == {"norm", "gate", "mul"}, kinds
    with pytest.raises(QuantkitError) as exc:
        quantkit.export_gguf(qmodel, tmp_path / "x.gguf", model=path, skip_unsupported=True)
    msg = _one_line(exc)
    assert "o_proj scales a linear's input by a constant (AWQ" in msg and "awq_fold_only=True" in msg
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("algorithm", ["awq", "awq+gptq"])
def test_awq_folded_scales_load_in_transformers(llama, tmp_path, algorithm):
    """AWQ with awq_fold_only: 1/s folded into the RMSNorm weights and the up rows, o_proj unscaled,
    no mul left; the GGUF file, loaded by transformers' own GGUF reader (which dequantizes the
    blocks), computes quantkit's program; the norms it holds are the folded ones, and (AWQ's
    round to nearest) every group still spans its whole grid: the qparams follow the folded rows."""
    model, path, batch, gm = llama
    qmodel = _quantize(gm, batch, WeightOnlyQuantizer(bits=4, group_size=32, symmetric=True, algorithm=algorithm,
                                                      awq_fold_only=True))
    kinds = [r["folded_into"] for r in qmodel.meta[ROUNDING_META_KEY] if "folded_into" in r]
    assert not any(k == "mul" for k in kinds) and kinds.count("unscaled") >= 2  # each layer's o_proj
    assert any(str(k).startswith("gate:") for k in kinds) and any(str(k).startswith("norm:") for k in kinds)
    assert not any(k.startswith("_qk_smooth_inv_") for k, _ in qmodel.named_buffers())
    quantkit.export_gguf(qmodel, tmp_path / "a.gguf", model=path)
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "a.gguf")).tensors}
    norms = [torch.from_numpy(np.asarray(tensors[f"blk.{i}.{n}_norm.weight"].data).copy())
             / getattr(model.model.layers[i], f"{hf}_layernorm").weight.detach()
             for i in range(2) for n, hf in (("attn", "input"), ("ffn", "post_attention"))]
    assert max(float((r - 1).abs().max()) for r in norms) > 0.05  # the folds moved the norms
    for module, (q, _, zp, _) in _graph_weights(qmodel).items() if algorithm == "awq" else ():  # (GPTQ's
        span = (q - zp.repeat_interleave(32, 1)).reshape(q.shape[0], -1, 32).abs().amax(-1)  # updates move them)
        assert int(span.min()) >= 7, module
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="a.gguf",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ref, got = qmodel(**batch)["logits"], hf(**batch).logits
    cos = torch.nn.functional.cosine_similarity(got.double(), ref.double(), -1)
    # fp16 block scales; measured 0.99999993 (awq)
    assert cos.min() >= 0.99999 and (got - ref).abs().max() <= 2e-3 * ref.abs().max(), cos.min()


def test_refuses_activation_quantization_and_other_architectures(llama, tmp_path):
    _, path, batch, gm = llama
    qmodel = _quantize(gm, batch, W8A8Quantizer())  # int8 activations
    with pytest.raises(QuantkitError) as exc:
        quantkit.export_gguf(qmodel, tmp_path / "x.gguf", model=path, skip_unsupported=True)
    assert "GGUF holds weight-only quantization" in _one_line(exc) and "w4a16" in str(exc.value)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)) \
        .save_pretrained(str(gpt2))
    with pytest.raises(QuantkitError) as exc:
        quantkit.export_gguf(gm, tmp_path / "y.gguf", model=gpt2)
    assert "GGUF export supports LlamaForCausalLM" in _one_line(exc) and "'GPT2LMHeadModel'" in str(exc.value)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))


def _calib(tmp_path):
    f = tmp_path / "calib.txt"
    f.write_text("\n".join(TEXT * 2))
    return f


def test_cli_format_gguf(llama, tmp_path):
    """``quantkit quantize DIR --scheme w4a16 --group-size 32 --format gguf --out m.gguf``: one file,
    Q4_1 blocks (w4a16 is asymmetric), loadable by gguf's reader; pt2,gguf puts model.gguf in DIR."""
    _, path, _, _ = llama
    out = tmp_path / "m.gguf"
    args = ["quantize", str(path), "--calib", str(_calib(tmp_path)), "--quiet", "--seq-len", "16",
            "--num-calib", "4", "--scheme", "w4a16", "--group-size", "32"]
    assert main(args + ["--out", str(out), "--format", "gguf"]) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == "Q4_1"
    assert types["token_embd.weight"] == "Q8_0"  # the CLI's int8 per-row embedding, its scale in each block
    both = tmp_path / "art"
    assert main(args + ["--out", str(both), "--format", "pt2,gguf"]) == 0
    assert (both / "model.gguf").is_file() and (both / "model.pt2").is_file()
    assert json.loads((both / "report.json").read_text())["gguf"]["tensor_types"]["Q4_1"] == 15
    half = tmp_path / "half.gguf"
    full = tmp_path / "full.gguf"  # lm_head left float: a 2-d float tensor (output.weight)
    assert main(args + ["--out", str(full), "--format", "gguf", "--skip", "lm_head"]) == 0
    assert main(args + ["--out", str(half), "--format", "gguf", "--skip", "lm_head", "--float-dtype", "float16"]) == 0
    reader = gguf.GGUFReader(str(half))
    halves = {t.name: t.tensor_type.name for t in reader.tensors}
    assert halves["blk.0.attn_q.weight"] == "Q4_1" and halves["blk.0.attn_norm.weight"] == "F32"  # 1-d stays F32
    kept = {t.name: t for t in gguf.GGUFReader(str(full)).tensors}
    assert "F16" in halves.values(), halves
    for t in reader.tensors:  # the F32 file's 2-d float tensors, rounded to float16 (numpy's own rounding)
        if t.tensor_type.name == "F16":
            want = np.asarray(kept[t.name].data, dtype=np.float32).astype(np.float16)
            assert kept[t.name].tensor_type.name == "F32" and np.array_equal(np.asarray(t.data), want), t.name
    assert int(reader.fields["general.file_type"].parts[-1][0]) in (int(gguf.LlamaFileType.MOSTLY_Q4_1),
                                                                    int(gguf.LlamaFileType.MOSTLY_F16))


@pytest.mark.parametrize("flags, message", [
    (["--scheme", "w4a16", "--group-size", "16"], "must be a multiple of 32, not --group-size 16"),
    (["--scheme", "nf4", "--group-size", "32"], "not --scheme nf4"),
    ([], "not the default w8a8"),
    (["--scheme", "w4a16", "--group-size", "32", "--out-name"], None),
    (["--scheme", "w4a16", "--group-size", "32", "--float-dtype", "bfloat16"],
     "writes float tensors as float32 or float16 (what llama.cpp's converter writes), not --float-dtype bfloat16"),
])
def test_cli_refuses_before_calibration(llama, tmp_path, capsys, flags, message):
    _, path, _, _ = llama
    if message is None:  # OUT must be a .gguf file
        flags, message = ["--scheme", "w4a16", "--group-size", "32"], "OUT must end in .gguf"
        out = tmp_path / "dir"
    else:
        out = tmp_path / "x.gguf"
    rc = main(["quantize", str(path), "--calib", str(_calib(tmp_path)), "--out", str(out), "--format", "gguf"]
              + flags)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and err.count("\n") == 0 and not out.exists(), err
