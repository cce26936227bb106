"""CPU int8 + bf16: run everything that is not an int8 GEMM in bfloat16.

Production CPU int8 inference is "int8-mixed-bf16": the GEMMs run in int8 and every other op
(attention/SDPA, LayerNorm, GELU, softmax, residual adds, the arithmetic around quantize and
dequantize) in bf16, which halves the memory traffic of the float part and lets oneDNN use its
AVX-512 BF16 / AMX kernels for the float attention. The int8 part is unchanged.

The pass writes the graph that ``torch.autocast`` would trace if every float op were on its
bf16 list: each float32 tensor a float op reads is cast to bf16 first (``dq(x).to(bf16)``,
``dq(w).to(bf16)``, ``bias.to(bf16)``, a float parameter ``.to(bf16)``); quantize ops read
the bf16 values as they are (``quantize_per_tensor`` converts to float32 itself); dynamic
quantizes (choose_qparams, per-token) get their float32 input back; the graph's outputs are
cast back to their original dtype. That is the form Inductor's int8-mixed-bf16 freezing patterns
(torch/_inductor/fx_passes/quantization.py, "to(dtype=torch.bfloat16) node at the inputs of
activation and weight") match, so each ``dq -> linear <- dq(w)`` still becomes one
``onednn.qlinear_pointwise``, now with a bf16 output (or a requantized uint8 one), and casts on
frozen parameters are folded into constants.

Numerics: bf16 has an 8-bit mantissa (relative rounding 2**-9), so values differ from the
float32 reference q/dq graph at that level, and an activation rounded to bf16 before its
quantize can land on the neighbouring int8 level. Tests state their tolerance against that.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from quantkit.kernels._cpu_isa import cpu_has

from .._graph import get_attr
from ..pipeline._float_fallback import bf16_weight_source, float_gemms, int8_weight_source
from ._registry import LoweringContext, register_lowering

__all__ = ["FLOAT_DTYPES", "KEEP_FLOAT32_META_KEY", "bf16_supported", "bf16_float_ops_pay", "bf16_attention_faster", "bf16_float_layer", "has_bf16_float_layers", "resolve_float_dtype", "float_ops_to_bf16",
           "float_layers_to_bf16", "lower_bf16", "lower_float_layers_bf16"]

aten = torch.ops.aten
_Q = torch.ops.quantized_decomposed
# node.meta key of nodes this pass leaves exactly as they are (inputs not cast, output not bf16): an
# int8 kernel chain whose arithmetic must stay the float32 reference's (``_per_token``'s quantize)
KEEP_FLOAT32_META_KEY = "quantkit_keep_float32"
# "auto": bf16 where the CPU computes it natively (AVX-512 BF16 or AMX) and oneDNN int8 runs
FLOAT_DTYPES = ("auto", "bf16", "fp32")
# quantized_decomposed ops that read the float tensor being quantized as their first argument
# and accept bf16 as it is (the op converts to float32 first; Inductor's requantize patterns
# expect no cast in between)
_QUANT_READS_BF16 = {_Q.quantize_per_tensor.default}


def bf16_supported() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX-512 BF16 or AMX-BF16)."""
    return cpu_has("avx512_bf16") or cpu_has("amx_bf16")


def bf16_float_ops_pay() -> bool:
    """Whether an int8 graph's float ops (attention, LayerNorm, GELU, softmax) gain from bf16 here:
    only on AMX. With AVX-512 BF16 alone (Zen 4) they measured slower in bf16 than in float32 --
    the casts cost more than the bf16 dot products save: all-MiniLM-L6-v2 32x128, 2 threads,
    interleaved, static int8 132 vs 137 ms, per-token + SmoothQuant 155 vs 169 ms, the transformer
    block 0.48 vs 0.65 ms (``benchmarks/bench_models.py``, ``bench_fast_accurate.py``, BENCHMARKS.md,
    2026-12-03). The float *GEMMs* a fallback keeps do gain from bf16 on any BF16 CPU
    (``float_layers_bf16``)."""
    return cpu_has("amx_bf16")


def resolve_float_dtype(float_dtype, *, onednn: bool, graph: GraphModule | None = None) -> torch.dtype:
    """The dtype ``quantkit.compile`` runs the float ops in.

    ``"auto"`` means bf16 on an AMX CPU (``bf16_float_ops_pay``) when oneDNN int8 runs and, given
    the ``graph``, only where its float attention (SDPA, float matmuls) measures faster in bf16
    (``bf16_attention_faster``: large attention, a rule from measurements) or it has float fallback
    GEMMs that run in bf16 anyway (``has_bf16_float_layers``); else float32.
    """
    if float_dtype in (torch.bfloat16, torch.float32):
        float_dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}[float_dtype]
    if float_dtype not in FLOAT_DTYPES:
        raise ValueError(f"unknown float_dtype {float_dtype!r}; use one of {list(FLOAT_DTYPES)}")
    if float_dtype == "auto":
        if not (onednn and bf16_supported() and bf16_float_ops_pay()):
            return torch.float32
        if graph is None or bf16_attention_faster(graph) or has_bf16_float_layers(graph):
            return torch.bfloat16
        return torch.float32
    return torch.bfloat16 if float_dtype == "bf16" else torch.float32


# ops whose size decides "auto": the float work int8 leaves behind (SDPA was 28% of the int8
# MiniLM's time, issue 17). Elementwise ops and LayerNorm are fused next to the int8 kernels
# either way; without attention (the benchmark MLP) bf16 measured no gain (2.33 vs 2.26 ms).
_ATTENTION_OPS = {aten.scaled_dot_product_attention.default, aten.matmul.default, aten.bmm.default}
# multiply-adds of one attention op (batch * heads * T * S * head_dim for SDPA) from which bf16
# pays. Measured, 1 thread, this machine (AVX-512 BF16 + AMX): the transformer block's
# 32x4x16x16 attention (0.5M MACs) runs 1.6-1.8x *slower* in bf16 (180 vs 330 us) and the whole
# int8 block 1.3x slower; MiniLM's 32x12x128x32 SDPA (403M MACs) 1.5x faster (48 vs 72 ms) and
# the int8 model 1.1x faster. Small bf16 kernels lose to their conversion and setup costs.
# A rule, not a timing at compile time: timings on a shared CPU flip (tried: 2 threads under load).
_MIN_BF16_MACS = 1 << 24


def _shape(node) -> tuple[int, ...] | None:
    while isinstance(node, Node) and _is_qdq_op(node) and "val" not in node.meta:
        node = node.args[0]  # a dequantized activation has its quantize's shape
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    dims = []
    for d in val.shape:
        try:
            dims.append(int(d))
        except Exception:  # a symbolic size: its example value
            hint = getattr(getattr(d, "node", None), "hint", None)
            if hint is None:
                return None
            dims.append(int(hint))
    return tuple(dims)


def _macs(node: Node) -> int:
    """Multiply-adds of one attention op from its input shapes (0 when unknown)."""
    a, b = (_shape(x) for x in node.args[:2])
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return 0
    batch = 1
    for d in a[:-2]:
        batch *= d
    if node.target is aten.scaled_dot_product_attention.default:  # q [.., T, D] @ k^T, then @ v
        return 2 * batch * a[-2] * b[-2] * a[-1]
    return batch * a[-2] * a[-1] * b[-1]


def bf16_float_layer(layer: Node) -> bool:
    """Whether the float GEMM ``layer`` is one :func:`float_layers_to_bf16` runs in bf16: its weight
    stored in bf16 (read through a float32 cast) or in int8 (read through its dequantize)."""
    return any(bf16_weight_source(a) is not None for a in layer.args) or int8_weight_source(layer) is not None


def has_bf16_float_layers(gm: GraphModule) -> bool:
    """Whether ``gm`` has float fallback GEMMs that compile runs in bf16 anyway (a bf16 or int8 stored
    weight, ``float_layers_to_bf16``): with the other float ops in float32 each of them pays a cast
    of its input and of its output, so on AMX ``"auto"`` runs every float op in bf16 for such a graph.
    Measured on an AMX Xeon, 2 threads, the bundled all-MiniLM-L6-v2 fallback (24 of 37 linears
    float, int8 weights) compiled: 107 ms with bf16 float ops against 157 ms with float32 ones at
    32x128 tokens, 22.0 against 22.2 ms at 32x18 (whose small attention alone keeps float32; issue 28)."""
    return any(map(bf16_float_layer, float_gemms(gm)))


def bf16_attention_faster(gm: GraphModule) -> bool:
    """Whether ``gm``'s float attention is large enough for bf16 to pay (see ``_MIN_BF16_MACS``).

    True when its largest SDPA / float matmul has at least ``_MIN_BF16_MACS`` multiply-adds at
    the graph's example shapes; a graph without attention stays float32.
    """
    sizes = [_macs(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in _ATTENTION_OPS]
    return max(sizes, default=0) >= _MIN_BF16_MACS


def _is_qdq_op(node: Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "quantized_decomposed"


def _orig_dtype(gm: GraphModule, node) -> torch.dtype | None:
    """The dtype ``node`` produced before the pass (None for non-tensors)."""
    if not isinstance(node, Node):
        return None
    if node.op == "get_attr":
        try:
            obj = get_attr(gm, node.target)
        except AttributeError:  # not there (any more): not a tensor this pass casts
            return None
        return obj.dtype if isinstance(obj, torch.Tensor) else None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if _is_qdq_op(node) and "dequantize" in node.target._name:
        return node.kwargs.get("out_dtype") or node.kwargs.get("output_dtype") or torch.float32
    return None


def float_ops_to_bf16(gm: GraphModule) -> dict[str, int]:
    """Rewrite ``gm`` in place so its float ops run in bf16; return counts of inserted casts.

    int8 tensors, quantization parameters (scales, zero points), the q/dq ops themselves and
    nodes marked ``meta[KEEP_FLOAT32_META_KEY]`` are left alone; see the module docstring for the rule. The graph's outputs keep their dtype.
    """
    graph = gm.graph
    bf16 = set()  # nodes that now produce bf16 (originally float32)
    casts: dict[tuple[Node, torch.dtype], Node] = {}
    counts = {"to_bf16": 0, "to_fp32": 0}

    def cast(src: Node, dtype: torch.dtype, key: str) -> Node:
        if (src, dtype) not in casts:
            with graph.inserting_after(src):
                c = graph.call_function(aten._to_copy.default, (src,), {"dtype": dtype})
            casts[(src, dtype)] = c
            counts[key] += 1
        return casts[(src, dtype)]

    def to_bf16(a):
        src = bf16_weight_source(a)
        if src is not None:  # a float fallback layer's bf16 weight (pipeline/_float_fallback): read it as it is
            return src
        if isinstance(a, Node) and a not in bf16 and _orig_dtype(gm, a) == torch.float32:
            return cast(a, torch.bfloat16, "to_bf16")
        return a

    def to_fp32(a):
        if isinstance(a, Node) and a in bf16:
            return cast(a, torch.float32, "to_fp32")
        return a

    inserted = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node in inserted or node.meta.get(KEEP_FLOAT32_META_KEY):
            continue
        if _is_qdq_op(node):
            if node.target not in _QUANT_READS_BF16 and node.args:
                node.args = (to_fp32(node.args[0]),) + tuple(node.args[1:])
            continue
        if node.target is aten._assert_tensor_metadata.default:
            # export's runtime check that a tensor is float32 (beside Llama's explicit .to(float32)
            # in RMSNorm / rotary): the pass changes such dtypes on purpose; the check computes nothing
            if node.kwargs.get("dtype") == torch.float32 and not node.users:
                graph.erase_node(node)
                counts["dtype_asserts_dropped"] = counts.get("dtype_asserts_dropped", 0) + 1
            continue
        if node.target is operator.getitem:
            if node.args[0] in bf16 and _orig_dtype(gm, node) == torch.float32:
                bf16.add(node)
            continue
        reads_float = False

        def visit(a):
            nonlocal reads_float
            if isinstance(a, Node) and (a in bf16 or _orig_dtype(gm, a) == torch.float32):
                reads_float = True
                return to_bf16(a)
            return a

        before = set(casts.values())
        node.args = torch.fx.node.map_arg(node.args, visit)
        node.kwargs = torch.fx.node.map_arg(node.kwargs, visit)
        inserted |= set(casts.values()) - before
        val = node.meta.get("val")
        # an explicit dtype (_to_copy(x, dtype=float32), aten.to.dtype(x, torch.float32), full(..., dtype=))
        # decides the output's dtype: not bf16; its float readers cast it
        explicit = any(isinstance(a, torch.dtype) for a in list(node.args) + list(node.kwargs.values()))
        if reads_float and not explicit and (isinstance(val, torch.Tensor) and val.dtype == torch.float32
                                                 or isinstance(val, (tuple, list))):
            bf16.add(node)
    out = next(n for n in graph.nodes if n.op == "output")

    def restore(a):
        return to_fp32(a) if isinstance(a, Node) and _orig_dtype(gm, a) == torch.float32 else a

    out.args = torch.fx.node.map_arg(out.args, restore)
    _drop_unread_weight_casts(gm)
    graph.lint()
    gm.recompile()
    return counts


def _drop_unread_weight_casts(gm: GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if bf16_weight_source(node) is not None and not node.users:
            gm.graph.erase_node(node)


def float_layers_to_bf16(gm: GraphModule) -> dict[str, int]:
    """Run ``gm``'s float fallback GEMMs in bf16 and everything else as it is; in place.

    A float GEMM whose weight :func:`~quantkit.pipeline._float_fallback.store_float_layers_bf16`
    stored in bf16 reads that weight directly, its other float inputs cast to bf16, and its output
    is cast back to float32 for its readers. One whose weight
    :func:`~quantkit.pipeline._float_fallback.store_float_layers_int8` stored in int8 reads its
    dequantized weight cast to bf16 (freezing folds both into one bf16 constant): on an AMX Xeon a
    float32 GEMM there ran ~4x slower than bf16, and the all-MiniLM-L6-v2 fallback with 19 of 37
    layers float took 357 ms at 32x128 against 85 ms for the whole model in bf16 (issue 28). Its
    numerics move by the bf16 rounding of the weight and the activation (relative ``2**-9``), as a
    bf16-weight layer's do; the activation is still never rounded to int8. The int8 layers and the float ops around them are
    untouched, so their oneDNN patterns still match. For graphs whose float ops stay float32
    (``float_dtype`` resolved to fp32); with bf16 float ops :func:`float_ops_to_bf16` does this too.

    Returns:
        ``{"float_layers_bf16": n}``, the number of layers rewritten (``{}`` for none).
    """
    graph = gm.graph
    done = 0
    for layer in float_gemms(gm):
        if not bf16_float_layer(layer):
            continue

        def to_bf16(a, layer=layer):
            src = bf16_weight_source(a)
            if src is not None:
                return src
            if isinstance(a, Node) and _orig_dtype(gm, a) == torch.float32:
                with graph.inserting_before(layer):
                    return graph.call_function(aten._to_copy.default, (a,), {"dtype": torch.bfloat16})
            return a

        layer.args = tuple(to_bf16(a) for a in layer.args)
        with graph.inserting_after(layer):
            back = graph.call_function(aten._to_copy.default, (layer,), {"dtype": torch.float32})
        if "val" in layer.meta:
            back.meta["val"] = layer.meta["val"]  # float32, as the layer's output was
        layer.replace_all_uses_with(back, delete_user_cb=lambda u, b=back: u is not b)
        done += 1
    if not done:
        return {}
    _drop_unread_weight_casts(gm)
    graph.lint()
    gm.recompile()
    return {"float_layers_bf16": done}


@register_lowering("bf16", order=400, devices=("cpu",))
def lower_bf16(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The registered int8-mixed-bf16 pass: :func:`float_ops_to_bf16` where ``compile`` resolved the
    float ops to bf16, on CPU, and not around FP8 ``_scaled_mm`` (its scales and bias stay float32)."""
    if ctx.float_dtype != torch.bfloat16 or ctx.counts.get("fp8_linear"):
        return {}
    return float_ops_to_bf16(gm)


@register_lowering("float_layers_bf16", order=410, devices=("cpu",))
def lower_float_layers_bf16(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The registered mixed-precision pass: :func:`float_layers_to_bf16` where oneDNN int8 runs on a
    CPU with native bf16 and the other float ops stay float32 (bf16 float ops already cover them).

    Why only the fallback's layers: their weights are already bf16 (``store_float_layers_bf16``),
    so a bf16 GEMM loses only the rounding of its activation and runs at the CPU's bf16 rate,
    where a float32 GEMM costs ~2x the memory traffic of a bf16 one and 4x an int8 one.
    ``compile(float_dtype="fp32")`` asks for float32 everywhere: it skips this pass
    (``ctx.requested_float_dtype``); an ``"auto"`` that resolved to float32 takes it.
    """
    if ctx.requested_float_dtype == "fp32":
        return {}
    if ctx.float_dtype != torch.float32 or ctx.target is None or str(getattr(ctx.target, "value", ctx.target)) != "onednn":
        return {}
    if not bf16_supported():
        return {}
    return float_layers_to_bf16(gm)
