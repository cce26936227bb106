"""What the CLI quantizes and calibrates with: model specs, example inputs, data, splits, batches.

Everything here is cheap to check before a model is loaded, so that bad command lines
fail in well under a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import random
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from . import _hf
from ._errors import QuantkitError

__all__ = [
    "UsageError", "ModelSpec", "is_factory_name", "DataSpec", "Split", "LoadedModel", "parse_example_input",
    "load_model", "read_samples", "nonfinite", "split_samples", "make_batches", "check_not_input",
    "check_out_location", "check_device", "to_device", "static_shapes", "pad_id_of", "TENSOR_SUFFIXES",
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


_KINDS = ("default", "hf", "factory")


def is_factory_name(model: str) -> bool:
    """``package.module:factory`` (and not an existing path)."""
    return bool(_FACTORY.match(model)) and not Path(model).exists()


@dataclass(frozen=True)
class ModelSpec:
    """Where the float model comes from; stored in quantization.json so eval can rebuild it."""

    kind: str  # "default" | "hf" | "factory"
    path: str | None = None
    factory: str | None = None
    weights: str | None = None
    example_input: str | None = None
    task: str = "auto"  # HF models: a _hf.TASK_CHOICES name

    @staticmethod
    def from_args(model: str | None, weights: str | None, example_input: str | None,
                  task: str = "auto") -> "ModelSpec":
        if task not in _hf.TASK_CHOICES:
            raise UsageError(f"unknown --task {task!r}; choose one of: {', '.join(_hf.TASK_CHOICES)}")
        if model is not None and is_factory_name(model):
            if example_input is None:
                raise UsageError(f"factory {model!r} needs --example-input SHAPE:DTYPE (e.g. 8x64:float32)")
            parse_example_input(example_input)
            if task != "auto":
                raise UsageError("--task applies to Hugging Face model directories only, not to a factory")
            if weights is not None:
                weights = str(Path(weights).absolute())
            return ModelSpec("factory", factory=model, weights=weights, example_input=example_input)
        if weights is not None or example_input is not None:
            raise UsageError("--weights and --example-input apply to a package.module:factory MODEL only")
        if model is None:
            # the bundled model is a sentence encoder: its output is the embedding
            return ModelSpec("default", task="feature-extraction" if task == "auto" else task)
        return ModelSpec("hf", path=str(Path(model).absolute()), task=task)

    @staticmethod
    def from_json(doc) -> "ModelSpec":
        """The spec recorded in quantization.json; every field is checked (the file is untrusted)."""
        def bad(why: str) -> QuantkitError:
            return QuantkitError(f"quantization.json's source.model {why}; re-run quantkit quantize, "
                                 "or pass --model to eval")

        if not isinstance(doc, dict):
            raise bad(f"is {type(doc).__name__}, not an object")
        unknown = sorted(set(doc) - {f.name for f in fields(ModelSpec)})
        if unknown:
            raise bad(f"has unknown fields {unknown}")
        for key, value in doc.items():
            if not isinstance(value, str):
                raise bad(f"field {key!r} is {type(value).__name__}, not a string")
        if doc.get("kind") not in _KINDS:
            raise bad(f"kind {doc.get('kind')!r} is not one of {list(_KINDS)}")
        # artifacts written before --task existed were loaded with AutoModel
        doc = {"task": "feature-extraction", **doc}
        if doc["task"] not in _hf.TASK_CHOICES:
            raise bad(f"task {doc['task']!r} is not one of {list(_hf.TASK_CHOICES)}")
        if doc["kind"] == "hf" and "path" not in doc:
            raise bad("has no path")
        if doc["kind"] == "factory":
            if not _FACTORY.match(doc.get("factory", "")):
                raise bad(f"factory {doc.get('factory')!r} is not package.module:factory")
            try:
                parse_example_input(doc.get("example_input", ""))
            except UsageError:
                raise bad(f"example_input {doc.get('example_input')!r} is not SHAPE:DTYPE") from None
        return ModelSpec(**doc)

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        if self.kind == "factory":
            d.pop("task")
        return d

    @property
    def is_hf(self) -> bool:
        return self.kind in ("default", "hf")

    def input_paths(self) -> list[Path]:
        """Files and directories this spec reads (never written to)."""
        if self.kind == "default":
            return [_hf.default_model_path()]
        return [Path(p) for p in (self.path, self.weights) if p]

    def check(self) -> None:
        """Cheap checks before anything is loaded (paths exist, weights are readable)."""
        if self.kind == "hf":
            path = Path(self.path)
            if not path.exists():
                raise QuantkitError(f"model path {self.path!r} does not exist; pass an HF model directory "
                                    "or package.module:factory")
            _hf.check_hf_dir(path)
            _hf.model_class(path, self.task)  # config.json's architecture must be one transformers has
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
    fit: _hf.LoadReport | None = None  # how the checkpoint's tensors fit the model (None: not from a file)


def _import_factory(name: str):
    """Import ``package.module:factory`` named on the command line.

    Naming it is the user's request to run that code, like ``python -m``: a module beside
    the caller (the current directory) imports too. The directory is on ``sys.path`` for
    this import only. Never called with a name read from an artifact (see ``eval --model``).
    """
    module_name, _, attr = name.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises at import
        detail = str(exc).splitlines()[0] if str(exc) else "no message"
        if isinstance(exc, ModuleNotFoundError):
            raise QuantkitError(f"could not import {module_name!r} for factory {name!r} ({detail}); check the "
                                "name, and run from the directory that holds the package") from None
        raise QuantkitError(f"could not import {module_name!r} for factory {name!r}: importing it failed "
                            f"({detail}); fix the module") from None
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)
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
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise QuantkitError(f"{str(path)!r} does not hold a state dict of tensors")
    return obj


def _fit(model: torch.nn.Module, sd: dict, architecture: str) -> _hf.LoadReport:
    own = model.state_dict()
    return _hf.LoadReport(
        architecture=architecture,
        missing=tuple(k for k in own if k not in sd),
        unexpected=tuple(k for k in sd if k not in own),
        mismatched=tuple((k, tuple(sd[k].shape), tuple(v.shape)) for k, v in own.items()
                         if k in sd and tuple(sd[k].shape) != tuple(v.shape)),
    )


def _example_tensors(specs) -> tuple:
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape, dtype in specs:
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            out.append(torch.zeros(shape, dtype=dtype))
    return tuple(out)


def load_model(spec: ModelSpec, *, progress: bool, allow_mismatch: bool = False) -> LoadedModel:
    """Load the float model a spec names (eval mode).

    Weights that do not fit the model (missing, unexpected or mis-shaped tensors) fail
    with one line naming them, unless ``allow_mismatch`` (then ``LoadedModel.fit`` says
    which tensors kept their seeded random initialisation).
    """
    if spec.is_hf:
        path = _hf.default_model_path() if spec.kind == "default" else Path(spec.path)
        model, tok, fit = _hf.load_hf_checkpoint(path, task=spec.task, progress=progress,
                                                 allow_mismatch=allow_mismatch)
        size = sum(p.stat().st_size for p in path.iterdir() if p.name in _hf.WEIGHT_FILES or p.suffix == ".safetensors")
        return LoadedModel(model, tok, None, size, fit)
    factory = _import_factory(spec.factory)
    torch.manual_seed(0)  # factories without --weights then rebuild the same model in eval
    try:
        model = factory()
    except Exception as exc:
        detail = str(exc).splitlines()[0] if str(exc) else "no message"
        raise QuantkitError(f"factory {spec.factory!r} failed when called: {detail}") from None
    if not isinstance(model, torch.nn.Module):
        raise QuantkitError(f"factory {spec.factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    fit = None
    if spec.weights is not None:
        sd = _load_state_dict(Path(spec.weights))
        fit = _fit(model, sd, type(model).__name__)
        if not fit.clean and not allow_mismatch:
            raise QuantkitError(f"weights {spec.weights!r} do not fit {spec.factory!r} ({fit.architecture}): "
                                f"{fit.summary()}; pass the weights saved from this model's state_dict(), "
                                "or --allow-missing-weights to keep the factory's weights for those tensors")
        bad = {k for k, _, _ in fit.mismatched}
        model.load_state_dict({k: v for k, v in sd.items() if k not in bad}, strict=fit.clean)
        size = Path(spec.weights).stat().st_size
    model.eval()
    return LoadedModel(model, None, _example_tensors(parse_example_input(spec.example_input)), size, fit)


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


def read_samples(data: DataSpec, *, example_ndims: list[int] | None = None) -> tuple[list, list[str]]:
    """All samples of a data source, and where each comes from.

    Returns:
        ``(samples, origins)``: strings for text, per-sample tuples/dicts of tensors for
        tensor directories; ``origins[i]`` names sample ``i`` (``"x.pt[3]"``, ``"line 5 of f.txt"``).

    Raises:
        QuantkitError: missing, empty or blank-only text; a directory without tensors.
    """
    if data.kind != "tensors":
        path = data.file
        sentences = _hf.read_sentences(path)
        lines = [i + 1 for i, ln in enumerate(path.read_text(encoding="utf-8").splitlines()) if ln.strip()]
        if len(lines) != len(sentences):  # line breaks splitlines sees but the file's reader may not
            lines = list(range(1, len(sentences) + 1))
        return sentences, [f"line {n} of {path.name}" for n in lines]
    samples, origins = [], []
    for f in _tensor_files(Path(data.path)):
        got = _samples_of(_as_batch(_read_tensor_file(f), f), f, example_ndims)
        samples.extend(got)
        origins.extend(f"{f.name}[{i}]" for i in range(len(got)))
    if not samples:
        raise QuantkitError(f"calibration directory {data.path!r} holds no samples (every tensor has batch size 0)")
    return samples, origins


def _tensors(sample) -> list[torch.Tensor]:
    if isinstance(sample, dict):
        return list(sample.values())
    return list(sample) if isinstance(sample, (tuple, list)) else []


def nonfinite(samples: list) -> list[int]:
    """Positions of the samples holding a NaN or an infinity (text samples never do)."""
    return [i for i, s in enumerate(samples)
            if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in _tensors(s))]


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


def _stack(samples: list, origins: list[str], what: str, pad_id: int | None):
    """One batch from samples of equal structure. Token-id samples (an HF model's
    ``input_ids`` with ``attention_mask``) of different lengths are right-padded, the
    padding masked; other tensors must agree in shape."""
    first, o0 = samples[0], origins[0]
    keys = list(first) if isinstance(first, dict) else None
    for s, o in zip(samples, origins):
        if (keys is None) != (not isinstance(s, dict)) or (keys is not None and list(s) != keys) \
                or (keys is None and len(s) != len(first)):
            raise QuantkitError(f"{what} sample {o} holds different inputs from sample {o0} "
                                f"({_structure(s)} vs {_structure(first)}); give every sample the same inputs")
    names = keys if keys is not None else list(range(len(first)))
    pad = pad_id is not None and keys is not None and "input_ids" in keys and "attention_mask" in keys \
        and all(first[k].dim() == 1 for k in keys)
    out = {}
    for k in names:
        col = [s[k] for s in samples]
        if pad and len({t.shape[0] for t in col}) > 1:
            n = max(t.shape[0] for t in col)
            value = pad_id if k == "input_ids" else 0
            col = [torch.nn.functional.pad(t, (0, n - t.shape[0]), value=value) for t in col]
        for t, o in zip(col, origins):
            if t.shape != col[0].shape or t.dtype != col[0].dtype:
                raise QuantkitError(
                    f"{what} sample {o} has {_desc(t)} for input {k!r} but sample {o0} has {_desc(col[0])}; "
                    "samples batched together need equal shapes: make them equal or pass --batch-size 1")
        out[k] = torch.stack(col)
    return out if keys is not None else tuple(out[i] for i in names)


def _desc(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}:{_dtype_name(t.dtype)}"


def _structure(sample) -> str:
    if isinstance(sample, dict):
        return "keys " + ", ".join(map(str, sample))
    return f"{len(sample)} tensors"


def _check_sample(sample, origin: str, example, what: str) -> None:
    """Compare a tensor sample with the factory's example input (without the batch dim)."""
    tensors = _tensors(sample)
    if len(tensors) != len(example):
        raise QuantkitError(f"{what} sample {origin} has {len(tensors)} tensors, --example-input has {len(example)}")
    for t, e in zip(tensors, example):
        if tuple(t.shape) != tuple(e.shape[1:]) or t.dtype != e.dtype:
            raise QuantkitError(
                f"{what} sample {origin} of shape {tuple(t.shape)}:{_dtype_name(t.dtype)} does not match --example-input "
                f"{'x'.join(map(str, e.shape))}:{_dtype_name(e.dtype)} (dims after the batch dim must agree)"
            )


def _pad_id(loaded: LoadedModel) -> int:
    for src in (loaded.tokenizer, getattr(loaded.model, "config", None)):
        v = getattr(src, "pad_token_id", None)
        if isinstance(v, int):
            return v
    return 0


def make_batches(samples: list, loaded: LoadedModel, *, seq_len: int, batch_size: int, what: str,
                 origins: list[str] | None = None) -> list:
    """Batches the model can take: tokenized (dynamic padding) for text, stacked tensors otherwise.

    Raises:
        QuantkitError: text for a model without a tokenizer, or tensor samples that cannot be
            batched (the message names the sample, from ``origins``).
    """
    if not samples:
        return []
    origins = origins if origins is not None else [f"#{i}" for i in range(len(samples))]
    if isinstance(samples[0], str):
        if loaded.tokenizer is None:
            raise QuantkitError(f"{what} data is text but the model has no tokenizer; "
                                "pass a directory of .pt/.npy/.safetensors tensors")
        return _hf.tokenize(loaded.tokenizer, samples, seq_len=seq_len, batch_size=batch_size, padding="longest")
    pad_id = None
    if loaded.example is not None:
        for s, o in zip(samples, origins):
            _check_sample(s, o, loaded.example, what)
    else:
        pad_id = _pad_id(loaded)
        samples = [_as_hf_inputs(s, o, what, loaded.model) for s, o in zip(samples, origins)]
    return [_stack(samples[i:i + batch_size], origins[i:i + batch_size], what, pad_id)
            for i in range(0, len(samples), batch_size)]


def static_shapes(batches: list, *, pad_id: int = 0) -> list:
    """The same batches with one shape, so a compiled model compiles once: token batches
    (dicts with a ``[batch, tokens]`` ``attention_mask``) right-padded to the longest, the
    padding masked; a short last batch filled up with copies of its first sample (the
    caller ignores rows past its real samples)."""
    if not batches:
        return batches
    size = _rows_of(batches[0])
    longest = max((b["attention_mask"].shape[1] for b in batches if _is_tokens(b)), default=None)
    out = []
    for b in batches:
        if longest is not None and _is_tokens(b):
            n = b["attention_mask"].shape[1]
            b = {k: torch.nn.functional.pad(v, (0, longest - n), value=pad_id if k == "input_ids" else 0)
                 if v.dim() == 2 and v.shape[1] == n else v for k, v in b.items()}
        short = size - _rows_of(b)
        if short > 0:
            fill = lambda t: torch.cat([t, t[:1].expand(short, *t.shape[1:])])  # noqa: E731
            b = {k: fill(v) for k, v in b.items()} if isinstance(b, dict) else tuple(fill(t) for t in b)
        out.append(b)
    return out


def _is_tokens(batch) -> bool:
    return isinstance(batch, dict) and "attention_mask" in batch and batch["attention_mask"].dim() == 2


def _rows_of(batch) -> int:
    return int(next(iter(batch.values())).shape[0] if isinstance(batch, dict) else batch[0].shape[0])


def pad_id_of(loaded: "LoadedModel") -> int:
    """The token id padding uses: the tokenizer's, else the model config's, else 0."""
    return _pad_id(loaded)


def _check_token_ids(ids, origin: str, what: str, model) -> None:
    """Token ids outside the vocabulary would fail deep inside the embedding lookup."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    n = getattr(emb, "num_embeddings", None)
    if ids is None or ids.numel() == 0 or not isinstance(n, int):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n:
        raise QuantkitError(f"{what} sample {origin} has token id {hi if hi >= n else lo}, outside the model's "
                            f"vocabulary of {n} (0..{n - 1}); tokenize with this model's tokenizer")


def _as_hf_inputs(sample, origin: str, what: str, model):
    """An HF model's keyword inputs: a bare tensor of token ids gets an all-ones attention mask.
    Token ids must be integers (a float tensor for a text model is a mistake, found here)."""
    if isinstance(sample, tuple):
        first = sample[0]
        if getattr(model, "main_input_name", None) == "input_ids" and first.is_floating_point():
            raise QuantkitError(f"{what} sample {origin} is a {_dtype_name(first.dtype)} tensor, but this text model "
                                "takes token ids: save integer (int64) input_ids, or a dict of named inputs")
        if len(sample) == 1 and not first.is_floating_point():
            _check_token_ids(first, origin, what, model)
            return {"input_ids": first, "attention_mask": torch.ones_like(first)}
        return sample  # positional inputs, as saved
    ids = sample.get("input_ids")
    if ids is not None and ids.is_floating_point():
        raise QuantkitError(f"{what} sample {origin} has {_dtype_name(ids.dtype)} input_ids; token ids are "
                            "integers: save them as int64")
    _check_token_ids(ids, origin, what, model)
    if ids is not None and "attention_mask" not in sample:
        sample = {**sample, "attention_mask": torch.ones_like(ids)}
    return sample


def check_device(name: str | None) -> torch.device:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``, which must be available here.

    Raises:
        UsageError: a malformed name, or a device this machine does not have.
    """
    name = "cpu" if name is None else name
    m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", name.strip().lower())
    if not m or (m.group(1) == "cpu" and m.group(2) is not None):
        raise UsageError(f"--device {name!r} is not cpu, cuda or cuda:N")
    if m.group(1) == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(m.group(2) or 0)
    if index >= count:
        have = f"{count} CUDA device(s) (cuda:0..cuda:{count - 1})" if count else "no CUDA device usable by this torch"
        raise UsageError(f"--device {name} is not available: this machine has {have}; pass --device cpu")
    return torch.device("cuda", index)


def to_device(batch, device: torch.device):
    """A batch (tensor, tuple or dict of tensors) on ``device``."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(t.to(device) for t in batch)
    return batch.to(device)


def check_not_input(out: Path, inputs: list[Path]) -> None:
    """Refuse an output directory that is, contains, or lies inside one of the input
    directories (inputs are never modified; an artifact inside a model or data directory
    would change it). A file input only refuses being the output itself or inside it."""
    out = out.absolute().resolve()
    for p in inputs:
        p = p.absolute().resolve()
        if p == out or out in p.parents:
            raise UsageError(f"--out {str(out)!r} would overwrite the input {str(p)!r}; choose another directory")
        if p.is_dir() and p in out.parents:
            raise UsageError(f"--out {str(out)!r} is inside the input directory {str(p)!r}; inputs are never "
                             "modified: choose a directory outside it")


def check_out_location(out: Path) -> None:
    """Fail now, not after calibration, when ``out`` cannot be created: its nearest existing
    ancestor must be a directory in which a directory can be made (probed by making and
    removing one, so read-only mounts and permissions are seen as the writer will see them)."""
    out = Path(out).absolute()
    parent = out.parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise QuantkitError(f"--out {str(out)!r} cannot be created: {str(parent)!r} is not a directory; "
                            "choose another output path")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent)
    except OSError as exc:
        raise QuantkitError(f"--out {str(out)!r} cannot be created: {str(parent)!r} is not writable "
                            f"({exc.strerror or type(exc).__name__}); choose a writable location") from None
    os.rmdir(probe)
