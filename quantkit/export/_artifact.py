"""save / load: a converted model as a directory holding ``model.pt2`` and ``quantization.json``.

``model.pt2`` is ``torch.export.save`` of the converted program (int8 weights and their
dequantize ops); it loads with ``torch.export.load`` once ``quantkit`` is imported
(which registers the ``quantized_decomposed`` ops). ``quantization.json`` records the
recipe, the qparams, the SHA-256 of ``model.pt2`` and, for a model quantized from a scheme
(``quantkit.quantize(scheme=...)``, ``quantkit quantize``), its ``SchemeConfig.to_dict()`` as
``"config"``, which :func:`load` rebuilds into ``meta["quantkit_config"]``. A causal LM captured
with a static KV cache (``capture(..., max_cache_len=N)``) records ``"max_cache_len"`` and its
``"kv_cache"`` description; :func:`load` puts that back into ``meta["quantkit_kv_cache"]``. Its
cache buffers are non-persistent buffers of the program, mutated in place by each call.

:func:`load` reads ``model.pt2`` without unpickling or running code from it
(``quantkit.export._safe_pt2``) and checks it against that SHA-256. Directories are written
beside their final place and swapped into it at the end (``quantkit.export._atomic``), so a
failure, Ctrl-C or SIGTERM leaves the previous directory (or nothing) behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import platform
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree

from . import _atomic, _safe_pt2
from ..pipeline._capture import CAPTURE_META_KEY
from ..pipeline._kv_capture import KV_CACHE_META_KEY, install_length_check, kv_cache_info, resolve_buffers
from .._graph import QPARAMS_META_KEY
from .._errors import QuantkitError
from ..quantizers._scheme import CONFIG_META_KEY, SchemeConfig, SchemeError

__all__ = ["save", "load", "MODEL_FILE", "RECIPE_FILE", "FORMAT", "FORMAT_VERSION", "ARTIFACT_FILES",
           "PROGRAM_META_KEY", "RECIPE_META_KEY", "CONFIG_META_KEY", "export_converted", "write_program",
           "recipe_document", "recorded_config", "versions", "atomic_dir", "check_out_dir", "read_json", "write_json",
           "verify_artifact", "file_sha256", "unverified_reason", "UnverifiedWarning"]

MODEL_FILE = "model.pt2"
RECIPE_FILE = "quantization.json"
FORMAT = "quantkit-int8"
FORMAT_VERSION = 1
# everything quantkit (API or CLI) writes into an artifact directory; --force replaces only these
ARTIFACT_FILES = frozenset({MODEL_FILE, RECIPE_FILE, "report.md", "report.json"})
ARTIFACT_DIRS = frozenset({"tokenizer", "compressed-tensors"})  # the HF checkpoint of --format pt2,compressed-tensors
# where load() keeps the ExportedProgram and the quantization.json it read, for save() to write again
PROGRAM_META_KEY = "quantkit_program"
RECIPE_META_KEY = "quantkit_recipe"


class UnverifiedWarning(UserWarning):
    """:func:`load` with ``allow_unverified=True`` read an artifact it could not verify."""


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

    Dimensions the captured graph treats as symbolic stay dynamic even when the example
    had size 1 there (torch.export would specialise a size-1 dimension): such dimensions
    are traced at size 2, as capture does. A model returned by :func:`load` gives back
    the program it was loaded from.

    Raises:
        QuantkitError: the model was not made by ``quantkit.capture`` → ``convert``, or
            torch.export cannot export it.
    """
    program = getattr(converted, "meta", {}).get(PROGRAM_META_KEY) if isinstance(converted, torch.nn.Module) else None
    if isinstance(program, torch.export.ExportedProgram):
        return program
    if not isinstance(converted, torch.fx.GraphModule) or not converted.meta.get("quantkit_converted"):
        raise QuantkitError(
            f"save expects the model returned by quantkit.convert (or quantkit.quantize), got {type(converted).__name__}"
        )
    capture = converted.meta.get(CAPTURE_META_KEY)
    if capture is None:
        raise QuantkitError("the converted model has no capture record; build it with quantkit.capture → prepare → convert")
    args, kwargs = tuple(capture["args"]), dict(capture["kwargs"])
    model = _plain_outputs(converted)
    grown = _grow_symbolic_dims(converted, args, kwargs)
    if grown is not None:
        try:
            return torch.export.export(model, *grown, dynamic_shapes=capture["dynamic_shapes"], strict=False)
        except Exception:  # e.g. the model needs the original sizes: export those below
            pass
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=capture["dynamic_shapes"], strict=False)
    except Exception as exc:  # torch.export raises many types
        raise QuantkitError(f"could not export the converted model: {_one_line(exc)}") from exc


def _grow_symbolic_dims(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with size-1 dims that ``gm``'s inputs hold as symbols repeated to size 2;
    None when there are none (or the inputs cannot be matched to ``gm``'s placeholders)."""
    in_spec = getattr(gm, "_in_spec", None)
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if in_spec is None:
        return None
    try:
        from torch.export._tree_utils import reorder_kwargs

        leaves, spec = pytree.tree_flatten((args, reorder_kwargs(kwargs, in_spec)))
    except Exception:
        return None
    if len(leaves) != len(vals):
        return None
    changed = False
    for i, (leaf, val) in enumerate(zip(leaves, vals)):
        if not isinstance(leaf, torch.Tensor) or not isinstance(val, torch.Tensor) or leaf.dim() != val.dim():
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and leaf.shape[d] == 1:
                leaf = torch.cat([leaf, leaf], dim=d)
                changed = True
        leaves[i] = leaf
    return pytree.tree_unflatten(leaves, spec) if changed else None


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


@contextlib.contextmanager
def _without_stack_traces(program: torch.export.ExportedProgram):
    """The nodes' ``stack_trace`` metadata left out while ``program`` is saved, then restored: it
    names the source files' absolute paths and the process's count of compiled graph modules
    (``<eval_with_key>.N``), so the same model, quantized twice, would be written as different bytes
    (issue 28: two runs of the default command must give the same artifact)."""
    saved = []
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            for node in graph.nodes:
                if "stack_trace" in node.meta:
                    saved.append((node, node.meta.pop("stack_trace")))
    try:
        yield
    finally:
        for node, trace in saved:
            node.meta["stack_trace"] = trace


def write_program(program: torch.export.ExportedProgram, directory: Path) -> Path:
    """Write ``program`` as ``directory/model.pt2`` and check that :func:`load` will accept it.

    Raises:
        QuantkitError: the program holds something quantkit refuses to load (a pickled
            tensor subclass or object), so it is not written as an artifact.
    """
    path = Path(directory) / MODEL_FILE
    with _without_stack_traces(program):
        torch.export.save(program, str(path))
    try:
        _safe_pt2.check_archive(path).zf.close()
    except QuantkitError as exc:
        path.unlink()
        raise QuantkitError(f"cannot save this program as a quantkit artifact: {getattr(exc, 'reason', exc)} "
                            "(quantkit.load would refuse it); keep weights and inputs plain tensors") from None
    return path


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _describe_inputs(value: Any):
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, (tuple, list)):
        return [_describe_inputs(v) for v in value]
    if isinstance(value, dict):
        return {k: _describe_inputs(v) for k, v in value.items()}
    return repr(value)


def recipe_document(converted: torch.nn.Module, *, recipe: dict | None = None,
                    source: dict | None = None, config: SchemeConfig | None = None) -> dict:
    """The contents of ``quantization.json``: recipe, per-tensor qparams and versions, and the
    scheme's config (``config``, else the converted model's ``meta["quantkit_config"]``) when
    there is one."""
    capture = converted.meta.get(CAPTURE_META_KEY) or {}
    config = config if config is not None else converted.meta.get(CONFIG_META_KEY)
    extra = {} if config is None else {"config": config.to_dict()}
    kv = kv_cache_info(converted)
    if kv is not None:  # a generating program: its cache, for load to describe again
        extra.update(max_cache_len=kv["max_cache_len"], kv_cache=kv)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": versions(),
        "recipe": recipe or {},
        "source": source or {},
        "example_inputs": {"args": _describe_inputs(list(capture.get("args", ()))),
                           "kwargs": _describe_inputs(dict(capture.get("kwargs", {})))},
        "tensors": list(converted.meta.get(QPARAMS_META_KEY, [])),
        **extra,
    }


def recorded_config(doc: dict | None, where: str) -> SchemeConfig | None:
    """The ``SchemeConfig`` a ``quantization.json`` document records (None when it records none).

    Raises:
        QuantkitError: (one line) the record is damaged, newer than this quantkit, or of a config
            type no imported module registers.
    """
    if not doc or doc.get("config") is None:
        return None
    try:
        return SchemeConfig.from_dict(doc["config"])
    except SchemeError as exc:
        raise QuantkitError(f"{where}: its scheme config cannot be read back: {exc}") from None


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuantkitError(f"{str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{str(path)!r} is not readable JSON ({type(exc).__name__})") from None


def _num(v) -> str:
    # 9 significant digits round-trip float32 (scales are float32); repr is what json.dumps writes
    # for a finite float (write_json refuses the others), without its per-call overhead
    return str(v) if isinstance(v, int) else repr(float(f"{v:.9g}"))


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


def _check_finite(value, where: str, path: Path) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise QuantkitError(f"cannot write {Path(path).name}: {where or 'the document'} is {value}, which JSON "
                            "cannot hold; check the model and data for NaN/inf")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{where}.{k}" if where else str(k), path)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{where}[{i}]", path)


def write_json(path: Path, doc: dict) -> None:
    """Write ``doc`` as standard JSON (one line per entry of top-level dicts and per record).

    Raises:
        QuantkitError: a value is NaN or infinite (not JSON); the message names its key.
    """
    _check_finite(doc, "", path)
    Path(path).write_text(_dumps(doc) + "\n", encoding="utf-8")


def _foreign_entries(path: Path) -> list[str]:
    """Entries of ``path`` that quantkit does not write into an artifact directory."""
    out = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_symlink():
            out.append(entry.name)
        elif entry.name in ARTIFACT_FILES and entry.is_file():
            continue
        elif entry.name in ARTIFACT_DIRS and entry.is_dir():
            continue
        else:
            out.append(entry.name)
    return out


def _is_quantkit_json(path: Path) -> bool:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def check_out_dir(path: str | os.PathLike, *, overwrite: bool, flag: str = "overwrite=True",
                  exists_error: type[QuantkitError] = QuantkitError) -> Path:
    """Check that ``path`` can be (re)written; returns it as a Path.

    Only an empty directory or a quantkit artifact is ever replaced: ``quantization.json``
    that is quantkit's, ``model.pt2``, and nothing but the files quantkit writes. First
    cleans up after a writer of ``path`` that was killed (see ``quantkit.export._atomic.recover``).

    Raises:
        QuantkitError: it exists and ``overwrite`` is False (``exists_error``), it is a file
            or a link, or it is a directory that is not empty and not a quantkit artifact.
    """
    path = Path(path)
    _atomic.recover(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir() or path.is_symlink():
            raise QuantkitError(f"output {str(path)!r} exists and is not a directory; choose another output path")
        if not overwrite:
            raise exists_error(f"output directory {str(path)!r} already exists; pass {flag} to replace it")
        entries = sorted(os.listdir(path))
        if not entries:
            return path
        if not (path / RECIPE_FILE).is_file() or not (path / MODEL_FILE).is_file():
            raise QuantkitError(f"output directory {str(path)!r} is not empty and is not a quantkit artifact (no "
                                f"{MODEL_FILE} with a {RECIPE_FILE}); refusing to replace it, choose another "
                                "output path")
        if not _is_quantkit_json(path / RECIPE_FILE):
            raise QuantkitError(f"output directory {str(path)!r} holds a {RECIPE_FILE} that is not quantkit's; "
                                "refusing to replace it, choose another output path")
        foreign = _foreign_entries(path)
        if foreign:
            raise QuantkitError(f"output directory {str(path)!r} also holds {', '.join(map(repr, foreign[:3]))}"
                                f"{' ...' if len(foreign) > 3 else ''}, which quantkit did not write; refusing to "
                                "replace it, move them or choose another output path")
    return path


def _seal(directory: Path) -> None:
    """Record the SHA-256 of ``model.pt2`` in ``quantization.json`` (when both are quantkit's)."""
    model, recipe = directory / MODEL_FILE, directory / RECIPE_FILE
    if not (model.is_file() and recipe.is_file()):
        return
    doc = read_json(recipe)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return
    digest = file_sha256(model)
    if doc.get("model_sha256") != digest:
        write_json(recipe, {**doc, "model_sha256": digest})


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, overwrite: bool = False, flag: str = "overwrite=True") -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``path``; on success it replaces ``path``.

    Before the swap, the SHA-256 of ``model.pt2`` is written into ``quantization.json``.
    The previous ``path`` stays in place until the new one is complete and is swapped out
    in one step (``renameat2(RENAME_EXCHANGE)`` on Linux). On any error, Ctrl-C or SIGTERM
    the temporary directory (and any parent directories this created) is removed and
    ``path`` is left as it was; a writer killed outright is cleaned up by the next write.
    """
    path = check_out_dir(path, overwrite=overwrite, flag=flag).absolute()
    with _atomic.atomic_dir(path, before_commit=_seal,
                            check=lambda: check_out_dir(path, overwrite=overwrite, flag=flag)) as tmp:
        yield tmp


def unverified_reason(doc: dict | None) -> str | None:
    """Why an artifact's ``model.pt2`` cannot be verified against its ``quantization.json``;
    None when it can.

    ``format_version`` must be :data:`FORMAT_VERSION` (an int; 1 is the only version there
    has been) and ``model_sha256`` present: without it nothing says which bytes were written,
    and an edited or swapped ``model.pt2`` would load unnoticed. Every artifact quantkit writes
    records it (``atomic_dir`` seals it in); only development builds of 0.1.0 from before the
    safe loader wrote version-1 artifacts without one. Those load with ``allow_unverified=True``,
    and :func:`save` of the loaded model writes them again with their SHA-256.

    Args:
        doc: the ``quantization.json`` document, or None when the directory has none.
    """
    if doc is None:
        return f"there is no {RECIPE_FILE} recording the SHA-256 of {MODEL_FILE}"
    version = doc.get("format_version")
    if "format_version" not in doc:
        return f"{RECIPE_FILE} has no format_version"
    if type(version) is not int or version != FORMAT_VERSION:
        return (f"{RECIPE_FILE} has format_version {_shown(version)}, which this quantkit does not read "
                f"(it reads {FORMAT_VERSION})")
    if doc.get("model_sha256") is None:
        return f"{RECIPE_FILE} records no SHA-256 of {MODEL_FILE} (model_sha256)"
    return None


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def verify_artifact(path: str | os.PathLike, *, allow_unverified: bool = False,
                    flag: str = "allow_unverified=True") -> dict:
    """Check an artifact directory without loading the model; returns its ``quantization.json``.

    Checks that both files exist, that ``quantization.json`` is quantkit's, of a
    ``format_version`` this quantkit reads and recording the SHA-256 of ``model.pt2``, that
    ``model.pt2`` has that SHA-256, and that it holds nothing quantkit refuses to load
    (pickled objects, code).

    Args:
        path: the artifact directory.
        allow_unverified: accept an artifact whose ``format_version`` is unknown or that records
            no SHA-256 (:func:`unverified_reason` says which); a SHA-256 that does not match is
            refused anyway, and the archive checks still run.
        flag: how the caller names ``allow_unverified`` in the refusal (the CLI: ``--allow-unverified``).

    Raises:
        QuantkitError: one line saying what is wrong.
    """
    path = Path(path)
    doc = _checked_recipe(path, allow_unverified=allow_unverified, flag=flag)
    _safe_pt2.check_archive(path / MODEL_FILE).zf.close()
    return doc


def _checked_recipe(path: Path, *, allow_unverified: bool, flag: str) -> dict:
    """:func:`verify_artifact` without the archive check (``load`` gets that from ``load_program``)."""
    if not path.is_dir():
        raise QuantkitError(f"{str(path)!r} is not a directory; pass a directory written by quantkit")
    if not (path / RECIPE_FILE).is_file() or not (path / MODEL_FILE).is_file():
        raise QuantkitError(f"{str(path)!r} has no {MODEL_FILE} and {RECIPE_FILE}; it is not a quantkit artifact")
    doc = read_json(path / RECIPE_FILE)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise QuantkitError(f"{str(path / RECIPE_FILE)!r} is not a quantkit quantization.json")
    _check_verified(path, doc, allow_unverified=allow_unverified, flag=flag)
    if doc.get("model_sha256") is not None:
        _check_digest(path / MODEL_FILE, doc)
    return doc


def _check_verified(path: Path, doc: dict | None, *, allow_unverified: bool, flag: str) -> None:
    reason = unverified_reason(doc)
    if reason is not None and not allow_unverified:
        how = "quantkit quantize" if flag.startswith("--") else "quantkit.save (or quantkit quantize)"
        raise QuantkitError(f"{str(path)!r} cannot be verified: {reason}; re-create it with {how}, "
                            f"or pass {flag} if you trust it")


def _check_digest(model_file: Path, doc: dict) -> None:
    expected = doc.get("model_sha256")
    if not isinstance(expected, str) or file_sha256(model_file) != expected.lower():
        raise QuantkitError(f"{str(model_file)!r} was modified or truncated after it was written (its SHA-256 "
                            f"does not match {RECIPE_FILE}); re-create the artifact")


def save(converted: torch.nn.Module, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Save a converted model as a deployable directory.

    The directory holds ``model.pt2`` (``torch.export.save`` of the converted program,
    int8 weights) and ``quantization.json`` (per-tensor scales and zero points, versions,
    the SHA-256 of ``model.pt2``). It is written beside ``path`` and swapped into place,
    so a failure leaves nothing (and, with ``overwrite``, the previous artifact intact).
    The batch dimension stays dynamic whatever the example's batch size was. A model
    returned by :func:`load` can be saved again.

    Args:
        converted: the output of :func:`quantkit.convert`, :func:`quantkit.quantize` or
            :func:`quantkit.load`.
        path: the directory to create.
        overwrite: replace ``path`` if it is empty or holds a quantkit artifact (and nothing else).

    Returns:
        ``path`` as a ``Path``.

    Example:
        >>> quantkit.save(quantkit.quantize(model, (x[:8],), batches), "out/mlp-int8")
        >>> qmodel = quantkit.load("out/mlp-int8")
    """
    check_out_dir(path, overwrite=overwrite)
    program = export_converted(converted)
    doc = converted.meta.get(RECIPE_META_KEY) if PROGRAM_META_KEY in converted.meta else None
    doc = {k: v for k, v in doc.items() if k != "model_sha256"} if doc else recipe_document(converted)
    with atomic_dir(path, overwrite=overwrite) as tmp:
        write_program(program, tmp)
        write_json(tmp / RECIPE_FILE, doc)
    return Path(path)


def load(path: str | os.PathLike, *, allow_unverified: bool = False) -> torch.nn.Module:
    """Load a directory written by :func:`quantkit.save` (or ``quantkit quantize``).

    ``model.pt2`` is read without unpickling or running anything from it: archives that
    hold pickled objects, compiled code or code-like names are refused. It must match the
    SHA-256 that ``quantization.json`` records, and ``quantization.json`` must be of a
    ``format_version`` this quantkit reads.

    Args:
        path: the artifact directory.
        allow_unverified: also load an artifact that cannot be verified: no ``quantization.json``
            (e.g. a directory holding only a ``model.pt2`` from ``torch.export.save``), no
            recorded SHA-256, or an unknown ``format_version``. A warning says so. The checks
            that keep code from running, and a SHA-256 that does not match, still refuse.

    Returns:
        The int8 model as a callable ``torch.nn.Module`` (``ExportedProgram.module()``). Its
        ``meta["quantkit_program"]`` is the ``ExportedProgram``, ``meta["quantkit_recipe"]``
        the ``quantization.json`` document (None without one) and ``meta["quantkit_config"]`` the
        ``SchemeConfig`` it records (None when it records none); :func:`save` writes them again.

    Raises:
        QuantkitError: the directory or its ``model.pt2`` is missing, unreadable, modified,
            unverifiable (without ``allow_unverified``), or holds something quantkit does not load;
            or its recorded scheme config is damaged or of a type no imported module registers.
    """
    path = Path(path)
    if not path.is_dir():
        raise QuantkitError(f"{str(path)!r} is not a directory; pass a directory written by quantkit.save")
    model_file = path / MODEL_FILE
    if not model_file.is_file():
        raise QuantkitError(f"{str(path)!r} has no {MODEL_FILE}; it is not a quantkit artifact")
    flag = "allow_unverified=True"
    if (path / RECIPE_FILE).is_file():
        doc = _checked_recipe(path, allow_unverified=allow_unverified, flag=flag)
    else:
        doc = None
        _check_verified(path, doc, allow_unverified=allow_unverified, flag=flag)
    config = recorded_config(doc, repr(str(path / RECIPE_FILE)))
    program = _safe_pt2.load_program(model_file)  # checks the archive first
    reason = unverified_reason(doc)
    if reason is not None:
        warnings.warn(f"{str(path)!r} is not verified ({reason}); loaded because allow_unverified=True",
                      UnverifiedWarning, stacklevel=2)
    module = program.module()
    module.meta["quantkit_converted"] = True  # a q/dq graph: quantkit.compile accepts it
    module.meta[PROGRAM_META_KEY] = program
    module.meta[RECIPE_META_KEY] = doc
    module.meta[CONFIG_META_KEY] = config
    kv = doc.get("kv_cache") if isinstance(doc, dict) else None
    if isinstance(kv, dict):
        module.meta[KV_CACHE_META_KEY] = resolve_buffers(kv, module)
        install_length_check(module)
    return module
