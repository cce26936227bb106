"""Lowering of weight-only layers: ``linear(x, dequantize_per_channel_group(q_w))`` to weight-only GEMMs.

A group size that does not divide K (``quantkit::dequantize_group``: a last group of the remainder,
576 = 4 x 128 + 64) lowers too: quantkit's CPU kernel and the Triton kernel take ``[N, ceil(K / g)]``
qparams as they are; aten's kernel gets them repeated onto the largest of its group sizes dividing both.

CPU:

* int4, ``N % 16 == 0``, group size a multiple of 8, on an AVX512-VNNI CPU → quantkit's own
  ``quantkit::int4_linear_cpu`` (``kernels/_int4_cpu.py``): 2-2.5x aten's kernel at 1-16 tokens,
  activations kept at ~15 bits instead of bf16's 8, float32 in and out (no casts around it).
* int4 elsewhere (or ``int4_kernel="aten"``), group size 32/64/128/256, ``N % 16 == 0`` →
  ``aten._weight_int4pack_mm_for_cpu`` on a weight
  repacked by ``aten._convert_weight_to_int4pack_for_cpu``. Its dequantization is
  ``(q_u4 - 8) * scale + zero`` with a float ``zero`` per group; ours is ``(q - zero_point) * scale``,
  so ``zero = (8 - zero_point_u4) * scale`` (``q_u4``: the value shifted to [0, 15]).
* int8, one group per output row (per channel), symmetric → ``aten._weight_int8pack_mm``.

Both aten kernels run bf16 activations (measured on this machine's AVX-512 CPU: their fp32-activation
paths are 10-100x slower than bf16, see BENCHMARKS.md), so a float32 model's activations are cast
to bf16 at the GEMM and its output cast back: W4A16 numerics, ~50 dB against the float32 q/dq
reference. Anything else (NF4, other group sizes or shapes, asymmetric int8) keeps its reference
dequantize.

CUDA: int4 and int8-in-[-8, 7] weights of any group size → ``quantkit.w4a16_linear``
(Triton, ``kernels/_w4a16.py``), weights stay packed.

Which CPU int4 kernel ran, on how many layers and why is recorded in ``gm.meta["quantkit_kernels"]``
(:func:`kernel_choices`): a fallback to aten's kernel is never silent. When quantkit's kernel could
run on this CPU but was refused (its cache folder or library failed the ownership, permission or
digest checks of ``kernels/_kernel_cache.py``) or failed to build, the lowering also warns.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from quantkit.kernels import _int4_cpu  # importing quantkit.kernels registers quantkit::w4a16_linear, int4_linear_cpu

from .._graph import get_attr
from .._qmath import expand_group_params, pack_int4
from ._registry import LoweringContext, register_lowering
from ._triton import _buffer as _new_attr  # a uniquely named buffer and its get_attr before a node

__all__ = ["lower_weight_only", "lower_weight_only_pass", "WeightOnlyMatch", "match_weight_only", "has_quant_ops", "INT4_KERNELS",
           "KERNELS_META_KEY", "kernel_choices"]

aten = torch.ops.aten
_CPU_GROUPS = (32, 64, 128, 256)  # aten._weight_int4pack_mm_for_cpu accepts these group sizes only
_COMPUTE_DTYPE = torch.bfloat16
INT4_KERNELS = ("auto", "quantkit", "aten")  # CPU int4: ours where the CPU allows it, or aten's
KERNELS_META_KEY = "quantkit_kernels"  # gm.meta: [{"op", "kernel", "layers", "reason"}] per kernel chosen
_ATEN_INT4 = "aten._weight_int4pack_mm_for_cpu"
# whole groups (torch's op) and a last group of the remainder (quantkit's, the same arguments)
_GROUP_DEQUANTIZE = (torch.ops.quantized_decomposed.dequantize_per_channel_group.default,
                     torch.ops.quantkit.dequantize_group.default)


@dataclass
class WeightOnlyMatch:
    """``linear(x, dequantize_per_channel_group(q, scale, zero_point, ...), bias)``."""

    linear: Node
    x: Node
    bias: Optional[Node]
    q: torch.Tensor          # [N, K] integers (unpacked), int8 or uint8
    packed: Optional[torch.Tensor]  # the stored packed int4 weight, when it is one
    signed: bool
    scale: torch.Tensor      # [N, ceil(K / g)] float32 (a last group of the remainder when g does not divide K)
    zero_point: torch.Tensor  # [N, ceil(K / g)]
    quant_min: int
    quant_max: int
    group_size: int


def match_weight_only(gm: GraphModule, node: Node) -> Optional[WeightOnlyMatch]:
    """The weight-only pattern ``convert`` emits around ``node`` (an ``aten.linear``), or None."""
    if node.op != "call_function" or node.target != aten.linear.default or len(node.args) < 2:
        return None
    dq = node.args[1]
    if not (isinstance(dq, Node) and dq.target in _GROUP_DEQUANTIZE and len(dq.users) == 1):
        return None
    src, scale, zp, qmin, qmax, _dtype, group = dq.args[:7]
    if not all(isinstance(a, Node) and a.op == "get_attr" for a in (scale, zp)):
        return None
    packed, signed = None, None
    if isinstance(src, Node) and src.target == torch.ops.quantkit.unpack_int4.default and src.args[0].op == "get_attr":
        packed, signed = get_attr(gm, src.args[0].target), bool(src.args[1])
        q = torch.ops.quantkit.unpack_int4(packed, signed)
    elif isinstance(src, Node) and src.op == "get_attr":
        q = get_attr(gm, src.target)
        signed = q.dtype == torch.int8
    else:
        return None
    x = node.args[0]
    if not (isinstance(x, Node) and isinstance(x.meta.get("val"), torch.Tensor)):
        return None
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return WeightOnlyMatch(node, x, bias, q, packed, signed, get_attr(gm, scale.target).float(),
                           get_attr(gm, zp.target), int(qmin), int(qmax), int(group))


def _leading_sizes(graph, x: Node) -> list:
    """``x.shape[:-1]`` as graph values: ints where static, ``sym_size`` nodes where not."""
    val = x.meta.get("val")
    sizes = []
    for i, s in enumerate(val.shape[:-1]):
        sizes.append(int(s) if isinstance(s, int) else graph.call_function(aten.sym_size.int, (x, i)))
    return sizes


def _emit_gemm(gm: GraphModule, m: WeightOnlyMatch, op, args: tuple, n: int) -> Node:
    """``reshape(op(x_2d.to(bf16), *args).to(x.dtype), [*x.shape[:-1], N]) + bias``."""
    graph = gm.graph
    out_dtype = m.x.meta["val"].dtype
    with graph.inserting_before(m.linear):
        x2 = graph.call_function(aten.reshape.default, (m.x, [-1, int(m.q.shape[1])]))
        if out_dtype != _COMPUTE_DTYPE:
            x2 = graph.call_function(aten._to_copy.default, (x2,), {"dtype": _COMPUTE_DTYPE})
        y = graph.call_function(op, (x2,) + args)
        if out_dtype != _COMPUTE_DTYPE:
            y = graph.call_function(aten._to_copy.default, (y,), {"dtype": out_dtype})
        y = graph.call_function(aten.reshape.default, (y, _leading_sizes(graph, m.x) + [n]))
        if m.bias is not None:
            y = graph.call_function(aten.add.Tensor, (y, m.bias))
    return y


def _lower_cpu_quantkit(gm: GraphModule, m: WeightOnlyMatch) -> Optional[Node]:
    """``quantkit::int4_linear_cpu`` on the weight repacked for it, float32/bf16 activations as they are."""
    n, k = m.q.shape
    # k % 8 with group_size % 8: a remainder group is a whole number of the kernel's octets
    if n % _int4_cpu.BLOCK_N or m.group_size % 8 or k % 8 or m.x.meta["val"].dtype not in (torch.float32,
                                                                                  torch.bfloat16):
        return None
    packed, scale_zero = _int4_cpu.pack_int4_cpu(m.q, m.scale, m.zero_point, m.group_size, m.signed)
    graph = gm.graph
    with graph.inserting_before(m.linear):
        w = _new_attr(gm, "_qk_int4cpu_packed_", packed, m.linear)
        sb = _new_attr(gm, "_qk_int4cpu_scale_zero_", scale_zero, m.linear)
        y = graph.call_function(torch.ops.quantkit.int4_linear_cpu.default, (m.x, w, sb, m.group_size))
        if m.bias is not None:
            y = graph.call_function(aten.add.Tensor, (y, m.bias))
    return y


def _aten_groups(m: WeightOnlyMatch) -> tuple[Optional[int], torch.Tensor, torch.Tensor]:
    """``(group size, scale, zero_point)`` for aten's int4 kernel, which needs whole groups of 32, 64,
    128 or 256: the match's own, or for a remainder group (576 = 4 x 128 + 64) the largest of those
    dividing both the group size and K, each qparam repeated over its sub-groups (exact). None when
    there is none."""
    k = int(m.q.shape[1])
    if k % m.group_size == 0:
        return (m.group_size if m.group_size in _CPU_GROUPS else None), m.scale, m.zero_point
    fine = next((g for g in reversed(_CPU_GROUPS) if m.group_size % g == 0 and k % g == 0), None)
    if fine is None:
        return None, m.scale, m.zero_point
    return (fine, expand_group_params(m.scale, k, m.group_size, fine),
            expand_group_params(m.zero_point, k, m.group_size, fine))


def _lower_cpu(gm: GraphModule, m: WeightOnlyMatch, int4_kernel: str = "auto",
               choose=lambda kernel, reason: None) -> Optional[Node]:
    """The lowered node for ``m`` on CPU, or None; ``choose(kernel, reason)`` hears which int4 kernel
    each int4 layer got and why."""
    n, k = m.q.shape
    four_bit = m.quant_max - m.quant_min == 15
    why_aten = "int4_kernel='aten'"
    if four_bit and int4_kernel != "aten":
        ours = _int4_cpu.status()
        if ours.available:
            new = _lower_cpu_quantkit(gm, m)
            if new is not None:
                choose(_int4_cpu.KERNEL, ours.reason)
                return new
            why_aten = (f"{_int4_cpu.KERNEL} needs N % 16 == 0, K and the group size multiples of 8, and "
                        f"float32/bf16 activations; got N={n}, K={k}, group_size={m.group_size}")
        elif int4_kernel == "quantkit":
            raise ValueError(f"int4_kernel='quantkit' cannot run here: {ours.reason}; use int4_kernel='auto' or "
                             "'aten'")
        else:
            why_aten = f"{_int4_cpu.KERNEL} cannot run here: {ours.reason}"
    if four_bit:
        group, scale, zero_point = _aten_groups(m)
        if group is None or n % 16:
            return None
        choose(_ATEN_INT4, why_aten)
        shift = 8 if m.signed else 0  # to the kernel's unsigned [0, 15]
        q_u4 = m.q.to(torch.int32) + shift
        zp_u4 = zero_point.to(torch.float32) + shift
        packed = aten._convert_weight_to_int4pack_for_cpu(q_u4.contiguous(), 1)
        zero = (8 - zp_u4) * scale
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(_COMPUTE_DTYPE).contiguous()  # [K // g, N, 2]
        w = _new_attr(gm, "_qk_int4pack_", packed, m.linear)
        qsz = _new_attr(gm, "_qk_int4_scale_zero_", sz, m.linear)
        return _emit_gemm(gm, m, aten._weight_int4pack_mm_for_cpu.default, (w, group, qsz), n)
    if m.group_size == k and m.signed and m.quant_min >= -128 and not bool(m.zero_point.any()):
        w = _new_attr(gm, "_qk_int8pack_", m.q.contiguous(), m.linear)
        s = _new_attr(gm, "_qk_int8pack_scale_", m.scale.reshape(n).to(_COMPUTE_DTYPE).contiguous(), m.linear)
        return _emit_gemm(gm, m, aten._weight_int8pack_mm.default, (w, s), n)
    return None


def _lower_cuda(gm: GraphModule, m: WeightOnlyMatch) -> Optional[Node]:
    if m.quant_max - m.quant_min != 15:  # any group size: the Triton kernel indexes groups by k // g
        return None
    packed = m.packed if m.packed is not None else pack_int4(m.q)
    graph = gm.graph
    with graph.inserting_before(m.linear):
        w = _new_attr(gm, "_qk_w4_", packed, m.linear)
        s = _new_attr(gm, "_qk_w4_scale_", m.scale.contiguous(), m.linear)
        z = _new_attr(gm, "_qk_w4_zero_point_", m.zero_point.to(torch.int8).contiguous(), m.linear)
        return graph.call_function(torch.ops.quantkit.w4a16_linear.default,
                                   (m.x, w, s, z, m.group_size, m.signed, m.bias))


def lower_weight_only(gm: GraphModule, device_type: str = "cpu", int4_kernel: str = "auto") -> dict[str, int]:
    """Rewrite the weight-only linears of ``gm`` (a ``quantkit.convert`` result) in place for
    ``device_type`` (``"cpu"`` or ``"cuda"``); return counts by kernel. Unmatched layers keep their
    reference dequantize. ``int4_kernel`` (CPU): ``"auto"`` uses quantkit's int4 kernel where this
    CPU runs it (AVX512-VNNI and a compiler) and aten's elsewhere; ``"quantkit"`` / ``"aten"`` force one."""
    if int4_kernel not in INT4_KERNELS:
        raise ValueError(f"unknown int4_kernel {int4_kernel!r}; use one of {list(INT4_KERNELS)}")
    counts = {"weight_only_int4": 0, "weight_only_int8": 0}
    chosen: dict[tuple[str, str], int] = {}  # (kernel, reason) -> int4 layers lowered to it

    def choose(kernel: str, reason: str) -> None:
        chosen[(kernel, reason)] = chosen.get((kernel, reason), 0) + 1

    for node in list(gm.graph.nodes):
        m = match_weight_only(gm, node)
        if m is None:
            continue
        new = _lower_cuda(gm, m) if device_type == "cuda" else _lower_cpu(gm, m, int4_kernel, choose)
        if new is None:
            continue
        new.meta.update({k: v for k, v in node.meta.items()})
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        counts["weight_only_int4" if m.quant_max - m.quant_min == 15 else "weight_only_int8"] += 1
    if any(counts.values()):
        gm.graph.eliminate_dead_code()
        used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        for name, _ in list(gm.named_buffers()):
            if "." not in name and name not in used and name.startswith(("_frozen_param", "_qk_")):
                delattr(gm, name)  # the packed/unpacked originals the kernels no longer read
        gm.graph.lint()
        gm.recompile()
    if chosen:
        gm.meta[KERNELS_META_KEY] = [{"op": "weight_only_int4", "kernel": kernel, "layers": layers, "reason": reason}
                                     for (kernel, reason), layers in chosen.items()]
        _warn_on_fault(chosen)
    return counts


@register_lowering("weight_only", order=200)
def lower_weight_only_pass(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The registered weight-only pass: int4/int8 weight-only linears on CUDA, and on CPU unless
    ``cpu_kernels="reference"``; records only the counts it rewrote."""
    if ctx.device != "cuda" and ctx.cpu_kernels == "reference":
        return {}
    return {k: v for k, v in lower_weight_only(gm, ctx.device).items() if v}


def _warn_on_fault(chosen: dict) -> None:
    """Warn when quantkit's int4 kernel could run on this CPU but was refused or failed to build."""
    ours = _int4_cpu.status()
    if ours.fault and any(kernel == _ATEN_INT4 for kernel, _ in chosen):
        warnings.warn(f"int4 weight-only layers run aten's kernel instead of {ours.kernel}: {ours.reason}",
                      RuntimeWarning, stacklevel=3)


def kernel_choices(gm) -> list[str]:
    """One line per kernel the weight-only lowering chose for ``gm`` (a lowered GraphModule, or the
    module ``quantkit.compile`` returns), e.g. ``int4 weight-only: 4 layers on
    aten._weight_int4pack_mm_for_cpu (quantkit::int4_linear_cpu cannot run here: ...)``; [] when
    there were no int4 layers to lower."""
    meta = getattr(getattr(gm, "_orig_mod", gm), "meta", {})
    return [f"int4 weight-only: {c['layers']} layer{'s' if c['layers'] != 1 else ''} on {c['kernel']} ({c['reason']})"
            for c in meta.get(KERNELS_META_KEY, [])]


def has_quant_ops(gm: GraphModule) -> bool:
    """Whether ``gm`` still holds quantize/dequantize ops (``quantized_decomposed`` or
    ``quantkit`` namespaces: reference q/dq, NF4 or unlowered group-wise weights) after lowering."""
    return any(n.op == "call_function" and getattr(n.target, "namespace", None) in ("quantized_decomposed", "quantkit")
               and _op_name(n.target) not in _COMPUTE_KERNELS for n in gm.graph.nodes)


# quantkit ops that are lowered compute kernels, not quantize/dequantize steps
_COMPUTE_KERNELS = frozenset({"int4_linear_cpu", "w4a16_linear", "int8_linear", "int8_bmm", "fp8_linear"})


def _op_name(target) -> str:
    return getattr(getattr(target, "_schema", None), "name", "").split("::")[-1]
