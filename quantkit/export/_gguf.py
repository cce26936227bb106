"""Export a quantkit program (or a float HF model) as a GGUF file that llama.cpp runs.

Weight-only int4/int8 weights in groups of 32 (or of a multiple of 32, or per output row: each
block repeats the group's scale) become GGUF blocks holding quantkit's
integers unchanged (``_gguf_blocks``: Q4_0 symmetric int4, Q4_1 asymmetric int4, Q8_0 symmetric
int8), so llama.cpp computes with GPTQ-, AWQ- or RTN-rounded weights as quantkit chose them, not
re-rounded from float. Float tensors (norms, biases, embeddings unless quantized, a float
lm_head) are F32 (``float_dtype="float16"``: 2-d ones F16). Names, hyperparameters and the
tokenizer follow llama.cpp's converter (``_gguf_arch``).

The HF side comes from ``model``, the HF model directory the program was captured from (as for
``export_compressed_tensors``): its config.json gives the architecture and hyperparameters, its
tokenizer files the vocabulary. The program's graph gives the tensors. Everything that GGUF cannot
hold is refused in one line before anything is written.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.fx import GraphModule

from .. import _hf
from .._errors import QuantkitError
from .._graph import QUANTIZE_OPS, FLOAT8_QUANTIZE_OPS, explicit_input_scales, module_scopes
from . import _ct_schemes as schemes
from . import _ct_checks  # noqa: F401  (registers the reader refusing remainder groups)
from ._ct_plan import recorded_modules
from ._gguf_arch import arch_for, gguf_name, qk_rows, write_metadata, write_tokenizer
from ._gguf_blocks import Blocks, fp16_error, kind_of, pack

__all__ = ["export_gguf", "GGUFExport", "check_available", "FLOAT_DTYPES"]

aten = torch.ops.aten
_QD = torch.ops.quantized_decomposed
FLOAT_DTYPES = ("float32", "float16")
# how messages name the options; the CLI passes its flags
_FLAGS = {"skip_unsupported": "skip_unsupported=True"}


@dataclass(frozen=True)
class GGUFExport:
    """What :func:`export_gguf` wrote.

    Attributes:
        path: the .gguf file.
        architecture: the GGUF architecture (``llama``, ``qwen2``).
        tensors: GGUF tensor name -> type written (``Q4_0``, ``Q4_1``, ``Q8_0``, ``F32``, ``F16``).
        kept_float: ``"module: why"`` for quantized weights GGUF cannot hold, written F16 of
            quantkit's dequantized values (only with ``skip_unsupported``).
        fp16_scale_error: the largest relative (Frobenius) weight error that rounding the
            float32 scales to GGUF's fp16 adds, over the quantized tensors (0.0 when none).
        tokenizer_pre: ``tokenizer.ggml.pre`` as written.
    """

    path: Path
    architecture: str
    tensors: dict
    kept_float: tuple[str, ...]
    fp16_scale_error: float
    tokenizer_pre: str


def check_available() -> str:
    """The installed ``gguf`` package version; a one-line error saying how to install it if absent."""
    try:
        import gguf  # noqa: F401
        from importlib import metadata
    except ImportError:
        raise QuantkitError("the GGUF format needs the gguf package: pip install 'quantkit[gguf]'") from None
    return metadata.version("gguf")


def _module(node, recorded: dict) -> str:
    scopes = module_scopes(node)
    return scopes[-1][0] if scopes else recorded.get(node.name, "")


def _meta_model(config_dir: Path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _read_program(gm: GraphModule, hf, skip_unsupported: bool) -> tuple[dict, dict, list[str]]:
    """``(quantized, kept, problems)``: HF module -> group-wise weight GGUF holds with its block kind;
    HF weight name -> float value for weights kept F16; and the refusals (``"module: what"``)."""
    modules = dict(hf.named_modules())
    recorded = recorded_modules(gm, modules)
    quantized: dict[str, tuple[object, str]] = {}
    kept: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    input_scales = set(explicit_input_scales(gm))

    def refuse(where: str, what: str, value=None) -> None:
        if skip_unsupported and value is not None and f"{where}.weight" in hf.state_dict():
            kept[f"{where}.weight"] = value
        problems.append(f"{where}: {what}")

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in QUANTIZE_OPS or node.target in FLOAT8_QUANTIZE_OPS:
            if not (isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr"):
                raise QuantkitError(f"GGUF holds weight-only quantization; {_module(node, recorded) or node.name} "
                                    "quantizes activations (w8a8/fp8): quantize with --scheme w4a16 or w8a16")
        if node in input_scales:
            where = _module(next(iter(node.users)), recorded) if node.users else ""
            raise QuantkitError(f"{where or node.name} scales a linear's input by a constant (AWQ that could not "
                                "fold into the op before it); GGUF cannot store it: quantize with "
                                "WeightOnlyQuantizer(..., awq_fold_only=True) (the CLI does for --format gguf)")
        read = schemes.reader_for(node.target)
        if read is None:
            continue
        role, value = read(gm, node)
        users = [u for u in node.users if u.target in (aten.linear.default, aten.embedding.default)]
        where = _module(users[0], recorded) if users else _module(node, recorded) or node.name
        if role != schemes.WEIGHT:
            what = value if isinstance(value, str) else value[0] if isinstance(value, tuple) else "a quantized input"
            if any(u.target == aten.linear.default and u.args[1] is node for u in node.users):
                raise QuantkitError(f"GGUF cannot hold {where}: {what} (GGUF's blocks hold int4/int8 groups of 32): "
                                    "quantize with --scheme w4a16 or w8a16 --group-size 32")
            raise QuantkitError(f"GGUF holds weight-only quantization; {where} has {what}: quantize with "
                                "--scheme w4a16 or w8a16 --group-size 32")
        if not isinstance(value, schemes.GroupWeight):
            value = _as_groups(value)
            if not isinstance(value, schemes.GroupWeight):
                refuse(where, "weights quantized along an axis other than the output rows", value)
                continue
        kind, why = kind_of(value)
        bad_use = not users or any(u.args[0 if u.target == aten.embedding.default else 1] is not node for u in users)
        if kind is None or bad_use:
            refuse(where, why or "a quantized weight not read by a Linear or Embedding", value.dequantized())
            continue
        if float(value.scale.abs().max()) > 65504.0:
            refuse(where, "scales beyond fp16's range (GGUF's block scales are fp16)", value.dequantized())
            continue
        quantized[where] = (value, kind)
    return quantized, kept, problems


def _as_groups(w):
    """A per-channel (output rows) or per-tensor integer weight as one group per row (GGUF repeats
    the row's scale in each block: exact); else its dequantized value (kept F16 when skipping)."""
    if w.q.dim() != 2 or w.axis not in (0, None):
        return w.dequantized()
    n = w.q.shape[0]
    scale = w.scale.detach().float().reshape(-1, 1).expand(n, 1).contiguous()
    zp = w.zero_point.reshape(-1, 1).expand(n, 1).contiguous()
    return schemes.GroupWeight(w.q, scale, zp, w.quant_min, w.quant_max, w.q.dtype, w.q.shape[1])


def _own_tensors(program) -> dict[str, torch.Tensor]:
    own = dict(program.named_parameters(remove_duplicate=False))
    own.update(dict(program.named_buffers(remove_duplicate=False)))
    if isinstance(program, GraphModule) and program.meta.get("quantkit_program") is not None:
        own = {k[len("model."):] if k.startswith("model.") else k: v for k, v in own.items()}  # quantkit.load
    return {k: v.detach() for k, v in own.items()}


def _float_array(t: torch.Tensor, dtype: str) -> np.ndarray:
    t = t.detach().to(torch.float32)
    return (t.to(torch.float16) if dtype == "float16" and t.dim() >= 2 else t).contiguous().numpy()


def _atomic_write(writer_fn, path: Path) -> None:
    """Write through ``writer_fn(tmp_path)`` into a temporary file beside ``path``, fsync it and
    rename it into place: a reader never sees a partial file, a failure leaves the old one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.quantkit-tmp-", dir=str(path.parent))
    os.close(fd)
    try:
        writer_fn(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_gguf(program, path: str | os.PathLike, *, model: str | os.PathLike, float_dtype: str = "float32",
                skip_unsupported: bool = False, overwrite: bool = False, name: str | None = None,
                flags: dict | None = None) -> GGUFExport:
    """Write ``program`` as a GGUF file llama.cpp loads.

    Args:
        program: a converted quantkit program (``quantkit.convert`` or ``quantkit.load``) with
            group-wise weight-only int4/int8 weights at group size 32, a float captured program,
            or the float HF model itself (``torch.nn.Module``).
        path: the .gguf file to write (atomically).
        model: the HF model directory the program was captured from: config.json (architecture,
            hyperparameters) and tokenizer files.
        float_dtype: ``"float32"`` (default: float tensors as quantkit computes with them) or
            ``"float16"`` (2-d float tensors F16, as llama.cpp's converter writes them).
        skip_unsupported: write quantized weights GGUF cannot hold as F16 of quantkit's
            dequantized values (listed in ``kept_float``) instead of refusing.
        overwrite: replace an existing file.
        name: ``general.name`` (default: the model directory's name).

    Returns:
        :class:`GGUFExport`.

    Raises:
        QuantkitError: one line, before anything is written: an architecture or tokenizer llama.cpp's
            converter path here does not cover, activation quantization, a group size other than 32,
            per-channel weights, asymmetric int8 (without ``skip_unsupported`` for the weight cases).

    Example:
        >>> quantkit.export_gguf(qmodel, "model-q4_0.gguf", model="SmolLM2-135M-Instruct")
    """
    import gguf

    flags = {**_FLAGS, **(flags or {})}
    check_available()
    if float_dtype not in FLOAT_DTYPES:
        raise ValueError(f"float_dtype must be one of {FLOAT_DTYPES}, got {float_dtype!r}")
    path, model_dir = Path(path), Path(model)
    if path.exists() and not overwrite:
        raise QuantkitError(f"{str(path)!r} exists; pass overwrite=True (--force) or choose another path")
    if not path.parent.is_dir():
        raise QuantkitError(f"{str(path.parent)!r} is not a directory; create it first")
    _hf.check_hf_dir(model_dir)
    config = _hf._config_json(model_dir)
    if "quantization_config" in config:
        raise QuantkitError(f"{str(model_dir / 'config.json')!r} has a quantization_config; pass the float "
                            "checkpoint the program was captured from")
    hf_arch, arch = arch_for(config)
    hf = _meta_model(model_dir)
    if isinstance(program, GraphModule):
        quantized, kept, problems = _read_program(program, hf, skip_unsupported)
    elif isinstance(program, torch.nn.Module):
        quantized, kept, problems = {}, {}, []
    else:
        raise TypeError(f"program must be a quantkit program or a torch.nn.Module, got {type(program).__name__}")
    if problems and not skip_unsupported:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise QuantkitError(f"GGUF cannot hold {problems[0]}{more}; pass {flags['skip_unsupported']} to keep "
                            "them F16")
    own = _own_tensors(program)
    n_blocks = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.gguf), n_blocks)
    aliases: dict[int, list[str]] = {}
    for key, p in hf.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(key)
    twin = {k: g for g in aliases.values() for k in g}
    planned: list[tuple[str, object]] = []  # (gguf name, Blocks or float array)
    types: dict[str, str] = {}
    errors: list[float] = []
    for key in hf.state_dict():
        module, _, leaf = key.rpartition(".")
        target = gguf_name(names, key)
        if target is None:
            raise QuantkitError(f"no GGUF name for {key!r} in llama.cpp's {arch.gguf.lower()} tensor map")
        if leaf == "weight" and module in quantized:
            w, kind = quantized[module]
            rows = qk_rows(key, config, arch, w.q.shape[0])
            planned.append((target, pack(w, kind, rows)))
            errors.append(fp16_error(w, kind))
            continue
        # a tied parameter the program holds under its twin's name (convert names the embedding's
        # table lm_head.weight when lm_head itself is quantized)
        held = [t for t in (key, *twin.get(key, ())) if t in kept or t in own]
        if not held:
            raise QuantkitError(f"the program has no tensor for {key!r}; export the program captured from "
                                f"{str(model_dir)!r}")
        value = kept.get(held[0], own.get(held[0]))
        if key.startswith("lm_head") and len(twin.get(key, ())) > 1 and \
                not any(t.rpartition(".")[0] in quantized for t in twin[key]):
            continue  # tied, and both float: the converter writes token_embd only, llama.cpp reuses it
        rows = qk_rows(key, config, arch, value.shape[0])
        planned.append((target, _float_array(value if rows is None else value[rows], float_dtype)))
    file_type = _file_type(gguf, planned, float_dtype)

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch.gguf)],
                                 use_temp_file=False)
        write_metadata(writer, config, arch, name=name or model_dir.name, file_type=file_type)
        pre_box.append(write_tokenizer(writer, model_dir, config, arch))
        for target, data in planned:
            if isinstance(data, Blocks):
                writer.add_tensor(target, data.data, raw_dtype=getattr(gguf.GGMLQuantizationType, data.kind))
            else:
                writer.add_tensor(target, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    pre_box: list[str] = []
    _atomic_write(write, path)
    for target, data in planned:
        types[target] = data.kind if isinstance(data, Blocks) else ("F16" if data.dtype == np.float16 else "F32")
    return GGUFExport(path=path, architecture=gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch.gguf)],
                      tensors=types, kept_float=tuple(problems), fp16_scale_error=max(errors, default=0.0),
                      tokenizer_pre=pre_box[0])


def _file_type(gguf, planned, float_dtype: str) -> int:
    """``general.file_type``: the most common block kind, else F16/F32 (llama.cpp's LlamaFileType)."""
    kinds = [d.kind for _, d in planned if isinstance(d, Blocks)]
    if kinds:
        kind = max(set(kinds), key=kinds.count)
        return int(getattr(gguf.LlamaFileType, f"MOSTLY_{kind}"))
    return int(gguf.LlamaFileType.MOSTLY_F16 if float_dtype == "float16" else gguf.LlamaFileType.ALL_F32)
