"""CPU per-token int8: the float prologue and the per-token quantize of a GEMM input in one kernel.

After ``int8_per_token`` (``_per_token.py``) and the bf16 passes, each per-token GEMM's input is
quantized by a chain of aten ops (``_quantize`` there)::

    x = _to_copy(src, float32); s = amax(|x|).clamp_min(1e-5) / 127
    q = _to_copy(clamp(round(x * (1 / s)), -128, 127) + 128, uint8)

and ``src`` is often a float prologue: the previous per-token GEMM's epilogue (``y * s_row + bias``),
a GELU or ReLU, a SmoothQuant column factor, bf16 round trips. Inductor compiles that into one loop
nest with two passes over each row and recomputes the prologue in both (two ``erf`` per element for
a GELU). This pass replaces such a chain, when it holds an activation or starts at a per-token GEMM's
epilogue, by ``quantkit::per_token_quant_cpu`` (``kernels/_per_token_quant_cpu.py``), which computes
the prologue once per element. The kernel's program repeats the graph's float32 operations in their
order, with a ``bf16`` rounding step wherever the graph's op returns bfloat16; GELU's ``erf`` is the
kernel's polynomial (about 1e-7 from ATen's), so an integer may move by one level where a value lands
that close to a rounding boundary.

Records ``per_token_quant_fused`` (chains replaced). A no-op where the kernel does not build here.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from quantkit.kernels import _per_token_quant_cpu

from .._graph import get_attr, unique_attr_name
from ._bf16 import KEEP_FLOAT32_META_KEY
from ._lower import Target
from ._per_token import INT8_KERNEL_META_KEY
from ._registry import LoweringContext, register_lowering

__all__ = ["fuse_per_token_quantize", "lower_per_token_fuse"]

aten = torch.ops.aten
_ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


def _is(node, target, nargs: int = 0) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target and len(node.args) >= nargs


def _vals(gm: GraphModule) -> Optional[dict]:
    """Every node's (fake) value, propagated afresh: the passes before this one change dtypes without
    updating ``meta["val"]``. None where the placeholders carry no fake values of one fake mode."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    modes = {getattr(v, "fake_mode", None) for v in inputs}
    if len(modes) != 1 or None in modes:
        return None
    saved = {n: n.meta.get("val", _MISSING) for n in gm.graph.nodes}
    try:
        mode = modes.pop()
        with mode:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
        return {n: n.meta.get("val") for n in gm.graph.nodes}
    except Exception:  # noqa: BLE001  (an op without a fake implementation: leave the graph as it is)
        return None
    finally:
        for n, v in saved.items():
            if v is _MISSING:
                n.meta.pop("val", None)
            else:
                n.meta["val"] = v


_MISSING = object()


def _val(vals: dict, node) -> Optional[torch.Tensor]:
    v = vals.get(node) if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dtype(vals: dict, node) -> Optional[torch.dtype]:
    v = _val(vals, node)
    return v.dtype if v is not None else None


def _single(node: Node) -> bool:
    return len(node.users) == 1


def _const(gm: GraphModule, node) -> Optional[torch.Tensor]:
    """The value of a constant: a ``get_attr``, or a dtype copy of one (the bf16 pass writes those)."""
    if _is(node, aten._to_copy.default, 1) and set(node.kwargs) <= {"dtype"} and len(node.args) == 1:
        inner = _const(gm, node.args[0])
        return inner.to(node.kwargs["dtype"]) if inner is not None and "dtype" in node.kwargs else inner
    if isinstance(node, Node) and node.op == "get_attr":
        obj = get_attr(gm, node.target)
        return obj if isinstance(obj, torch.Tensor) else None
    return None


def _quant_chain(q8: Node):
    """The per-token quantize ending at ``q8`` (``_to_copy(..., uint8)``): ``(x, scale)`` or None."""
    if not (_is(q8, aten._to_copy.default, 1) and q8.kwargs.get("dtype") is torch.uint8):
        return None
    add = q8.args[0]
    if not (_is(add, aten.add.Tensor, 2) and add.args[1] == 128 and _single(add)):
        return None
    clamp = add.args[0]
    if not (_is(clamp, aten.clamp.default, 3) and tuple(clamp.args[1:3]) == (-128, 127) and _single(clamp)):
        return None
    rnd = clamp.args[0]
    if not (_is(rnd, aten.round.default, 1) and _single(rnd)):
        return None
    mul = rnd.args[0]
    if not (_is(mul, aten.mul.Tensor, 2) and _single(mul)):
        return None
    x, recip = mul.args
    if not (_is(recip, aten.reciprocal.default, 1) and _single(recip)):
        return None
    scale = recip.args[0]
    if not (_is(scale, aten.div.Tensor, 2) and scale.args[1] == 127):
        return None
    cmin = scale.args[0]
    if not (_is(cmin, aten.clamp_min.default, 2) and cmin.args[1] == 1e-5 and _single(cmin)):
        return None
    amax = cmin.args[0]
    if not (_is(amax, aten.amax.default, 3) and list(amax.args[1]) == [-1] and amax.args[2] and _single(amax)):
        return None
    ab = amax.args[0]
    if not (_is(ab, aten.abs.default, 1) and ab.args[0] is x and _single(ab)):
        return None
    if not (_is(x, aten._to_copy.default, 1) and x.kwargs.get("dtype") is torch.float32 and len(x.users) == 2):
        return None
    return x, scale


def _step(gm: GraphModule, vals: dict, node: Node, have_row: bool, n_cols: int):
    """The kernel's steps for ``node`` (in program order), its float input, and the row scale or
    column vector it reads: ``(steps, src, row, col)``, or None where the kernel cannot run it."""
    if not isinstance(node, Node) or node.op != "call_function" or _dtype(vals, node) not in (torch.float32, torch.bfloat16):
        return None
    out_bf16 = ["bf16"] if _dtype(vals, node) is torch.bfloat16 else []
    src = node.args[0] if node.args else None
    if not isinstance(src, Node) or _dtype(vals, src) not in (torch.float32, torch.bfloat16):
        return None
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"} and len(node.args) == 1:
        return out_bf16, src, None, None  # a widening copy is exact; a narrowing one rounds
    if node.target is aten.gelu.default:
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approx not in ("none", "tanh"):
            return None
        return ["gelu" if approx == "none" else "gelu_tanh", *out_bf16], src, None, None
    if node.target is aten.relu.default and len(node.args) == 1:
        return ["relu", *out_bf16], src, None, None
    if node.target in (aten.mul.Tensor, aten.add.Tensor) and len(node.args) == 2 and not node.kwargs:
        other = node.args[1]
        vec = _const(gm, other)
        n = _val(vals, node).shape[-1]
        if vec is not None and vec.dim() == 1 and vec.numel() == n and vec.is_floating_point() and n_cols < 2:
            name = "mul_col" if node.target is aten.mul.Tensor else "add_col"
            return [name, *out_bf16], src, None, vec.detach().to(torch.float32)
        oval, sval = _val(vals, other), _val(vals, src)
        if (node.target is aten.mul.Tensor and not have_row and not out_bf16 and isinstance(oval, torch.Tensor)
                and isinstance(sval, torch.Tensor) and oval.dtype is torch.float32 and sval.dtype is torch.float32
                and oval.dim() == sval.dim() and oval.shape[-1] == 1 and oval.shape[:-1] == sval.shape[:-1]):
            return ["mul_row"], src, other, None
    return None


def _prologue(gm: GraphModule, vals: dict, node: Node):
    """Walk back from ``node`` (what the quantize chain reads) through the ops the kernel can run, as
    long as each is read only by the chain: ``(source, steps, row, cols)`` in program order."""
    steps: list[str] = []  # built backwards
    cols: list[torch.Tensor] = []
    row = None
    while _single(node):
        found = _step(gm, vals, node, row is not None, len(cols))
        if found is None:
            break
        more, node, r, c = found
        steps.extend(reversed(more))
        row = r if r is not None else row
        if c is not None:
            cols.append(c)
    if _dtype(vals, node) not in (torch.float32, torch.bfloat16):
        return None
    steps.reverse()
    cols.reverse()
    return node, steps, row, cols


def fuse_per_token_quantize(gm: GraphModule) -> int:
    """Replace each per-token quantize chain of a per-token GEMM input whose prologue holds an
    activation or a GEMM epilogue by ``quantkit::per_token_quant_cpu``; returns how many."""
    vals = _vals(gm)
    if vals is None:
        return 0
    chains = []
    for node in gm.graph.nodes:
        if INT8_KERNEL_META_KEY not in node.meta:
            continue
        found = _quant_chain(node)
        if found is None:
            continue
        x, scale = found
        pro = _prologue(gm, vals, x.args[0])
        if pro is None:
            continue
        src, steps, row, cols = pro
        if not any(s in _ACTIVATIONS or s == "mul_row" for s in steps):
            continue  # a bare quantize: Inductor's own loop is as good
        chains.append((node, x, scale, src, steps, row, cols))
    op = torch.ops.quantkit.per_token_quant_cpu.default
    for q8, x, scale, src, steps, row, cols in chains:
        tag = q8.meta[INT8_KERNEL_META_KEY]
        with gm.graph.inserting_before(x):  # before the chain: its scale is read inside it
            col_nodes = []
            for c in cols:
                name = unique_attr_name(gm, "_qk_prologue_col_")
                gm.register_buffer(name, c.contiguous())
                col_nodes.append(gm.graph.get_attr(name))
            col_nodes += [None] * (2 - len(col_nodes))
            call = gm.graph.call_function(op, (src, row, col_nodes[0], col_nodes[1], list(steps)))
            q_new = gm.graph.call_function(operator.getitem, (call, 0))
            s_new = gm.graph.call_function(operator.getitem, (call, 1))
        for n, old in ((call, None), (q_new, q8), (s_new, scale), *((c, None) for c in col_nodes if c is not None)):
            n.meta[INT8_KERNEL_META_KEY] = tag
            n.meta[KEEP_FLOAT32_META_KEY] = True
            if old is not None and "val" in old.meta:
                n.meta["val"] = old.meta["val"]
        q8.replace_all_uses_with(q_new)
        scale.replace_all_uses_with(s_new)
    if chains:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return len(chains)


@register_lowering("per_token_quant_fuse", order=420, devices=("cpu",))
def lower_per_token_fuse(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The registered pass: :func:`fuse_per_token_quantize` after the bf16 passes, where ``compile``
    chose oneDNN, the graph has per-token GEMMs and the kernel builds here."""
    if ctx.target != Target.ONEDNN or not ctx.counts.get("per_token_linears"):
        return {}
    if ctx.cpu_kernels == "reference" or not _per_token_quant_cpu.available():
        return {}
    return {"per_token_quant_fused": fuse_per_token_quantize(gm)}
