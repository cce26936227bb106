"""``quantkit quantize --format``: which artifacts to write, and the compressed-tensors one.

``pt2`` (default) is quantkit's artifact directory; ``compressed-tensors`` an HF model directory
that transformers and vLLM load (``quantkit.export_compressed_tensors``); ``pt2,compressed-tensors``
writes the artifact with the HF directory inside it, in ``compressed-tensors/``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .._quiet import silenced
from . import _gguf
from . import _inputs as inputs

__all__ = ["FORMATS", "SUBDIR", "folds_only", "parse_formats", "check", "write", "summary", "describe", "refuse_sequential",
           "lm_head_float"]

PT2, CT, GGUF = "pt2", "compressed-tensors", _gguf.GGUF
FORMATS = (PT2, CT, GGUF)
SUBDIR = CT  # where --format pt2,compressed-tensors puts the HF directory inside the artifact


def folds_only(args) -> bool:
    """Whether SmoothQuant/AWQ must leave no explicit input-scale ``mul`` (``--format`` names an
    export that has no tensor for one: compressed-tensors, GGUF)."""
    return bool({CT, GGUF} & set(parse_formats(getattr(args, "format", None))))


def parse_formats(text: str | None) -> tuple[str, ...]:
    """``--format``: a comma-separated subset of :data:`FORMATS`, in that order."""
    names = [n.strip() for n in (text or PT2).split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise inputs.UsageError(f"unknown --format {unknown[0] if unknown else text!r}; use pt2, compressed-tensors, "
                                "gguf or pt2 with one of them (pt2,compressed-tensors)")
    return tuple(f for f in FORMATS if f in names)


def check(args, spec: inputs.ModelSpec, out: Path, check_pt2_dir) -> Path:
    """Checks before anything loads: an HF model, compressed-tensors installed, a writable --out."""
    formats = parse_formats(getattr(args, "format", None))
    for flag, given in (("--skip-unsupported", getattr(args, "skip_unsupported", False)),
                        ("--quantize-lm-head", getattr(args, "quantize_lm_head", False)),
                        ("--float-dtype", getattr(args, "float_dtype", None) is not None),
                        ("--engine", getattr(args, "engine", None) is not None)):
        if given and CT not in formats and not (flag in ("--skip-unsupported", "--float-dtype") and GGUF in formats):
            raise inputs.UsageError(f"{flag} applies to --format compressed-tensors" +
                                    (" or gguf" if flag == "--float-dtype" else "") + f" only; add it or drop {flag}")
    if CT in formats:
        _refuse_unexpressible(args)
        _refuse_for_engine(args)
        if not spec.is_hf:
            raise inputs.UsageError("--format compressed-tensors writes an HF checkpoint, so MODEL must be an HF model "
                                    "directory (config.json and weights), not a factory")
        from ..export._compressed_tensors import check_available, check_source

        check_source(_model_dir(spec))  # a quantized source fails here, before anything loads or calibrates
        check_available()
    gguf_out = _gguf.check(args, spec, out, formats, force=args.force)  # --format gguf: OUT is the file
    if gguf_out is not None:
        return gguf_out
    if formats == (CT,):
        from ..export._compressed_tensors import check_out_dir

        return check_out_dir(out, overwrite=args.force, flag="--force", exists_error=inputs.UsageError)
    return check_pt2_dir(out)


def _refuse_unexpressible(args) -> None:
    """Recipes with no compressed-tensors scheme at all, refused before anything loads (the rest,
    per layer, after quantizing and before writing)."""
    why = None
    if getattr(args, "scheme", None) == "nf4":
        why = "--scheme nf4 (compressed-tensors has no NF4 scheme): use --scheme w4a16"
    elif getattr(args, "kv_cache", None) == "fp8_e5m2":
        why = "--kv-cache fp8_e5m2 (the format's 8-bit float is E4M3): use --kv-cache fp8_e4m3"
    elif getattr(args, "kv_cache", None) == "int8":  # quantizers.FP8Quantizer.kv_spec: symmetric [-127, 127]
        why = ("--kv-cache int8 (quantkit's int8 KV cache is [-127, 127], the format's [-128, 127]): use "
               "--kv-cache fp8_e4m3")
    elif getattr(args, "kv_cache", None) and getattr(args, "kv_granularity", None) == "per-head":
        why = "--kv-granularity per-head (quantkit writes per-tensor KV-cache scales): drop --kv-granularity"
    if why is not None:
        raise inputs.UsageError(f"--format compressed-tensors cannot store {why}, or use --format pt2")


def _refuse_for_engine(args) -> None:
    """Schemes the chosen engine (--engine, default vllm-cpu) cannot run, refused before anything loads."""
    from ..export._ct_checks import engine_refusal

    scheme = getattr(args, "scheme", None)
    kinds = []
    if scheme == "w8a16":
        kinds.append("w8a16")
    elif scheme == "fp8" and not getattr(args, "dynamic", None):
        kinds.append("fp8-static")
    why = engine_refusal(kinds, getattr(args, "engine", None) or "vllm-cpu", **_ENGINE_FLAGS)
    if why is not None:
        raise inputs.UsageError(why.replace(" use w4a16", " use --scheme w4a16").replace(
            " use fp8-dynamic", " use --scheme fp8-dynamic"))


# how the export's messages name its options here
_ENGINE_FLAGS = {"engine_flag": "--engine transformers"}
_FLAGS = {"skip_unsupported": "--skip-unsupported", "quantize_lm_head": "--quantize-lm-head",
          "skip_lm_head": "--skip lm_head", "engine": "--engine transformers"}


def lm_head_float(args, recipe, module_names: list[str]):
    """``recipe`` with ``lm_head`` added to its ``skip`` when it must stay float: --format
    compressed-tensors without --quantize-lm-head (vLLM keeps it float, as llm-compressor writes it;
    the pt2 artifact written beside the export is the same model). Else ``recipe`` as it is."""
    if CT not in parse_formats(getattr(args, "format", None)) or getattr(args, "quantize_lm_head", False) \
            or "lm_head" not in module_names or "lm_head" in recipe.skip:
        return recipe
    return dataclasses.replace(recipe, skip=tuple(recipe.skip) + ("lm_head",))


def refuse_sequential(args) -> None:
    """The layer-by-layer path (--max-memory, --sequential) writes pt2 only, and no generating artifact:
    it quantizes full-sequence blocks, never the program with a static KV cache --max-cache-len asks for."""
    if getattr(args, "max_cache_len", None) is not None:
        raise inputs.UsageError("--max-cache-len is not available with layer-by-layer quantization (--sequential, "
                                "--resume, or a --max-memory the model does not fit) yet; drop --sequential/--resume, "
                                "raise --max-memory, or drop --max-cache-len")
    if CT in parse_formats(getattr(args, "format", None)):
        raise inputs.UsageError("--format compressed-tensors is not available with layer-by-layer quantization "
                                "(--max-memory, --sequential) yet; use --format pt2 there")


def _model_dir(spec: inputs.ModelSpec) -> Path:
    from .. import _hf

    return _hf.default_model_path() if spec.kind == "default" else Path(spec.path)


def write(directory: Path, *, qmodel, spec: inputs.ModelSpec, loaded, batches: list, skip_unsupported: bool,
          record: dict | None = None, atomic: bool, args=None):
    """Export ``qmodel`` as compressed-tensors into ``directory`` (``atomic``: swapped into place,
    else written into a fresh directory inside the caller's atomic one), verified against it."""
    from ..export import _atomic, _compressed_tensors as ct

    kw = dict(inputs=batches, skip_unsupported=skip_unsupported, model_class=type(loaded.model), flags=_FLAGS,
              quantize_lm_head=bool(getattr(args, "quantize_lm_head", False)),
              float_dtype=getattr(args, "float_dtype", None) or "bfloat16",
              engine=getattr(args, "engine", None) or "vllm-cpu")
    # transformers, compressed-tensors and torchao run here: what they print, log or warn is not ours
    # to show (stdout is the summary line's, stderr the error line's); QUANTKIT_DEBUG=1 shows it
    with silenced():
        if not atomic:
            return ct.write_checkpoint(qmodel, _model_dir(spec), directory, record=record, **kw)
        check = lambda: ct.check_out_dir(directory, overwrite=True, flag="--force")  # noqa: E731
        with _atomic.atomic_dir(directory, check=check) as tmp:
            return ct.write_checkpoint(qmodel, _model_dir(spec), tmp, record=record, **kw)


def summary(result) -> dict:
    """The report's ``compressed_tensors`` entry."""
    return {"int8_linears": result.linears, "kept_float": list(result.kept_float),
            "weight_only_dequantized": list(result.dequantized), "verification": result.verification,
            "versions": result.versions, "notes": list(result.notes)}


def describe(result) -> str:
    v = result.verification
    kept = f", {len(result.kept_float)} layers kept float" if result.kept_float else ""
    notes = "".join(f"; {n}" for n in result.notes)
    return (f"compressed-tensors: {result.linears} quantized linears{kept}; loaded with transformers "
            f"(compressed-tensors {result.versions['compressed_tensors']}), min cosine {v['min_cosine']:.6f} "
            f"vs quantkit's model on {v['rows']} rows{notes}")
