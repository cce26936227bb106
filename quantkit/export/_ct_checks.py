"""Checks of a written compressed-tensors checkpoint besides the loaded model's own tensors: the
files read back, the model outputs compared (cosine per row, SQNR per layer), and the two places
where transformers 5.24 with compressed-tensors 0.20 does not hold what the checkpoint stores.

- Asymmetric ``pack-quantized`` weights: the checkpoint stores zero points packed into int32
  along the output channels (what compressed-tensors' own compressor writes and vLLM reads),
  but transformers' default (compressed) load path builds the module on the meta device with
  the zero points unpacked and refuses the sizes (llm-compressor#1618). Such exports are loaded
  with ``CompressedTensorsConfig(dequantize=True)``: transformers runs compressed-tensors'
  decompressor on every weight, and each dense weight must equal quantkit's dequantized one.
- KV-cache scales: compressed-tensors 0.20 hooks attention modules whose ``forward`` takes
  ``past_key_values``; transformers 5's Llama takes ``cache``, so the ``k_scale``/``v_scale``
  load into nothing and the cache stays float there (vLLM reads them). They are checked in the
  files, and the model-level comparison is then made without quantkit's K/V quantization.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from torch.fx import GraphModule, Node

from .._errors import QuantkitError
from .._graph import get_attr
from ..pipeline._inputs import call_model
from ._ct_schemes import UNKNOWN, Float8Act, Float8Weight, GroupWeight, is_float8, layer_tensors, register_reader

__all__ = ["remainder_group", "dense_load", "kv_applied", "check_files", "check_dense", "stored_on_modules", "same", "compare",
           "sqnr_db", "ENGINES", "FLOAT_DTYPES", "float_dtype", "engine_refusal", "plan_kinds"]

# what an export is written for: "vllm-cpu" (default) refuses the schemes vLLM's CPU build has no
# kernel for; "transformers" writes every scheme the format expresses (transformers runs them all)
ENGINES = ("vllm-cpu", "transformers")
# float tensors' dtype by name (--float-dtype); bf16 is what vLLM runs (it casts float32 tensors, warning)
FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# vLLM 0.32's CPU build (vllm-cpu, checked by benchmarks/vllm_check.py): kinds of layers it cannot run
_VLLM_CPU_LIMITS = {
    # model_executor/kernels/linear/mixed_precision/cpu.py: CPUWNA16 takes scalar types uint4 / uint4b8
    "w8a16": ("8-bit weight-only layers (w8a16): its CPU WNA16 kernels take 4-bit weights only (uint4, uint4b8), "
              "so it finds no kernel for uint8b128", "use w4a16"),
    # the CPU scaled-mm path without AMX narrows a 0-dim input scale on the first generate
    "fp8-static": ("static FP8 (a calibrated per-tensor input scale): its CPU FP8 path without AMX crashes on the "
                   "first generate (narrow() on a 0-dim scale)", "use fp8-dynamic"),
}
# not refused: w4a16 with float32 tensors. cpu_gemm_wna16 runs bf16 only (issue 30: vLLM run with
# dtype="float32" fails), but vLLM's default dtype="auto" runs a float32 checkpoint in bf16 on CPU
# (benchmarks/vllm_check.py)


# --- remainder groups: neither compressed-tensors nor GGUF holds one ----------------------------

def remainder_group(in_features: int, group_size: int) -> tuple[str, str]:
    """``(what, hint)`` refusing a weight whose last group holds the remainder (576 features in groups of
    128): compressed-tensors' ``group_size`` and GGUF's blocks of 32 both need groups that divide the
    row. The hint names the largest group sizes below ``group_size`` that divide ``in_features``."""
    k, g = int(in_features), int(group_size)
    fits = [d for d in (256, 128, 64, 32, 16, 8) if d < g and k % d == 0][:3]
    sizes = " or ".join(str(d) for d in fits) if fits else f"a divisor of {k}"
    return (f"a remainder group ({k} input features in groups of {g} leave a last group of {k % g})",
            f"its groups must divide the input features: quantize with a group size that divides {k}, e.g. {sizes}")


@register_reader(torch.ops.quantkit.dequantize_group.default)
def _read_remainder_group(gm: GraphModule, dq: Node) -> tuple[str, object]:
    """The compressed-tensors / GGUF reader of ``quantkit::dequantize_group``: always a refusal."""
    q = dq.args[0]
    val = dq.meta.get("val")
    if not isinstance(val, torch.Tensor) and isinstance(q, Node):
        src = q.args[0] if q.target == torch.ops.quantkit.unpack_int4.default else q
        const = get_attr(gm, src.target) if src.op == "get_attr" else None
        val = None if const is None else const.new_empty(const.shape[0], const.shape[-1] * (2 if src is not q else 1))
    k = int(val.shape[-1]) if isinstance(val, torch.Tensor) else 0
    return UNKNOWN, remainder_group(k, int(dq.args[6]))


def float_dtype(value) -> torch.dtype:
    """``float_dtype`` as a torch dtype: a name of :data:`FLOAT_DTYPES` or one of its dtypes."""
    if isinstance(value, torch.dtype) and value in FLOAT_DTYPES.values():
        return value
    if isinstance(value, str) and value in FLOAT_DTYPES:
        return FLOAT_DTYPES[value]
    raise ValueError(f"float_dtype must be one of {', '.join(FLOAT_DTYPES)}, got {value!r}")


def plan_kinds(plan) -> dict[str, str]:
    """The layers of ``plan`` that :data:`_VLLM_CPU_LIMITS` names, as ``{kind: first module}``."""
    kinds: dict[str, str] = {}
    for name, layer in plan.linears.items():
        w, a = layer.weight, layer.act
        kind = None
        if isinstance(w, GroupWeight) and w.bits == 8:
            kind = "w8a16"
        elif isinstance(w, Float8Weight) and isinstance(a, Float8Act) and a.kind == "static":
            kind = "fp8-static"
        if kind is not None:
            kinds.setdefault(kind, name)
    return kinds


def engine_refusal(kinds, engine: str, *, engine_flag: str = "engine='transformers'") -> str | None:
    """One line refusing the first of ``kinds`` (names of :data:`_VLLM_CPU_LIMITS`, or a dict of
    them to a module) that ``engine`` cannot run, saying what to use instead; None when it runs them."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine != "vllm-cpu":
        return None
    for kind in kinds:
        if kind in _VLLM_CPU_LIMITS:
            why, instead = _VLLM_CPU_LIMITS[kind]
            where = f" ({kinds[kind]})" if isinstance(kinds, dict) else ""
            return (f"vLLM's CPU build cannot run {why}{where}; {instead}, or pass {engine_flag} to write it for "
                    "transformers (which runs it)")
    return None


def dense_load(plan) -> bool:
    """Whether the export must be verified through transformers' dequantizing load path."""
    return any(isinstance(layer.weight, GroupWeight) and not layer.weight.symmetric for layer in plan.linears.values())


def kv_applied(model, plan) -> bool:
    """Whether the loaded model holds the KV-cache scales on its attention modules."""
    return bool(plan.kv) and all(isinstance(getattr(model.get_submodule(m), "k_scale", None), torch.Tensor)
                                 for m in plan.kv)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if is_float8(a.dtype) else torch.equal(a, b)


def check_files(directory: Path, plan) -> int:
    """Every quantized tensor the export wrote (weights, scales, zero points, KV scales), read
    back from its safetensors: quantkit's, bit for bit. Returns how many were compared."""
    from safetensors import safe_open

    want = {f"{m}.{k}": t for m, layer in plan.linears.items() for k, t in layer_tensors(layer).items()}
    want.update({f"{m}.{k}": t for m, kv in plan.kv.items() for k, t in kv.stored().items()})
    found = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            found.update({k: st.get_tensor(k) for k in st.keys() if k in want})
    for key, expected in want.items():
        got = found.get(key)
        if got is None or not _same(got, expected):
            raise QuantkitError(f"the export's {key} as written is not quantkit's tensor; nothing was written, "
                                "please report it")
    return len(want)


def check_dense(model, plan) -> None:
    """After a dequantizing load: each quantized linear's dense weight is quantkit's dequantized weight."""
    for name, layer in plan.linears.items():
        w = model.get_submodule(name).weight
        if not torch.equal(w, layer.weight.dequantized(w.dtype).to(w.device)):
            raise QuantkitError(f"transformers dequantized {name}.weight of the export differently from quantkit; "
                                "nothing was written, please report it")


def stored_on_modules(plan, with_kv: bool) -> list:
    """``(module, {attr: tensor})`` the compressed load path must hold, bit for bit."""
    out = [(name, layer_tensors(layer)) for name, layer in plan.linears.items()]
    return out + ([(name, kv.stored()) for name, kv in plan.kv.items()] if with_kv else [])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (float8 compared as bytes)."""
    return _same(a, b)


# --- comparing outputs ----------------------------------------------------------------------

def _main_tensor(out) -> torch.Tensor:
    keys = list(out.keys()) if hasattr(out, "keys") else []
    for k in ("logits", "last_hidden_state"):
        if k in keys and isinstance(out[k], torch.Tensor):
            return out[k]
    values = [out[k] for k in keys] if keys else (list(out) if isinstance(out, (tuple, list)) else [out])
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    raise QuantkitError(f"the model returned no float tensor ({type(out).__name__}) to compare")


def _rows(out, batch) -> torch.Tensor:
    """Rows compared by cosine, as quantkit's reports compare: one per real token for logits,
    a mean-pooled sentence embedding for other [batch, tokens, ...] outputs with an attention
    mask, else one per sample."""
    t = _main_tensor(out)
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if mask is not None and t.dim() >= 3 and tuple(mask.shape) == tuple(t.shape[:2]):
        real = mask.bool()
        keys = list(out.keys()) if hasattr(out, "keys") else []
        if "logits" in keys:
            return t[real].reshape(int(real.sum()), -1).double()
        m = real.unsqueeze(-1).to(torch.float64)
        return (t.double().reshape(*t.shape[:2], -1) * m).sum(1) / m.sum(1).clamp(min=1)
    return t.reshape(t.shape[0], -1).double()


def compare(reference, candidate, batches: list) -> dict:
    """Cosines of ``reference``'s and ``candidate``'s outputs, row by row (:func:`_rows`)."""
    cos = []
    with torch.no_grad():
        for batch in batches:
            ref = _rows(call_model(reference, batch), batch)
            got = _rows(call_model(candidate, batch), batch)
            if ref.shape != got.shape:
                raise QuantkitError(f"transformers' model of the export returns shape {tuple(got.shape)} where "
                                    f"quantkit's returns {tuple(ref.shape)}")
            cos.append(torch.nn.functional.cosine_similarity(ref, got, dim=-1))
    c = torch.cat(cos)
    if not bool(torch.isfinite(c).all()):
        raise QuantkitError("transformers' model of the export produced NaN or inf where quantkit's model did not")
    return {"rows": int(c.numel()), "min_cosine": float(c.min()), "mean_cosine": float(c.mean())}


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """SQNR of ``got`` against ``ref`` in dB, float64 (inf when equal)."""
    noise = float((ref.double() - got.double()).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(max(float(ref.double().pow(2).sum()), 1e-300) / noise)
