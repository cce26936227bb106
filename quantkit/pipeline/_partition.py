"""Cut an exported graph into a chain of blocks at the model's repeated units.

The repeated unit is found from the graph alone: every node records the modules it ran in
(``nn_module_stack``); a module path ending in an index (``model.layers.3``) is an entry of
a list, and the list whose entries run the same sequence of ops (transformer layers) and
cover the most nodes is the chain. Nodes before the first entry form the head (embeddings,
masks, rotary tables), nodes after the last one the tail (final norm, LM head). Values
crossing a boundary (hidden states, masks, cos/sin, sizes) become the blocks' inputs and
outputs; weights (``get_attr``) are read by each block that uses them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch.fx import Graph, GraphModule, Node

from .._errors import CaptureError

__all__ = ["Block", "find_repeated_unit", "partition", "run_block"]

_ENTRY = re.compile(r"(?P<parent>.+)\.(?P<index>[0-9]+)\Z")


@dataclass
class Block:
    """One link of the chain: ``module(*values of inputs)`` returns the values of ``outputs``.

    ``origin`` maps each node name of ``module``'s graph to the node of the partitioned graph
    it copies (the same name, unless FX had to rename it)."""

    index: int
    name: str
    module: GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[str, ...]
    origin: dict[str, Node] = field(default_factory=dict)


def _stack_paths(node: Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]


def _signature(node: Node) -> str:
    return str(node.target) if node.op == "call_function" else node.op


def find_repeated_unit(gm: GraphModule) -> tuple[str, int]:
    """``(list path, entry count)`` of the model's repeated unit, e.g. ``("model.layers", 4)``.

    Raises:
        CaptureError: no list of at least two structurally identical entries.
    """
    runs: dict[str, dict[int, list[str]]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        seen = set()
        for path in _stack_paths(node):
            m = _ENTRY.match(path)
            if m and (m["parent"], m["index"]) not in seen:
                seen.add((m["parent"], m["index"]))
                runs.setdefault(m["parent"], {}).setdefault(int(m["index"]), []).append(_signature(node))
    best = None
    for parent, entries in runs.items():
        if sorted(entries) != list(range(len(entries))):
            continue
        first = entries[0]
        if any(ops != first for ops in entries.values()):
            continue
        # a list of two or more identical entries first (a one-layer model's list of one otherwise),
        # then the one covering the most nodes (transformer layers before the experts inside them)
        key = (len(entries) >= 2, len(first) * len(entries))
        if best is None or key > best[0]:
            best = (key, parent, len(entries))
    if best is None:
        raise CaptureError("found no repeated unit (a list of identical layers) in the captured graph; "
                           "this model cannot be quantized block by block, quantize it in memory")
    return best[1], best[2]


def _assign(gm: GraphModule, parent: str, count: int) -> dict[Node, int]:
    """Block index of every node but ``get_attr`` ones: 0 head, 1..count the entries, count+1 tail."""
    entry = re.compile(re.escape(parent) + r"\.(?P<index>[0-9]+)(\.|\Z)")
    nodes = list(gm.graph.nodes)
    layer: dict[Node, int] = {}
    for node in nodes:
        for path in _stack_paths(node):
            m = entry.match(path)
            if m:
                layer[node] = int(m["index"]) + 1
                break
    last_layer_pos = max((i for i, n in enumerate(nodes) if n in layer), default=-1)
    tail = count + 1
    block: dict[Node, int] = {}
    deferred: list[Node] = []
    for pos, node in enumerate(nodes):
        if node.op == "get_attr":
            continue
        if node.op == "placeholder":
            block[node] = 0
            continue
        if node.op == "output":
            block[node] = tail
            continue
        deps = [block[a] for a in node.all_input_nodes if a in block]
        if node in layer:
            block[node] = max([layer[node], *deps])
        elif pos > last_layer_pos:
            block[node] = max([tail, *deps])
        elif deps:
            block[node] = max(deps)
        else:  # computed from weights or from nothing (arange): placed with its first consumer
            deferred.append(node)
    for node in reversed(deferred):
        users = [block[u] for u in node.users if u in block]
        block[node] = min(users) if users else 0
    for node in nodes:  # a chain: nothing reads a value of a later block
        for a in node.all_input_nodes:
            if a in block and node in block and block[a] > block[node]:
                raise CaptureError(f"cannot cut the graph into a chain at {parent!r}: node {node.name!r} of block "
                                   f"{block[node]} reads {a.name!r} of block {block[a]}; quantize it in memory")
    return block


def partition(gm: GraphModule, parent: str | None = None, count: int | None = None) -> list[Block]:
    """Cut ``gm`` (a captured or prepared graph) into ``count + 2`` blocks: head, the entries of
    the repeated unit ``parent`` (found with :func:`find_repeated_unit` by default), tail.

    The blocks' modules share ``gm``'s submodules (observers) and read its attributes as
    they are when the block is built; ``gm`` itself is not modified.
    """
    if parent is None or count is None:
        parent, count = find_repeated_unit(gm)
    block = _assign(gm, parent, count)
    nodes = list(gm.graph.nodes)
    n_blocks = count + 2
    # the last block that reads each value (the output node reads the model's outputs)
    last_use: dict[Node, int] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            if a.op != "get_attr" and node in block:
                last_use[a] = max(last_use.get(a, -1), block[node])
    blocks = []
    for b in range(n_blocks):
        graph = Graph()
        env: dict[Node, Node] = {}
        members = [n for n in nodes if block.get(n) == b and n.op != "output"]
        member_set = set(members)
        inputs = [a for a in nodes if a not in member_set and a.op != "get_attr" and a in block and block[a] < b
                  and any(block.get(u) == b for u in a.users)]
        for a in inputs:
            env[a] = graph.placeholder(a.name)
            env[a].meta.update(a.meta)
        attributes = []

        def arg(a: Node) -> Node:
            if a not in env:  # a weight read by this block
                env[a] = graph.node_copy(a)
                attributes.append(str(a.target))
            return env[a]

        for node in members:
            if node.op == "placeholder":
                env[node] = graph.placeholder(node.name)
                env[node].meta.update(node.meta)
                inputs.append(node)
                continue
            for a in node.all_input_nodes:
                if a.op == "get_attr":
                    arg(a)
            env[node] = graph.node_copy(node, lambda a: env[a])
        outputs = [n for n in members if last_use.get(n, -1) > b and n.op != "output"]
        graph.output(tuple(env[n] for n in outputs))
        module = GraphModule(gm, graph, class_name=f"Block{b}")
        name = "head" if b == 0 else "tail" if b == n_blocks - 1 else f"{parent}.{b - 1}"
        origin = {env[n].name: n for n in env}
        blocks.append(Block(b, name, module, tuple(a.name for a in inputs), tuple(n.name for n in outputs),
                            tuple(attributes), origin))
    return blocks


def run_block(block: Block, values: dict) -> dict:
    """Run ``block`` on the boundary values it reads; returns the values it produces."""
    out = block.module(*[values[name] for name in block.inputs])
    return dict(zip(block.outputs, out))

