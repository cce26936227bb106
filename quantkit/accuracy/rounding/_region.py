"""AWQ's module-output loss: the part of the graph a group of linears feeds, run on captured
inputs with candidate weights.

The reference AWQ (llm-awq, AutoAWQ, llm-compressor) scores the scales of ``q/k/v`` by the
attention block's output and those of ``gate/up`` by the MLP's, not by the linears' own
outputs: an error in ``q`` or ``k`` matters through the softmax, one in ``gate`` through the
activation and the product with ``up``. Here that block is found in the graph, without module
names: the **output region** of a group's input ``src`` is every node between ``src`` and one
of its post-dominators (nodes every path from ``src`` passes through):

- ``end="merge"`` (quantkit's default, measured better and faster on SmolLM2: BENCHMARKS.md):
  the first post-dominator where two values from the region meet (the SDPA or the
  ``softmax(q kᵀ) v`` matmul of ``q/k/v``, fused or not; the ``silu(gate) * up`` product),
  or, where none comes before the next linear or residual add, the last one before it
  (``fc1``'s activation; ``o_proj`` itself);
- ``end="residual"`` (the reference's module output): the first post-dominator that adds the
  region's result to a value from outside (the residual ``add`` after ``o_proj`` or
  ``down_proj``), the region ending at that result (the residual cancels in the error); with
  no such add it ends as ``"merge"``.

:func:`output_region` finds it; :class:`RegionScorer` runs it as a small GraphModule,
the group's weights as inputs, and returns ``Σ ‖region(W) - region(W')‖²`` per candidate.

A region whose ops all act on each row (token) alone (linears, pointwise ops, reductions and
norms over the last dimension, no input besides ``src`` and per-channel constants:
:attr:`Region.separable`, the gated MLP) is scored on AWQ's uniform row sample. Any other
(attention, which mixes the tokens of a sequence and reads the mask and the rotary tables) is
scored on whole calibration batches: :class:`BatchSample` keeps, per region, the values of
``src`` and of every other input for the batches with the smallest keys (seeded by the batch's
values, as ``_sample``'s row keys) whose rows fit a budget, so that the batches kept are a
function of the multiset of batches, the same under a process group (:meth:`BatchSample.merge`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from ..._graph import get_attr
from ._sample import value_key

__all__ = ["Region", "output_region", "feeds_attention_scores", "BatchSample", "store_tap", "RegionScorer"]

aten = torch.ops.aten
_MAX_NODES = 400  # a region larger than this is not one block: the group falls back to its linears' outputs
_ROW_OPS = {aten.linear.default, aten.to.dtype, aten._to_copy.default, aten.alias.default,
            aten._assert_tensor_metadata.default}
_LAST_DIM_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default}
_NORMS = {aten.layer_norm.default} | ({aten.rms_norm.default} if hasattr(aten, "rms_norm") else set())
_SDPA = {aten.scaled_dot_product_attention.default}
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math"):
    if hasattr(aten, _name):
        _SDPA.add(getattr(aten, _name).default)
_MATMULS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default}


@dataclass
class Region:
    """The nodes between a group's input ``src`` and its post-dominator (see the module docstring)."""

    src: Node
    nodes: list[Node]            # topological order
    out: Node                    # the value compared
    inputs: list[Node]           # values read from outside besides src and get_attrs
    separable: bool              # every op acts on each row alone
    linears: list[Node] = field(default_factory=list)  # the group's linears (in nodes)

    @property
    def trivial(self) -> bool:
        """The region is the group's one linear: its output loss is the linears' own."""
        return len(self.nodes) == 1 and self.nodes[0] is self.out and self.out in self.linears


def _row_wise(n: Node) -> bool:
    t = n.target
    if t in _ROW_OPS or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
        return True
    if t in _LAST_DIM_REDUCTIONS:
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        return keep and isinstance(dims, (list, tuple)) and list(dims) == [-1]
    if t in _NORMS:
        shape = n.args[1] if len(n.args) > 1 else None
        return isinstance(shape, (list, tuple)) and len(shape) == 1
    return False


def _small_constant(gm: GraphModule | None, n: Node) -> bool:
    """A get_attr of at most one dimension (broadcast along the rows)."""
    if gm is None:
        return False
    t = get_attr(gm, n.target)
    return isinstance(t, torch.Tensor) and t.dim() <= 1


def output_region(src: Node, linears: list[Node], root: GraphModule | None = None, *,
                  end: str = "merge") -> Region | None:
    """The output region of ``src`` (whose users include ``linears``) up to ``end`` (see the
    module docstring), or None where there is no block-sized one (no post-dominator before the
    graph's output within ``_MAX_NODES``)."""
    if end not in ("merge", "residual"):
        raise ValueError(f"end must be 'merge' or 'residual', got {end!r}")
    pending = set(src.users)
    region: list[Node] = []
    last = None  # (length, node) at the latest post-dominator kept
    node = src.next
    while node.op != "root":
        if node in pending:
            if node.op == "output" or len(region) >= _MAX_NODES:
                break
            region.append(node)
            if len(pending) == 1:  # every path from src passes through node
                inside = set(region)
                mine = _residual_operand(node, inside, src)
                if mine is not None:  # the residual add: compare the region's own result
                    region.pop()
                    if end == "residual" or last is None:
                        return _region(root, src, region, mine, linears)
                    break
                if end == "merge":
                    if last is not None and node.target is aten.linear.default and node not in linears:
                        break  # the next linear: the region ends before it
                    last = (len(region), node)
                    if sum(a in inside for a in set(node.all_input_nodes)) >= 2:
                        break  # the group's outputs meet here
                else:
                    last = (len(region), node)
            pending.remove(node)
            pending.update(node.users)
        node = node.next
    if last is None:
        return None
    return _region(root, src, region[:last[0]], last[1], linears)


def _residual_operand(end: Node, inside: set, src: Node) -> Node | None:
    """``end``'s operand from inside the region when ``end`` adds to it a value from outside."""
    if end.target is not aten.add.Tensor or len(end.args) != 2 or end.kwargs:
        return None
    a, b = end.args
    for mine, other in ((a, b), (b, a)):
        if isinstance(mine, Node) and mine in inside and mine is not end and isinstance(other, Node) \
                and other not in inside and other is not src:
            return mine
    return None


def _region(root, src: Node, region: list[Node], out: Node, linears: list[Node]) -> Region | None:
    inside = set(region)
    if not all(lin in inside for lin in linears):
        return None
    inputs, seen = [], set()
    for n in region:
        for a in n.all_input_nodes:
            if a is src or a in inside or a.op == "get_attr" or a in seen:
                continue
            seen.add(a)
            inputs.append(a)
    separable = not inputs and all(
        n.op == "call_function" and _row_wise(n)
        and all(a.op != "get_attr" or n.target is aten.linear.default or _small_constant(root, a)
                for a in n.all_input_nodes)
        for n in region)
    return Region(src, region, out, inputs, separable, list(linears))


def feeds_attention_scores(linear: Node, *, depth: int = 32) -> bool:
    """``linear``'s output reaches an attention's scores (an SDPA's query or key, or a matmul
    whose result goes to a softmax) without passing another linear: a query or key projection."""
    frontier, seen = [linear], {linear}
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen or u.op != "call_function":
                    continue
                seen.add(u)
                if u.target in _SDPA:
                    if any(a is n for a in u.args[:2]):
                        return True
                    continue
                if u.target is aten.linear.default:
                    continue
                if u.target in _MATMULS and _reaches_softmax(u):
                    return True
                nxt.append(u)
        frontier = nxt
        if not frontier:
            break
    return False


def _reaches_softmax(n: Node, depth: int = 4) -> bool:
    frontier = [n]
    for _ in range(depth):
        frontier = [u for f in frontier for u in f.users if u.op == "call_function"]
        if any(u.target in _SOFTMAX for u in frontier):
            return True
        if any(u.target in _MATMULS or u.target is aten.linear.default for u in frontier):
            return False
    return False


# --- whole batches for the regions that mix a sequence's rows -----------------------------------
class BatchSample:
    """For each of a set of regions, the values of its ``src`` and inputs on the calibration
    batches with the smallest keys whose rows total at most ``budget`` (at least one batch).

    Use :meth:`batch` around each batch's forward and :meth:`store` from taps."""

    def __init__(self, budget: int, seed: int = 0) -> None:
        self.budget, self.seed = int(budget), int(seed)
        self.kept: list[tuple[float, int, dict]] = []  # (key, rows, {slot: value}) sorted by key
        self._current: dict | None = None

    @contextlib.contextmanager
    def batch(self, args, kwargs):
        leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self._current = {}
        try:
            yield
            values = self._current
            rows = max((v.numel() // max(1, v.shape[-1]) for k, v in values.items()
                        if k[1] == "src" and isinstance(v, torch.Tensor) and v.dim()), default=0)
            if values and rows:
                self.merge([(value_key(leaves, self.seed), rows, values)])
        finally:
            self._current = None

    def store(self, slot: tuple, value) -> None:
        if self._current is not None:
            self._current[slot] = value.detach() if isinstance(value, torch.Tensor) else value

    def merge(self, items: list[tuple[float, int, dict]]) -> None:
        """Take in batches (another rank's); keep the smallest keys within the budget."""
        kept = sorted(self.kept + list(items), key=lambda it: it[0])
        total, keep = 0, []
        for it in kept:
            if keep and total + it[1] > self.budget:
                break
            keep.append(it)
            total += it[1]
        self.kept = keep

    def values(self, group: int) -> list[dict]:
        """Per kept batch, ``{name: value}`` of region ``group`` (slots ``(group, name)``)."""
        return [{name: v for (g, name), v in vals.items() if g == group} for _, _, vals in self.kept]


class _Store(torch.nn.Module):
    def __init__(self, sample: BatchSample, slots: list[tuple]) -> None:
        super().__init__()
        self.sample, self.slots = sample, slots

    def forward(self, x):
        for slot in self.slots:
            self.sample.store(slot, x)
        return x


def store_tap(sample: BatchSample, slots: list[tuple]) -> torch.nn.Module:
    """A tap module storing its value under ``slots`` into ``sample`` (one node, many regions)."""
    return _Store(sample, slots)


# --- running a region ------------------------------------------------------------------------------
class RegionScorer:
    """``region`` as a GraphModule over ``root``'s current attributes, the group's weights
    (``weights``: get_attr targets, one per linear) passed in, and its float output on the
    captured inputs ``batches`` (``[{"src": value, "in0": value, ...}, ...]``)."""

    def __init__(self, root: torch.nn.Module, region: Region, weights: list[str], batches: list[dict]) -> None:
        graph = Graph()
        env: dict[Node, Node] = {region.src: graph.placeholder("src")}
        for i, n in enumerate(region.inputs):
            env[n] = graph.placeholder(f"in{i}")
        self.weights = list(weights)
        w_ph = {t: graph.placeholder(f"w{i}") for i, t in enumerate(self.weights)}
        for n in region.nodes:
            if n.target is aten._assert_tensor_metadata.default:
                continue  # a check of the traced shapes (row samples are 2-D)
            for a in n.all_input_nodes:
                if a not in env and a.op == "get_attr":
                    env[a] = w_ph[str(a.target)] if str(a.target) in w_ph else graph.get_attr(str(a.target))
            env[n] = graph.node_copy(n, lambda a: env[a])
        graph.output(env[region.out])
        self.gm = GraphModule(root, graph)
        self.args = [[b["src"]] + [b[f"in{i}"] for i in range(len(region.inputs))] for b in batches]
        with torch.no_grad():
            self.reference_weights = [get_attr(root, t) for t in self.weights]
            self.reference = [self.gm(*a, *self.reference_weights).detach() for a in self.args]

    def dtype(self, i: int) -> torch.dtype:
        """The dtype of the group's ``i``-th weight."""
        return self.reference_weights[i].dtype

    def errors(self, candidates) -> torch.Tensor:
        """``Σ ‖region(candidate) - region(float)‖²`` (float64) for each candidate (an iterable of
        lists, one weight per linear)."""
        errs = []
        with torch.no_grad():
            for ws in candidates:
                e = torch.zeros((), dtype=torch.float64)
                for a, ref in zip(self.args, self.reference):
                    e += (self.gm(*a, *ws).float() - ref.float()).pow(2).sum(dtype=torch.float64)
                errs.append(e)
        return torch.stack(errs)
