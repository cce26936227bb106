"""save / load: a converted model as a directory holding ``model.pt2`` and ``quantization.json``.

``model.pt2`` is ``torch.export.save`` of the converted program (int8 weights and their
dequantize ops); it loads with ``torch.export.load`` once ``quantkit`` is imported
(which registers the ``quantized_decomposed`` ops). Directories are written beside
their final place and renamed into it at the end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch

from ._capture import CAPTURE_META_KEY
from ._convert import QPARAMS_META_KEY
from ._errors import QuantkitError

__all__ = ["save", "load", "MODEL_FILE", "RECIPE_FILE", "FORMAT_VERSION",
           "export_converted", "write_program", "recipe_document", "versions", "atomic_dir",
           "check_out_dir", "read_json", "write_json"]

MODEL_FILE = "model.pt2"
RECIPE_FILE = "quantization.json"
FORMAT = "quantkit-int8"
FORMAT_VERSION = 1


def versions() -> dict[str, str]:
    """Versions of the packages that made (or read) an artifact."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("quantkit", "torch", "torchao", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _one_line(exc: BaseException) -> str:
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    if len(first) > 200:
        first = first[:197] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def export_converted(converted: torch.nn.Module) -> torch.export.ExportedProgram:
    """Re-export a converted GraphModule with the inputs it was captured with.

    Raises:
        QuantkitError: the model was not made by ``quantkit.capture`` → ``convert``, or
            torch.export cannot export it.
    """
    if not isinstance(converted, torch.fx.GraphModule) or not converted.meta.get("quantkit_converted"):
        raise QuantkitError(
            f"save expects the model returned by quantkit.convert (or quantkit.quantize), got {type(converted).__name__}"
        )
    capture = converted.meta.get(CAPTURE_META_KEY)
    if capture is None:
        raise QuantkitError("the converted model has no capture record; build it with quantkit.capture → prepare → convert")
    try:
        return torch.export.export(_plain_outputs(converted), tuple(capture["args"]), dict(capture["kwargs"]),
                                   dynamic_shapes=capture["dynamic_shapes"], strict=False)
    except Exception as exc:  # torch.export raises many types
        raise QuantkitError(f"could not export the converted model: {_one_line(exc)}") from exc


def _plain(out):
    """Outputs as builtin containers: mappings (HF ``ModelOutput``) → dict, named tuples → tuple."""
    if isinstance(out, Mapping):
        return {k: _plain(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return (list if isinstance(out, list) else tuple)(_plain(v) for v in out)
    return out


class _PlainOutputs(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return _plain(self.model(*args, **kwargs))


def _plain_outputs(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` returning builtin containers, with ``model.forward``'s signature.

    torch.export.load can only rebuild output containers whose pytree registration is
    imported; a saved HF model returning ``BaseModelOutput`` would need transformers
    just to load. The signature is copied so that dynamic shapes keyed by argument
    name still apply.
    """
    sig = inspect.signature(model.forward)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def forward(self, *args, **kwargs):
        return _PlainOutputs.forward(self, *args, **kwargs)

    forward.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
    cls = type("PlainOutputs", (_PlainOutputs,), {"forward": forward})
    return cls(model)


def write_program(program: torch.export.ExportedProgram, directory: Path) -> Path:
    path = Path(directory) / MODEL_FILE
    torch.export.save(program, str(path))
    return path


def _describe_inputs(value: Any):
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, (tuple, list)):
        return [_describe_inputs(v) for v in value]
    if isinstance(value, dict):
        return {k: _describe_inputs(v) for k, v in value.items()}
    return repr(value)


def recipe_document(converted: torch.nn.Module, *, recipe: dict | None = None,
                    source: dict | None = None) -> dict:
    """The contents of ``quantization.json``: recipe, per-tensor qparams and versions."""
    capture = converted.meta.get(CAPTURE_META_KEY) or {}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": versions(),
        "recipe": recipe or {},
        "source": source or {},
        "example_inputs": {"args": _describe_inputs(list(capture.get("args", ()))),
                           "kwargs": _describe_inputs(dict(capture.get("kwargs", {})))},
        "tensors": list(converted.meta.get(QPARAMS_META_KEY, [])),
    }


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuantkitError(f"{str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{str(path)!r} is not readable JSON ({type(exc).__name__})") from None


def _num(v) -> str:
    # 9 significant digits round-trip float32 (scales are float32)
    return str(v) if isinstance(v, int) else json.dumps(float(f"{v:.9g}"))


def _inline(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, float):
        return _num(value)
    return json.dumps(value)


def _dumps(value, indent: int = 0) -> str:
    """JSON with one line per entry of top-level dicts, one line per record in lists of records."""
    pad = "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(str(k))}: {_dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "[\n" + ",\n".join(pad + _inline(v) for v in value) + "\n" + "  " * indent + "]"
    return _inline(value)


def write_json(path: Path, doc: dict) -> None:
    Path(path).write_text(_dumps(doc) + "\n", encoding="utf-8")


def _is_artifact_or_empty(path: Path) -> bool:
    return not any(path.iterdir()) or (path / RECIPE_FILE).is_file()


def check_out_dir(path: str | os.PathLike, *, overwrite: bool, flag: str = "overwrite=True",
                  exists_error: type[QuantkitError] = QuantkitError) -> Path:
    """Check that ``path`` can be (re)written; returns it as a Path.

    Raises:
        QuantkitError: it exists and ``overwrite`` is False, it is a file, or it is a
            non-empty directory that is not a quantkit artifact (never replaced).
    """
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir() or path.is_symlink():
            raise QuantkitError(f"output {str(path)!r} exists and is not a directory; choose another output path")
        if not overwrite:
            raise exists_error(f"output directory {str(path)!r} already exists; pass {flag} to replace it")
        if not _is_artifact_or_empty(path):
            raise QuantkitError(
                f"output directory {str(path)!r} is not empty and holds no {RECIPE_FILE}; "
                "refusing to replace it, choose another output path"
            )
    return path


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, overwrite: bool = False, flag: str = "overwrite=True") -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``path``; on success it replaces ``path``.

    On any error (or Ctrl-C) the temporary directory, and any parent directories this
    created, are removed and ``path`` is left as it was.
    """
    path = check_out_dir(path, overwrite=overwrite, flag=flag).absolute()
    created = []
    parent = path.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    for p in reversed(created):
        p.mkdir()
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary directory
    try:
        yield tmp
        check_out_dir(path, overwrite=overwrite, flag=flag)  # it may have appeared meanwhile
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save(converted: torch.nn.Module, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Save a converted model as a deployable directory.

    The directory holds ``model.pt2`` (``torch.export.save`` of the converted program,
    int8 weights) and ``quantization.json`` (per-tensor scales and zero points, versions).
    It is written beside ``path`` and renamed into place, so a failure leaves nothing.

    Args:
        converted: the output of :func:`quantkit.convert` or :func:`quantkit.quantize`.
        path: the directory to create.
        overwrite: replace ``path`` if it already holds a quantkit artifact.

    Returns:
        ``path`` as a ``Path``.

    Example:
        >>> quantkit.save(quantkit.quantize(model, (x[:8],), batches), "out/mlp-int8")
        >>> qmodel = quantkit.load("out/mlp-int8")
    """
    check_out_dir(path, overwrite=overwrite)
    program = export_converted(converted)
    with atomic_dir(path, overwrite=overwrite) as tmp:
        write_program(program, tmp)
        write_json(tmp / RECIPE_FILE, recipe_document(converted))
    return Path(path)


def load(path: str | os.PathLike) -> torch.nn.Module:
    """Load a directory written by :func:`quantkit.save` (or ``quantkit quantize``).

    Returns:
        The int8 model as a callable ``torch.nn.Module`` (``ExportedProgram.module()``);
        for the ``ExportedProgram`` itself use ``torch.export.load(path / "model.pt2")``.

    Raises:
        QuantkitError: the directory or its ``model.pt2`` is missing or unreadable.
    """
    path = Path(path)
    if not path.is_dir():
        raise QuantkitError(f"{str(path)!r} is not a directory; pass a directory written by quantkit.save")
    model_file = path / MODEL_FILE
    if not model_file.is_file():
        raise QuantkitError(f"{str(path)!r} has no {MODEL_FILE}; it is not a quantkit artifact")
    with _captured_logs("torch.export") as logged:
        try:
            program = torch.export.load(str(model_file))
        except Exception as exc:  # corrupt zip, unknown ops, version skew
            # torch.export logs the cause as a warning with a traceback; keep its last line
            cause = next((ln.strip() for r in reversed(logged) for ln in reversed(r.getMessage().splitlines())
                          if ln.strip()), _one_line(exc))
            raise QuantkitError(f"could not load {str(model_file)!r}: {cause}") from exc
    module = program.module()
    module.meta["quantkit_converted"] = True  # a q/dq graph: quantkit.compile accepts it
    return module


@contextlib.contextmanager
def _captured_logs(name: str):
    """Collect (instead of print) the records of logger ``name`` and its children."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger(name)
    handler, propagate = _Keep(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
