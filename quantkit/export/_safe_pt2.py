"""Read a ``model.pt2`` without running code from it.

torch 2.13's reader (``torch.export.load`` → ``torch.export.pt2_archive._package.load_pt2``
→ ``torch._export.serde.serialize``) runs code taken from the archive on these paths:

1. ``data/sample_inputs/<model>.pt``: ``deserialize_torch_artifact`` tries
   ``torch.load(weights_only=True)`` and, when that fails, ``torch.load(weights_only=False)``.
2. ``data/weights/<model>_weights_config.json`` entries with ``use_pickle``:
   ``torch.load(weights_only=False)`` of the weight member.
3. ``data/constants/<model>_constants_config.json`` ``tensor_constant*`` entries with
   ``use_pickle``: ``torch.load(weights_only=False)``.
4. ``data/constants/opaque_obj*``: ``pickle.loads``.
5. ``data/constants/custom_obj*``: ``torch._C._pickle_load_obj`` (TorchScript objects).
6. legacy ``data/weights/<model>.pt`` / ``data/constants/<model>.pt``: read as bytes, then
   ``deserialize_torch_artifact`` (weights_only=True, falling back to False) as in 1.
7. ``data/aotinductor/<model>/``: compiled shared libraries, loaded by ``load_pt2``.
8. ``models/<model>.json``, which is not pickle but is executed in places:
   ``guards_code`` strings are ``exec``'d into a guard function by ``ExportedProgram.module()``;
   ``expr_str`` of symbolic sizes goes through ``sympy.sympify`` (``eval``); node and
   placeholder names are pasted unchecked into the Python source FX generates and
   ``exec``s; attribute paths (``parameter_name``, ...) are pasted into ``getattr(...)``
   calls in that source; pytree specs (``in_spec``/``out_spec``) may name a module for
   ``importlib.import_module`` (defaultdict factories, enums).
9. the pre-2.8 zip format fallback of ``torch.export.load`` (``version`` member), which
   hands pickled state to 1.

:func:`load_program` never calls ``torch.export.load``: it checks the archive with
``zipfile`` (:func:`check_archive`: an allowlist of members, configs without pickled
entries, a model JSON whose names, expressions, guards and specs are plain), reads the
tensors itself, loads the sample inputs with ``torch.load(weights_only=True)`` and hands
only ready-made objects to torch's ``ExportedProgramDeserializer``. As a second guard,
the deserializer runs inside :func:`refuse_unsafe_unpickling`, in which every
``torch.load`` is forced to ``weights_only=True`` and pickle/TorchScript unpickling in
torch's reader raises.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import sys
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .._errors import QuantkitError

__all__ = ["check_archive", "load_program", "refuse_unsafe_unpickling", "Archive"]

MODEL_NAME = "model"  # torch.export.save names its one program "model"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_FQN = re.compile(r"([A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*)?\Z")
_WEIGHT = re.compile(r"weight_[0-9]+\Z")
_CONSTANT = re.compile(r"tensor_constant_[0-9]+\Z")
# members torch.export.save writes for one ExportedProgram, relative to the archive root
_FIXED = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
          f"models/{MODEL_NAME}.json", f"data/weights/{MODEL_NAME}_weights_config.json",
          f"data/constants/{MODEL_NAME}_constants_config.json", f"data/sample_inputs/{MODEL_NAME}.pt"}
_SAMPLE_INPUTS = f"data/sample_inputs/{MODEL_NAME}.pt"
# torch.utils._sympy.functions and the sympy names torch prints in shape expressions
_SYMPY_FUNCTIONS = {
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
    "ToFloat", "Identity", "Max", "Min", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Abs",
    "floor", "ceiling", "Piecewise", "Integer", "Rational", "oo", "zoo", "nan", "True", "False",
    "true", "false",
}
# sympy's own constructors as sympy.srepr prints them
_SYMPY_NAMES = _SYMPY_FUNCTIONS | {
    "Symbol", "Integer", "Rational", "Float", "Mul", "Add", "Pow", "Equality", "Unequality", "StrictLessThan",
    "LessThan", "StrictGreaterThan", "GreaterThan", "BooleanTrue", "BooleanFalse", "Infinity",
    "NegativeInfinity", "IntInfinity", "NegativeIntInfinity",
}
_SPEC_TYPES = {None, "builtins.tuple", "builtins.list", "builtins.dict"}


def _symbol_re() -> re.Pattern:
    from torch.utils._sympy.symbol import prefix_str

    prefixes = sorted((p for p in prefix_str.values() if p.isalpha()), key=len, reverse=True)
    return re.compile(f"({'|'.join(prefixes)})[0-9]+\\Z")


class _Refused(QuantkitError):
    """Raised inside the checks; :func:`check_archive` words it with the path."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Archive:
    """A checked archive: its ``zipfile`` handle, the archive-root prefix of its members, the
    program JSON and the sample inputs (loaded with ``weights_only=True``)."""

    zf: zipfile.ZipFile
    root: str
    program: dict
    example_inputs: Any = None

    def read(self, member: str) -> bytes:
        return self.zf.read(self.root + member)


def check_archive(path: str | Path) -> Archive:
    """Check that ``path`` is a ``.pt2`` quantkit can load without unpickling or running code.

    Only the members ``torch.export.save`` writes for one program made of plain tensors are
    allowed; weights and constants must be raw tensor bytes, never pickles; the sample inputs
    must load with ``torch.load(weights_only=True)``; the program JSON must hold plain names,
    shape expressions, guards and input/output structures.

    Returns:
        The open, checked :class:`Archive`.

    Raises:
        QuantkitError: one line naming the file and what is wrong with it.
    """
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise QuantkitError(f"{str(path)!r} does not exist") from None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise QuantkitError(f"could not load {str(path)!r}: not a .pt2 archive, or truncated "
                            f"({type(exc).__name__}); re-create it") from None
    try:
        return _check(zf)
    except _Refused as exc:
        zf.close()
        raise _refusal(path, exc) from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as exc:
        zf.close()  # ValueError: bad UTF-8 or JSON; the others: JSON of the wrong shape
        raise QuantkitError(f"could not load {str(path)!r}: damaged archive ({type(exc).__name__}); "
                            "re-create it") from None


def _refusal(path: Path, reason: _Refused) -> QuantkitError:
    exc = QuantkitError(f"refusing to load {str(path)!r}: {reason}; quantkit only loads the model.pt2 files "
                        "it writes (plain tensors, no pickled objects or code)")
    exc.reason = str(reason)  # for callers that word it themselves (save)
    return exc


def _check(zf: zipfile.ZipFile) -> Archive:
    infos = zf.infolist()
    if not infos:
        raise _Refused("it is empty")
    root = infos[0].filename.split("/", 1)[0] + "/"
    seen: set[str] = set()
    for info in infos:
        name = info.filename
        if name in seen:
            raise _Refused(f"member {name!r} appears twice")
        seen.add(name)
        if not name.startswith(root) or ".." in name.split("/") or "\\" in name:
            raise _Refused(f"member {_show(name)} is outside the archive root {root!r}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise _Refused(f"member {name!r} is compressed (torch.export.save stores members uncompressed)")
        _check_member(name[len(root):])
    missing = sorted(m for m in _FIXED - {".data/serialization_id"} if root + m not in seen)
    if missing:
        raise _Refused(f"it has no {missing[0]!r} member")
    archive = Archive(zf, root, {})
    if archive.read("archive_format") != b"pt2":
        raise _Refused("its archive_format is not pt2")
    from torch.export.pt2_archive.constants import ARCHIVE_VERSION_VALUE

    if archive.read("archive_version").decode() != ARCHIVE_VERSION_VALUE:
        raise _Refused(f"its archive_version is not {ARCHIVE_VERSION_VALUE} (made by another torch version)")
    if archive.read("byteorder").decode() != sys.byteorder:
        raise _Refused(f"it was written on a {archive.read('byteorder').decode()!r}-endian machine")
    for kind, pattern in (("weight", _WEIGHT), ("constant", _CONSTANT)):
        _check_payload_config(archive, kind, pattern, seen)
    program = json.loads(archive.read(f"models/{MODEL_NAME}.json"))
    if not isinstance(program, dict):
        raise _Refused("its program JSON is not an object")
    _check_program(program)
    return Archive(zf, root, program, _read_sample_inputs(archive))


def _check_member(member: str) -> None:
    if member in _FIXED:
        return
    folder, _, leaf = member.rpartition("/")
    if folder == "data/weights" and _WEIGHT.match(leaf):
        return
    if folder == "data/constants" and _CONSTANT.match(leaf):
        return
    if member.startswith("data/aotinductor/"):
        raise _Refused(f"member {_show(member)} is compiled native code (AOTInductor)")
    if leaf.startswith(("custom_obj", "opaque_obj")):
        raise _Refused(f"member {_show(member)} is a pickled object that needs a full unpickler")
    if leaf.endswith(".pt") and folder in ("data/weights", "data/constants"):
        raise _Refused(f"member {_show(member)} is a legacy pickled {folder.rsplit('/', 1)[1]} file "
                       "that needs a full unpickler")
    if member == "version":
        raise _Refused("it is in the pre-2.8 pickled format")
    raise _Refused(f"unexpected member {_show(member)}")


def _check_payload_config(archive: Archive, kind: str, pattern: re.Pattern, seen: set[str]) -> None:
    folder = "weights" if kind == "weight" else "constants"
    config = json.loads(archive.read(f"data/{folder}/{MODEL_NAME}_{folder}_config.json"))
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise _Refused(f"its {folder} config is not a JSON object with a 'config' entry")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            raise _Refused(f"{kind} {_show(fqn)} has no payload description")
        if not _FQN.match(fqn) or not fqn:
            raise _Refused(f"{kind} name {_show(fqn)} is not a dotted Python name")
        if meta.get("use_pickle"):
            raise _Refused(f"{kind} {fqn!r} is stored pickled and needs a full unpickler")
        name = meta.get("path_name")
        if not isinstance(name, str) or not pattern.match(name):
            raise _Refused(f"{kind} {fqn!r} points at {_show(name)}, not a raw tensor member")
        if archive.root + f"data/{folder}/{name}" not in seen:
            raise _Refused(f"{kind} {fqn!r} points at a missing member {name!r}")
        tm = meta.get("tensor_meta")
        if not isinstance(tm, dict):
            raise _Refused(f"{kind} {fqn!r} has no tensor description")
        for field in ("sizes", "strides"):
            if not all(isinstance(s, dict) and set(s) == {"as_int"} and isinstance(s["as_int"], int)
                       and s["as_int"] >= 0 for s in tm.get(field, [None])):
                raise _Refused(f"{kind} {fqn!r} has {field} that are not non-negative integers")


def _check_program(program: dict) -> None:
    symbol = _symbol_re()
    gm = program.get("graph_module")
    if not isinstance(gm, dict):
        raise _Refused("its program JSON has no graph_module")
    graph = gm.get("graph") or {}
    if graph.get("custom_obj_values"):
        raise _Refused("its graph holds TorchScript objects")
    _walk(program, "", symbol)
    guards = program.get("guards_code") or []
    if not isinstance(guards, list):
        raise _Refused("its guards_code is not a list")
    for guard in guards:
        _check_guard(guard)


def _walk(value: Any, key: str, symbol: re.Pattern) -> None:
    """Check every string that torch pastes into code, evaluates or imports, by its JSON key."""
    if isinstance(value, dict):
        for k, v in value.items():
            _walk(v, k, symbol)
        return
    if isinstance(value, list):
        for v in value:
            _walk(v, key, symbol)
        return
    if not isinstance(value, str):
        return
    if key in ("name", "as_name"):
        if not _IDENT.match(value):
            raise _Refused(f"graph name {_show(value)} is not a Python identifier")
    elif key == "target" or key == "fqn" or key.endswith("_name"):
        if not _FQN.match(value):
            raise _Refused(f"{key} {_show(value)} is not a dotted Python name")
    elif key == "expr_str":
        _check_expr(value, symbol)
    elif key in ("in_spec", "out_spec"):
        _check_spec(value)


_EXPR_NODES = (ast.Expression, ast.Call, ast.Name, ast.Constant, ast.keyword, ast.Load, ast.UnaryOp, ast.USub,
               ast.UAdd, ast.Not, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
               ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.BoolOp, ast.And, ast.Or)
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?\Z")


def _check_expr(expr: str, symbol: re.Pattern) -> None:
    """``expr_str`` is ``sympy.srepr`` output (``Mul(Integer(2), Symbol('s0', positive=True))``) that
    torch feeds to ``sympy.sympify``: only sympy constructors, size symbols and numbers may appear."""
    bad = f"symbolic size {_show(expr)}"
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise _Refused(f"{bad} is not an expression") from None
    for node in ast.walk(tree):
        if not isinstance(node, _EXPR_NODES):
            raise _Refused(f"{bad} holds a {type(node).__name__}")
        if isinstance(node, ast.Name) and node.id not in _SYMPY_NAMES and not symbol.match(node.id):
            raise _Refused(f"{bad} names {node.id!r}, which is neither a size symbol nor a sympy constructor")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _SYMPY_NAMES):
            raise _Refused(f"{bad} calls something other than a sympy constructor")
        if isinstance(node, ast.keyword) and not (node.arg and isinstance(node.value, ast.Constant)
                                                  and isinstance(node.value.value, (bool, int))):
            raise _Refused(f"{bad} has a keyword argument that is not a flag")
        if isinstance(node, ast.Constant) and not (
                isinstance(node.value, (bool, int, float)) or (isinstance(node.value, str) and (
                    symbol.match(node.value) or _NUMBER.match(node.value)))):
            raise _Refused(f"{bad} holds the constant {_show(node.value)}")


def _check_spec(text: str) -> None:
    try:
        protocol, spec = json.loads(text)
    except (ValueError, TypeError):
        raise _Refused(f"input/output structure {_show(text)} is not a pytree spec") from None

    def visit(node):
        if not isinstance(node, dict) or node.get("type") not in _SPEC_TYPES:
            kind = node.get("type") if isinstance(node, dict) else node
            raise _Refused(f"input/output structure uses {_show(kind)}; only tuples, lists and dicts "
                           "of tensors are loaded")
        context = json.loads(node["context"]) if isinstance(node.get("context"), str) else node.get("context")
        if context is not None and not (isinstance(context, list)
                                        and all(isinstance(c, (str, int)) for c in context)):
            raise _Refused(f"input/output structure has context {_show(node.get('context'))}")
        for child in node.get("children_spec") or []:
            visit(child)

    visit(spec)


_GUARD_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub,
                ast.UAdd, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
                ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Load, ast.Constant, ast.Name,
                ast.Subscript, ast.Attribute, ast.Call)


def _check_guard(guard: Any) -> None:
    """A guard must be arithmetic and comparisons over ``L['input']....size()[i]``-style reads."""
    bad = _Refused(f"guard {_show(guard)} is not a plain comparison of input sizes")
    if not isinstance(guard, str):
        raise bad
    try:
        tree = ast.parse(guard, mode="eval")
    except SyntaxError:
        raise bad from None
    for node in ast.walk(tree):
        if not isinstance(node, _GUARD_NODES):
            raise bad
        if isinstance(node, ast.Name) and node.id != "L" and node.id not in _SYMPY_FUNCTIONS:
            raise bad
        if isinstance(node, ast.Attribute) and node.attr not in ("size", "stride", "storage_offset"):
            raise bad
        if isinstance(node, ast.Call) and (node.keywords or not (
                isinstance(node.func, ast.Attribute) or (isinstance(node.func, ast.Name)
                                                         and node.func.id in _SYMPY_FUNCTIONS))):
            raise bad
        if isinstance(node, ast.Constant) and not (
                isinstance(node.value, (int, float, bool))
                or (isinstance(node.value, str) and _IDENT.match(node.value))):
            raise bad


# --- loading ---------------------------------------------------------------------------

def _read_tensor(archive: Archive, member: str, tm, cache: dict[str, torch.Tensor]) -> torch.Tensor:
    from torch._export.serde.serialize import (deserialize_device, deserialize_scalar_type, deserialize_size,
                                               deserialize_storage_offset, deserialize_stride)

    dtype = deserialize_scalar_type(tm.dtype)
    if member not in cache:
        info = archive.zf.getinfo(archive.root + member)
        if info.file_size == 0:
            flat = torch.zeros(deserialize_size(tm.sizes), dtype=dtype).reshape(-1)
        else:
            size = torch._utils._element_size(dtype)
            if info.file_size % size:
                raise _Refused(f"member {member!r} holds {info.file_size} bytes, not whole {dtype} elements")
            flat = torch.empty(info.file_size // size, dtype=dtype)
            buf = memoryview(flat.view(torch.uint8).numpy()).cast("B")
            with archive.zf.open(info) as f:  # zipfile checks the CRC at the end
                done = 0
                while done < len(buf):
                    n = f.readinto(buf[done:])
                    if not n:
                        raise EOFError(member)
                    done += n
        cache[member] = flat
    try:
        t = torch.as_strided(cache[member], deserialize_size(tm.sizes), deserialize_stride(tm.strides),
                             deserialize_storage_offset(tm.storage_offset))
    except RuntimeError:
        raise _Refused(f"member {member!r} is too small for the tensor it describes") from None
    device = deserialize_device(tm.device)
    return t if device.type == "cpu" else t.to(device)


def _read_payloads(archive: Archive, folder: str) -> dict[str, torch.Tensor]:
    from torch._export.serde import schema
    from torch._export.serde.serialize import _dict_to_dataclass

    config = _dict_to_dataclass(schema.PayloadConfig,
                                json.loads(archive.read(f"data/{folder}/{MODEL_NAME}_{folder}_config.json")))
    out, cache = {}, {}
    for fqn, meta in config.config.items():
        t = _read_tensor(archive, f"data/{folder}/{meta.path_name}", meta.tensor_meta, cache)
        tm = meta.tensor_meta
        if meta.is_param:
            t = torch.nn.Parameter(t, requires_grad=tm.requires_grad)
        elif tm.requires_grad:
            t.requires_grad_(True)
        out[fqn] = t
    return out


def _read_sample_inputs(archive: Archive):
    data = archive.read(_SAMPLE_INPUTS)
    if not data:
        return None
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # weights_only refuses anything but tensors and plain containers
        raise _Refused(f"member {_SAMPLE_INPUTS!r} holds Python objects that need a full unpickler "
                       f"({type(exc).__name__} with weights_only=True)") from None
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple)
            and isinstance(value[1], dict)):
        raise _Refused(f"member {_SAMPLE_INPUTS!r} is not an (args, kwargs) pair")
    return value


class _RefusingPickle:
    """Stands in for the ``pickle`` module inside torch's pt2 reader while a load runs."""

    def __getattr__(self, name):
        import pickle

        return getattr(pickle, name)

    @staticmethod
    def loads(*args, **kwargs):
        raise QuantkitError("refusing to unpickle a Python object while loading a .pt2")

    load = loads


_GUARD_LOCK = threading.RLock()


@contextlib.contextmanager
def refuse_unsafe_unpickling() -> Iterator[None]:
    """While inside: ``torch.load`` always runs with ``weights_only=True``, and the ``pickle.loads``
    and TorchScript object unpickling of torch's pt2 reader raise ``QuantkitError``.

    It patches ``torch.load`` process-wide for its duration (a lock keeps nested or concurrent
    uses consistent), so keep the block short.
    """
    from torch.export.pt2_archive import _package

    with _GUARD_LOCK:
        real_load, real_pickle, real_obj = torch.load, _package.pickle, torch._C._pickle_load_obj

        def forced_load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **kwargs):
            return real_load(f, map_location=map_location, weights_only=True, mmap=mmap)

        def refused_obj(*args, **kwargs):
            raise QuantkitError("refusing to unpickle a TorchScript object while loading a .pt2")

        torch.load, _package.pickle, torch._C._pickle_load_obj = forced_load, _RefusingPickle(), refused_obj
        try:
            yield
        finally:
            torch.load, _package.pickle, torch._C._pickle_load_obj = real_load, real_pickle, real_obj


def load_program(path: str | Path) -> torch.export.ExportedProgram:
    """``torch.export.load`` for quantkit's ``model.pt2``, without unpickling or running archive code.

    Raises:
        QuantkitError: the file is not a .pt2 quantkit can load safely (one line saying why).
    """
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass

    archive = check_archive(path)
    try:
        with archive.zf:
            state_dict = _read_payloads(archive, "weights")
            constants = _read_payloads(archive, "constants")
        serialized = _dict_to_dataclass(schema.ExportedProgram, archive.program)
        with refuse_unsafe_unpickling():
            # ready-made dicts/tuples: deserialize_torch_artifact passes them through untouched
            return ExportedProgramDeserializer().deserialize(serialized, state_dict, constants,
                                                             archive.example_inputs)
    except _Refused as exc:
        raise _refusal(Path(path), exc) from None
    except QuantkitError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise QuantkitError(f"could not load {str(path)!r}: damaged archive ({type(exc).__name__}); "
                            "re-create it") from None
    except Exception as exc:  # torch's deserializer: version skew, unknown ops, inconsistent graph
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        raise QuantkitError(f"could not load {str(path)!r}: {type(exc).__name__}: {first[:200]}") from exc
