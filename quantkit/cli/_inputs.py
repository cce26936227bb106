"""What the CLI quantizes and where it writes: model specs, example inputs, loading, devices, --out.

Everything here but loading is cheap to check before a model is loaded, so that bad command
lines fail in well under a second. The data side is ``_data``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .. import _hf
from .._errors import QuantkitError
from ..sequential._state import PartialDir

__all__ = [
    "UsageError", "ModelSpec", "is_factory_name", "LoadedModel", "parse_example_input", "load_model",
    "check_not_input", "check_out_location", "check_device",
]

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


def check_not_input(out: Path, inputs: list[Path]) -> None:
    """Refuse an output directory that is, contains, or lies inside one of the input
    directories (inputs are never modified; an artifact inside a model or data directory
    would change it). A file input only refuses being the output itself or inside it.

    The block-by-block progress directory beside ``out`` (``.NAME.quantkit-partial``, which
    quantkit creates and removes) gets the same check, the link at that path (if any) resolved."""
    partial = PartialDir.beside(out).resolve()
    out = out.absolute().resolve()
    for p in inputs:
        p = p.absolute().resolve()
        if p == out or out in p.parents:
            raise UsageError(f"--out {str(out)!r} would overwrite the input {str(p)!r}; choose another directory")
        if p.is_dir() and p in out.parents:
            raise UsageError(f"--out {str(out)!r} is inside the input directory {str(p)!r}; inputs are never "
                             "modified: choose a directory outside it")
        if p == partial or partial in p.parents or (p.is_dir() and p in partial.parents):
            raise UsageError(f"--out {str(out)!r} keeps its block-by-block progress in {str(partial)!r}, which "
                             f"would overwrite the input {str(p)!r}; choose another --out")


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
