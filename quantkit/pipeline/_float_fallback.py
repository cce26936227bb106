"""Float fallback layers of a converted graph: no stray q/dq around them, weights stored in bf16.

The accuracy fallback keeps its most sensitive GEMMs float (:class:`~quantkit.pipeline._layers.KeepFloat`).
Two things make such a mixed graph cheaper without touching its int8 layers:

- **No stray q/dq.** A ``quantize -> dequantize`` pair read by a float layer only rounds the value
  the layer reads and costs two elementwise passes; the float layer reads the float source instead
  (seen through view-like ops, which are re-applied to the float value). Where the same dequantize
  also feeds an int8 layer, only the float layer's input moves; the int8 layer keeps its pattern, so
  Inductor's ``dq -> linear <- dq(w)`` fusions still match.
- **bf16 weights.** A float layer's weight is stored as bf16 and read through one
  ``_to_copy(w, dtype=float32)``: the artifact holds 2 bytes per float weight instead of 4 (int8
  layers hold 1), the graph still computes in float32 (Inductor's freezing folds the cast into a
  constant), and the int8-mixed-bf16 lowering (``lowering/_bf16.py``) reads the bf16 weight as it
  is. Biases stay float32: they are 1/K of the weight and are added at full precision.

Numerics: a bf16 weight is the float32 one rounded to 8 significant bits (relative error at most
2**-9 per element); the layer's output differs from the float32-weight layer at that level.

Both functions work in place on a converted GraphModule (layer nodes keep their names from
capture, so the fallback's layer names apply); :func:`finish_float_layers` runs both.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .._graph import DEQUANTIZE_OPS, QPARAMS_META_KEY, QUANTIZE_OPS, get_attr, set_attr, unique_attr_name
from .._qmath import choose_qparams, quantize as qmath_quantize
from ._layers import _FAMILIES, _MOVES, KEEP_FLOAT_META_KEY, source_dequantize

__all__ = ["FLOAT_WEIGHTS_META_KEY", "INT8_WEIGHTS_META_KEY", "float_gemms", "drop_stray_qdq",
           "store_float_layers_bf16", "store_float_layers_int8", "int8_weight", "int8_weight_source",
           "finish_float_layers", "finish_recorded_float_layers", "bf16_weight_source"]

aten = torch.ops.aten
# gm.meta key: the names of the layers whose weights store_float_layers_bf16 stored in bf16
FLOAT_WEIGHTS_META_KEY = "quantkit_bf16_float_layers"
# GEMM-like ops a fallback keeps float (add is a layer family, but it has no weight and no GEMM)
_GEMM_FAMILIES = {t for t, fam in _FAMILIES.items() if fam != "add"} | {aten.addmm.default}
_DQ_CHANNEL = torch.ops.quantized_decomposed.dequantize_per_channel.default
# GEMMs whose weight operand has its output channels on dim 0 (linear [N, K], conv [C_out, ...])
_WEIGHT_AXIS0 = {t for t, fam in _FAMILIES.items() if fam in ("linear", "conv")}


def _operands(node: Node) -> tuple:
    """The two multiplied operands of a GEMM-like node (``addmm(bias, x, w)`` reads args 1 and 2)."""
    return tuple(node.args[1:3]) if node.target is aten.addmm.default else tuple(node.args[:2])


def float_gemms(gm: GraphModule) -> list[Node]:
    """GEMM-like nodes (linear, conv, matmul/bmm/mm, addmm) of ``gm`` that run float.

    A GEMM runs int8 when both its operands are dequantized (activation and weight, or the two
    activations of an attention matmul); one with a float operand computes in float, whatever
    its other input is.
    """
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _GEMM_FAMILIES
            and not all(source_dequantize(a) is not None for a in _operands(n))]


def _from_attr(node) -> bool:
    """Whether ``node`` is an attribute, seen through view-like ops (a weight, not an activation)."""
    while isinstance(node, Node) and node.op == "call_function" and node.target in _MOVES:
        node = node.args[0]
    return isinstance(node, Node) and node.op == "get_attr"


def _is_activation_dq(node) -> bool:
    """``dequantize(quantize(x, ...))`` of an activation ``x``: a rounded activation. A weight's
    dequantize reads an int8 attribute, or ``quantize(w)`` of the float weight where convert did not
    fold it (``fold_quantize=False``): a weight-only layer's weight must stay quantized."""
    return (isinstance(node, Node) and node.op == "call_function" and node.target in DEQUANTIZE_OPS
            and isinstance(node.args[0], Node) and node.args[0].op == "call_function"
            and node.args[0].target in QUANTIZE_OPS and not _from_attr(node.args[0].args[0]))


def drop_stray_qdq(gm: GraphModule) -> int:
    """Let every float GEMM of ``gm`` read the float value its q/dq input rounds; in place.

    For each float layer's tensor input that is (through view-like ops) ``dq(q(x))``, the layer
    reads ``x`` (with the same view ops applied) instead; q/dq pairs nobody else reads go. int8
    layers and the q/dq they read are left as they are.

    Returns:
        The number of layer inputs that now read a float source.
    """
    graph = gm.graph
    memo: dict[Node, Node] = {}

    def float_of(node):
        """The float value ``node`` rounds (``node`` itself when there is none)."""
        if not isinstance(node, Node):
            return node
        if node in memo:
            return memo[node]
        out = node
        if _is_activation_dq(node):
            out = float_of(node.args[0].args[0])
        elif node.op == "call_function" and node.target in _MOVES:
            src = float_of(node.args[0])
            if src is not node.args[0]:  # re-apply the view op to the float source
                with graph.inserting_after(node):
                    out = graph.call_function(node.target, (src,) + tuple(node.args[1:]), dict(node.kwargs))
                out.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
        memo[node] = out
        return out

    rewired = 0
    for layer in float_gemms(gm):
        for arg in _operands(layer):
            src = float_of(arg)
            if src is not arg:
                layer.replace_input_with(arg, src)
                rewired += 1
    if rewired:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return rewired


def _weight_attr(layer: Node) -> Node | None:
    """The ``get_attr`` node of ``layer``'s weight operand (a linear/conv's args[1]; the right operand
    of matmul/mm/addmm), if it reads one directly."""
    w = _operands(layer)[1] if len(_operands(layer)) > 1 else None
    return w if isinstance(w, Node) and w.op == "get_attr" else None


def bf16_weight_source(node) -> Node | None:
    """The bf16 ``get_attr`` behind ``node`` when ``node`` is a float32 cast of a bf16 attribute
    (``_to_copy(w_bf16, dtype=float32)``, what :func:`store_float_layers_bf16` inserts), else None.

    Read from the graph's structure alone, so it holds for a model reloaded from an artifact too
    (node meta does not survive ``torch.export``).
    """
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is aten._to_copy.default
            and node.kwargs.get("dtype") == torch.float32 and set(node.kwargs) <= {"dtype"}):
        return None
    src = node.args[0]
    if not (isinstance(src, Node) and src.op == "get_attr" and node.graph.owning_module is not None):
        return None
    try:
        tensor = get_attr(node.graph.owning_module, src.target)
    except AttributeError:
        return None
    return src if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16 else None


def _chosen_float_layers(gm: GraphModule, names) -> list[Node]:
    wanted = None if names is None else frozenset(names)
    return [n for n in float_gemms(gm) if wanted is None or n.name in wanted]


def _own_float32_weights(gm: GraphModule, layers: list[Node], ops=None):
    """``(target, tensor, readers)`` for each float32 weight attribute of ``layers`` (those whose op is
    in ``ops``, when given) that only ``layers`` read: one that a tied embedding or an int8 layer also
    reads must keep its float32 values. Each attribute once."""
    chosen = set(layers)
    by_target: dict[str, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            by_target.setdefault(str(node.target), []).append(node)
    seen: set[str] = set()
    for layer in layers:
        w = _weight_attr(layer)
        if w is None or str(w.target) in seen or (ops is not None and layer.target not in ops):
            continue
        target = str(w.target)
        seen.add(target)
        tensor = get_attr(gm, target)
        if not (isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32):
            continue
        readers = by_target[target]
        if all(set(r.users) <= chosen for r in readers):
            yield target, tensor, readers


def store_float_layers_bf16(gm: GraphModule, names=None, *, rounded: dict | None = None) -> int:
    """Store the weights of ``gm``'s float GEMMs as bf16, each read through a cast to float32; in place.

    Args:
        gm: a converted GraphModule (e.g. ``Variants.build(keep)``).
        names: the layer (node) names whose weights to store in bf16; None for every float GEMM
            with a float32 weight. Names of int8 layers, of layers without a weight attribute
            (attention matmuls) or not in ``gm`` are skipped.

    A weight attribute that anything other than the chosen float layers also reads (a tied
    embedding, an int8 layer) stays float32. The names stored are added to
    ``gm.meta[FLOAT_WEIGHTS_META_KEY]``. ``rounded``: a memo shared by calls on graphs that hold
    the same float weights (``Variants``' scoring copies): each weight is rounded once, and the
    graphs share its rounded tensor. It keeps the weights it has seen alive.

    Returns:
        The number of weight tensors now stored in bf16.

    Example:
        >>> qm = variants.build(["linear_3"])
        >>> store_float_layers_bf16(qm, ["linear_3"])
        1
    """
    layers, done, stored = _chosen_float_layers(gm, names), set(), 0
    for target, tensor, readers in _own_float32_weights(gm, layers):
        set_attr(gm, target, _memoised(rounded, tensor, lambda t: t.to(torch.bfloat16)))
        for r in readers:
            val = r.meta.pop("val", None)
            r.meta.pop("tensor_meta", None)
            with gm.graph.inserting_after(r):
                cast = gm.graph.call_function(aten._to_copy.default, (r,), {"dtype": torch.float32})
            if val is not None:
                cast.meta["val"] = val  # float32, as the weight was
            r.replace_all_uses_with(cast, delete_user_cb=lambda u, c=cast: u is not c)
        done.add(target)
        stored += 1
    names_done = sorted({n.name for n in layers if _weight_source_target(n) in done})
    if stored:
        gm.meta[FLOAT_WEIGHTS_META_KEY] = sorted(set(gm.meta.get(FLOAT_WEIGHTS_META_KEY, ())) | set(names_done))
        gm.graph.lint()
        gm.recompile()
    return stored


# gm.meta key: the names of the layers whose weights store_float_layers_int8 stored in int8
INT8_WEIGHTS_META_KEY = "quantkit_int8_weight_float_layers"
_INT8_RANGE = (-127, 127)  # symmetric, as W8A8's weights: no -128, so -w rounds to -q


def _memoised(rounded: dict | None, tensor: torch.Tensor, make):
    """``make(tensor)``, once per tensor and memo (``rounded``; None: no memo). The memo holds
    ``tensor``, so its id is not reused while the entry lives."""
    if rounded is None:
        return make(tensor)
    if id(tensor) not in rounded:
        rounded[id(tensor)] = (tensor, make(tensor))
    return rounded[id(tensor)][1]


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, zero_point)``: ``w`` rounded to int8 per output channel (dim 0), symmetric in
    [-127, 127] with the scale ``absmax / 127`` (quantkit._qmath.choose_qparams, as W8A8's
    per-channel weight observer computes it)."""
    flat = w.detach().reshape(w.shape[0], -1)
    scale, zp = choose_qparams(flat.amin(dim=1), flat.amax(dim=1), qscheme=torch.per_channel_symmetric,
                               dtype=torch.int8, quant_min=_INT8_RANGE[0], quant_max=_INT8_RANGE[1])
    return qmath_quantize(w.detach(), scale, zp, *_INT8_RANGE, torch.int8, axis=0), scale, zp


def store_float_layers_int8(gm: GraphModule, names=None, *, rounded: dict | None = None) -> int:
    """Store the weights of ``gm``'s float GEMMs as int8 per output channel, each read through its
    ``dequantize_per_channel``; in place. The layer still computes in float on its float input (no
    activation rounding: what made it sensitive), the artifact holds 1 byte per weight as an int8
    layer does, and a compile with freezing folds the dequantize into a constant weight.

    Args, guards and return value as :func:`store_float_layers_bf16` (names stored go to
    ``gm.meta[INT8_WEIGHTS_META_KEY]``; with a ``rounded`` memo, the graphs share each weight's int8
    tensor, scale and zero point, so a scoring copy's folded dequantize is computed once too).

    Numerics: each weight moves by at most half its channel's step ``absmax / 127``.

    Example:
        >>> qm = variants.build(["linear_3"])
        >>> store_float_layers_int8(qm, ["linear_3"])
        1
    """
    layers, done = _chosen_float_layers(gm, names), set()
    for target, tensor, readers in _own_float32_weights(gm, layers, ops=_WEIGHT_AXIS0):
        if tensor.dim() < 2:
            continue
        q, scale, zp = _memoised(rounded, tensor, int8_weight)
        # quantization.json describes this int8 tensor as it does convert's (plus: its layer reads float)
        users = sorted({u.name for r in readers for u in r.users})
        gm.meta.setdefault(QPARAMS_META_KEY, []).append({
            "node": f"{readers[0].name} -> {users[0]}", "kind": "weight", "dtype": "int8",
            "qscheme": "per_channel_symmetric", "scale": scale.reshape(-1).tolist(),
            "zero_point": zp.reshape(-1).tolist(), "quant_min": _INT8_RANGE[0], "quant_max": _INT8_RANGE[1],
            "float_input": True})
        set_attr(gm, target, q)
        base = target.replace(".", "_")
        scale_name, zp_name = unique_attr_name(gm, base + "_scale", sep="_"), unique_attr_name(gm, base + "_zp", sep="_")
        gm.register_buffer(scale_name, scale)
        gm.register_buffer(zp_name, zp)
        for r in readers:
            val = r.meta.pop("val", None)
            r.meta.pop("tensor_meta", None)
            with gm.graph.inserting_before(r.next):  # in this order, right after the weight
                s_node = gm.graph.get_attr(scale_name)
                z_node = gm.graph.get_attr(zp_name)
                dq = gm.graph.call_function(_DQ_CHANNEL, (r, s_node, z_node, 0, *_INT8_RANGE, torch.int8))
            if val is not None:
                dq.meta["val"] = val  # float32, as the weight was
            r.replace_all_uses_with(dq, delete_user_cb=lambda u, d=dq: u is not d)
        done.add(target)
    names_done = sorted({n.name for n in layers if int8_weight_source(n) in done})
    if done:
        gm.meta[INT8_WEIGHTS_META_KEY] = sorted(set(gm.meta.get(INT8_WEIGHTS_META_KEY, ())) | set(names_done))
        gm.graph.lint()
        gm.recompile()
    return len(done)


def int8_weight_source(layer: Node) -> str | None:
    """The int8 attribute behind ``layer``'s weight when it reads ``dequantize_per_channel(get_attr)``
    (what :func:`store_float_layers_int8` leaves; the graph's structure alone, so a reloaded one too)."""
    ops = _operands(layer)
    w = ops[1] if len(ops) > 1 else None
    if isinstance(w, Node) and w.target is _DQ_CHANNEL and isinstance(w.args[0], Node) and w.args[0].op == "get_attr":
        return str(w.args[0].target)
    return None


def _weight_source_target(layer: Node) -> str | None:
    ops = _operands(layer)
    src = bf16_weight_source(ops[1]) if len(ops) > 1 else None
    return str(src.target) if src is not None else None


# the weight dtypes a converted float layer can be stored in, and the function that stores them
_STORES = {"bf16": store_float_layers_bf16, "int8": store_float_layers_int8}


def finish_float_layers(gm: GraphModule, names=None, weights: str = "bf16", *,
                        rounded: dict | None = None) -> dict[str, int]:
    """Both steps on a converted graph, in place: :func:`drop_stray_qdq`, then
    :func:`store_float_layers_bf16` (``weights="bf16"``) or :func:`store_float_layers_int8`
    (``"int8"``) for ``names`` (None: every float GEMM), sharing their ``rounded`` memo.

    Returns:
        ``{"stray_qdq_inputs": ..., "bf16_weights": ...}`` (``"int8_weights"`` for int8).
    """
    if weights not in _STORES:
        raise ValueError(f"unknown float layer weights {weights!r}; use 'bf16' or 'int8'")
    stray = drop_stray_qdq(gm)
    return {"stray_qdq_inputs": stray, f"{weights}_weights": _STORES[weights](gm, names, rounded=rounded)}


def finish_recorded_float_layers(converted: GraphModule) -> dict[str, int]:
    """:func:`finish_float_layers` for the layers a ``KeepFloat(..., float_weights="bf16")`` marked
    (in their node meta) in the graph it prepared (``{}`` and nothing done when there is no such record); in place.

    For ``convert`` to call on its result, so that ``quantkit.quantize(model, ..., keep_float_quantizer)``
    rebuilds the fallback's artifact with its bf16 weights.
    """
    out: dict[str, int] = {}
    for weights in _STORES:
        names = [n.name for n in converted.graph.nodes if n.meta.get(KEEP_FLOAT_META_KEY) == weights]
        if names:
            out.update(finish_float_layers(converted, names, weights))
    return out
