"""FP8 lowering: ``linear(dq8(q8(x)), dq8(w_fp8), bias)`` → ``torch._scaled_mm`` on the float8 operands.

The converted graph (``quantkit.pipeline.emit._float8``) keeps each FP8 linear as torchao's
float8 dequantize of the activation's float8 tensor and of the float8 weight buffer, then an
``aten.linear`` in float32. This pass hands the float8 tensors and their scales to
``aten._scaled_mm`` instead (CPU: its reference implementation in torch 2.13; CUDA: cuBLASLt
FP8 on sm_89+), which accumulates in float32 and applies ``scale_a ⊗ scale_b`` to the product.

``_scaled_mm`` takes a row-major ``[M, K]`` left operand and a column-major ``[K, N]`` right one
(the weight ``[N, K]`` transposed: a view), with either two singleton scales (tensor-wise) or
contiguous ``[M, 1]`` and ``[1, N]`` (row-wise); a per-tensor scale meeting a row-wise one is repeated,
since mixed layouts are refused (measured, torch 2.13 CPU: "Invalid scaling configuration").
On CUDA the row-wise path needs a bf16 output (cuBLASLt), so the product is cast back to float32.

Numerics against the reference q/dq graph (measured, issue 28, all-MiniLM-L6-v2 FP8 static, 32 x 128
tokens, CPU): each ``_scaled_mm`` fed the reference's own inputs agrees with its ``linear`` to ~130 dB
(float32 summation order), yet the hidden states end 33-34 dB apart -- as far as Inductor compiling the
reference math itself (33.8 dB) or the reference against itself with one ulp of float32 noise
(35.4 dB). Every static E4M3 quantize turns a rounding difference at a rounding boundary into a whole
E4M3 step, and those flips grow ~10x per layer; no op here loses precision
(``tests/test_fp8_cpu_sqnr.py``). On CPU ``_scaled_mm`` is torch's emulation (float8 widened, float32
GEMM): it keeps the float8 tensors in the graph, not a speed-up.

With ``kernel="triton"`` the linear becomes ``quantkit::fp8_linear`` (``kernels/_fp8_gemm.py``) instead:
the same float8 operands and scales in their graph shapes (no repeated scales, no transposes), float32
output and bias (no bf16 round trip); on CPU tensors the op runs its torch path.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import quantkit.kernels  # noqa: F401  (registers torch.ops.quantkit.fp8_linear)

from .._graph import FLOAT8_DEQUANTIZE_OPS, FLOAT8_QUANTIZE_OPS, get_attr
from .._graph import example_value as _val
from ._registry import LoweringContext, register_lowering

__all__ = ["lower_fp8", "lower_fp8_pass", "has_fp8_qdq", "FP8_KERNELS"]

aten = torch.ops.aten
_LINEAR = {aten.linear.default}
FP8_KERNELS = ("scaled_mm", "triton")  # what lower_fp8 runs an FP8 linear as


def has_fp8_qdq(gm: GraphModule) -> bool:
    """Whether ``gm`` holds float8 dequantize ops (an FP8 ``quantkit.convert`` result)."""
    return any(n.op == "call_function" and n.target in FLOAT8_DEQUANTIZE_OPS for n in gm.graph.nodes)


def _match(gm: GraphModule, node: Node):
    """``(x_fp8, x_scale, w_fp8 get_attr, w_scale tensor, bias, out_dtype)`` for an FP8 linear, else None."""
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    x_dq, w_dq = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    for dq in (x_dq, w_dq):
        if not (isinstance(dq, Node) and dq.op == "call_function" and dq.target in FLOAT8_DEQUANTIZE_OPS):
            return None
    x_q, x_scale = x_dq.args[0], x_dq.args[1]
    w, w_scale = w_dq.args[0], w_dq.args[1]
    if not (isinstance(x_q, Node) and x_q.op == "call_function" and x_q.target in FLOAT8_QUANTIZE_OPS):
        return None
    if not (isinstance(w, Node) and w.op == "get_attr" and isinstance(w_scale, Node) and w_scale.op == "get_attr"):
        return None
    weight, wscale = get_attr(gm, w.target), get_attr(gm, w_scale.target)
    if weight.dim() != 2 or wscale.numel() not in (1, weight.shape[0]):
        return None
    out_dtype = x_dq.args[2] if len(x_dq.args) > 2 else x_dq.kwargs.get("output_dtype", torch.float32)
    if out_dtype != torch.float32 or w_dq.args[2:3] not in ((), (torch.float32,)):
        return None
    if _val(node) is None:  # the linear's output: its leading sizes are the input's
        return None
    return x_q, x_scale, w, weight, w_scale, wscale, bias


def lower_fp8(gm: GraphModule, device: str = "cpu", kernel: str = "scaled_mm") -> dict[str, int]:
    """Rewrite every FP8 linear of ``gm`` (in place) into ``aten._scaled_mm`` (``kernel="scaled_mm"``)
    or quantkit's Triton ``fp8_linear`` (``kernel="triton"``); return ``{"fp8_linear": count}``. For
    ``_scaled_mm``, weight scales ``[N, 1]`` become ``[1, N]`` buffers and per-token activation scales
    ``[..., 1]`` are reshaped to ``[M, 1]``. Anything else keeps its reference float8 q/dq ops."""
    if kernel not in FP8_KERNELS:
        raise ValueError(f"unknown FP8 kernel {kernel!r}; use one of {list(FP8_KERNELS)}")
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        m = _match(gm, node)
        if m is None:
            continue
        x_q, x_scale, w, weight, w_scale, wscale, bias = m
        if kernel == "triton":
            _emit_triton(graph, node, x_q, x_scale, w, w_scale, bias)
            count += 1
            continue
        n_out, k = weight.shape
        out_val = _val(node)
        # a static activation scale is a [1] buffer; a dynamic one comes from the graph: amax
        # (per tensor, 0-d) or choose_scale_float8 (per token)
        if x_scale.op == "get_attr":
            per_token = get_attr(gm, x_scale.target).numel() != 1
        else:
            per_token = x_scale.target not in (aten.div.Tensor,)
        per_channel = wscale.numel() != 1
        with graph.inserting_before(node):
            a = graph.call_function(aten.reshape.default, (x_q, [-1, k]))
            b = graph.call_function(aten.t.default, (w,))  # [K, N] column-major view
            rows = graph.call_function(aten.sym_size.int, (a, 0))
            if per_token:
                sa = graph.call_function(aten.reshape.default, (x_scale, [-1, 1]))
            else:
                sa = graph.call_function(aten.reshape.default, (x_scale, [1, 1]) if per_channel else (x_scale, []))
                if per_channel:
                    sa = graph.call_function(aten.repeat.default, (sa, [rows, 1]))  # contiguous [M, 1]
            name = str(w_scale.target).replace(".", "_") + "_row"  # a loaded program nests its constants
            if not hasattr(gm, name):
                gm.register_buffer(name, wscale.reshape(1, -1).contiguous() if per_channel else wscale.reshape(()))
            sb = graph.get_attr(name)
            if per_token and not per_channel:
                sb = graph.call_function(aten.repeat.default, (
                    graph.call_function(aten.reshape.default, (sb, [1, 1])), [1, n_out]))
            out_dtype = torch.bfloat16 if device == "cuda" and (per_token or per_channel) else torch.float32
            mm_bias = bias if out_dtype == torch.float32 else None
            mm = graph.call_function(aten._scaled_mm.default, (a, b, sa, sb),
                                     {"bias": mm_bias, "out_dtype": out_dtype})
            out = mm
            if out_dtype != torch.float32:
                out = graph.call_function(aten._to_copy.default, (mm,), {"dtype": torch.float32})
                if bias is not None:
                    out = graph.call_function(aten.add.Tensor, (out, bias))
            lead = [graph.call_function(aten.sym_size.int, (x_q, i)) if not isinstance(out_val.shape[i], int)
                    else int(out_val.shape[i]) for i in range(out_val.dim() - 1)]
            out = graph.call_function(aten.reshape.default, (out, lead + [n_out]))
        out.meta.update({k_: v for k_, v in node.meta.items() if k_ != "val"})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    # every float8 quantize becomes aten ops (bit-identical), also those feeding no lowered linear
    # (attention matmuls): see _decompose_quantize for why Inductor must not see torchao's op
    for n in [n for n in graph.nodes if n.op == "call_function" and n.target in FLOAT8_QUANTIZE_OPS]:
        _decompose_quantize(graph, n)
    for n in [n for n in graph.nodes if n.op == "call_function" and n.target in FLOAT8_DEQUANTIZE_OPS]:
        _decompose_dequantize(graph, n)
    graph.eliminate_dead_code()
    _drop_unused_attrs(gm)
    graph.lint()
    gm.recompile()
    return {"fp8_linear": count}


@register_lowering("fp8", order=300)
def lower_fp8_pass(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The registered FP8 pass: on CUDA with ``ctx.fp8_kernel``, on CPU (``_scaled_mm``) unless
    ``cpu_kernels="reference"``; records only the counts it rewrote."""
    if ctx.device == "cuda":
        counts = lower_fp8(gm, "cuda", ctx.fp8_kernel)
    elif ctx.cpu_kernels != "reference":
        counts = lower_fp8(gm, "cpu")
    else:
        return {}
    return {k: v for k, v in counts.items() if v}


def _emit_triton(graph, node: Node, x_q: Node, x_scale: Node, w: Node, w_scale: Node, bias) -> None:
    """Replace the linear ``node`` by ``quantkit::fp8_linear`` on its float8 operands and scales."""
    with graph.inserting_before(node):
        out = graph.call_function(torch.ops.quantkit.fp8_linear.default,
                                  (x_q, w, x_scale, w_scale, bias, torch.float32))
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _decompose_quantize(graph, x_q: Node) -> Node:
    """The float8 quantize ``x_q`` as aten ops (float32 ``x / scale``, clamp to the format's
    range, cast: torchao's ``_quantize_affine_float8`` step for step, so bit-identical).

    Inductor must not see torchao's op with a per-token scale: once torchao's x86 Inductor
    passes are imported (``X86InductorQuantizer`` does it), its lowering of that op asserts
    "Only support per-tensor quantization for float8 now" (torchao 0.18)."""
    x, scale = x_q.args[0], x_q.args[1]
    dtype = x_q.args[2] if len(x_q.args) > 2 else x_q.kwargs.get("float8_dtype", torch.float8_e4m3fn)
    big = torch.finfo(dtype).max
    with graph.inserting_after(x_q):
        f32 = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
        with graph.inserting_after(f32):
            div = graph.call_function(aten.div.Tensor, (f32, scale))
            with graph.inserting_after(div):
                clamp = graph.call_function(aten.clamp.default, (div, -big, big))
                with graph.inserting_after(clamp):
                    out = graph.call_function(aten._to_copy.default, (clamp,), {"dtype": dtype})
    out.meta.update(x_q.meta)
    x_q.replace_all_uses_with(out)
    graph.erase_node(x_q)
    return out


def _decompose_dequantize(graph, dq: Node) -> None:
    """The float8 dequantize ``dq`` as aten ops (float32 ``x * scale``, cast to the output dtype:
    torchao's ``_dequantize_affine_float8`` for scales that broadcast, as every quantkit FP8 scale
    does), for the reason given in :func:`_decompose_quantize`."""
    x, scale = dq.args[0], dq.args[1]
    dtype = dq.args[2] if len(dq.args) > 2 else dq.kwargs.get("output_dtype", torch.float32)
    with graph.inserting_after(dq):
        f32 = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
        with graph.inserting_after(f32):
            mul = graph.call_function(aten.mul.Tensor, (f32, scale))
            out = mul
            if dtype != torch.float32:
                with graph.inserting_after(mul):
                    out = graph.call_function(aten._to_copy.default, (mul,), {"dtype": dtype})
    out.meta.update(dq.meta)
    dq.replace_all_uses_with(out)
    graph.erase_node(dq)


def _drop_unused_attrs(gm: GraphModule) -> None:
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [n for n, _ in gm.named_buffers(recurse=False)]:
        if name not in used and name.startswith("_qk_scale_"):
            delattr(gm, name)
