"""What ``quantkit eval`` reads of an artifact: its checked ``quantization.json``, the recorded source
(float model, data, held-out split) field by field, the float model to compare with, and the program.

Shared by the comparison of ``_eval`` and the causal-LM perplexity of ``_eval_lm``. An artifact's
JSON files are untrusted input: every field is checked before use, and no code an artifact names
is imported (a factory float model comes only from ``--model``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..export import _artifact
from . import _data as datasets, _inputs as inputs
from .._errors import QuantkitError

__all__ = ["Source", "damaged", "read_artifact", "read_source", "float_spec", "load_program"]


def damaged(path: Path, why: str) -> QuantkitError:
    return QuantkitError(f"{str(path)!r} is damaged: {why}; re-run quantkit quantize to rewrite the artifact")


def read_artifact(directory: str, args, warn) -> tuple[Path, dict]:
    """The checked artifact at ``directory`` and its ``quantization.json``. With
    ``--allow-unverified`` one that cannot be verified is read too, and ``warn`` says so."""
    path = Path(directory)
    if not path.is_dir():
        raise QuantkitError(f"{directory!r} is not a directory; pass the --out directory of quantkit quantize")
    # both files, quantkit's format and format_version, model.pt2's SHA-256, nothing unsafe
    doc = _artifact.verify_artifact(path, allow_unverified=args.allow_unverified, flag="--allow-unverified")
    reason = _artifact.unverified_reason(doc)
    if reason is not None:
        warn(f"quantkit: warning: {str(path)!r} is not verified ({reason}); read because of --allow-unverified")
    for key, kind in (("recipe", dict), ("source", dict), ("versions", dict), ("tensors", list)):
        if key in doc and not isinstance(doc[key], kind):
            raise damaged(path / _artifact.RECIPE_FILE, f"field {key!r} is {type(doc[key]).__name__}, "
                                                         f"not {'an object' if kind is dict else 'a list'}")
    if not all(isinstance(t, dict) for t in doc.get("tensors", [])):
        raise damaged(path / _artifact.RECIPE_FILE, "'tensors' holds entries that are not objects")
    return path, doc


@dataclass(frozen=True)
class Source:
    """quantization.json's ``source``, checked field by field."""

    model: inputs.ModelSpec
    data: datasets.DataSpec
    fingerprint: str
    samples: int
    heldout: list[int]
    seq_len: int
    batch_size: int
    allow_missing_weights: bool


def read_source(path: Path, doc: dict) -> Source:
    src = doc.get("source")
    if not src:
        raise QuantkitError(f"{str(path)!r} was saved from Python and does not record its float model; "
                            "eval needs an artifact written by quantkit quantize")
    file = path / _artifact.RECIPE_FILE

    def field(key, kind, check=lambda v: True, default=None):
        v = src.get(key, default)
        if not isinstance(v, kind) or isinstance(v, bool) is not (kind is bool) or not check(v):
            raise damaged(file, f"source.{key} is {v!r}")
        return v

    samples = field("samples", int, lambda v: v >= 1)
    data = src.get("data", {})
    if not isinstance(data, dict) or data.get("kind", "default") not in ("default", "text", "tensors") \
            or not isinstance(data.get("path", ""), str) or (data.get("kind") in ("text", "tensors") and "path" not in data):
        raise damaged(file, f"source.data is {data!r}")
    heldout = field("heldout", list, lambda v: v and all(isinstance(i, int) and not isinstance(i, bool)
                                                        and 0 <= i < samples for i in v))
    return Source(
        model=inputs.ModelSpec.from_json(src.get("model")),
        data=datasets.DataSpec.from_json(data),
        fingerprint=field("fingerprint", str),
        samples=samples,
        heldout=heldout,
        seq_len=field("seq_len", int, lambda v: v >= 2, 128),
        batch_size=field("batch_size", int, lambda v: v >= 1, 32),
        allow_missing_weights=field("allow_missing_weights", bool, default=False),
    )


def float_spec(args, source: Source) -> inputs.ModelSpec:
    """The float model to compare with: ``--model`` if given, else the recorded HF model.
    A factory is imported only when ``--model`` names it (never from the artifact)."""
    recorded = source.model
    if args.model is None:
        for flag, v in (("--weights", args.weights), ("--example-input", args.example_input), ("--task", args.task)):
            if v is not None:
                raise inputs.UsageError(f"{flag} applies with --model only")
        if recorded.kind == "factory":
            raise inputs.UsageError(
                f"this artifact's float model comes from the factory {recorded.factory!r}; eval does not import "
                f"code an artifact names: pass --model {recorded.factory} if you trust that code")
        return recorded
    if inputs.is_factory_name(args.model):
        same = recorded.kind == "factory"
        weights = args.weights or (recorded.weights if same else None)
        example = args.example_input or (recorded.example_input if same else None)
        return inputs.ModelSpec.from_args(args.model, weights, example, "auto")
    task = args.task or (recorded.task if recorded.is_hf else "auto")
    return inputs.ModelSpec.from_args(args.model, args.weights, args.example_input, task)


def load_program(path: Path, device: torch.device, *, allow_unverified: bool):
    """The artifact's int8 program as a module on ``device`` (artifacts are saved for CPU)."""
    with warnings.catch_warnings():  # read_artifact has said it is not verified
        warnings.simplefilter("ignore", _artifact.UnverifiedWarning)
        # verified and read without unpickling (quantkit.export._safe_pt2)
        module = _artifact.load(path, allow_unverified=allow_unverified)
    if device.type == "cpu":
        return module
    from torch.export.passes import move_to_device_pass

    moved = move_to_device_pass(module.meta[_artifact.PROGRAM_META_KEY], device).module()
    moved.meta["quantkit_converted"] = True
    return moved
