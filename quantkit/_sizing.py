"""Sizes a Hugging Face checkpoint implies, checked before any module is built.

config.json is read as plain JSON and its size fields (layers, vocab, widths, heads,
positions, at the top level and in nested sub-configs such as ``text_config``) are checked

- for type: a positive integer (or null, where transformers takes a default);
- against the checkpoint's tensor shapes, read from the safetensors headers only (no tensor
  byte is read): the layer count against the numbered layers in the tensor names (the
  largest ``prefix.N.`` stack), the vocabulary against the embedding's rows, the hidden
  size against the tensors' dimensions, and every width against the largest dimension;
- against the memory this machine has, for the in-memory path.

The rules use the config's standard attribute names and the tensor names and shapes, not
one architecture's parameter formula, so that they hold for any transformers model. An
impossible or inconsistent config is one :class:`~quantkit.QuantkitError` line naming the
field and its value; nothing has been allocated or constructed by then.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ._errors import QuantkitError

__all__ = ["TensorInfo", "ModelSize", "read_safetensors_header", "checkpoint_shapes", "layer_stack", "check_config",
           "available_memory", "format_bytes", "size_field", "DTYPE_BYTES"]

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E8M0": 1, "F4": 1, "C64": 8}

# safetensors refuses headers above 100 MB (safetensors/src/tensor.rs, MAX_HEADER_SIZE)
_MAX_HEADER = 100_000_000

# config.json size fields, by role (names used by transformers' configs: Llama/Mistral/Qwen,
# BERT/RoBERTa, GPT-2/GPT-J, T5, BART/OPT, DistilBERT, and their sub-configs)
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
           "num_decoder_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
_WIDTHS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim",
           "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim", "d_kv", "kv_channels")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_key_value_heads", "encoder_attention_heads",
          "decoder_attention_heads")
_POSITIONS = ("max_position_embeddings", "n_positions")
_VOCAB = ("vocab_size",)
_FIELDS = _LAYERS + _HIDDEN + _WIDTHS + _HEADS + _POSITIONS + _VOCAB
# positions of a model without a position-embedding table (rotary): no tensor bounds them. 2**26
# (67M tokens) is far above every published context length (10M at most) and keeps absurd values out
_MAX_POSITIONS = 2 ** 26
# ALBERT-style shared layers: no tensor counts the passes; published models make 12-24 (xxlarge: 12)
_MAX_SHARED_LAYERS = 4096


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor, from its file's header: shape, safetensors dtype name, file name."""

    shape: tuple[int, ...]
    dtype: str
    file: str

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True)
class ModelSize:
    """What config.json and the checkpoint imply, from :func:`check_config`.

    ``weight_bytes``: the checkpoint's tensors as stored (transformers loads them in that
    dtype); ``described_bytes``: the model config.json describes (larger when it has layers or
    embedding rows the checkpoint lacks, which only ``allow_missing`` lets through);
    ``layers``/``stack``: the largest numbered stack of the tensor names (``model.layers``);
    ``largest_unit_bytes``: the largest of its layers, or of the tensors outside it.
    """

    weight_bytes: int
    described_bytes: int
    layers: int = 0
    stack: str | None = None
    largest_unit_bytes: int = 0


def format_bytes(n: int | float) -> str:
    """``1.5 GiB``, ``320 MiB``, ``12 KiB``, ``100 B``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} EiB"  # pragma: no cover


def _bad_file(path: Path, why: str) -> QuantkitError:
    return QuantkitError(f"{str(path)!r} is not a valid safetensors file ({why}); re-download or re-save the weights")


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file from its header alone (the first 8 + N bytes).

    Raises:
        QuantkitError: a header that is cut short, too large, not JSON, or whose shapes,
            dtypes or offsets do not describe the file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad_file(path, "shorter than its header")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER or n > size - 8:
                raise _bad_file(path, f"header of {n} bytes")
            doc = json.loads(f.read(n).decode("utf-8"))
    except QuantkitError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _bad_file(path, type(exc).__name__) from None
    if not isinstance(doc, dict):
        raise _bad_file(path, "header is not an object")
    data = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for key, entry in doc.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape)
                or not isinstance(dtype, str) or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets)):
            raise _bad_file(path, f"header entry {key!r}")
        info = TensorInfo(tuple(shape), dtype, path.name)
        begin, end = offsets
        if not 0 <= begin <= end <= data:
            raise _bad_file(path, f"tensor {key!r} lies outside the file")
        if dtype in DTYPE_BYTES and dtype != "F4" and end - begin != info.nbytes:  # sub-byte types: no fixed size
            raise _bad_file(path, f"tensor {key!r} does not fit its byte range")
        out[key] = info
    return out


def checkpoint_shapes(model_dir: str | os.PathLike) -> dict[str, TensorInfo] | None:
    """Every tensor of the ``*.safetensors`` files in ``model_dir`` (headers only); None when
    the directory has none (a ``pytorch_model.bin`` checkpoint is not read here: its shapes
    sit inside a pickle).

    Raises:
        QuantkitError: an unreadable header, or a tensor stored in two files.
    """
    files = sorted(p for p in Path(model_dir).iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not files:
        return None
    out: dict[str, TensorInfo] = {}
    for path in files:
        for key, info in read_safetensors_header(path).items():
            if key in out:
                raise QuantkitError(f"tensor {key!r} is stored in both {out[key].file!r} and {path.name!r}; "
                                    "remove the stale file")
            out[key] = info
    return out


def _reclaimable(stat_file: str, key: str) -> int:
    """Page cache the kernel drops before it refuses memory (``inactive_file`` of a cgroup)."""
    try:
        for line in Path(stat_file).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def available_memory() -> int | None:
    """Bytes this process can still use: MemAvailable, capped by a cgroup (v2 or v1) limit
    less the cgroup's usage (its inactive page cache counted as free, as the kernel reclaims
    it first); None where neither can be read (not Linux)."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    for root, limit_name, usage_name, stat_key in (
            ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        try:
            limit = Path(root, limit_name).read_text().strip()
            usage = int(Path(root, usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            usage -= _reclaimable(str(Path(root, "memory.stat")), stat_key)
            left = max(0, int(limit) - max(0, usage))
            free = left if free is None else min(free, left)
        break
    return free


# --- config.json --------------------------------------------------------------------------

def _levels(doc: dict) -> list[tuple[str, dict]]:
    """``("", config)`` and each nested sub-config (``text_config``, ``vision_config``, an
    encoder-decoder's ``encoder``/``decoder``), with the prefix that names its fields."""
    out = [("", doc)]
    for key, value in doc.items():
        if isinstance(value, dict) and (key.endswith("_config") or "model_type" in value):
            out.append((f"{key}.", value))
    return out


def _show(value) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _field_error(where: str, value, why: str) -> QuantkitError:
    return QuantkitError(f"config.json {where} = {_show(value)} {why}; fix config.json "
                         "(or re-save the model with save_pretrained)")


def _check_types(doc: dict) -> list[tuple[str, str, int, dict]]:
    """``(where, field, value, level)`` of every size field that is set; raises for a value
    that is not a positive integer."""
    fields = []
    for prefix, level in _levels(doc):
        for name in _FIELDS:
            if name not in level or level[name] is None:
                continue
            value = level[name]
            # a list is one value per stage (Swin's num_heads, SegFormer's num_attention_heads)
            items = value if isinstance(value, list) and value else [value]
            for item in items:
                if type(item) is not int:  # bool, float (even 12.0), string, object
                    raise _field_error(prefix + name, value, f"is {type(item).__name__}, not a positive integer")
                if item <= 0:
                    raise _field_error(prefix + name, value, "is not a positive integer")
            fields.append((prefix + name, name, max(items), level))
    return fields


_INDEX = re.compile(r"^(\d+)$")


def _stacks(shapes: dict[str, TensorInfo]) -> dict[str, dict[int, int]]:
    """Numbered layer stacks of the tensor names: ``{"model.layers": {0: bytes, 1: bytes}}``
    (the prefix up to a name's first integer component)."""
    stacks: dict[str, dict[int, int]] = {}
    for name, info in shapes.items():
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if _INDEX.match(part):
                if i:
                    layer = stacks.setdefault(".".join(parts[:i]), {})
                    layer[int(part)] = layer.get(int(part), 0) + info.nbytes
                break
    return stacks


def layer_stack(shapes: dict[str, TensorInfo]) -> tuple[str | None, int]:
    """The checkpoint's largest numbered stack of layers, ``("model.layers", 32)``, from the
    tensor names alone (``(None, 0)`` when no name has an integer component)."""
    stacks = _stacks(shapes)
    stack = max(stacks, key=lambda k: (max(stacks[k]) + 1, sum(stacks[k].values())), default=None)
    return stack, (max(stacks[stack]) + 1 if stack is not None else 0)


def size_field(doc: dict, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` set to a positive integer in config.json ``doc`` (or in a nested
    sub-config), e.g. ``size_field(doc, ("num_attention_heads", "n_head"))``."""
    for _, level in _levels(doc):
        for name in names:
            value = level.get(name)
            if type(value) is int and value > 0:
                return value
    return None


def _embeddings(shapes: dict[str, TensorInfo]) -> list[tuple[str, TensorInfo]]:
    """2-D token-embedding tables, largest first: ``embed_tokens``, ``word_embeddings``,
    ``wte``, ``shared``, ... (position and token-type tables left out)."""
    found = []
    for name, info in shapes.items():
        module = name.rsplit(".", 1)[0].lower() if "." in name else name.lower()
        last = module.rsplit(".", 1)[-1]
        if len(info.shape) != 2 or not name.endswith(".weight"):
            continue
        if "pos" in last or "type" in last or last in ("wpe",):
            continue
        if "emb" in last or last in ("wte", "shared", "tok_embeddings", "word_embeddings"):
            found.append((name, info))
    return sorted(found, key=lambda kv: -kv[1].shape[0])


def _positions(shapes: dict[str, TensorInfo]) -> list[tuple[str, TensorInfo]]:
    out = []
    for name, info in shapes.items():
        last = name.rsplit(".", 2)[-2].lower() if name.count(".") else ""
        if len(info.shape) == 2 and (last == "wpe" or ("pos" in last and "emb" in last)):
            out.append((name, info))
    return out


def check_config(model_dir: str | os.PathLike, *, allow_missing: bool = False,
                 memory: int | None = None, memory_what: str = "available") -> ModelSize:
    """Check config.json's sizes (see the module docstring) before any module is built.

    Args:
        model_dir: an HF model directory.
        allow_missing: let layers and embedding rows the checkpoint lacks through (they
            are randomly initialised, ``--allow-missing-weights``); the model config.json
            then describes must still fit ``memory``.
        memory: bytes the whole model must fit in (the in-memory path); None: no memory check.
        memory_what: how ``memory`` is named in the message (``available``, ``--max-memory``).

    Returns:
        The :class:`ModelSize` the checkpoint and config imply.

    Raises:
        QuantkitError: one line naming the field and its value (or the memory needed).
    """
    path = Path(model_dir)
    cfg_file = path / "config.json"
    try:
        doc = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise QuantkitError(f"{str(cfg_file)!r} is not readable JSON ({type(exc).__name__}); "
                            "re-save the model with save_pretrained") from None
    if not isinstance(doc, dict):
        raise QuantkitError(f"{str(cfg_file)!r} is not a JSON object; re-save the model with save_pretrained")
    fields = _check_types(doc)
    shapes = checkpoint_shapes(path)
    if not shapes:  # no safetensors headers to compare with: types only
        return ModelSize(0, 0)
    weight_bytes = sum(t.nbytes for t in shapes.values())
    dims = {d for t in shapes.values() for d in t.shape}
    largest_dim = max(dims, default=0)
    stacks = _stacks(shapes)
    stack, layers = layer_stack(shapes)
    per_layer = max(stacks[stack].values()) if stack is not None else 0
    biggest_other = max((t.nbytes for k, t in shapes.items() if stack is None or not k.startswith(stack + ".")),
                        default=0)
    embeds = _embeddings(shapes)
    extra = 0
    for where, name, value, level in fields:
        if name in _LAYERS:
            if name == "num_hidden_layers" and "num_hidden_groups" in level:
                # ALBERT: the forward passes num_hidden_layers times through num_hidden_groups shared layers
                if value > _MAX_SHARED_LAYERS:
                    raise _field_error(where, value, f"is more passes through shared layers than any model makes "
                                                     f"(at most {_MAX_SHARED_LAYERS})")
                continue
            if stack is None or value <= layers:
                continue
            if not allow_missing:
                raise _field_error(where, value, f"but the checkpoint has {layers} layer{'s' * (layers != 1)} "
                                                 f"({stack}.0 to {stack}.{layers - 1})")
            extra = max(extra, (value - layers) * per_layer)
        elif name in _VOCAB:
            rows = {t.shape[0] for _, t in embeds}
            if embeds and value not in rows:
                emb, info = embeds[0]
                if not allow_missing or value > largest_dim:
                    raise _field_error(where, value, f"but the checkpoint's embedding {emb} has {info.shape[0]} rows")
                extra += max(0, value - info.shape[0]) * info.shape[1] * DTYPE_BYTES.get(info.dtype, 4)
            elif not embeds and value > largest_dim:
                raise _field_error(where, value, f"is larger than every dimension of the checkpoint's tensors "
                                                 f"(largest {largest_dim})")
        elif name in _HIDDEN:
            if value > largest_dim or (value not in dims and not allow_missing):
                shown = f" (the embedding {embeds[0][0]} is {list(embeds[0][1].shape)})" if embeds else ""
                raise _field_error(where, value, f"but no tensor of the checkpoint has a dimension of {value}{shown}")
        elif name in _POSITIONS:
            tables = _positions(shapes)
            bound = max((t.shape[0] for _, t in tables), default=_MAX_POSITIONS)
            if value > bound and not (allow_missing and tables and value <= largest_dim):
                what = (f"but the checkpoint's position table {tables[0][0]} has {tables[0][1].shape[0]} rows"
                        if tables else f"is more positions than any model supports (at most {_MAX_POSITIONS})")
                raise _field_error(where, value, what)
        elif value > largest_dim:  # widths and heads: no tensor is that wide
            raise _field_error(where, value, f"is larger than every dimension of the checkpoint's tensors "
                                             f"(largest {largest_dim})")
    size = ModelSize(weight_bytes, weight_bytes + extra, layers, stack, max(per_layer, biggest_other))
    if memory is not None and size.described_bytes > memory:
        raise QuantkitError(
            f"the model in {str(path)!r} needs {format_bytes(size.described_bytes)} for its weights alone, more than "
            f"the {format_bytes(memory)} {memory_what}; quantize it block by block (quantkit quantize --max-memory "
            f"SIZE), or run where it fits")
    return size
