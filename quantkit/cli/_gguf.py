"""``quantkit quantize --format gguf``: a GGUF file that llama.cpp runs (``quantkit.export_gguf``).

``--format gguf`` makes OUT the .gguf file itself; ``--format pt2,gguf`` writes the artifact
directory with ``model.gguf`` inside it. What GGUF cannot hold is refused here, before anything
loads or calibrates: GGUF's Q4_0/Q4_1/Q8_0 blocks hold weight-only int4/int8 groups of 32 (a group
size that is a multiple of 32, or one group per row, repeats its scale in each block).
``--float-dtype float16`` writes the 2-d float tensors F16, as llama.cpp's converter does (default
float32: the values quantkit computes with).
"""

from __future__ import annotations

from pathlib import Path

from .._quiet import silenced
from . import _inputs as inputs

__all__ = ["GGUF", "FILE", "check", "write", "summary", "describe"]

GGUF = "gguf"
FILE = "model.gguf"  # where --format pt2,gguf puts the GGUF file inside the artifact
_FLAGS = {"skip_unsupported": "--skip-unsupported"}


def _refuse_scheme(args) -> None:
    scheme = getattr(args, "scheme", None)
    group = getattr(args, "group_size", None)
    if scheme not in ("w4a16", "w8a16"):
        what = f"--scheme {scheme}" if scheme else "the default w8a8 (int8 activations)"
        raise inputs.UsageError(f"--format gguf holds weight-only int4/int8 (Q4_0, Q4_1, Q8_0), not {what}: use "
                                "--scheme w4a16 or w8a16 (--group-size 32 for GGUF's own layout)")
    if group is not None and group % 32:
        raise inputs.UsageError(f"--format gguf blocks hold 32 weights per scale, so the group size must be a "
                                f"multiple of 32, not --group-size {group}: use --group-size 32")


def check(args, spec: inputs.ModelSpec, out: Path, formats: tuple[str, ...], force: bool) -> Path | None:
    """Checks before anything loads; returns OUT when it is the .gguf file alone, else None."""
    if GGUF not in formats:
        return None
    if len(formats) > 1 and formats != ("pt2", GGUF):
        raise inputs.UsageError("--format gguf combines with pt2 only (pt2,gguf): write compressed-tensors "
                                "in another run")
    _refuse_scheme(args)
    from ..export._gguf import FLOAT_DTYPES

    if getattr(args, "float_dtype", None) not in (None, *FLOAT_DTYPES):
        raise inputs.UsageError(f"--format gguf writes float tensors as {' or '.join(FLOAT_DTYPES)} (what llama.cpp's "
                                f"converter writes), not --float-dtype {args.float_dtype}: use --float-dtype float16")
    if not spec.is_hf:
        raise inputs.UsageError("--format gguf needs the HF model's config.json and tokenizer, so MODEL must be "
                                "an HF model directory, not a factory")
    from ..export._gguf import check_available

    check_available()
    if formats != (GGUF,):
        return None
    if out.suffix != ".gguf":
        raise inputs.UsageError(f"--format gguf writes one file: OUT must end in .gguf, got {str(out)!r}")
    if out.exists() and (not force or not out.is_file()):
        raise inputs.UsageError(f"{str(out)!r} exists; pass --force to replace it" if out.is_file() else
                                f"{str(out)!r} is a directory; choose a .gguf file path")
    if not out.parent.is_dir():
        raise inputs.UsageError(f"{str(out.parent)!r} is not a directory; create it first")
    return out


def write(path: Path, *, qmodel, model_dir: Path, args):
    """Export ``qmodel`` as GGUF into ``path`` (atomically)."""
    from ..export._gguf import export_gguf

    with silenced():  # transformers' tokenizer loading and gguf's writer log; the summary line is ours
        return export_gguf(qmodel, path, model=model_dir, skip_unsupported=bool(getattr(args, "skip_unsupported",
                                                                                         False)),
                           float_dtype=getattr(args, "float_dtype", None) or "float32", overwrite=True, flags=_FLAGS)


def summary(result) -> dict:
    """The report's ``gguf`` entry."""
    kinds: dict[str, int] = {}
    for kind in result.tensors.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"architecture": result.architecture, "tensor_types": kinds, "kept_float": list(result.kept_float),
            "fp16_scale_error": result.fp16_scale_error, "tokenizer_pre": result.tokenizer_pre}


def describe(result) -> str:
    kinds = summary(result)["tensor_types"]
    kept = f", {len(result.kept_float)} kept F16" if result.kept_float else ""
    return (f"gguf ({result.architecture}): " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) +
            f" tensors{kept}; fp16 scales add at most {result.fp16_scale_error:.1e} relative weight error")
