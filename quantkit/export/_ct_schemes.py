"""compressed-tensors schemes beyond W8A8 int8: FP8 (``float-quantized``), group-wise int4/int8
weight-only (``pack-quantized``) and KV-cache scales (``kv_cache_scheme``).

Each class reads one quantized tensor of quantkit's converted graph and says how the format
stores it: its ``QuantizationArgs`` (:meth:`args`), the tensors of its module in the checkpoint
(:meth:`stored`), and what the format cannot express (:meth:`problem`). The stored values are
quantkit's own, never re-quantized:

- FP8: the float8_e4m3fn weight and its float32 scale (``[N, 1]`` per channel, ``[1]`` per
  tensor) as convert folded them; a static input's scale as ``input_scale``.
- Group-wise: compressed-tensors keeps b-bit integers signed, in ``[-2^(b-1), 2^(b-1) - 1]``,
  and packs them densely into int32 (``pack_to_int32``: each value offset by ``2^(b-1)``, 32 / b
  per word along the input features); an asymmetric scheme stores its zero points packed the
  same way along the output channels (``packed_dim=0``). quantkit's unsigned int4 (``[0, 15]``,
  zero point in ``[0, 15]``) becomes that grid by subtracting 8 from both, which leaves
  ``q - zero_point``, and so the dequantized weight, unchanged.
- KV cache: per-tensor (or per-KV-head) static scales of the key and value inputs of each
  attention, stored as ``<attention>.k_scale`` / ``v_scale``.

What each dequantize op of the converted graph holds is said by the reader registered for that op
(:func:`register_reader`): FP8, group-wise and NF4 register theirs here, W8A8 int8 in ``_ct_plan``. A
scheme that converts to a new dequantize op adds its reader from its own file.

compressed-tensors is imported only inside functions (it is an optional extra).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from .._graph import FLOAT8_DEQUANTIZE_OPS, get_attr  # _graph's import of _qdq registers quantkit::dequantize_nf4
from .._qmath import FLOAT8_DTYPES, dequantize_float8, float8_max, quantize_float8

__all__ = ["quant_args", "Float8Weight", "GroupWeight", "Float8Act", "KVCache", "read_float8_weight",
           "read_float8_act", "read_group_weight", "group_weights_strategy", "pair_problem", "quantization_config", "layer_tensors",
           "HINT_NF4", "HINT_SCHEMES", "kv_attention", "is_float8", "FORMAT_INT", "FORMAT_FLOAT", "FORMAT_PACK",
           "register_reader", "reader_for", "WEIGHT", "ACT", "UNKNOWN"]

_AO = torch.ops.torchao
_QD = torch.ops.quantized_decomposed
aten = torch.ops.aten

FORMAT_INT, FORMAT_FLOAT, FORMAT_PACK = "int-quantized", "float-quantized", "pack-quantized"
HINT_SCHEMES = "quantkit's compressed-tensors export writes W8A8 int8, FP8 (E4M3) and int4/int8 weight-only schemes"
HINT_NF4 = "compressed-tensors has no NF4 scheme (its 4-bit weight formats are int4, NVFP4 and MXFP4): quantize " \
           "with --scheme w4a16 (WeightOnlyQuantizer(bits=4, scheme='int4'))"
_HINT_E4M3 = "compressed-tensors' 8-bit float is E4M3: use float8_e4m3fn (FP8Quantizer's default)"


# --- readers: what one dequantize op of the converted graph holds --------------------------
# A reader is ``fn(gm, dequantize node) -> (role, value)``: (WEIGHT, a weight), (ACT, an input's
# quantization) or (UNKNOWN, what the format cannot store: a message, or (message, hint)).
WEIGHT, ACT, UNKNOWN = "weight", "act", "unknown"
Reader = Callable[[GraphModule, Node], tuple[str, object]]
_READERS: dict[object, Reader] = {}


def register_reader(*ops) -> Callable[[Reader], Reader]:
    """Register the decorated function as the reader of the dequantize ``ops`` (OpOverloads)."""
    def decorator(fn: Reader) -> Reader:
        for op in ops:
            if _READERS.get(op, fn) is not fn:
                raise ValueError(f"a compressed-tensors reader for {op} is already registered "
                                 f"({_READERS[op].__module__}.{_READERS[op].__qualname__})")
            _READERS[op] = fn
        return fn

    return decorator


def reader_for(op) -> Reader | None:
    """The reader registered for the dequantize op ``op``, or None."""
    return _READERS.get(op)


def quant_args(*, num_bits: int, type: str, symmetric: bool, strategy: str, dynamic: bool = False,
               group_size: int | None = None) -> dict:
    """One compressed-tensors ``QuantizationArgs``, as a JSON-ready dict."""
    return {"num_bits": num_bits, "type": type, "symmetric": symmetric, "strategy": strategy, "dynamic": dynamic,
            "group_size": group_size, "block_structure": None, "actorder": None, "observer": None}


def _const(gm: torch.nn.Module, arg):
    return get_attr(gm, arg.target) if isinstance(arg, Node) and arg.op == "get_attr" else None


def _arg(node: Node, index: int, name: str, default=None):
    """An op argument by position or keyword; a graph loaded from ``model.pt2`` drops defaults."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- FP8 ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Float8Weight:
    """An FP8 weight as convert folded it: ``q`` [out, in] float8, ``scale`` ``[out, 1]`` or ``[1]``."""

    q: torch.Tensor
    scale: torch.Tensor
    format = FORMAT_FLOAT

    @property
    def strategy(self) -> str | None:
        if self.scale.numel() == 1 and self.scale.dim() <= 1:
            return "tensor"
        return "channel" if tuple(self.scale.shape) == (self.q.shape[0], 1) else None

    def problem(self) -> tuple[str, str] | None:
        if self.q.dtype != torch.float8_e4m3fn:
            return f"{_name(self.q.dtype)} weights", _HINT_E4M3
        if self.q.dim() != 2 or self.strategy is None:
            return f"float8 weights with scales shaped {tuple(self.scale.shape)}", \
                "the format takes per-tensor or per-output-channel FP8 weight scales: quantize with " \
                "weight_granularity='per-channel' or 'per-tensor'"
        return None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_float8(self.q, self.scale, dtype)

    def args(self) -> dict:
        return quant_args(num_bits=8, type="float", symmetric=True, strategy=self.strategy)

    def stored(self) -> dict[str, torch.Tensor]:
        scale = self.scale.detach().to(torch.float32)
        return {"weight": self.q.contiguous(),
                "weight_scale": (scale.reshape(1) if self.strategy == "tensor" else scale.reshape(-1, 1)).contiguous()}


@dataclass(frozen=True)
class Float8Act:
    """How a linear's input is quantized to FP8: ``"static"`` (``scale`` [1]), ``"dynamic-token"``
    or ``"dynamic-tensor"`` (scales floored at ``floor``, chosen at run time)."""

    kind: str
    dtype: torch.dtype
    scale: torch.Tensor | None = None
    floor: float | None = None

    def problem(self) -> tuple[str, str] | None:
        if self.dtype != torch.float8_e4m3fn:
            return f"{_name(self.dtype)} activations", _HINT_E4M3
        if self.kind == "static" and (self.scale is None or self.scale.numel() != 1):
            return "static FP8 activations with more than one scale", \
                "the format takes one static input scale per layer: quantize activations per tensor"
        return None

    @property
    def symmetric(self) -> bool:
        return True

    def args(self) -> dict:
        strategy = "token" if self.kind == "dynamic-token" else "tensor"
        return quant_args(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=self.kind != "static")

    def stored(self) -> dict[str, torch.Tensor]:
        if self.kind != "static":
            return {}
        return {"input_scale": self.scale.detach().to(torch.float32).reshape(1).contiguous()}

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """quantkit's FP8 quantize-dequantize of ``x``, with the graph's torchao ops."""
        if self.kind == "static":
            scale = self.scale.to(x.device)
        elif self.kind == "dynamic-token":
            block = [1] * (x.dim() - 1) + [int(x.shape[-1])]
            scale = _AO.choose_scale_float8.default(x, block, self.dtype, torch.float32, self.floor, None)
        else:
            scale = torch.clamp_min(x.abs().amax(), self.floor) / float8_max(self.dtype)
        return dequantize_float8(quantize_float8(x, scale, self.dtype), scale, x.dtype)

    def same(self, other) -> bool:
        return isinstance(other, Float8Act) and (self.kind, self.dtype, self.floor) == \
            (other.kind, other.dtype, other.floor) and \
            (self.scale is None) == (other.scale is None) and (self.scale is None or torch.equal(self.scale, other.scale))


def read_float8_weight(gm: GraphModule, dq: Node) -> Float8Weight | None:
    """The weight a float8 ``dequantize`` of a folded constant reads, else None."""
    q, scale = _const(gm, dq.args[0]), _const(gm, dq.args[1])
    if q is None or scale is None:
        return None
    return Float8Weight(q, scale.detach().float())


def read_float8_act(gm: GraphModule, dq: Node) -> Float8Act | None:
    """How the float8 quantize feeding ``dq`` chooses its scale: a constant (static), torchao's
    ``choose_scale_float8`` per row (dynamic per token) or ``amax / max`` (dynamic per tensor)."""
    q = dq.args[0]
    if not isinstance(q, Node) or q.target != _AO.quantize_affine_float8_non_decomposed.default:
        return None
    dtype, s = _arg(q, 2, "float8_dtype", torch.float8_e4m3fn), q.args[1]
    scale = _const(gm, s)
    if scale is not None:
        return Float8Act("static", dtype, scale.detach().float())
    if isinstance(s, Node) and s.target == _AO.choose_scale_float8.default:
        block = list(s.args[1])
        if all(b == 1 for b in block[:-1]):
            floor = _arg(s, 4, "hp_value_lb")
            return Float8Act("dynamic-token", dtype, floor=None if floor is None else float(floor))
        return None
    if isinstance(s, Node) and s.target == aten.div.Tensor and isinstance(s.args[0], Node) \
            and s.args[0].target == aten.clamp_min.default:
        return Float8Act("dynamic-tensor", dtype, floor=float(s.args[0].args[1]))
    return None


@register_reader(*FLOAT8_DEQUANTIZE_OPS)
def _read_float8(gm: GraphModule, dq: Node) -> tuple[str, object]:
    w = read_float8_weight(gm, dq)
    if w is not None:
        return WEIGHT, w
    a = read_float8_act(gm, dq)
    if a is not None:
        return ACT, a
    return UNKNOWN, "an FP8 dequantize of a computed value"


# --- group-wise int4 / int8 weight-only ---------------------------------------------------

@dataclass(frozen=True)
class GroupWeight:
    """A group-wise integer weight as quantkit holds it: ``q`` [out, in] (unpacked, int8 or
    uint8), ``scale`` and ``zero_point`` ``[out, in // group_size]``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    quant_min: int
    quant_max: int
    dtype: torch.dtype
    group_size: int
    # one group per row written as the "channel" strategy; set for the whole model
    # (group_weights_strategy), since transformers' dequantizing loader applies one scheme to all
    per_channel: bool = False
    format = FORMAT_PACK

    @property
    def bits(self) -> int:
        return (self.quant_max - self.quant_min + 1).bit_length() - 1

    @property
    def shift(self) -> int:
        """What to subtract to put quantkit's integers on the format's signed grid."""
        return 1 << (self.bits - 1) if self.quant_min == 0 else 0

    def signed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, zero_point)`` on compressed-tensors' signed grid, int8."""
        q = (self.q.to(torch.int16) - self.shift).to(torch.int8)
        zp = (self.zero_point.to(torch.int32) - self.shift)
        lo = -(1 << (self.bits - 1))
        return q, zp.clamp(lo, -lo - 1).to(torch.int8)

    @property
    def symmetric(self) -> bool:
        return bool(((self.zero_point.to(torch.int32) - self.shift) == 0).all())

    @property
    def strategy(self) -> str:
        return "channel" if self.per_channel else "group"

    def problem(self) -> tuple[str, str] | None:
        full = self.quant_max - self.quant_min + 1
        if full not in (16, 256) or self.quant_min not in (0, -(full // 2)):
            return (f"{_name(self.dtype)} weights in [{self.quant_min}, {self.quant_max}]",
                    "the format packs full-range int4 or int8 weights: use WeightOnlyQuantizer's default ranges")
        zp = self.zero_point.to(torch.int32) - self.shift
        half = full // 2
        if bool((zp < -half).any() or (zp >= half).any()):
            return (f"{self.bits}-bit zero points outside [{-half}, {half - 1}] once signed",
                    "the format stores zero points on the weights' own grid: quantize with symmetric=True")
        if self.q.dim() != 2 or self.q.shape[1] % self.group_size:
            return f"group-wise weights of shape {tuple(self.q.shape)}", "the format groups 2-d Linear weights"
        return None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight quantkit's model computes with (torch's ``dequantize_per_channel_group``)."""
        return _QD.dequantize_per_channel_group.default(self.q, self.scale, self.zero_point, self.quant_min,
                                                        self.quant_max, self.dtype, self.group_size, dtype)

    def args(self) -> dict:
        return quant_args(num_bits=self.bits, type="int", symmetric=self.symmetric, strategy=self.strategy,
                          group_size=self.group_size if self.strategy == "group" else None)

    def stored(self) -> dict[str, torch.Tensor]:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        q, zp = self.signed()
        out = {"weight_packed": pack_to_int32(q, self.bits).contiguous(),
               "weight_shape": torch.tensor(list(self.q.shape), dtype=torch.int64),
               "weight_scale": self.scale.detach().to(torch.float32).reshape(self.q.shape[0], -1).contiguous()}
        if not self.symmetric:
            out["weight_zero_point"] = pack_to_int32(zp.reshape(self.q.shape[0], -1), self.bits,
                                                     packed_dim=0).contiguous()
        return out


def group_weights_strategy(weights: dict) -> dict:
    """``weights`` (name -> weight) with group-wise ones written per channel when every one of them
    has one group per row (``group_size=None``), else all as groups (a group size that equals
    some layer's input features stays a group there: one scheme for the model)."""
    groups = {k: w for k, w in weights.items() if isinstance(w, GroupWeight)}
    per_channel = bool(groups) and all(w.group_size == w.q.shape[1] for w in groups.values())
    return {k: dataclasses.replace(w, per_channel=per_channel) for k, w in groups.items()}


def read_group_weight(gm: GraphModule, dq: Node) -> GroupWeight | None:
    """The weight a ``dequantize_per_channel_group`` of a folded constant reads (int8 as it is,
    int4 through ``quantkit::unpack_int4``), else None."""
    src = dq.args[0]
    q = _const(gm, src)
    if q is None and isinstance(src, Node) and src.target == torch.ops.quantkit.unpack_int4.default:
        packed = _const(gm, src.args[0])
        q = None if packed is None else torch.ops.quantkit.unpack_int4.default(packed, bool(src.args[1]))
    scale, zp = _const(gm, dq.args[1]), _const(gm, dq.args[2])
    if q is None or scale is None or zp is None:
        return None
    qmin, qmax, dtype, g = dq.args[3:7]
    return GroupWeight(q, scale.detach().float(), zp.detach(), int(qmin), int(qmax), dtype, int(g))


@register_reader(_QD.dequantize_per_channel_group.default)
def _read_group(gm: GraphModule, dq: Node) -> tuple[str, object]:
    w = read_group_weight(gm, dq)
    return (WEIGHT, w) if w is not None else (UNKNOWN, "group-wise quantization of a computed value")


@register_reader(torch.ops.quantkit.dequantize_nf4.default)
def _read_nf4(gm: GraphModule, dq: Node) -> tuple[str, object]:
    return UNKNOWN, ("NF4 weights", HINT_NF4)


# --- pairs, KV cache, config --------------------------------------------------------------

def pair_problem(weight, act) -> tuple[str, str] | None:
    """What the format cannot express about a linear's weight and input quantization together."""
    if isinstance(weight, GroupWeight):
        if act is not None:
            return "group-wise weights with quantized activations", "the format's group-wise schemes are " \
                   "weight-only (W4A16, W8A16): keep activations float"
        return weight.problem()
    if isinstance(weight, Float8Weight) != isinstance(act, Float8Act):
        return "FP8 mixed with int8 in one layer", HINT_SCHEMES
    return None


@dataclass(frozen=True)
class KVCache:
    """The static key and value quantization of one attention module (``sdpa``'s K and V inputs)."""

    module: str
    key: object  # Float8Act or the int8 ActQuant, static
    value: object
    nodes: tuple[str, ...] = ()  # the K and V dequantize nodes

    def _scale(self, act) -> torch.Tensor:
        s = act.scale if isinstance(act, Float8Act) else torch.tensor([act.scale], dtype=torch.float32)
        return s.detach().to(torch.float32).reshape(1).contiguous()

    def stored(self) -> dict[str, torch.Tensor]:
        return {"k_scale": self._scale(self.key), "v_scale": self._scale(self.value)}

    def args(self) -> dict:
        if isinstance(self.key, Float8Act):
            return quant_args(num_bits=8, type="float", symmetric=True, strategy="tensor")
        return quant_args(num_bits=8, type="int", symmetric=True, strategy="tensor")

    def problem(self) -> tuple[str, str] | None:
        for act in (self.key, self.value):
            if isinstance(act, Float8Act) and act.scale is not None and act.scale.numel() != 1:
                return "per-head KV-cache scales", "quantkit writes per-tensor KV-cache scales: quantize the " \
                                                   "KV cache per tensor"
            if act.kind != "static":
                return "a dynamic KV-cache quantization", "the format stores static KV-cache scales"
            if isinstance(act, Float8Act):
                p = act.problem()
                if p is not None:
                    return (f"a {p[0].replace(' activations', '')} KV cache", p[1])
            elif act.dtype != torch.int8 or (act.quant_min, act.quant_max) != (-128, 127) or act.zero_point != 0:
                return (f"a KV cache in {_name(act.dtype)} [{act.quant_min}, {act.quant_max}]",
                        "the format's int8 KV cache is symmetric int8 in [-128, 127]: use an fp8_e4m3 KV cache")
        return None


def quantization_config(linears: dict, float_linears: list[str], kv: dict, version: str,
                        by_name: tuple[str, ...] = ()) -> dict:
    """compressed-tensors' ``quantization_config``: one group per distinct scheme. A single
    scheme targets ``Linear`` with the float linears in ``ignore`` (llm-compressor's layout)
    plus the modules of ``by_name`` (an ``lm_head``: vLLM's ParallelLMHead is no Linear, so it
    is quantized only when named); several name their modules. ``format`` is the groups' one
    format, else ``mixed-precision``."""
    groups: dict[str, tuple[dict, dict | None, str, list[str]]] = {}
    for name, layer in linears.items():
        w = layer.weight.args()
        a = layer.act.args() if layer.act is not None else None
        key = json.dumps([w, a, layer.weight.format], sort_keys=True)
        groups.setdefault(key, (w, a, layer.weight.format, []))[3].append(name)
    config_groups = {}
    for i, (w, a, fmt, names) in enumerate(sorted(groups.values(), key=lambda g: g[3][0])):
        targets = ["Linear"] + sorted(n for n in by_name if n in names) if len(groups) == 1 else sorted(names)
        config_groups[f"group_{i}"] = {"targets": targets, "weights": w,
                                       "input_activations": a, "output_activations": None, "format": fmt}
    formats = {g[2] for g in groups.values()}
    kv_args = next(iter(kv.values())).args() if kv else None
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": config_groups, "ignore": sorted(float_linears),
            "kv_cache_scheme": kv_args, "global_compression_ratio": None, "version": version}


def layer_tensors(layer) -> dict[str, torch.Tensor]:
    """A stored linear's tensors by local name (``weight``/``weight_packed``, scales, input qparams)."""
    out = dict(layer.weight.stored())
    if layer.act is not None:
        out.update(layer.act.stored())
    return out


def kv_attention(module) -> bool:
    """Whether ``module`` is an attention whose cache the format's consumers scale: it holds
    ``k_proj``/``v_proj`` (or ``qkv_proj``), where llm-compressor writes and vLLM reads
    ``<attention>.k_scale`` / ``v_scale``."""
    return module is not None and "attention" in type(module).__name__.lower() and (
        (hasattr(module, "k_proj") and hasattr(module, "v_proj")) or hasattr(module, "qkv_proj"))


def is_float8(dtype) -> bool:
    return dtype in FLOAT8_DTYPES
