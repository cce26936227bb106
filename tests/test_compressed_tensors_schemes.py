"""compressed-tensors export of FP8, group-wise weight-only and KV-cache schemes (issue 20).

Each checkpoint loads with transformers' own loader plus the compressed-tensors package, holds
quantkit's quantized tensors bit for bit, and computes what quantkit's model computes. The
references here read quantkit's graph directly (torchao's float8 and torch's group-wise dequantize
nodes, quantkit's two-per-byte int4 buffers) and decode compressed-tensors' int32 packing with
their own bit arithmetic, independently of the export's reader and of compressed-tensors' unpacker.
"""

import functools
import json
import shutil

import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.cli import main  # noqa: E402
from quantkit.quantizers import FP8Quantizer, WeightOnlyQuantizer  # noqa: E402
from tests._ct_helpers import AS_BEFORE, FLOAT32, tiny_llama, token_cosines  # noqa: E402

AO = torch.ops.torchao
QD = torch.ops.quantized_decomposed
F8_DQ = AO.dequantize_affine_float8_non_decomposed.default
F8_Q = AO.quantize_affine_float8_non_decomposed.default
GROUP_DQ = QD.dequantize_per_channel_group.default
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _capture(model, batch):
    """Captured once per model and module (quantkit.prepare copies it)."""
    return quantkit.capture(model, batch, dynamic_shapes=_hf.dynamic_shapes(batch))


def _quantize(gm, batches, quantizer):
    prepared = quantkit.prepare(gm, quantizer)
    quantkit.calibrate(prepared, batches, progress=False)
    return quantkit.convert(prepared)


def _get(qmodel, node):
    return functools.reduce(getattr, node.target.split("."), qmodel)


def _module_of(node) -> str:
    stack = list(node.meta["nn_module_stack"].values())
    root = next(path for path, t in stack if str(t).startswith("transformers.models."))
    return stack[-1][0][len(root) + 1:] if root else stack[-1][0]


def _unpack_nibbles(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """quantkit's int4 buffer: two per byte along the last dimension, element 2i in the low nibble."""
    lo, hi = (packed & 0xF).to(torch.int16), (packed >> 4).to(torch.int16)
    q = torch.stack([lo, hi], -1).reshape(*packed.shape[:-1], -1)
    return torch.where(q > 7, q - 16, q) if signed else q


def _graph_weights(qmodel) -> dict:
    """module -> what quantkit's graph computes each quantized linear's weight from."""
    out = {}
    for node in qmodel.graph.nodes:
        if node.target != torch.ops.aten.linear.default:
            continue
        w = node.args[1]
        if getattr(w, "target", None) == F8_DQ:
            out[_module_of(node)] = {"q": _get(qmodel, w.args[0]), "scale": _get(qmodel, w.args[1])}
        elif getattr(w, "target", None) == GROUP_DQ:
            src = w.args[0]
            if src.op == "get_attr":
                q = _get(qmodel, src).to(torch.int16)
            else:  # quantkit::unpack_int4(packed, signed)
                q = _unpack_nibbles(_get(qmodel, src.args[0]), src.args[1])
            qmin, qmax, _, g = w.args[3:7]
            out[_module_of(node)] = {"q": q, "scale": _get(qmodel, w.args[1]), "zp": _get(qmodel, w.args[2]),
                                     "qmin": qmin, "qmax": qmax, "group_size": g}
    return out


def _unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' dense int32 packing, decoded bit by bit: value i of a row sits at bit
    i * bits of the row's little-endian bit string, stored with an offset of 2^(bits - 1)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    bitstr = ((w.unsqueeze(-1) >> torch.arange(32)) & 1).reshape(w.shape[0], -1)  # [rows, 32 * words]
    vals = bitstr[:, :count * bits].reshape(w.shape[0], count, bits)
    return (vals * (1 << torch.arange(bits))).sum(-1) - (1 << (bits - 1))


def _safetensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _check_group_files(path, qmodel, n_expected: int) -> None:
    """The packed integers, zero points and scales written are quantkit's, on the signed grid."""
    files = _safetensors(path)
    ours = _graph_weights(qmodel)
    assert len(ours) == n_expected
    for name, w in ours.items():
        bits = (w["qmax"] - w["qmin"] + 1).bit_length() - 1
        shift = (1 << (bits - 1)) if w["qmin"] == 0 else 0
        n, k = w["q"].shape
        assert files[f"{name}.weight_shape"].tolist() == [n, k], name
        assert torch.equal(_unpack_int32(files[f"{name}.weight_packed"], bits, k), w["q"].to(torch.int64) - shift)
        assert torch.equal(files[f"{name}.weight_scale"], w["scale"].float().reshape(n, -1)), name
        zp = w["zp"].to(torch.int64).reshape(n, -1) - shift
        if f"{name}.weight_zero_point" in files:  # packed along the output channels
            got = _unpack_int32(files[f"{name}.weight_zero_point"].t().contiguous(), bits, n).t()
            assert torch.equal(got, zp), name
        else:
            assert not zp.any(), name  # symmetric: no zero points stored


def _check_fp8_loaded(loaded, qmodel, n_expected: int) -> None:
    ours = _graph_weights(qmodel)
    assert len(ours) == n_expected
    for name, w in ours.items():
        mod = loaded.get_submodule(name)
        assert mod.weight.dtype == torch.float8_e4m3fn, name
        assert torch.equal(mod.weight.view(torch.uint8), w["q"].view(torch.uint8)), name
        assert torch.equal(mod.weight_scale.flatten(), w["scale"].float().flatten()), name


def _input_scales(qmodel) -> dict:
    """module -> the static FP8 scale quantkit's graph quantizes each linear's input with."""
    out = {}
    for node in qmodel.graph.nodes:
        if node.target == torch.ops.aten.linear.default and getattr(node.args[0], "target", None) == F8_DQ:
            scale = node.args[0].args[1]
            if scale.op == "get_attr":
                out[_module_of(node)] = _get(qmodel, scale)
    return out


def _without_kv_quant(qmodel):
    """quantkit's graph with sdpa's K/V quantize-dequantize removed (what transformers computes
    when it does not apply the KV-cache scales)."""
    import copy

    graph = copy.deepcopy(qmodel.graph)
    ref = torch.fx.GraphModule(qmodel, graph)
    for node in list(graph.nodes):
        if node.target == SDPA:
            args = list(node.args)
            for i in (1, 2):
                assert args[i].target == F8_DQ and args[i].args[0].target == F8_Q
                args[i] = args[i].args[0].args[0]
            node.args = tuple(args)
    graph.eliminate_dead_code()
    ref.recompile()
    return ref


# --- a tiny Llama -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model, path, batches = tiny_llama(tmp_path_factory, hidden_size=64, n_batches=2, seed=0, data_seed=0)
    return model, path, batches, _capture(model, batches[0])


FP8_RECIPES = {
    "static-kv": dict(kv_cache="fp8_e4m3"),
    "dynamic-token": dict(dynamic=True, granularity="per-token"),
    "per-tensor-weights": dict(weight_granularity="per-tensor", dynamic=True),
}


@pytest.mark.parametrize("recipe", list(FP8_RECIPES))
def test_tiny_llama_fp8(llama, tmp_path, recipe):
    """float-quantized: E4M3 weights and scales bit for bit, static input scales, and (static-kv)
    the KV-cache scales in the files; logits as quantkit's."""
    _, path, batches, gm = llama
    qmodel = _quantize(gm, batches[:1], FP8Quantizer(**FP8_RECIPES[recipe]))
    out = tmp_path / recipe
    result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], **AS_BEFORE)
    assert result.linears == 2 * 7 + 1 and result.kept_float == ()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == group["format"] == "float-quantized"
    w, a = group["weights"], group["input_activations"]
    assert (w["type"], w["num_bits"], w["strategy"]) == \
        ("float", 8, "tensor" if recipe == "per-tensor-weights" else "channel")
    assert (a["type"], a["dynamic"], a["strategy"]) == {
        "static-kv": ("float", False, "tensor"), "dynamic-token": ("float", True, "token"),
        "per-tensor-weights": ("float", True, "tensor")}[recipe]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    _check_fp8_loaded(loaded, qmodel, 15)
    for name, scale in _input_scales(qmodel).items():
        assert torch.equal(loaded.get_submodule(name).input_scale, scale.float().reshape(1)), name
    batch = batches[1]
    with torch.no_grad():
        got = loaded(**batch).logits
        ref = qmodel(**batch)["logits"]
    if recipe == "static-kv":
        assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "tensor"
        files = _safetensors(out)
        sdpas = [n for n in qmodel.graph.nodes if n.target == SDPA]
        assert len(sdpas) == 2
        for node in sdpas:  # quantkit's calibrated K and V scales, bit for bit
            attn = _module_of(node)
            for key, arg in (("k_scale", node.args[1]), ("v_scale", node.args[2])):
                assert torch.equal(files[f"{attn}.{key}"], _get(qmodel, arg.args[1]).float().reshape(1)), attn
        # transformers 5.24 loads the scales into nothing (compressed-tensors 0.20 hooks attention
        # forwards that take past_key_values; Llama's takes cache): its cache stays float
        assert result.verification["kv_cache"]["applied_by_transformers"] is False
        with torch.no_grad():
            no_kv = _without_kv_quant(qmodel)(**batch)["logits"]
        assert torch.allclose(got, no_kv, atol=1e-5), (got - no_kv).abs().max()
        assert not torch.equal(no_kv, ref)  # the K/V quantization does change quantkit's output
        # with quantkit's FP8 K/V it agrees at FP8 KV noise only (0.997 min cosine here)
        assert token_cosines(ref, got, batch["attention_mask"]).min() >= 0.99
    else:
        assert qc["kv_cache_scheme"] is None
        cos = token_cosines(ref, got, batch["attention_mask"])
        assert cos.min() >= 0.999, cos.min()


WEIGHT_ONLY = {
    "w4a16-asym-g32": dict(bits=4, group_size=32),
    "w4a16-sym-g32": dict(bits=4, group_size=32, symmetric=True),
    "w8a16-channel": dict(bits=8, group_size=None, symmetric=True),
    # AWQ's 1/s folded into the RMSNorms and the up rows (o_proj left unscaled): what the file holds
    "w4a16-sym-g32-awq": dict(bits=4, group_size=32, symmetric=True, algorithm="awq", awq_fold_only=True),
}


@pytest.mark.parametrize("recipe", list(WEIGHT_ONLY))
def test_tiny_llama_weight_only(llama, tmp_path, recipe):
    """pack-quantized: the int32-packed integers, zero points and scales are quantkit's, and
    transformers' model of the checkpoint computes quantkit's logits (same dequantized weights)."""
    _, path, batches, gm = llama
    qmodel = _quantize(gm, batches[:1], WeightOnlyQuantizer(**WEIGHT_ONLY[recipe]))
    out = tmp_path / recipe
    result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], **AS_BEFORE)
    assert result.linears == 15
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert qc["format"] == "pack-quantized" and group["input_activations"] is None
    cfg = WEIGHT_ONLY[recipe]
    if cfg.get("algorithm") == "awq":  # the folds did move the norms the file holds
        tensors = _safetensors(out)
        norms = [n for n in tensors if n.endswith("layernorm.weight")]
        assert len(norms) == 4 and any(  # the block loss may choose mild scales: ~1% here
            not torch.allclose(tensors[n].float(), llama[0].get_parameter(n), rtol=1e-3) for n in norms)
    assert (w["num_bits"], w["symmetric"], w["strategy"], w["group_size"]) == (
        cfg["bits"], cfg.get("symmetric", False), "group" if cfg["group_size"] else "channel", cfg["group_size"])
    _check_group_files(out, qmodel, 15)

    kwargs = {}
    if not cfg.get("symmetric", False):
        # transformers 5.24 + compressed-tensors 0.20 build the compressed module with unpacked
        # zero points and refuse the packed ones (llm-compressor#1618); the dequantizing load works
        assert result.verification["loaded_with"] == "CompressedTensorsConfig(dequantize=True)"
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, **kwargs).eval()
    batch = batches[1]
    with torch.no_grad():
        got = loaded(**batch).logits
        ref = qmodel(**batch)["logits"]
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_explicit_input_scales_are_refused_unless_folded(llama, tmp_path):
    """SmoothQuant and AWQ leave ``x * (1/s)`` before grouped-query attention's o_proj, where 1/s
    folds into no op; no compressed-tensors tensor holds it: one line naming the layer and the
    options, nothing written. With fold_only (SmoothQuant) the W8A8 checkpoint exports and
    transformers computes quantkit's logits."""
    from quantkit.quantizers import QuantConfig, W8A8Quantizer

    _, path, batches, gm = llama
    for smoothed, quantizer in (
            (gm, WeightOnlyQuantizer(bits=4, group_size=32, symmetric=True, algorithm="awq")),
            (quantkit.smooth_quant(gm, batches[:1], alpha=0.5), W8A8Quantizer(QuantConfig(ops=frozenset({"linear"}))))):
        qmodel = _quantize(smoothed, batches[:1], quantizer)
        with pytest.raises(quantkit.QuantkitError) as exc:
            quantkit.export_compressed_tensors(qmodel, path, tmp_path / "x", **AS_BEFORE)
        msg = str(exc.value)
        assert "\n" not in msg and msg.startswith("model.layers.0.self_attn.o_proj and "), msg
        assert "more read their input through an explicit per-channel scale" in msg
        assert "fold_only=True" in msg and not (tmp_path / "x").exists()
    smoothed = quantkit.smooth_quant(gm, batches[:1], alpha=0.5, fold_only=True)
    kinds = [r["folded_into"].split(":")[0] for r in smoothed.meta["quantkit_smoothquant"]]
    assert kinds == ["norm", "unscaled", "norm", "gate"] * 2, kinds  # (the tied lm_head has no own weight)
    qmodel = _quantize(smoothed, batches[:1], W8A8Quantizer(QuantConfig(ops=frozenset({"linear"}))))
    out = tmp_path / "sq"
    quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], **AS_BEFORE)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got, ref = loaded(**batches[1]).logits, qmodel(**batches[1])["logits"]
    assert token_cosines(ref, got, batches[1]["attention_mask"]).min() >= 0.9999


def test_nf4_is_refused_or_kept_float(llama, tmp_path):
    """NF4 has no compressed-tensors scheme: one line before anything is written; with
    skip_unsupported the NF4 layer is stored as the float values quantkit computes with."""
    from quantkit.quantizers import WeightOnlyConfig

    _, path, batches, gm = llama
    quantizer = WeightOnlyQuantizer(bits=4, group_size=32).set_module_name(
        "lm_head", WeightOnlyConfig(bits=4, group_size=32, scheme="nf4"))
    qmodel = _quantize(gm, batches[:1], quantizer)
    out = tmp_path / "nf4"
    with pytest.raises(quantkit.QuantkitError, match=r"^compressed-tensors cannot express NF4 weights \(lm_head\): "
                                                     r"compressed-tensors has no NF4 scheme.*--scheme w4a16") as err:
        quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], **FLOAT32)
    assert "\n" not in str(err.value) and not out.exists()
    result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], skip_unsupported=True, **FLOAT32)
    assert result.linears == 14 and result.kept_float == ("lm_head: NF4 weights",)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        got, ref = loaded(**batches[1]).logits, qmodel(**batches[1])["logits"]
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def test_e5m2_kv_cache_is_refused(llama, tmp_path):
    _, path, batches, gm = llama
    qmodel = _quantize(gm, batches[:1], FP8Quantizer(kv_cache="fp8_e5m2"))
    out = tmp_path / "e5m2"
    with pytest.raises(quantkit.QuantkitError, match=r"cannot express a float8_e5m2 KV cache .*float8_e4m3fn"):
        quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], **AS_BEFORE)
    assert not out.exists()


# --- a tiny BERT, through the CLI ---------------------------------------------------------

@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("bert") / "bert"
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=30522, max_position_embeddings=128)
    transformers.BertModel(cfg).save_pretrained(str(directory))
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(_hf.default_model_path() / f, directory / f)
    sentences = directory.parent / "sentences.txt"
    sentences.write_text("\n".join(_hf.read_sentences(_hf.default_calibration_file())[:24]) + "\n", encoding="utf-8")
    return directory, sentences


@pytest.fixture(scope="module")
def bert_captured(bert):
    directory, sentences = bert
    model = transformers.BertModel.from_pretrained(str(directory)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    texts = _hf.read_sentences(sentences)
    enc = lambda t: dict(tok(t, padding=True, truncation=True, max_length=32, return_tensors="pt"))  # noqa: E731
    calib, heldout = enc(texts[:8]), enc(texts[16:24])
    return _capture(model, calib), calib, heldout


@pytest.mark.parametrize("scheme", ["fp8", "w4a16-g32"])
def test_tiny_bert(bert, bert_captured, tmp_path, scheme):
    """A tiny BERT (the group size equals some layers' input features: still one group scheme).
    FP8 with a KV cache: BERT's attention has no k_proj/v_proj, where the format's KV-cache scales
    live, so that is one line before writing, or kept float with skip_unsupported."""
    directory, _ = bert
    gm, calib, heldout = bert_captured
    quantizer = FP8Quantizer(kv_cache="fp8_e4m3") if scheme == "fp8" else WeightOnlyQuantizer(bits=4, group_size=32)
    qmodel = _quantize(gm, [calib], quantizer)
    out = tmp_path / scheme
    if scheme == "fp8":
        with pytest.raises(quantkit.QuantkitError, match=r"cannot express a KV cache in BertSelfAttention "
                                                         r"\(encoder.layer.0.attention.self and 1 more layers\): .*k_proj"):
            quantkit.export_compressed_tensors(qmodel, directory, out, inputs=[heldout], **FLOAT32)
        assert not out.exists()
    result = quantkit.export_compressed_tensors(qmodel, directory, out, inputs=[heldout], **FLOAT32,
                                                skip_unsupported=scheme == "fp8")
    assert len(result.kept_float) == (2 if scheme == "fp8" else 0)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert len(qc["config_groups"]) == 1
    if scheme == "fp8":
        loaded = transformers.AutoModel.from_pretrained(str(out), dtype=torch.float32).eval()
        _check_fp8_loaded(loaded, qmodel, 13)
    else:
        _check_group_files(out, qmodel, 13)
        loaded = transformers.AutoModel.from_pretrained(
            str(out), dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        ref = (_without_kv_quant(qmodel) if scheme == "fp8" else qmodel)(**heldout)["last_hidden_state"]
        got = loaded.eval()(**heldout).last_hidden_state
    assert token_cosines(ref, got, heldout["attention_mask"]).min() >= 0.99999

    if scheme == "fp8":
        return
    # from the artifact quantkit.load reads back (no module names in its graph: quantization.json's
    # records name the layers): the same checkpoint, tensor for tensor
    quantkit.save(qmodel, tmp_path / "artifact")
    again = tmp_path / "from-artifact"
    quantkit.export_compressed_tensors(quantkit.load(tmp_path / "artifact"), directory, again, inputs=[heldout],
                                       **FLOAT32)
    first, second = _safetensors(out), _safetensors(again)
    assert sorted(first) == sorted(second)
    for key, t in first.items():
        assert t.dtype == second[key].dtype and torch.equal(t.view(torch.uint8), second[key].view(torch.uint8)), key
    assert json.loads((again / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    # without its records the artifact is unverified (refused unless asked for), and the loaded graph
    # names no layer: one line
    (tmp_path / "artifact" / "quantization.json").unlink()
    with pytest.raises(quantkit.QuantkitError, match="cannot be verified"):
        quantkit.load(tmp_path / "artifact")
    with pytest.warns(UserWarning, match="not verified|cannot be verified"):
        bare = quantkit.load(tmp_path / "artifact", allow_unverified=True)
    with pytest.raises(quantkit.QuantkitError, match="has no quantization.json records to name its layers"):
        quantkit.export_compressed_tensors(bare, directory, tmp_path / "x", inputs=[heldout], **FLOAT32)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("scheme", [["--scheme", "fp8", "--engine", "transformers"],
                                    ["--scheme", "w4a16", "--group-size", "32"]])
def test_cli_tiny_bert(bert, tmp_path, scheme):
    """``--scheme fp8|w4a16 --format compressed-tensors`` (static FP8 with ``--engine transformers``:
    vLLM's CPU build cannot run it): the CLI verified the checkpoint against
    its quantized model on the held-out split; transformers' AutoModel loads it (tokenizer
    included) and it stays as close to the float model as FP8 / int4 g32 on a random tiny BERT is."""
    directory, sentences = bert
    ct_dir = tmp_path / scheme[1]
    assert main(["quantize", str(directory), "--calib", str(sentences), "--out", str(ct_dir), "--quiet",
                 "--format", "compressed-tensors", "--seq-len", "32", "--num-calib", "8"] + scheme) == 0
    marker = json.loads((ct_dir / "quantkit_export.json").read_text())
    assert len(marker["int8_linears"]) == 2 * 6 + 1 and marker["verification"]["min_cosine"] >= 0.99999
    assert marker["verification"]["tensors_equal_in_files"] >= 2 * 13
    assert not (ct_dir / "model.pt2").exists()
    qc = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    assert qc["format"] == ("float-quantized" if scheme[1] == "fp8" else "pack-quantized")
    kwargs = {} if scheme[1] == "fp8" else {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)}
    loaded = transformers.AutoModel.from_pretrained(str(ct_dir), dtype=torch.float32, **kwargs).eval()
    assert type(loaded).__name__ == "BertModel"
    tok = transformers.AutoTokenizer.from_pretrained(str(ct_dir))
    batch = dict(tok(_hf.read_sentences(sentences)[16:24], padding=True, max_length=32, truncation=True,
                     return_tensors="pt"))
    float_model = transformers.AutoModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        fp = float_model(**batch).last_hidden_state
        got = loaded(**batch).last_hidden_state
    assert token_cosines(fp, got, batch["attention_mask"]).mean() >= 0.99


# --- the bundled MiniLM -------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    path = _hf.default_model_path()
    model, tok = _hf.load_hf_model(path, progress=False)
    texts = _hf.read_sentences(_hf.default_calibration_file())
    enc = lambda s: dict(tok(s, padding=True, truncation=True, max_length=48, return_tensors="pt"))  # noqa: E731
    calib = enc(texts[:8])
    return _capture(model, calib), path, [calib], [enc(texts[-12:])]


@pytest.mark.parametrize("scheme", ["fp8", "w4a16-g32"])
def test_minilm(minilm, tmp_path, scheme):
    """all-MiniLM-L6-v2: FP8 static (float-quantized) and int4 g32 (pack-quantized); sentence
    embeddings of held-out sentences agree with quantkit's at cosine >= 0.999."""
    gm, path, calib, heldout = minilm
    quantizer = FP8Quantizer() if scheme == "fp8" else WeightOnlyQuantizer(bits=4, group_size=32)
    qmodel = _quantize(gm, calib, quantizer)
    out = tmp_path / scheme
    result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=heldout, **FLOAT32)
    assert result.linears == 6 * 6 + 1
    kwargs = {}
    if scheme == "fp8":
        loaded = transformers.AutoModel.from_pretrained(str(out), dtype=torch.float32).eval()
        _check_fp8_loaded(loaded, qmodel, 37)
    else:
        _check_group_files(out, qmodel, 37)
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
        loaded = transformers.AutoModel.from_pretrained(str(out), dtype=torch.float32, **kwargs).eval()
    b = heldout[0]
    with torch.no_grad():
        q = _hf.embed(qmodel(**b), b["attention_mask"])
        got = _hf.embed(loaded(**b), b["attention_mask"])
    cos = _hf.cosine(q, got)
    print(f"MiniLM {scheme}: held-out sentence cosine vs quantkit min {cos.min():.7f} mean {cos.mean():.7f}; "
          f"verification {json.dumps(result.verification)}")
    assert cos.min() >= 0.999, cos


@pytest.mark.parametrize("flags, message", [
    (["--scheme", "nf4"], "cannot store --scheme nf4 (compressed-tensors has no NF4 scheme): use --scheme w4a16"),
    (["--scheme", "fp8", "--kv-cache", "fp8_e5m2"], "cannot store --kv-cache fp8_e5m2"),
    (["--scheme", "fp8", "--kv-cache", "fp8_e4m3", "--kv-granularity", "per-head"], "per-tensor KV-cache scales"),
])
def test_cli_refuses_unexpressible_recipes_before_loading(bert, tmp_path, capsys, flags, message):
    directory, sentences = bert
    out = tmp_path / "o"
    assert main(["quantize", str(directory), "--calib", str(sentences), "--out", str(out),
                 "--format", "compressed-tensors"] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0 and not out.exists()


def test_every_dequantize_op_has_one_reader():
    """The export reads each dequantize through the reader registered for its op (export/_ct_schemes.py):
    quantkit's int8, FP8, group-wise and NF4 ops all have one, and an op cannot get a second."""
    from quantkit import _graph
    from quantkit.export import _ct_plan, _ct_schemes  # noqa: F401  (_ct_plan registers the int8 reader)

    ops = _graph.DEQUANTIZE_OPS | _graph.FLOAT8_DEQUANTIZE_OPS | _graph.GROUPWISE_DEQUANTIZE_OPS
    assert all(_ct_schemes.reader_for(op) is not None for op in ops)
    assert _ct_schemes.reader_for(QD.quantize_per_tensor.default) is None
    with pytest.raises(ValueError, match="already registered"):
        _ct_schemes.register_reader(GROUP_DQ)(lambda gm, dq: (_ct_schemes.UNKNOWN, "mine"))
    assert _ct_schemes.reader_for(GROUP_DQ).__name__ == "_read_group"
