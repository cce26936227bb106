"""What the CLI quantizes and calibrates with: model specs, example inputs, data, splits, batches.

Everything here is cheap to check before a model is loaded, so that bad command lines
fail in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import _hf
from ._errors import QuantkitError

__all__ = [
    "UsageError", "ModelSpec", "DataSpec", "Split", "LoadedModel", "parse_example_input",
    "load_model", "read_samples", "split_samples", "make_batches", "TENSOR_SUFFIXES",
]

TENSOR_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors")
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class UsageError(QuantkitError):
    """The command line itself is wrong (exit code 2)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_example_input(text: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``"8x64:float32"`` → ``[((8, 64), torch.float32)]``; several inputs are comma-separated."""
    specs = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+(?:x\d+)*)\s*:\s*(\w+)\s*", part)
        if not m or m.group(2).lower() not in _DTYPES:
            raise UsageError(
                f"--example-input {text!r} is not SHAPE:DTYPE; write e.g. 8x64:float32 "
                f"(dtypes: {', '.join(sorted(set(map(_dtype_name, _DTYPES.values()))))})"
            )
        shape = tuple(int(s) for s in m.group(1).split("x"))
        if any(s < 1 for s in shape):
            raise UsageError(f"--example-input {text!r} has a zero dimension")
        specs.append((shape, _DTYPES[m.group(2).lower()]))
    return specs


@dataclass(frozen=True)
class ModelSpec:
    """Where the float model comes from; stored in quantization.json so eval can rebuild it."""

    kind: str  # "default" | "hf" | "factory"
    path: str | None = None
    factory: str | None = None
    weights: str | None = None
    example_input: str | None = None

    @staticmethod
    def from_args(model: str | None, weights: str | None, example_input: str | None) -> "ModelSpec":
        if model is not None and _FACTORY.match(model) and not Path(model).exists():
            if example_input is None:
                raise UsageError(f"factory {model!r} needs --example-input SHAPE:DTYPE (e.g. 8x64:float32)")
            parse_example_input(example_input)
            if weights is not None:
                weights = str(Path(weights).absolute())
            return ModelSpec("factory", factory=model, weights=weights, example_input=example_input)
        if weights is not None or example_input is not None:
            raise UsageError("--weights and --example-input apply to a package.module:factory MODEL only")
        if model is None:
            return ModelSpec("default")
        return ModelSpec("hf", path=str(Path(model).absolute()))

    @staticmethod
    def from_json(doc: dict) -> "ModelSpec":
        try:
            return ModelSpec(**doc)
        except TypeError:
            raise QuantkitError(f"quantization.json has an unreadable model source {doc!r}") from None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def is_hf(self) -> bool:
        return self.kind in ("default", "hf")

    def input_paths(self) -> list[Path]:
        """Files and directories this spec reads (never written to)."""
        if self.kind == "default":
            return []
        return [Path(p) for p in (self.path, self.weights) if p]

    def check(self) -> None:
        """Cheap checks before anything is loaded (paths exist, weights are readable)."""
        if self.kind == "hf":
            path = Path(self.path)
            if not path.exists():
                raise QuantkitError(f"model path {self.path!r} does not exist; pass an HF model directory "
                                    "or package.module:factory")
            _hf.check_hf_dir(path)
        elif self.kind == "default":
            _hf.default_model_path()
        elif self.weights is not None:
            w = Path(self.weights)
            if not w.is_file():
                raise QuantkitError(f"weights file {self.weights!r} does not exist")
            if w.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
                raise QuantkitError(f"weights file {self.weights!r} must be .safetensors or .pt (a state dict)")
            if w.suffix == ".safetensors":
                _hf.check_safetensors(w)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any = None
    example: Any = None  # one batch for capture (factories); HF models use a calibration batch
    weight_bytes: int = 0  # size of the fp32 weights on disk (or in memory for factories)


def _import_factory(name: str):
    module_name, _, attr = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like python -m: modules beside the caller import
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises at import
        raise QuantkitError(f"could not import {module_name!r} for factory {name!r}: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise QuantkitError(f"{module_name!r} has no callable {attr!r}; MODEL must be package.module:factory")
    return factory


def _load_state_dict(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise QuantkitError(f"could not read weights {str(path)!r} ({type(exc).__name__}); "
                            "save a state dict with torch.save(model.state_dict(), path)") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise QuantkitError(f"{str(path)!r} does not hold a state dict of tensors")
    return obj


def _example_tensors(specs) -> tuple:
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape, dtype in specs:
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            out.append(torch.zeros(shape, dtype=dtype))
    return tuple(out)


def load_model(spec: ModelSpec, *, progress: bool) -> LoadedModel:
    """Load the float model a spec names (eval mode)."""
    if spec.is_hf:
        path = _hf.default_model_path() if spec.kind == "default" else Path(spec.path)
        model, tok = _hf.load_hf_model(path, progress=progress)
        size = sum(p.stat().st_size for p in path.iterdir() if p.name in _hf.WEIGHT_FILES or p.suffix == ".safetensors")
        return LoadedModel(model, tok, None, size)
    factory = _import_factory(spec.factory)
    torch.manual_seed(0)  # factories without --weights then rebuild the same model in eval
    try:
        model = factory()
    except Exception as exc:
        raise QuantkitError(f"factory {spec.factory!r} failed: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    if not isinstance(model, torch.nn.Module):
        raise QuantkitError(f"factory {spec.factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if spec.weights is not None:
        sd = _load_state_dict(Path(spec.weights))
        try:
            model.load_state_dict(sd, strict=True)
        except RuntimeError as exc:
            first = next((ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()), str(exc))
            raise QuantkitError(f"weights {spec.weights!r} do not fit {spec.factory!r}: {first}") from None
        size = Path(spec.weights).stat().st_size
    model.eval()
    return LoadedModel(model, None, _example_tensors(parse_example_input(spec.example_input)), size)


# --- data ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DataSpec:
    """Calibration or evaluation data: a text file, a directory of tensors, or the bundled sentences."""

    kind: str  # "default" | "text" | "tensors"
    path: str | None = None

    @staticmethod
    def from_arg(path: str | None) -> "DataSpec":
        if path is None:
            return DataSpec("default")
        p = Path(path)
        if not p.exists():
            raise QuantkitError(f"calibration data {path!r} does not exist; pass a text file or a directory of tensors")
        return DataSpec("tensors" if p.is_dir() else "text", str(p.absolute()))

    @staticmethod
    def from_json(doc: dict) -> "DataSpec":
        return DataSpec(doc.get("kind", "default"), doc.get("path"))

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def file(self) -> Path:
        return _hf.default_calibration_file() if self.kind == "default" else Path(self.path)


def _tensor_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in TENSOR_SUFFIXES)
    if not files:
        raise QuantkitError(f"calibration directory {str(directory)!r} has no {'/'.join(TENSOR_SUFFIXES)} files")
    return files


def _read_tensor_file(path: Path):
    try:
        if path.suffix == ".npy":
            import numpy as np

            return torch.from_numpy(np.load(str(path), allow_pickle=False))
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            _hf.check_safetensors(path)
            return load_file(str(path))
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except QuantkitError:
        raise
    except Exception as exc:
        raise QuantkitError(f"could not read calibration tensor file {str(path)!r} ({type(exc).__name__})") from None


def _as_batch(obj, path: Path):
    """A file's content as (args tuple) or {kwargs}: the batch dimension is dim 0 of each tensor."""
    if isinstance(obj, torch.Tensor):
        return (obj,)
    if isinstance(obj, (tuple, list)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return tuple(obj)
    if isinstance(obj, dict) and obj and all(isinstance(t, torch.Tensor) for t in obj.values()):
        return dict(obj)
    raise QuantkitError(f"{str(path)!r} must hold a tensor, a tuple of tensors or a dict of tensors")


def _samples_of(batch, path: Path, ndims: list[int] | None) -> list:
    """Split a file's tensors into samples along dim 0. A file one dim short of the model's
    inputs (``ndims``) is one sample; without ``ndims`` (HF models), so are 1-D integer
    tensors: the token ids of one sequence (HF models take ``[batch, tokens]``)."""
    tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
    if ndims is None and tensors and all(t.dim() == 1 and not t.is_floating_point() for t in tensors):
        ndims = [2] * len(tensors)
    if ndims is not None and len(ndims) == len(tensors) and all(t.dim() == n - 1 for t, n in zip(tensors, ndims)):
        batch = {k: v.unsqueeze(0) for k, v in batch.items()} if isinstance(batch, dict) else tuple(t.unsqueeze(0) for t in batch)
        tensors = [t.unsqueeze(0) for t in tensors]
    if any(t.dim() == 0 for t in tensors) or len({t.shape[0] for t in tensors}) != 1:
        raise QuantkitError(f"tensors in {str(path)!r} need one shared batch dimension (dim 0)")
    n = tensors[0].shape[0]
    if isinstance(batch, dict):
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]
    return [tuple(t[i] for t in batch) for i in range(n)]


def read_samples(data: DataSpec, *, example_ndims: list[int] | None = None) -> list:
    """All samples of a data source: strings for text, per-sample tuples/dicts of tensors for tensor dirs.

    Raises:
        QuantkitError: missing, empty or blank-only text; a directory without tensors.
    """
    if data.kind != "tensors":
        return _hf.read_sentences(data.file)
    samples = []
    for f in _tensor_files(Path(data.path)):
        samples.extend(_samples_of(_as_batch(_read_tensor_file(f), f), f, example_ndims))
    if not samples:
        raise QuantkitError(f"calibration directory {data.path!r} holds no samples (every tensor has batch size 0)")
    return samples


def fingerprint(data: DataSpec) -> str:
    """sha256 of the data's files, to notice when eval's data is not what quantize split."""
    h = hashlib.sha256()
    files = _tensor_files(Path(data.path)) if data.kind == "tensors" else [data.file]
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Split:
    """Indices of the calibration and held-out samples (held out samples are never calibrated on)."""

    calib: list[int] = field(default_factory=list)
    heldout: list[int] = field(default_factory=list)


# 20% held out, at most 256 samples: enough for a stable mean cosine, cheap to evaluate
HELDOUT_FRACTION = 0.2
MAX_HELDOUT = 256


def split_samples(n: int, *, num_calib: int | None, seed: int = 0) -> Split:
    """A seeded shuffle of ``range(n)``: the first part held out, the rest (up to ``num_calib``) calibrates."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    if n < 2:
        return Split(calib=order, heldout=order)  # nothing to hold out: evaluate on the calibration sample
    k = max(1, min(MAX_HELDOUT, int(round(n * HELDOUT_FRACTION))))
    heldout, calib = sorted(order[:k]), order[k:]
    if num_calib is not None:
        calib = calib[:num_calib]
    return Split(calib=sorted(calib), heldout=heldout)


def _stack(samples: list):
    if isinstance(samples[0], dict):
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    return tuple(torch.stack([s[i] for s in samples]) for i in range(len(samples[0])))


def _check_sample(sample, example, what: str) -> None:
    """Compare a tensor sample with the factory's example input (without the batch dim)."""
    tensors = list(sample.values()) if isinstance(sample, dict) else list(sample)
    if len(tensors) != len(example):
        raise QuantkitError(f"{what} samples have {len(tensors)} tensors, --example-input has {len(example)}")
    for t, e in zip(tensors, example):
        if tuple(t.shape) != tuple(e.shape[1:]) or t.dtype != e.dtype:
            raise QuantkitError(
                f"{what} sample of shape {tuple(t.shape)}:{_dtype_name(t.dtype)} does not match --example-input "
                f"{'x'.join(map(str, e.shape))}:{_dtype_name(e.dtype)} (dims after the batch dim must agree)"
            )


def make_batches(samples: list, loaded: LoadedModel, *, seq_len: int, batch_size: int, what: str) -> list:
    """Batches the model can take: tokenized (dynamic padding) for text, stacked tensors otherwise."""
    if not samples:
        return []
    if isinstance(samples[0], str):
        if loaded.tokenizer is None:
            raise QuantkitError(f"{what} data is text but the model has no tokenizer; "
                                "pass a directory of .pt/.npy/.safetensors tensors")
        return _hf.tokenize(loaded.tokenizer, samples, seq_len=seq_len, batch_size=batch_size, padding="longest")
    if loaded.example is not None:
        _check_sample(samples[0], loaded.example, what)
    elif isinstance(samples[0], tuple) and len(samples[0]) == 1 and not samples[0][0].is_floating_point():
        # a bare tensor of token ids for an HF model
        samples = [{"input_ids": s[0], "attention_mask": torch.ones_like(s[0])} for s in samples]
    return [_stack(samples[i:i + batch_size]) for i in range(0, len(samples), batch_size)]


def check_not_input(out: Path, inputs: list[Path]) -> None:
    """Refuse an output directory that is, or contains, one of the inputs (inputs are never modified)."""
    out = out.absolute().resolve()
    for p in inputs:
        p = p.absolute().resolve()
        if p == out or out in p.parents:
            raise UsageError(f"--out {str(out)!r} would overwrite the input {str(p)!r}; choose another directory")

