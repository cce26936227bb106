"""Write an artifact whose weights are not in memory: they are streamed from safetensors files.

The converted model holds data-less fake tensors in place of its weights (the sequential
path's); it is exported as it is, and ``model.pt2`` is written with torch's own archive
writer, member by member, in the layout ``torch.export.save`` gives (one raw
``data/weights/weight_<i>`` member per tensor, the program JSON, the sample inputs): each
weight is read from its safetensors file, written, and dropped before the next one. The
file is a plain ``model.pt2``: ``quantkit.load`` and ``torch.export.load`` read it as any other.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .._errors import QuantkitError
from .._graph import set_attr
from ..pipeline._capture import CAPTURE_META_KEY
from ..pipeline._meta_capture import fake_inputs as _fakify
from . import _artifact, _safe_pt2

__all__ = ["export_fake", "write_streamed_artifact", "load_streamed", "write_streamed_program"]


def _fake_mode(gm: torch.nn.Module):
    from torch._subclasses.fake_tensor import FakeTensor

    for t in list(gm.parameters()) + list(gm.buffers()):
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


def export_fake(converted: torch.fx.GraphModule) -> torch.export.ExportedProgram:
    """:func:`quantkit.export._artifact.export_converted` for a model whose weights are fake
    tensors: exported with fake inputs of the same mode; the program's example inputs are
    the real ones.

    Raises:
        QuantkitError: torch.export cannot export it.
    """
    mode = _fake_mode(converted)
    capture = converted.meta.get(CAPTURE_META_KEY)
    if mode is None or capture is None:
        raise QuantkitError("export_fake expects a converted model with fake weights and a capture record")
    args, kwargs = tuple(capture["args"]), dict(capture["kwargs"])
    model = _artifact._plain_outputs(converted)
    tries = []
    grown = _artifact._grow_symbolic_dims(converted, args, kwargs)
    if grown is not None:
        tries.append(grown)
    tries.append((args, kwargs))
    error = None
    for a, k in tries:
        try:
            ep = torch.export.export(model, _fakify(mode, a), _fakify(mode, k),
                                     dynamic_shapes=capture["dynamic_shapes"], strict=False)
        except Exception as exc:  # torch.export raises many types
            error = exc
            continue
        ep._example_inputs = (tuple(a), dict(k))
        return ep
    raise QuantkitError(f"could not export the converted model: {_artifact._one_line(error)}") from error


def _owner_name(fqn: str) -> str:
    # _plain_outputs wraps the model as ``.model``
    return fqn[len("model."):] if fqn.startswith("model.") else fqn


def _read(source: tuple[Path, str]) -> torch.Tensor:
    from safetensors import safe_open

    path, key = source
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def write_streamed_program(program: torch.export.ExportedProgram, streamed: dict[str, tuple[Path, str]],
                           directory: Path) -> Path:
    """Write ``program`` as ``directory/model.pt2``; its fake weights are read from ``streamed``
    (attribute name -> (safetensors file, key)) one at a time.

    Raises:
        QuantkitError: a fake weight has no source, or a source has another shape or dtype.
    """
    from torch._export.serde import schema
    from torch._export.serde.serialize import _dataclass_to_dict, serialize, serialize_tensor_meta
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.export.pt2_archive import _package
    from torch.export.pt2_archive.constants import (MODELS_FILENAME_FORMAT, SAMPLE_INPUTS_FILENAME_FORMAT,
                                                    WEIGHT_FILENAME_PREFIX, WEIGHTS_CONFIG_FILENAME_FORMAT,
                                                    WEIGHTS_DIR, CONSTANTS_CONFIG_FILENAME_FORMAT)

    path = Path(directory) / _artifact.MODEL_FILE
    name = _safe_pt2.MODEL_NAME
    with _package.PT2ArchiveWriter(str(path)) as writer:
        config: dict[str, schema.PayloadMeta] = {}
        members: dict[int, str] = {}
        for fqn, tensor in program.state_dict.items():
            key = id(tensor)
            if key not in members:
                if isinstance(tensor, FakeTensor):
                    source = streamed.get(_owner_name(fqn))
                    if source is None:
                        raise QuantkitError(f"no stored value for weight {fqn!r}")
                    value = _read(source)
                    if tuple(value.shape) != tuple(tensor.shape) or value.dtype != tensor.dtype:
                        raise QuantkitError(f"stored value of {fqn!r} is {value.dtype}{list(value.shape)}, the "
                                            f"program expects {tensor.dtype}{list(tensor.shape)}")
                else:
                    value = tensor.detach().cpu().contiguous()
                member = f"{WEIGHT_FILENAME_PREFIX}{len(members)}"
                storage = value.untyped_storage()
                writer.archive_file.write_record(os.path.join(WEIGHTS_DIR, member), storage, storage.nbytes())
                members[key] = member
                del value, storage
            config[fqn] = schema.PayloadMeta(path_name=members[key], is_param=isinstance(tensor, torch.nn.Parameter),
                                             use_pickle=False, tensor_meta=serialize_tensor_meta(tensor))
        writer.write_string(WEIGHTS_CONFIG_FILENAME_FORMAT.format(name),
                            json.dumps(_dataclass_to_dict(schema.PayloadConfig(config=config))))
        constants = _package._package_constants(name, program, writer)
        writer.write_string(CONSTANTS_CONFIG_FILENAME_FORMAT.format(name), json.dumps(_dataclass_to_dict(constants)))
        artifact = serialize(program, serialize_state_dict=False, serialize_constants=False)
        writer.write_bytes(MODELS_FILENAME_FORMAT.format(name), artifact.exported_program)
        writer.write_bytes(SAMPLE_INPUTS_FILENAME_FORMAT.format(name), artifact.example_inputs)
    try:
        _safe_pt2.check_archive(path).zf.close()
    except QuantkitError as exc:
        path.unlink()
        raise QuantkitError(f"cannot save this program as a quantkit artifact: {getattr(exc, 'reason', exc)}") from None
    return path


def write_streamed_artifact(converted: torch.fx.GraphModule, streamed: dict[str, tuple[Path, str]],
                            out: str | os.PathLike, *, overwrite: bool = False, recipe: dict | None = None,
                            source: dict | None = None) -> Path:
    """Write the artifact directory ``out`` (``model.pt2`` + ``quantization.json``) atomically,
    as :func:`quantkit.save` does, with the fake weights of ``converted`` streamed from
    ``streamed``."""
    program = export_fake(converted)
    doc = _artifact.recipe_document(converted, recipe=recipe, source=source)
    with _artifact.atomic_dir(out, overwrite=overwrite) as tmp:
        write_streamed_program(program, streamed, tmp)
        _artifact.write_json(tmp / _artifact.RECIPE_FILE, doc)
    return Path(out)


def load_streamed(converted: torch.fx.GraphModule, streamed: dict[str, tuple[Path, str]]) -> torch.fx.GraphModule:
    """Replace ``converted``'s fake weights with their stored values (in place); returns it."""
    for target, source in streamed.items():  # each a parameter or a buffer: it stays one
        set_attr(converted, target, _read(source), detach=False)
    return converted
