"""last_position_program: a KV-cache program whose lm_head runs on the last position only.

Generation reads the logits of the last position alone (the prefill's next token, then one token
per decode step), so the prefill's ``[B, L, hidden] x [hidden, vocab]`` lm_head GEMM computes L - 1
rows nobody reads; on SmolLM2-135M (vocab 49,152, hidden 576) that is most of a short prompt's
FLOPs outside the layers. The rewrite slices the lm_head's input to its last position before any
q/dq of it (so the quantized linear's pattern, which lowering fuses into a kernel, stays whole) and
leaves everything else alone: every layer still writes all L positions into the cache.

Per-token and static activation quantization give the same last row either way; a dynamic
per-tensor lm_head input is quantized with the last row's own range (as a decode step does)
rather than the whole prompt's, so its last-row logits can differ in the last bits.
"""

from __future__ import annotations

import sys

import torch
from torch.fx import Graph, GraphModule, Node

from .._graph import DEQUANTIZE_OPS, FLOAT8_DEQUANTIZE_OPS, FLOAT8_QUANTIZE_OPS, QUANTIZE_OPS

__all__ = ["last_position_program", "LAST_POSITION_META_KEY"]

# meta key of a rewritten program: True (the lm_head computes the last position only)
LAST_POSITION_META_KEY = "quantkit_last_position_logits"

_aten = torch.ops.aten
# ops between the lm_head's input and the linear: its activation's quantize and dequantize
_QDQ = QUANTIZE_OPS | DEQUANTIZE_OPS | FLOAT8_QUANTIZE_OPS | FLOAT8_DEQUANTIZE_OPS
# ops between the linear and the program's output: dtype casts of the logits
_CASTS = frozenset({_aten.to.dtype, _aten._to_copy.default})


def _lm_head(graph: Graph) -> tuple[Node, Node] | None:
    """``(linear, source)``: the linear whose output is the program's only output, and the node whose
    ``[B, L, hidden]`` value feeds it (through its activation q/dq); None if the graph is not so."""
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is None:
        return None
    result = output.args[0]
    if isinstance(result, (tuple, list)):
        if len(result) != 1:
            return None
        result = result[0]
    node = result
    while isinstance(node, Node) and node.target in _CASTS:
        node = node.args[0]
    if not isinstance(node, Node) or node.target is not _aten.linear.default:
        return None
    source = node.args[0]
    while isinstance(source, Node) and source.target in _QDQ:
        source = source.args[0]
    val = source.meta.get("val") if isinstance(source, Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 3:
        return None
    return node, source


def _between(linear: Node, source: Node) -> set[Node]:
    """The nodes on the paths from ``source`` to ``linear`` (its q/dq and run-time qparams ops)."""
    seen, stack = set(), [linear]
    while stack:
        node = stack.pop()
        if node in seen or node is source:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def last_position_program(program) -> GraphModule | None:
    """A copy of ``program`` whose logits are those of its input's last position, ``[B, 1, vocab]``.

    The copy shares ``program``'s parameters and buffers (the KV cache included: a call of either
    writes the cache the other reads) and its ``meta``; its graph is a copy with one
    ``aten.slice`` inserted before the lm_head. ``program`` is not changed.

    Args:
        program: a KV-cache program (``quantkit.capture(..., max_cache_len=N)``, ``convert`` of it,
            ``quantkit.load`` of its artifact) whose only output is an ``aten.linear``'s (the lm_head).

    Returns:
        The rewritten GraphModule, or None when ``program`` is no such graph (then generation
        runs it as it is).
    """
    if not isinstance(program, GraphModule) or program.meta.get(LAST_POSITION_META_KEY):
        return None
    found = _lm_head(program.graph)
    if found is None:
        return None
    linear, source = found
    inside = _between(linear, source)
    graph = Graph()
    graph._codegen = program.graph._codegen  # torch.export's pytree calling convention, kept
    copies: dict[Node, Node] = {}
    result = graph.graph_copy(program.graph, copies)
    graph.output(result)
    new_source = copies[source]
    with graph.inserting_after(new_source):
        last = graph.call_function(_aten.slice.Tensor, (new_source, 1, -1, sys.maxsize))
    val = source.meta["val"]
    mode = getattr(val, "fake_mode", None)
    if mode is not None:  # lowering passes read shapes from meta["val"]
        with mode:
            last.meta["val"] = val[:, -1:, :]
    for node in inside:
        copies[node].replace_input_with(new_source, last)
    rewritten = GraphModule(program, graph, class_name=type(program).__name__)
    rewritten.meta.update(program.meta)
    rewritten.meta[LAST_POSITION_META_KEY] = True
    return rewritten
