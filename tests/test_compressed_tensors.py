"""Export to compressed-tensors (issue 20): the checkpoints load with transformers' own loader plus
the compressed-tensors package, hold quantkit's int8 weights and scales exactly, and compute what
quantkit's int8 model computes. The references read quantkit's graph here, independently of the
export's own graph reader."""

import copy
import functools
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.cli import main  # noqa: E402
from quantkit.quantizers import EmbeddingQuantizer, QuantConfig, W8A8Quantizer  # noqa: E402
from tests._ct_helpers import AS_BEFORE, FLOAT32, tiny_llama, token_cosines  # noqa: E402

QD = torch.ops.quantized_decomposed
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _quantize(model, batches, config=QuantConfig()):
    from torchao.quantization.pt2e.quantizer import ComposableQuantizer

    gm = quantkit.capture(model, batches[0], dynamic_shapes=_hf.dynamic_shapes(batches[0]))
    prepared = quantkit.prepare(gm, ComposableQuantizer([EmbeddingQuantizer(), W8A8Quantizer(config)]))
    quantkit.calibrate(prepared, batches, progress=False)
    return quantkit.convert(prepared)


def _int8_linears(qmodel) -> dict:
    """module name -> (int8 weight, per-channel scales, input (scale, zero point) or None), read
    from the q/dq graph: the weight dequantize and the input dequantize of each aten.linear."""
    out = {}
    for node in qmodel.graph.nodes:
        if node.target != torch.ops.aten.linear.default:
            continue
        x, w = node.args[0], node.args[1]
        if getattr(w, "target", None) != QD.dequantize_per_channel.default:
            continue
        stack = list(node.meta["nn_module_stack"].values())
        # names relative to the HF model (quantkit.load wraps it in a module of its own)
        root = next(path for path, t in stack if str(t).startswith("transformers.models."))
        module = stack[-1][0][len(root) + 1:] if root else stack[-1][0]
        q = functools.reduce(getattr, w.args[0].target.split("."), qmodel)
        scale = functools.reduce(getattr, w.args[1].target.split("."), qmodel)
        act = (x.args[1], x.args[2], x.args[5]) if x.target == QD.dequantize_per_tensor.default else None
        out[module] = (q, scale, act)
    return out


def _check_tensors(loaded, qmodel, expected_linears: int) -> None:
    """Each int8 linear of the loaded checkpoint holds quantkit's integers and scales, bit for bit."""
    ours = _int8_linears(qmodel)
    assert len(ours) == expected_linears
    for name, (q, scale, act) in ours.items():
        mod = loaded.get_submodule(name)
        assert mod.weight.dtype == torch.int8 and torch.equal(mod.weight, q), name
        assert torch.equal(mod.weight_scale.flatten(), scale.float()), name
        if act is not None:  # static: uint8 [0, 255] is int8 [-128, 127] with the zero point shifted
            s, zp, dtype = act
            assert torch.equal(mod.input_scale, torch.tensor([s], dtype=torch.float32)), name
            assert int(mod.input_zero_point) == (zp - 128 if dtype == torch.uint8 else zp), name


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory, hidden_size=32, n_batches=3, seed=0, data_seed=0)


@pytest.mark.parametrize("scheme", ["static", "per-token"])
def test_tiny_llama_loads_in_transformers_and_matches(llama, tmp_path, scheme):
    """A tied-embedding Llama: int8 linears (lm_head too) with static or dynamic per-token int8
    inputs; the embedding is weight-only int8 in quantkit, stored as its dequantized values."""
    model, path, batches = llama
    config = QuantConfig() if scheme == "static" else QuantConfig(dynamic=True, granularity="per-token")
    qmodel = _quantize(model, batches[:2], config)
    out = tmp_path / "llama-w8a8"
    result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[2:], **AS_BEFORE)
    assert result.linears == 2 * 7 + 1 and result.kept_float == ()

    doc = json.loads((out / "config.json").read_text())
    qc = doc["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear", "lm_head"] and group["weights"]["strategy"] == "channel"
    acts = group["input_activations"]
    assert (acts["strategy"], acts["dynamic"]) == (("tensor", False) if scheme == "static" else ("token", True))
    assert doc["tie_word_embeddings"] is False  # lm_head int8, the embedding float: stored apart

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert hasattr(loaded.model.layers[0].self_attn.q_proj, "quantization_scheme")  # compressed-tensors applied it
    _check_tensors(loaded, qmodel, 15)
    batch = batches[2]
    with torch.no_grad():
        ref = qmodel(**batch)["logits"]
        got = loaded(**batch).logits
        fp = model(**batch).logits
    cos = token_cosines(ref, got, batch["attention_mask"])
    assert cos.min() >= 0.999, cos.min()
    if scheme == "static":  # same integers, same scales: equal up to float rounding of the q/dq ops
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert token_cosines(fp, got, batch["attention_mask"]).min() > 0.99


def _tiny_bert(directory: Path, **kw) -> Path:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=30522, max_position_embeddings=128, **kw)
    transformers.BertModel(cfg).save_pretrained(str(directory))
    for f in _TOKENIZER_FILES:
        shutil.copy(_hf.default_model_path() / f, directory / f)
    return directory


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return _tiny_bert(tmp_path_factory.mktemp("bert") / "bert")


@pytest.fixture(scope="module")
def sentences(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("text") / "sentences.txt"
    f.write_text("\n".join(_hf.read_sentences(_hf.default_calibration_file())[:24]) + "\n", encoding="utf-8")
    return f


def _encode(path: Path, texts: list[str]) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    return dict(tok(texts, padding=True, truncation=True, max_length=32, return_tensors="pt"))


def test_cli_writes_both_formats_for_a_tiny_bert(bert_dir, sentences, tmp_path, capsys):
    """--format pt2,compressed-tensors: the artifact, and the HF checkpoint inside it, which
    transformers' AutoModel loads (tokenizer included) and which computes the artifact's outputs."""
    out = tmp_path / "bert-int8"
    assert main(["quantize", str(bert_dir), "--calib", str(sentences), "--out", str(out), "--quiet",
                 "--format", "pt2,compressed-tensors", "--seq-len", "32", "--recipe", "static"]) == 0
    ct_dir = out / "compressed-tensors"
    assert (out / "model.pt2").is_file() and (ct_dir / "model.safetensors").is_file()
    rep = json.loads((out / "report.json").read_text())["compressed_tensors"]
    assert rep["int8_linears"] == 2 * 6 + 1 and rep["versions"]["compressed_tensors"]
    assert rep["verification"]["worst_layer_sqnr_db"] is None or rep["verification"]["worst_layer_sqnr_db"] > 50

    qmodel = quantkit.load(out)
    loaded = transformers.AutoModel.from_pretrained(str(ct_dir), dtype=torch.float32).eval()
    assert type(loaded).__name__ == "BertModel"
    # the artifact's recorded weight scales, and the float weights quantized with them as torch
    # defines it (round(w * (1 / s)), clamped), are the checkpoint's, bit for bit
    records = {t["node"].split(" -> ")[0]: t for t in json.loads((out / "quantization.json").read_text())["tensors"]
               if t["kind"] == "weight"}
    float_model = transformers.AutoModel.from_pretrained(str(bert_dir), dtype=torch.float32)
    int8 = [n for n, m in loaded.named_modules() if getattr(m, "weight", None) is not None
            and m.weight.dtype == torch.int8]
    assert len(int8) == 13
    for name in int8:
        scale = torch.tensor(records[name.replace(".", "_") + "_weight"]["scale"], dtype=torch.float32)
        w = float_model.get_submodule(name).weight.detach()
        expected = torch.clamp(torch.round(w * (1.0 / scale[:, None])), -128, 127).to(torch.int8)
        mod = loaded.get_submodule(name)
        assert torch.equal(mod.weight_scale.flatten(), scale) and torch.equal(mod.weight, expected), name
    batch = _encode(ct_dir, _hf.read_sentences(sentences)[16:24])
    with torch.no_grad():
        ref = qmodel(**batch)["last_hidden_state"]
        got = loaded(**batch).last_hidden_state
    assert token_cosines(ref, got, batch["attention_mask"]).min() >= 0.999

    # --force replaces an artifact holding the HF directory; a lone compressed-tensors export too
    assert main(["quantize", str(bert_dir), "--calib", str(sentences), "--out", str(out), "--quiet", "--force",
                 "--format", "compressed-tensors", "--seq-len", "32", "--num-calib", "8", "--recipe", "static"]) == 1
    assert "not empty and is not a quantkit compressed-tensors export" in capsys.readouterr().err
    lone = tmp_path / "lone"
    for _ in range(2):
        assert main(["quantize", str(bert_dir), "--calib", str(sentences), "--out", str(lone), "--quiet", "--force",
                     "--format", "compressed-tensors", "--seq-len", "32", "--num-calib", "8", "--recipe", "static"]) == 0
    assert not (lone / "model.pt2").exists() and (lone / "config.json").is_file()
    assert (lone / "vocab.txt").is_file()


def test_minilm_export_matches_quantkit(tmp_path):
    """The bundled all-MiniLM-L6-v2, static W8A8 (the default recipe): the checkpoint holds quantkit's
    tensors exactly and transformers' model of it is as close to float as quantkit's int8 model.
    Sentence embeddings agree at mean cosine 0.995-0.999 (half of them exactly), not >= 0.999: transformers'
    compressed-tensors adds the zero point before rounding, torch after, and the few integers that
    flips cascade through MiniLM's later quantizations (the export checks each layer at >= 50 dB)."""
    path = _hf.default_model_path()
    model, tok = _hf.load_hf_model(path, progress=False)
    texts = _hf.read_sentences(_hf.default_calibration_file())
    enc = lambda s: dict(tok(s, padding=True, truncation=True, max_length=64, return_tensors="pt"))  # noqa: E731
    calib, heldout = [enc(texts[:32])], [enc(texts[-16:])]
    qmodel = _quantize(model, calib)
    out = tmp_path / "minilm"
    result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=heldout, **FLOAT32)
    assert result.linears == 6 * 6 + 1 and result.versions["compressed_tensors"]
    assert result.verification["worst_layer_sqnr_db"] is None or result.verification["worst_layer_sqnr_db"] >= 50
    loaded = transformers.AutoModel.from_pretrained(str(out), dtype=torch.float32).eval()
    _check_tensors(loaded, qmodel, 37)
    b = heldout[0]
    with torch.no_grad():
        q = _hf.embed(qmodel(**b), b["attention_mask"])
        got = _hf.embed(loaded(**b), b["attention_mask"])
        fp = _hf.embed(model(**b), b["attention_mask"])
    cos = _hf.cosine(q, got)
    # sentences no tie reaches are the same numbers; the rest differ at int8 noise level
    assert (cos >= 0.9999).sum() >= len(cos) // 2 and cos.mean() >= 0.99, cos
    assert _hf.cosine(fp, got).mean() >= _hf.cosine(fp, q).mean() - 0.005


def test_unexpressible_recipe_fails_before_writing(llama, tmp_path):
    """7-bit activations: one line saying what to use instead, and nothing on disk; skipping
    every layer leaves nothing to store."""
    model, path, batches = llama
    qmodel = _quantize(model, batches[:1], QuantConfig(activation="affine-uint7"))
    out = tmp_path / "uint7"
    with pytest.raises(quantkit.QuantkitError, match=r"uint8 activations in \[0, 127\].*--activation affine-uint8"):
        quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[2:], **AS_BEFORE)
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(quantkit.QuantkitError, match="no layer of the model can be stored int8"):
        quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[2:], skip_unsupported=True, **AS_BEFORE)
    assert not out.exists()

    dynamic = _quantize(model, batches[:1], QuantConfig(dynamic=True))
    with pytest.raises(quantkit.QuantkitError, match="dynamic per-tensor activations.*--scheme w8a8-per-token"):
        quantkit.export_compressed_tensors(dynamic, path, out, inputs=batches[2:], **AS_BEFORE)
    assert not out.exists()


def test_skip_unsupported_keeps_attention_matmuls_float(tmp_path):
    """Eager attention with quantized matmuls between activations: refused, or with
    skip_unsupported stored with those matmuls float, and then the loaded model computes
    quantkit's model without their quantization (rebuilt here by removing those q/dq pairs)."""
    path = _tiny_bert(tmp_path / "eager", attn_implementation="eager")
    model = transformers.BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    batch = _encode(path, _hf.read_sentences(_hf.default_calibration_file())[:8])
    qmodel = _quantize(model, [batch])
    matmuls = [n for n in qmodel.graph.nodes if n.target == torch.ops.aten.matmul.default
               and any(a.target in (QD.dequantize_per_tensor.default,) for a in n.args)]
    assert len(matmuls) == 4  # Q @ K^T and P @ V in each of the 2 layers
    out = tmp_path / "eager-int8"
    with pytest.raises(quantkit.QuantkitError, match="quantized matmul between activations.*--ops linear"):
        quantkit.export_compressed_tensors(qmodel, path, out, inputs=[batch], **FLOAT32)
    assert not out.exists()
    result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=[batch], skip_unsupported=True, **FLOAT32)
    assert len(result.kept_float) == 2 and all("matmul" in k for k in result.kept_float)

    # reference: quantkit's graph with the matmuls' input quantization removed (the float value
    # the quantize read, through the reshape/transpose/permute the q/dq pairs pass through)
    graph = copy.deepcopy(qmodel.graph)  # with its pytree input/output handling
    ref = torch.fx.GraphModule(qmodel, graph)
    shape_ops = {torch.ops.aten.view.default, torch.ops.aten.permute.default, torch.ops.aten.transpose.int,
                 torch.ops.aten.reshape.default}

    def unquantized(node, before):
        while node.target in (QD.dequantize_per_tensor.default, QD.quantize_per_tensor.default):
            node = node.args[0]
        if node.target in shape_ops:
            src = unquantized(node.args[0], before)
            if src is not node.args[0]:
                with graph.inserting_before(before):
                    return graph.call_function(node.target, (src,) + tuple(node.args[1:]))
        return node

    for node in list(graph.nodes):
        if node.target == torch.ops.aten.matmul.default:
            node.args = tuple(unquantized(a, node) for a in node.args)
    graph.eliminate_dead_code()
    ref.recompile()
    loaded = transformers.AutoModel.from_pretrained(str(out), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        want, got, q = ref(**batch)["last_hidden_state"], loaded(**batch).last_hidden_state, \
            qmodel(**batch)["last_hidden_state"]
    # float32 summation order differs between the two graphs' kernels: measured max 6.2e-5 on an AVX2-only
    # AMD EPYC (Zen 3), below 1e-5 on AVX-512 Xeons. The matmuls' quantization itself moves this tiny
    # random model's output by ~4e-4 (measured), so the loaded model must sit far closer to the reference
    err, moved = (got - want).abs().max(), (got - q).abs().max()
    assert err < 1.5e-4, err
    assert moved > 4 * err, (moved, err)  # the matmuls' quantization did change the output, beyond that noise


def test_bad_inputs_are_one_line_errors(llama, tmp_path, capsys, monkeypatch):
    model, path, batches = llama
    # the CLI: a factory model is not an HF checkpoint; neither is a directory without config.json
    calib = tmp_path / "calib"
    calib.mkdir()
    assert main(["quantize", "tests.cli_factories:mlp", "--example-input", "4x16:float32", "--calib", str(calib),
                 "--out", str(tmp_path / "o"), "--format", "compressed-tensors"]) == 2
    assert "MODEL must be an HF model directory" in capsys.readouterr().err
    not_hf = tmp_path / "not-hf"
    not_hf.mkdir()
    (not_hf / "weights.bin").write_bytes(b"x")
    code = main(["quantize", str(not_hf), "--out", str(tmp_path / "o"), "--format", "compressed-tensors"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.count("\n") == 0 and "not a Hugging Face model directory" in err
    assert main(["quantize", str(path), "--out", str(tmp_path / "o"), "--format", "onnx"]) == 2
    assert "unknown --format 'onnx'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

    # the API: a directory that is not an HF model; compressed-tensors not installed
    qmodel = _quantize(model, batches[:1])
    with pytest.raises(quantkit.QuantkitError, match="not a Hugging Face model directory"):
        quantkit.export_compressed_tensors(qmodel, not_hf, tmp_path / "o", inputs=batches[2:], **AS_BEFORE)
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    with pytest.raises(quantkit.QuantkitError, match=r"pip install 'quantkit\[serve\]'"):
        quantkit.export_compressed_tensors(qmodel, path, tmp_path / "o", inputs=batches[2:], **AS_BEFORE)
    assert not (tmp_path / "o").exists()
