"""Export a quantkit quantized model as a compressed-tensors checkpoint: an HF model directory
that transformers (with the ``compressed-tensors`` package) and vLLM load.

The directory holds the source model's config.json plus a ``quantization_config``
(``quant_method: compressed-tensors``; format ``int-quantized`` for W8A8 int8, ``float-quantized``
for FP8, ``pack-quantized`` for int4/int8 weight-only, ``mixed-precision`` for several;
``kv_cache_scheme`` for KV-cache scales: ``_ct_schemes``), safetensors with each quantized
nn.Linear as ``weight`` (int8 / float8) or ``weight_packed``, ``weight_scale`` (and zero points)
and its input's ``input_scale`` / ``input_zero_point`` (static) or a dynamic scheme, the float
tensors as they are in quantkit's model, the tokenizer files, and ``quantkit_export.json`` (what
was written, what was kept float, the verification). Before the directory is put in place it is
loaded back with transformers and its outputs compared with quantkit's model: a mismatch removes
it (what transformers 5.24 does not load as stored is checked in the files: ``_ct_checks``).

compressed-tensors is imported only here (``pip install 'quantkit[serve]'``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.fx import GraphModule

from .. import _hf
from .._errors import QuantkitError
from .._graph import explicit_input_scales, module_scopes, type_name
from ..pipeline._inputs import call_model
from . import _atomic
from ._ct_plan import ActQuant, Plan, float_value, read_graph, recorded_modules
from . import _ct_checks as checks
from ._ct_schemes import is_float8, layer_tensors, quantization_config

__all__ = ["export_compressed_tensors", "write_checkpoint", "CompressedTensorsExport", "check_available",
           "check_out_dir", "check_source", "MARKER_FILE", "TESTED_VERSION"]

MARKER_FILE = "quantkit_export.json"
_MARKER_FORMAT = "quantkit-compressed-tensors"
# the compressed-tensors release this export was written and checked against (with transformers 5.24)
TESTED_VERSION = "0.20.0"
# transformers' own minimum for loading compressed-tensors checkpoints (its CompressedTensorsHfQuantizer)
_MIN_VERSION = (0, 15)
# tokenizer and generation files an HF model directory may hold; copied as they are
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
           "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
           "chat_template.jinja", "chat_template.json", "generation_config.json", "preprocessor_config.json")
# keys of the copied JSON files that name Python files of the source directory (custom code): the
# export holds weights laid out for, and verified with, the transformers class quantkit loaded
# (never the custom code), so they are left out rather than pointing at code that is not there
_REMOTE_CODE_KEYS = ("auto_map",)
# one safetensors file up to this size, else shards with an index (transformers' default max_shard_size)
_SHARD_BYTES = 5 * 1000**3
# verification, in two tiers. Per layer: each int8 linear of the loaded model is fed its own
# input and compared with quantkit's q/dq math on it (torch's quantized_decomposed ops). Static:
# they differ only where a value lies within float32 rounding of a half step (compressed-tensors
# adds the zero point before rounding, torch after): all-MiniLM-L6-v2's worst layer is 67 dB,
# a wrong scale, zero point or layout gives < 20 dB. Dynamic per-token scales are the consumer's
# own (compressed-tensors divides amax by 127.5, quantkit and vLLM by 127), so there each layer
# must be as close to its float result (same input, quantkit's dequantized weight) as quantkit's
# is, within 6 dB: compressed-tensors maps each token's amax to 127.5 and clamps it to 127, a
# half-step error on one value per row, which costs 5.0 dB on a tiny Llama's 32-wide rows and
# less on wide ones (MiniLM's one-token pooler agrees with quantkit's at only 26 dB, yet both are
# as far from float).
# End to end, the few flipped integers cascade through later quantizations to int8 noise level
# (MiniLM static: embedding cosine mean 0.9987, min 0.994, where quantkit's int8 vs float is min
# 0.992), so the model-level bar is looser.
_MIN_LAYER_SQNR_DB = 50.0
_MAX_DYNAMIC_MARGIN_DB = 6.0
_MIN_MEAN_COSINE = 0.99
# without int8 activations (FP8, weight-only) the consumer computes with quantkit's dequantized
# weights and the same FP8 rounding (x / scale, saturate, round to E4M3), so every row must agree
# up to float32 summation order: measured min cosine 1 - 1e-15 on a tiny Llama and MiniLM; a
# wrong tensor anywhere (e.g. a tied embedding stored with lm_head's values) gives < 0.998
_MIN_EXACT_COSINE = 0.99999
# how messages name the options; the CLI passes its flags
_FLAGS = {"skip_unsupported": "skip_unsupported=True", "quantize_lm_head": "quantize_lm_head=True",
          "skip_lm_head": "a quantizer that skips lm_head", "engine": "engine='transformers'"}

@dataclass(frozen=True)
class CompressedTensorsExport:
    """What :func:`export_compressed_tensors` wrote.

    Attributes:
        path: the HF model directory.
        linears: how many nn.Linear layers are stored quantized.
        kept_float: ``"module: why"`` for each quantized layer the format cannot express, kept
            float (only with ``skip_unsupported``).
        dequantized: modules whose weight-only int8 weights (embeddings) are stored as the float
            values quantkit's model computes with (vLLM loads no int8 embeddings).
        verification: the comparison with quantkit's model (``samples``, ``min_cosine``,
            ``mean_cosine``, ``sqnr_db``) after loading with transformers.
        versions: compressed-tensors, transformers and torch versions it was checked with.
        notes: what was changed from the source directory besides the quantization (e.g. an
            ``auto_map`` left out), one sentence each.
    """

    path: Path
    linears: int
    kept_float: tuple[str, ...]
    dequantized: tuple[str, ...]
    verification: dict
    versions: dict
    notes: tuple[str, ...] = ()


def check_available() -> str:
    """The installed compressed-tensors version; a one-line error saying how to install it if absent."""
    try:
        import compressed_tensors
    except ImportError:
        raise QuantkitError("the compressed-tensors format needs the compressed-tensors package: "
                            "pip install 'quantkit[serve]'") from None
    version = getattr(compressed_tensors, "__version__", "0")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < _MIN_VERSION:
        raise QuantkitError(f"compressed-tensors {version} is too old for transformers' loader (needs >= "
                            f"{'.'.join(map(str, _MIN_VERSION))}); pip install 'quantkit[serve]'")
    return version


def check_source(model_dir: str | os.PathLike) -> None:
    """Refuse a source model whose config.json already has a ``quantization_config`` (a quantized
    checkpoint cannot be quantized again into this format); cheap: reads config.json only."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():  # not an HF directory: check_hf_dir says so
        return
    if "quantization_config" in _hf._config_json(model_dir):
        raise QuantkitError(f"{str(model_dir / 'config.json')!r} already has a quantization_config (the checkpoint "
                            "is quantized); quantize the float checkpoint instead")


def check_out_dir(path: str | os.PathLike, *, overwrite: bool, flag: str = "overwrite=True",
                  exists_error: type[QuantkitError] = QuantkitError) -> Path:
    """Check that ``path`` may be written: absent, empty, or (with ``overwrite``) a previous
    export holding only the files it recorded in ``quantkit_export.json``."""
    path = Path(path)
    entries = _atomic.existing_entries(path, overwrite=overwrite, flag=flag, exists_error=exists_error)
    if not entries:
        return path
    try:
        doc = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != _MARKER_FORMAT:
        raise QuantkitError(f"output directory {str(path)!r} is not empty and is not a quantkit compressed-tensors "
                            "export; refusing to replace it, choose another output path")
    foreign = [e for e in entries if e != MARKER_FILE and e not in set(doc.get("files") or ())]
    if foreign:
        raise QuantkitError(f"output directory {str(path)!r} also holds {', '.join(map(repr, foreign[:3]))}, which "
                            "quantkit did not write; refusing to replace it, move them or choose another output path")
    return path


def _lm_head(hf, modules: dict) -> str | None:
    """The module name of the HF model's output head (``get_output_embeddings``), if a Linear."""
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return None
    return next((n for n, m in modules.items() if m is head), None)


def _captured_class(qmodel: GraphModule):
    """The transformers class the graph was captured from (the root of its ``nn_module_stack``)."""
    import transformers

    for node in qmodel.graph.nodes:
        for fqn, t in (node.meta.get("nn_module_stack") or {}).values():
            if str(fqn) in ("", "L['self']", "L__self__"):
                name = type_name(t)
                cls = getattr(transformers, name.rsplit(".", 1)[-1], None)
                if name.startswith("transformers.") and isinstance(cls, type) \
                        and issubclass(cls, transformers.PreTrainedModel):
                    return cls
                return None
    return None


def _meta_model(cls, config):
    try:
        with torch.device("meta"):
            return cls(config)
    except Exception as exc:
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise QuantkitError(f"could not build {cls.__name__} from the model's config.json ({first.strip()}); "
                            "pass model_class= the class the model was captured from") from None


def _tensors(qmodel: GraphModule, hf, plan: Plan, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor],
                                                                               list[tuple[str, str]], dict]:
    """Every persistent tensor of the HF model, by name: int8 linears with their scales, the
    dequantized weights, the rest from quantkit's model, float ones (not scales) cast to ``dtype``.
    Returns ``(tensors, untied, cast)``: ``untied``, pairs of tied HF parameters that are now stored
    differently (one int8, one float); ``cast``, quantkit's tensor name -> the value as stored, for
    the float tensors of quantkit's model whose dtype changed (the verification's reference uses them)."""
    own = dict(qmodel.named_parameters(remove_duplicate=False))
    own.update(dict(qmodel.named_buffers(remove_duplicate=False)))
    source = {k: k for k in own}
    if qmodel.meta.get("quantkit_program") is not None:  # quantkit.load: the HF model is the wrapper's .model
        source = {k[len("model."):] if k.startswith("model.") else k: k for k in own}
        own = {k[len("model."):] if k.startswith("model.") else k: v for k, v in own.items()}
    used: dict[str, str] = {}  # HF key -> the name of quantkit's tensor stored there as it is
    aliases: dict[int, list[str]] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    alias_of = {n: group for group in aliases.values() for n in group}
    out: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    missing = []
    for key in hf.state_dict():
        module, _, leaf = key.rpartition(".")
        layer = plan.linears.get(module)
        if layer is not None and leaf == "weight":
            out.update({f"{module}.{local}": t for local, t in layer_tensors(layer).items()})
            quantized.add(key)
        elif key in plan.dequantized:
            out[key] = plan.dequantized[key]
        elif key in own:
            out[key] = own[key].detach()
            used[key] = key
        else:
            missing.append(key)
    for key in list(missing):  # a tied parameter quantkit's graph holds under its other name
        # the value quantkit's graph computes with under the twin's name (even when the twin itself
        # is stored quantized or dequantized: an int8 or NF4 lm_head beside a float embedding)
        twin = next((n for n in alias_of.get(key, ()) if n in own), None)
        if twin is not None:
            out[key] = own[twin].detach()
            used[key] = twin
            missing.remove(key)
    for module, kv in plan.kv.items():
        out.update({f"{module}.{local}": t for local, t in kv.stored().items()})
    if missing:
        raise QuantkitError(f"quantkit's model has no tensor for {missing[0]!r} ({len(missing)} of the "
                            f"{type(hf).__name__} checkpoint's tensors); export the model that was captured from "
                            "this checkpoint, or pass model_class= the class it was captured from")
    untied = []
    for group in aliases.values():
        kinds = {n in quantized for n in group}
        # also tied tensors stored with different values (an NF4 lm_head kept float beside a float embedding)
        floats = [out[n] for n in group if n in out and n not in quantized]
        if len(group) > 1 and (len(kinds) > 1 or any(not torch.equal(floats[0], f) for f in floats[1:])):
            untied.append(tuple(group))
    cast: dict[str, torch.Tensor] = {}
    for k, v in out.items():  # float tensors in the engine's dtype (scales keep quantkit's float32)
        if v.is_floating_point() and not is_float8(v.dtype) and v.dtype != dtype and (k in used
                                                                                     or k in plan.dequantized):
            out[k] = v.to(dtype)
            if k in used:
                cast[source[used[k]]] = out[k].to(v.dtype)
    seen: set[int] = set()
    for k, v in out.items():  # safetensors refuses tensors that share storage (tied or views)
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    return out, untied, cast


class _Cast(torch.nn.Module):
    """``model`` run with some of its tensors replaced (``torch.func.functional_call``): quantkit's
    model with the float tensors as the export stores them, the verification's reference."""

    def __init__(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.tensors = tensors

    def forward(self, *args, **kwargs):
        return torch.func.functional_call(self.model, self.tensors, args, kwargs)


def _save(tensors: dict[str, torch.Tensor], directory: Path) -> list[str]:
    """safetensors, in shards with an index past :data:`_SHARD_BYTES`; returns the file names."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        t = tensors[key]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
    return names + ["model.safetensors.index.json"]


def _config(model_dir: Path, cls, qconfig: dict, untied: list, dtype: torch.dtype) -> dict:
    check_source(model_dir)
    doc = {k: v for k, v in _hf._config_json(model_dir).items() if k not in _REMOTE_CODE_KEYS}
    doc["architectures"] = [cls.__name__]
    doc["dtype"] = str(dtype).removeprefix("torch.")  # what vLLM's dtype="auto" runs
    if "torch_dtype" in doc:
        doc["torch_dtype"] = doc["dtype"]
    if untied:
        if not _is_embedding_tie(untied):
            raise QuantkitError(f"tied parameters {', '.join(untied[0])} would be stored one int8 and one float, and "
                                "only tied word embeddings can be untied in config.json; keep one of them float "
                                "with --skip")
        doc["tie_word_embeddings"] = False  # lm_head int8, the embedding float: stored apart
    doc["quantization_config"] = qconfig
    return doc


def _remote_code_note(name: str, doc: dict) -> str:
    keys = ", ".join(k for k in _REMOTE_CODE_KEYS if k in doc)
    return (f"{name}: left out {keys} (it names custom code, which quantkit never ran: the export is for "
            "transformers' own class)")


def _copy_files(model_dir: Path, directory: Path) -> tuple[list[str], list[str]]:
    """Copy the tokenizer and generation files of ``model_dir`` (plain files only), JSON ones
    without :data:`_REMOTE_CODE_KEYS`; returns the names copied and a note per key left out."""
    files, notes = [], []
    for name in _COPIED:
        src = model_dir / name
        if not src.is_file() or src.is_symlink():
            continue
        doc = None
        if name.endswith(".json"):
            try:
                doc = json.loads(src.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError):
                doc = None
        if isinstance(doc, dict) and any(k in doc for k in _REMOTE_CODE_KEYS):
            notes.append(_remote_code_note(name, doc))
            kept = {k: v for k, v in doc.items() if k not in _REMOTE_CODE_KEYS}
            (directory / name).write_text(json.dumps(kept, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(src, directory / name)
        files.append(name)
    return files, notes


def _is_embedding_tie(untied: list) -> bool:
    return all(any(n.endswith("lm_head.weight") or "embed" in n for n in group) for group in untied)


def _layer_check(model, plan: Plan, batch) -> dict:
    """Run the loaded model once, feeding each int8 linear's own input to quantkit's math too;
    returns the worst per-layer SQNR and its layer."""
    seen: dict[str, tuple] = {}
    hooks = []
    for name in plan.linears:
        def hook(mod, args, out, name=name):
            seen.setdefault(name, (args[0].detach(), out.detach(), mod.bias))
        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            call_model(model, batch)
    finally:
        for h in hooks:
            h.remove()
    worst, where, margin, margin_at = math.inf, None, -math.inf, None
    with torch.no_grad():
        for name, (x, out, bias) in seen.items():
            layer = plan.linears[name]
            w = layer.weight.dequantized(x.dtype).to(x.device)
            ref = torch.nn.functional.linear(x if layer.act is None else layer.act.fake_quant(x), w, bias)
            if layer.act is None or layer.act.kind == "static":
                db = checks.sqnr_db(ref, out)
                if db < worst:
                    worst, where = db, name
            else:  # how much further from float the consumer's layer is than quantkit's
                exact = torch.nn.functional.linear(x, w, bias)
                m = checks.sqnr_db(exact, ref) - checks.sqnr_db(exact, out)
                if m > margin:
                    margin, margin_at = m, name
    return {"layers": len(seen), "worst_layer_sqnr_db": None if worst == math.inf else round(worst, 2),
            "worst_layer": where, "worst_dynamic_margin_db": None if margin_at is None else round(margin, 2),
            "worst_dynamic_layer": margin_at}


def _reference(qmodel: GraphModule, plan: Plan, also: tuple[str, ...] = ()) -> torch.nn.Module:
    """quantkit's model with the quantizations the format drops removed (skip_unsupported), and
    those named in ``also`` (a KV cache the consumer does not apply): what the consumer should
    compute. The graph is copied; tensors are shared, not copied."""
    if not plan.bypass and not also:
        return qmodel
    graph = copy.deepcopy(qmodel.graph)  # keeps the pytree input/output handling
    ref = GraphModule(qmodel, graph)
    nodes = {n.name: n for n in graph.nodes}
    memo: dict = {}
    for name in list(plan.bypass) + list(also):
        dq = nodes[name]
        dq.replace_all_uses_with(float_value(graph, dq, memo))
    graph.eliminate_dead_code()
    ref.recompile()
    ref.meta.update(qmodel.meta)
    return ref


def _check_loaded(model, plan: Plan, info: dict, *, dense: bool) -> None:
    ignored = set() if checks.kv_applied(model, plan) else {f"{m}.{s}" for m in plan.kv for s in ("k_scale", "v_scale")}
    bad = [(what, k) for what in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in (info.get(what) or ())
           if not (what == "unexpected_keys" and k in ignored)]
    if bad:
        what, key = bad[0]
        raise QuantkitError(f"transformers reports {what.replace('_', ' ')[:-1]} {key!r} loading the export "
                            f"({len(bad)} such); the checkpoint does not fit its config")
    if dense:
        checks.check_dense(model, plan)
        return
    for name, tensors in checks.stored_on_modules(plan, with_kv=not ignored):
        mod = model.get_submodule(name)
        for attr, expected in tensors.items():
            got = getattr(mod, attr, None)
            if not isinstance(got, torch.Tensor) or not checks.same(got, expected):
                raise QuantkitError(f"transformers loaded {name}.{attr} of the export differently from quantkit's "
                                    "tensor; the compressed-tensors version may not match (checked with "
                                    f"{TESTED_VERSION})")


def _verify(directory: Path, cls, plan: Plan, qmodel: GraphModule, batches: list, dtype: torch.dtype,
            cast: dict) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    dense = checks.dense_load(plan)
    extra = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)} if dense else {}
    try:
        model, info = cls.from_pretrained(str(directory), dtype=dtype, local_files_only=True,
                                          output_loading_info=True, trust_remote_code=False, **extra)
    except Exception as exc:
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise QuantkitError(f"transformers could not load the export ({first.strip()[:300]}); nothing was written") \
            from None
    model.eval()
    device = next((t.device for t in (batches[0].values() if isinstance(batches[0], dict) else batches[0])
                   if isinstance(t, torch.Tensor)), torch.device("cpu"))
    model.to(device)
    _check_loaded(model, plan, info, dense=dense)
    kv_applied = checks.kv_applied(model, plan)
    files_checked = checks.check_files(directory, plan)
    reference = _reference(qmodel, plan, () if kv_applied else tuple(n for kv in plan.kv.values() for n in kv.nodes))
    if cast:  # quantkit's model with the float tensors rounded as stored (computed in float32 still)
        reference = _Cast(reference, cast)
    layers = _layer_check(model, plan, batches[0])
    if layers["layers"] != len(plan.linears):
        raise QuantkitError(f"only {layers['layers']} of the {len(plan.linears)} quantized linears ran in transformers' "
                            "model of the export; the module names do not match, please report it")
    worst, margin = layers["worst_layer_sqnr_db"], layers["worst_dynamic_margin_db"]
    if worst is not None and not worst >= _MIN_LAYER_SQNR_DB:
        raise QuantkitError(f"transformers computes {layers['worst_layer']} of the export differently from quantkit "
                            f"({worst:.1f} dB SQNR on the same input, < {_MIN_LAYER_SQNR_DB:g} dB); nothing was "
                            f"written, please report it (checked with compressed-tensors {TESTED_VERSION})")
    if margin is not None and not margin <= _MAX_DYNAMIC_MARGIN_DB:
        raise QuantkitError(f"transformers computes {layers['worst_dynamic_layer']} of the export {margin:.1f} dB "
                            f"further from float than quantkit (> {_MAX_DYNAMIC_MARGIN_DB:g} dB); nothing was "
                            f"written, please report it (checked with compressed-tensors {TESTED_VERSION})")
    layers["tensors_equal_in_files"] = files_checked
    layers["loaded_with"] = "CompressedTensorsConfig(dequantize=True)" if dense else "default (compressed)"
    if plan.kv:  # the scales equal quantkit's in the files (checked above); applied by transformers or not
        layers["kv_cache"] = {"attentions": len(plan.kv), "scales_equal": True, "applied_by_transformers": kv_applied}
    result = {**layers, **checks.compare(reference, model, batches), "min_layer_sqnr_db": _MIN_LAYER_SQNR_DB,
              "max_dynamic_margin_db": _MAX_DYNAMIC_MARGIN_DB, "min_mean_cosine": _MIN_MEAN_COSINE}
    exact = not any(isinstance(layer.act, ActQuant) for layer in plan.linears.values())
    if exact:
        result["min_exact_cosine"] = _MIN_EXACT_COSINE
        if not result["min_cosine"] >= _MIN_EXACT_COSINE:
            raise QuantkitError(f"the export loaded with transformers does not compute quantkit's model (min cosine "
                                f"{result['min_cosine']:.6f} < {_MIN_EXACT_COSINE} over {result['rows']} rows, where "
                                "the weights and the FP8 rounding are the same); nothing was written, please report it")
    if not result["mean_cosine"] >= _MIN_MEAN_COSINE:
        raise QuantkitError(f"the export loaded with transformers does not match quantkit's model (mean cosine "
                            f"{result['mean_cosine']:.5f} < {_MIN_MEAN_COSINE} over {result['rows']} rows); nothing "
                            "was written, please report it")
    return result


def _default_inputs(qmodel: GraphModule) -> list:
    capture = qmodel.meta.get("quantkit_capture")
    if capture is None:
        raise QuantkitError("the model has no capture example to verify the export with; pass inputs=[batch, ...]")
    args, kwargs = capture.get("args", ()), capture.get("kwargs", {})
    return [dict(kwargs)] if kwargs else [tuple(args)]


def _versions(ct_version: str) -> dict:
    import transformers

    try:  # the installed distribution's version (quantkit.__version__ is the same; the façade is not imported here)
        quantkit = metadata.version("quantkit")
    except metadata.PackageNotFoundError:  # a source tree on sys.path
        quantkit = "unknown"
    return {"quantkit": quantkit, "compressed_tensors": ct_version, "transformers": transformers.__version__,
            "torch": torch.__version__}


def write_checkpoint(qmodel: GraphModule, model_dir: str | os.PathLike, directory: str | os.PathLike, *,
                     inputs: Iterable[Any] | None = None, skip_unsupported: bool = False, model_class=None,
                     quantize_lm_head: bool = False, float_dtype="bfloat16", engine: str = "vllm-cpu",
                     record: dict | None = None, flags: dict | None = None) -> CompressedTensorsExport:
    """:func:`export_compressed_tensors` into an existing empty ``directory`` (no atomic swap:
    the caller's). Raises before writing anything when the recipe cannot be expressed; ``flags``
    is how the caller names the options in its messages (:data:`_FLAGS`' keys; the CLI: its flags)."""
    flags = {**_FLAGS, **(flags or {})}
    dtype = checks.float_dtype(float_dtype)
    checks.engine_refusal((), engine)  # a bad engine name fails first
    ct_version = check_available()
    if not isinstance(qmodel, GraphModule) or not qmodel.meta.get("quantkit_converted"):
        raise TypeError(f"export_compressed_tensors expects quantkit's converted model (quantkit.convert, quantize or "
                        f"load), got {type(qmodel).__name__}")
    model_dir = Path(model_dir)
    _hf.check_hf_dir(model_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    cls = model_class or _captured_class(qmodel) or _hf.model_class(model_dir, "auto")[0]
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise QuantkitError(f"model_class must be a transformers model class, got {cls!r}")
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True,
                                                         trust_remote_code=False)
    except Exception as exc:
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise QuantkitError(f"could not read the config.json in {str(model_dir)!r}: {first.strip()}") from None
    hf = _meta_model(cls, config)
    modules = dict(hf.named_modules())
    if qmodel.meta.get("quantkit_program") is not None and not recorded_modules(qmodel, modules):
        raise QuantkitError("this loaded artifact has no quantization.json records to name its layers by (a graph "
                            "read from model.pt2 keeps no module names); export the model quantkit.quantize or "
                            "quantkit.convert returns, or an artifact directory with its quantization.json")
    scaled = explicit_input_scales(qmodel)
    if scaled:  # no tensor holds x * (1/s): the engine would compute without it
        user, todo = scaled[0], list(scaled[0].users)  # the linear reading it (through its input's q/dq)
        while todo and user.target != torch.ops.aten.linear.default:
            user = todo.pop(0)
            todo += list(user.users)
        scopes = module_scopes(user)
        where = scopes[-1][0] if scopes else recorded_modules(qmodel, modules).get(user.name, "")
        more = f" and {len(scaled) - 1} more" if len(scaled) > 1 else ""
        raise QuantkitError(f"{where or scaled[0].name}{more} read their input through an explicit per-channel scale "
                            "(SmoothQuant or AWQ where 1/s folds into no op); compressed-tensors has no tensor for "
                            "it: quantize with smooth_quant(..., fold_only=True) or WeightOnlyQuantizer(..., "
                            "awq_fold_only=True) (the CLI does both for --format compressed-tensors)")
    plan = read_graph(qmodel, modules)
    if plan.unsupported and not skip_unsupported:
        u = plan.unsupported[0]
        more = f" and {len(plan.unsupported) - 1} more layers" if len(plan.unsupported) > 1 else ""
        raise QuantkitError(f"compressed-tensors cannot express {u.what} ({u.module}{more}): {u.hint}, or pass "
                            f"{flags['skip_unsupported']} to keep those layers float")
    if not plan.linears:
        why = f"; {plan.unsupported[0].what}: {plan.unsupported[0].hint}" if plan.unsupported else ""
        raise QuantkitError(f"no layer of the model can be stored int8 in the compressed-tensors format{why}")
    head = _lm_head(hf, modules)
    if head is not None and head in plan.linears and not quantize_lm_head:
        raise QuantkitError(f"{head} is quantized, and vLLM keeps {head} float (its ParallelLMHead is no Linear, so it "
                            f"refuses {head}'s scales); quantize with {head} kept float ({flags['skip_lm_head']}), or "
                            f"pass {flags['quantize_lm_head']} to store it quantized with {head!r} in the targets")
    if quantize_lm_head and (head is None or head not in plan.linears):
        raise QuantkitError(f"{flags['quantize_lm_head']} but the model's "
                            f"{'output head is float' if head else 'has no output head (lm_head)'}; quantize "
                            f"{head or 'lm_head'} or drop {flags['quantize_lm_head']}")
    refusal = checks.engine_refusal(checks.plan_kinds(plan), engine, engine_flag=flags["engine"])
    if refusal is not None:
        raise QuantkitError(refusal)
    batches = list(inputs) if inputs is not None else _default_inputs(qmodel)
    if not batches:
        raise QuantkitError("inputs is empty; pass at least one batch to verify the export with")
    tensors, untied, cast = _tensors(qmodel, hf, plan, dtype)
    float_linears = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n not in plan.linears]
    qconfig = quantization_config(plan.linears, float_linears, plan.kv, ct_version,
                                  by_name=(head,) if quantize_lm_head else ())
    doc = _config(model_dir, cls, qconfig, untied, dtype)
    from compressed_tensors.quantization import QuantizationConfig

    try:  # the installed compressed-tensors must parse what we write
        QuantizationConfig.model_validate(doc["quantization_config"])
    except Exception as exc:
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise QuantkitError(f"compressed-tensors {ct_version} rejects the quantization_config ({first}); quantkit "
                            f"writes the format of compressed-tensors {TESTED_VERSION}") from None

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = _save(tensors, directory)
    (directory / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    files.append("config.json")
    source_config = _hf._config_json(model_dir)
    notes = [_remote_code_note("config.json", source_config)] if any(k in source_config for k in _REMOTE_CODE_KEYS) \
        else []
    copied, copy_notes = _copy_files(model_dir, directory)
    files += copied
    notes += copy_notes
    # loaded in float32 (bf16 and fp16 widen exactly), against quantkit's model with the same float tensors
    with contextlib.redirect_stderr(io.StringIO()):  # compressed-tensors' progress bars; errors are raised
        verification = _verify(directory, cls, plan, qmodel, batches, torch.float32, cast)
    kept = tuple(f"{u.module}: {u.what}" for u in plan.unsupported)
    result = CompressedTensorsExport(path=directory, linears=len(plan.linears), kept_float=kept,
                                     dequantized=tuple(plan.weight_only), verification=verification,
                                     versions=_versions(ct_version), notes=tuple(notes))
    marker = {"format": _MARKER_FORMAT, "files": sorted(files + [MARKER_FILE]), "source": str(model_dir),
              "architecture": cls.__name__, "int8_linears": sorted(plan.linears), "kept_float": list(kept),
              "formats": sorted({layer.weight.format for layer in plan.linears.values()}),
              "kv_cache": sorted(plan.kv),
              "weight_only_dequantized": list(plan.weight_only), "untied": [list(g) for g in untied],
              "float_dtype": str(dtype).removeprefix("torch."), "engine": engine,
              "lm_head": "quantized" if quantize_lm_head else ("float" if head else None),
              "verification": verification, "versions": result.versions, "notes": list(result.notes),
              **(record or {})}
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    return result


def export_compressed_tensors(qmodel: GraphModule, model_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                              inputs: Iterable[Any] | None = None, skip_unsupported: bool = False,
                              overwrite: bool = False, model_class=None, quantize_lm_head: bool = False,
                              float_dtype="bfloat16", engine: str = "vllm-cpu") -> CompressedTensorsExport:
    """Write quantkit's quantized model as a compressed-tensors checkpoint that transformers and vLLM load.

    ``out_dir`` becomes an HF model directory: ``model_dir``'s config.json with a
    ``quantization_config``, safetensors and the tokenizer files. Schemes: W8A8 int8
    (``int-quantized``: per-channel weights, static per-tensor or dynamic per-token inputs),
    FP8 E4M3 (``float-quantized``: per-channel or per-tensor weights, static per-tensor or
    dynamic inputs), group-wise int4/int8 weight-only (``pack-quantized``) and static KV-cache
    scales (``kv_cache_scheme``, ``FP8Quantizer(kv_cache=...)``). NF4 has no compressed-tensors
    scheme.
    It is written beside ``out_dir``, loaded back with ``transformers`` (the class the model
    was captured from) and compared with ``qmodel`` on ``inputs``; only a match is put in place.

    Args:
        qmodel: the converted model (:func:`quantkit.convert` / :func:`quantkit.quantize`) of an
            HF model captured with :func:`quantkit.capture`, or an artifact read back with
            :func:`quantkit.load` (its layers named by the artifact's ``quantization.json``).
        model_dir: the HF model directory it was quantized from (config, tokenizer).
        out_dir: the directory to create.
        inputs: batches to verify with (default: the capture example).
        skip_unsupported: keep layers the format cannot express float (listed in the result)
            instead of failing.
        overwrite: replace ``out_dir`` if it is empty or a previous export.
        model_class: the transformers class ``qmodel`` was captured from (default: read from the graph).
        quantize_lm_head: store the output head (``lm_head``) quantized, named in the targets (vLLM
            quantizes it only by name). Default False, as llm-compressor: it must be float in
            ``qmodel`` (quantize with ``skip=["lm_head"]``) and is listed in ``ignore``.
        float_dtype: the dtype of the float tensors (norms, embeddings, float layers):
            ``"bfloat16"`` (default; what vLLM runs), ``"float16"`` or ``"float32"``. Scales stay float32.
        engine: ``"vllm-cpu"`` (default) refuses, in one line, what vLLM's CPU build cannot run
            (w8a16, static FP8); ``"transformers"`` writes it anyway.

    Returns:
        A :class:`CompressedTensorsExport`.

    Raises:
        QuantkitError: compressed-tensors is not installed, ``model_dir`` is not an HF model
            directory, the recipe cannot be expressed (before anything is written), or the
            export does not load or match (nothing is left behind).

    Example:
        >>> quantkit.export_compressed_tensors(qmodel, "models/llama", "out/llama-w8a8")
    """
    check_available()
    _hf.check_hf_dir(model_dir)
    check_source(model_dir)
    path = check_out_dir(out_dir, overwrite=overwrite).absolute()
    with _atomic.atomic_dir(path, check=lambda: check_out_dir(path, overwrite=overwrite)) as tmp:
        result = write_checkpoint(qmodel, model_dir, tmp, inputs=inputs, skip_unsupported=skip_unsupported,
                                  model_class=model_class, quantize_lm_head=quantize_lm_head,
                                  float_dtype=float_dtype, engine=engine)
    return CompressedTensorsExport(path=Path(out_dir), linears=result.linears, kept_float=result.kept_float,
                                   dequantized=result.dequantized, verification=result.verification,
                                   versions=result.versions, notes=result.notes)
