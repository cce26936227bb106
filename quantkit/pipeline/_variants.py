"""Build quantized variants of one model that keep different layers float, calibrating once.

Observers see float activations during calibration whatever else is quantized, so an
observer's statistics do not depend on which other layers are quantized. The model is
prepared and calibrated once with every layer quantized; each variant is prepared with
:class:`KeepFloat` and its observers are copies of the calibrated ones that watch the
same tensors. Where that match is not exact (e.g. observers shared across several
tensors change with the variant), the variant is calibrated afresh.

A search scores dozens of variants (issue 28: 59 builds of ~0.8 s each, prepare + convert, were a
third of the default ``quantkit quantize``), so :meth:`Variants.variant` builds a *scoring* copy
without a prepare or convert: the one converted graph with the kept-float layers pointed at their
float weights and the quantize/dequantize pairs that served only them bypassed, which is what a
:class:`KeepFloat` build gives (the same ops on the same values). Where that cannot be guaranteed
(a weight that is not a plain attribute, or a first variant that is not bit-equal to its real
build) it is the real :meth:`build`. Dynamic graphs take the shortcut too: a float layer's input
bypasses its run-time ``choose_qparams -> quantize -> dequantize`` as a static one bypasses its
q/dq pair (measured bit-equal to the real builds on per-token MiniLM with SmoothQuant; the default
search's per-token fallback built 37+ models for real before, ~25 s of its 45 s). The artifact is
always built the real way.
"""

from __future__ import annotations

import copy
import operator
import weakref
from typing import Iterable

import torch
from torch.fx import GraphModule, Node

from quantkit._graph import (CHOOSE_QPARAMS_OPS, DEQUANTIZE_OPS, QUANTIZE_OPS, constant_value, get_attr,
                             is_observer_node, unique_attr_name)
from quantkit._qmath import fake_quantize_fused as _fake_quant, fake_quantize_per_token
from quantkit.observers import DerivedObserver
from quantkit.quantizers import W8A8Quantizer

from ._calibrate import calibrate
from ._capture import capture
from ._convert import convert, convert_in_place
from ._float_fallback import finish_float_layers
from ._inputs import call_model
from ._layers import _MOVES, FLOAT_WEIGHT_DTYPES, KeepFloat, Layer, find_layers
from ._prepare import from_attributes, prepare

__all__ = ["Variants", "fuse_qdq", "scoring_copy", "Resumed", "SCORING_WEIGHTS_META_KEY"]

# torch's own GraphModule that writes its Python code when first called, not at each edit: a scoring
# copy was recompiled three times (~30 ms each for MiniLM's 1,000 nodes; issue 28: a fifth of the
# fallback search), and a resumed skip-one variant, run node by node, never needs its code
try:
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:  # pragma: no cover - an older torch: code at construction, as GraphModule does
    _LazyGraphModule = GraphModule


def _producer(node: Node, modules: dict) -> str:
    while is_observer_node(node, modules):
        node = node.args[0]
    return node.name


def _observer_groups(prepared: GraphModule) -> dict[tuple, tuple[torch.nn.Module, list[str]]]:
    """Key (config + watched tensors) -> (observer instance, its submodule names)."""
    modules = dict(prepared.named_modules(remove_duplicate=False))
    watched: dict[int, set[str]] = {}
    names: dict[int, list[str]] = {}
    instances: dict[int, torch.nn.Module] = {}
    for node in prepared.graph.nodes:
        if not is_observer_node(node, modules):
            continue
        obs = modules[str(node.target)]
        watched.setdefault(id(obs), set()).add(_producer(node.args[0], modules))
        names.setdefault(id(obs), []).append(str(node.target))
        instances[id(obs)] = obs
    groups = {}
    for key, obs in instances.items():
        config = (type(obs), str(getattr(obs, "dtype", "")), str(getattr(obs, "qscheme", "")),
                  getattr(obs, "quant_min", None), getattr(obs, "quant_max", None),
                  getattr(obs, "ch_axis", None), bool(getattr(obs, "is_dynamic", False)))
        groups[config + (frozenset(watched[key]),)] = (obs, names[key])
    return groups


def _float_weights(prepared: GraphModule, layers: list[Layer]) -> dict[str, dict[int, torch.Tensor] | None]:
    """Layer name -> {argument index: the float tensor its weight observer watches} (the value a
    KeepFloat build leaves in place of the int8 weight); None where a quantized argument other than
    the activation is not ``observer(get_attr)`` (then that layer's variants are built for real)."""
    modules = dict(prepared.named_modules(remove_duplicate=False))
    nodes = {n.name: n for n in prepared.graph.nodes}
    out: dict[str, dict[int, torch.Tensor] | None] = {}
    for layer in layers:
        node, weights = nodes.get(layer.name), {}
        if node is None:
            out[layer.name] = None
            continue
        for i, arg in enumerate(node.args):
            if not (isinstance(arg, Node) and is_observer_node(arg, modules)):
                continue
            src = arg.args[0]
            if src.op == "get_attr":
                weights[i] = get_attr(prepared, src.target)
            elif from_attributes(src):
                weights = None  # a computed constant (a transposed weight): not a plain attribute
                break
        out[layer.name] = weights
    return out


def _terminals(dq: Node, out: set) -> bool:
    """Add to ``out`` every (layer node, argument index) that the dequantize ``dq`` feeds through
    view-like ops and further quantize/dequantize pairs; False when it also feeds anything else."""
    todo = [(dq, u) for u in dq.users]
    while todo:
        src, user = todo.pop()
        if user.op != "call_function":
            return False
        if user.target in _MOVES and user.args and user.args[0] is src:
            todo.extend((user, u) for u in user.users)
        elif user.target in QUANTIZE_OPS and user.args[0] is src:
            for d in user.users:
                if d.op != "call_function" or d.target not in DEQUANTIZE_OPS:
                    return False
                todo.extend((d, u) for u in d.users)
        else:
            idx = [i for i, a in enumerate(user.args) if a is src]
            if not idx or any(user.kwargs.get(k) is src for k in user.kwargs):
                return False
            out.update((user, i) for i in idx)
    return True


class Variants:
    """A model calibrated once, from which variants with float layers are built.

    Args:
        model: the float model (or an already captured GraphModule).
        example_inputs: one batch to capture ``model`` with (ignored for a GraphModule).
        calib_data: calibration batches (iterated again only for variants whose
            observers cannot be copied).
        quantizer: the quantizer for the all-quantized model.
        prepared: ``model`` (a GraphModule) already prepared with ``quantizer`` and calibrated on
            ``calib_data`` (a search that scored the all-int8 recipe has one): it is used as it
            is (not modified) instead of preparing and calibrating again.
        float_weights: ``"fp32"`` (default), ``"bf16"`` or ``"int8"`` (per channel): what the kept-float
            layers' weights are stored in (``KeepFloat(float_weights=...)``; bf16 and int8 also read their inputs unrounded, see
            ``pipeline/_float_fallback``). Scoring copies apply the same, so a search scores the
            artifact it will build.
    """

    def __init__(self, model: torch.nn.Module, example_inputs, calib_data: Iterable, quantizer, *,
                 prepared: GraphModule | None = None, float_weights: str = "fp32") -> None:
        if float_weights not in FLOAT_WEIGHT_DTYPES:
            raise ValueError(f"unknown float_weights {float_weights!r}; use 'fp32', 'bf16' or 'int8'")
        self.float_weights = float_weights
        if quantizer is None:
            quantizer = W8A8Quantizer()
        self.quantizer = quantizer
        self.calib_data = calib_data
        self.float_graph = model if isinstance(model, GraphModule) else capture(model, example_inputs)
        if prepared is None:
            prepared = prepare(self.float_graph, quantizer)  # prepare copies; the float graph stays as it is
            calibrate(prepared, calib_data, progress=False, distributed=False)  # every rank has all the data
        elif "quantkit_calibrated_batches" not in prepared.meta:
            raise ValueError("Variants(prepared=...) takes a calibrated prepared model; calibrate it first")
        self.prepared = prepared  # calibrated (not modified): another Variants of it skips the calibration
        self._batches = prepared.meta["quantkit_calibrated_batches"]
        # convert leaves the prepared model (and so these observers) as they are
        self._groups = _observer_groups(prepared)
        if not self._groups:
            raise ValueError("the quantizer quantizes no linear, conv, matmul or add op in this model; nothing to analyse")
        self.quantized = convert(prepared)
        self.layers: list[Layer] = find_layers(self.quantized)
        if not self.layers:
            raise ValueError("the quantizer quantizes no linear, conv, matmul or add op in this model; nothing to analyse")
        self.rebuilt = 0  # variants that needed a fresh calibration (for tests and reports)
        # the scoring shortcut (see the module docstring): None until its first variant is checked
        # against a real build, then whether it was bit-equal
        self._weights = _float_weights(prepared, self.layers)
        self.cheap: bool | None = None
        self.built = 0  # real builds (prepare + convert) done, for tests and reports
        self._scoring: GraphModule | None = None  # the all-int8 model's scoring copy
        # int8 float-layer weights, rounded once per weight for all scoring copies (float_weights="int8")
        self._rounded: dict = {}

    def quantizer_for(self, keep_float: Iterable[str]):
        names = frozenset(keep_float)
        return self.quantizer if not names else KeepFloat(self.quantizer, names, float_weights=self.float_weights)

    def build(self, keep_float: Iterable[str]) -> GraphModule:
        """The converted model with the layers named in ``keep_float`` left float."""
        names = frozenset(keep_float)
        if not names:
            return copy.deepcopy(self.quantized)
        self.built += 1
        prepared = prepare(self.float_graph, self.quantizer_for(names))
        modules = dict(prepared.named_modules(remove_duplicate=False))
        if not any(is_observer_node(n, modules) for n in prepared.graph.nodes):
            prepared.meta.pop("quantkit_prepared", None)
            return prepared  # everything float: nothing to convert
        if not self.calibrate_like(prepared):
            self.rebuilt += 1
            calibrate(prepared, self.calib_data, progress=False, distributed=False)  # every rank has all the data
        return convert_in_place(prepared)  # our own prepared model: no copy needed

    def calibrate_like(self, prepared: GraphModule) -> bool:
        """Give ``prepared`` (this float graph prepared again, e.g. with some layers skipped) copies of
        this object's calibrated observers, in place, where each of its observers matches one here
        exactly (the same configuration watching the same tensors): what calibrating it on the same
        data gives, without running the data again. Returns False, changing nothing, where they do
        not all match (then calibrate it)."""
        if not self._copy_observers(prepared):
            return False
        prepared.meta["quantkit_calibrated_batches"] = self._batches
        return True

    def variant(self, keep_float: Iterable[str]) -> GraphModule:
        """A model computing what ``build(keep_float)`` computes, for scoring only: the converted
        graph rewired (no prepare, no convert) where that is known to be exact, else ``build``.
        It shares tensors with this object's converted model (do not modify them); its
        ``meta`` does not describe its own qparams: build the artifact with :meth:`build`."""
        names = frozenset(keep_float)
        if not names:
            if self._scoring is None:
                self._scoring = scoring_copy(self.quantized)
            return self._scoring
        if self.cheap is False or any(self._weights.get(n) is None for n in names):
            return self.build(names)
        cheap = self._rewire(names)
        if cheap is None:
            return self.build(names)
        # (a lazy GraphModule: these edits' recompiles only mark it; its code is written at a first call)
        if self.float_weights != "fp32":  # what convert does for KeepFloat(float_weights=...)
            finish_float_layers(cheap, sorted(names), self.float_weights, rounded=self._rounded)
        if self.cheap is None:  # the first one is checked against the real build, bit for bit
            real = self.build(names)
            self.cheap = _same(cheap, real, next(iter(self.calib_data)))
            if not self.cheap:
                return real
        return fuse_qdq(cheap)

    def weights_float(self) -> GraphModule | None:
        """The all-int8 scoring copy with every layer's weight float and every activation still
        rounded as it is: what perfect weight rounding gives (a weight algorithm such as GPTQ only
        moves the int8 weights towards these). None where a weight is not a plain attribute."""
        names = frozenset(layer.name for layer in self.layers)
        if self.cheap is False or any(self._weights.get(n) is None for n in names):
            return None
        gm = self._rewire(names, bypass=False)
        return None if gm is None else fuse_qdq(gm)

    def _rewire(self, names: frozenset, bypass: bool = True) -> GraphModule | None:
        """The converted graph with ``names``' weights float and (``bypass``) the activation q/dq
        that served only them bypassed."""
        graph = torch.fx.Graph()
        env: dict[Node, Node] = {}
        out = graph.graph_copy(self.quantized.graph, env)
        graph.output(out)
        graph._codegen = copy.deepcopy(self.quantized.graph._codegen)  # inputs/outputs as pytrees, as captured
        new = {old.name: n for old, n in env.items()}
        weights: dict[str, torch.Tensor] = {}
        for name in sorted(names):
            node = new[name]
            for i, w in self._weights[name].items():
                dq = node.args[i]
                if not (isinstance(dq, Node) and dq.op == "call_function" and dq.target in DEQUANTIZE_OPS):
                    return None
                attr = f"_qk_variant_float_{len(weights)}"
                weights[attr] = w
                with graph.inserting_before(dq):
                    node.update_arg(i, graph.get_attr(attr))
        for dq in [n for n in graph.nodes if bypass and n.op == "call_function" and n.target in DEQUANTIZE_OPS]:
            q = dq.args[0]
            if not (isinstance(q, Node) and q.op == "call_function" and q.target in QUANTIZE_OPS) or not dq.users:
                continue
            served: set = set()
            if _terminals(dq, served) and served and all(layer.name in names for layer, _ in served):
                dq.replace_all_uses_with(q.args[0])
        _drop_dead(graph)
        # a dict root: the new module holds the converted model's own tensors and submodules, no copies
        root = {str(n.target): weights[n.target] if n.target in weights else get_attr(self.quantized, n.target)
                for n in graph.nodes if n.op in ("get_attr", "call_module")}
        gm = _LazyGraphModule(root, graph)  # its code is generated at its first call: a resumed variant has none
        gm.meta.update(self.quantized.meta)
        gm.meta["quantkit_variant_of"] = sorted(names)
        return gm

    def _copy_observers(self, prepared: GraphModule) -> bool:
        groups = _observer_groups(prepared)
        if any(key not in self._groups for key in groups) or any(
            isinstance(obs, DerivedObserver) for obs, _ in list(groups.values()) + list(self._groups.values())
        ):
            return False
        for key, (obs, names) in groups.items():
            new = copy.deepcopy(self._groups[key][0])
            new.node_name = obs.node_name
            for name in names:
                setattr(prepared, name, new)
        return True


_QD = torch.ops.quantized_decomposed
_Q, _DQ = _QD.quantize_per_tensor.default, _QD.dequantize_per_tensor.default
_CHOOSE_TOKEN, _Q_TOKEN, _DQ_TOKEN = (_QD.choose_qparams_per_token.default, _QD.quantize_per_token.default,
                                      _QD.dequantize_per_token.default)


# the int8 weight's memory (storage address and offset, shape, strides, dtype) -> (a weak reference
# to the first tensor seen there, its version counter, {(its dequantize's other arguments): the
# float32 weight}): the scoring copies of one search share their int8 weights' memory (each graph
# holds its own Parameter object for it), so each weight is dequantized once per search. An entry
# goes with that first tensor (while it lives, so does the memory: no other tensor has its address),
# and an in-place write (a new version) starts it afresh
_DEQUANTIZED: dict[tuple, tuple[weakref.ref, int, dict]] = {}
# gm.meta key of a scoring copy: {float32 buffer name: the int8 weight attribute it stands for}
SCORING_WEIGHTS_META_KEY = "quantkit_scoring_weights"


def _memo_of(weight: torch.Tensor) -> dict:
    key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(),
           weight.dtype)
    entry = _DEQUANTIZED.get(key)
    if entry is None or entry[0]() is None or entry[1] != weight._version:
        entry = _DEQUANTIZED[key] = (weakref.ref(weight), weight._version, {})
        weakref.finalize(weight, _forget, key, entry)
    return entry[2]


def _forget(key: tuple, entry: tuple) -> None:
    if _DEQUANTIZED.get(key) is entry:  # not an entry made since for the same memory
        del _DEQUANTIZED[key]


def _constant_dequantize(gm: GraphModule, dq: Node, constants: dict) -> torch.Tensor | None:
    """The float value of a ``dequantize`` whose tensor inputs are all attributes that the graph
    never writes (a weight; read by :func:`quantkit._graph.constant_value` with its memo
    ``constants``), computed once per int8 tensor and qparams across graphs by the op itself (so
    bit-equal to what every call computed); None for any other dequantize."""
    if dq.kwargs or not dq.args or not all(not isinstance(a, Node) or a.op == "get_attr" for a in dq.args):
        return None
    values = [constant_value(gm, a, constants) for a in dq.args]
    if any(v is None for a, v in zip(dq.args, values) if isinstance(a, Node)):  # an attribute the graph writes
        return None
    weight = values[0]
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.int8, torch.uint8):
        return None
    key = (dq.target, *(id(v) if isinstance(v, torch.Tensor) else v for v in values[1:]))
    memo = _memo_of(weight)
    hit = memo.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], values[1:])):  # ids reused: not the same qparams
        with torch.no_grad():
            hit = memo[key] = (tuple(values[1:]), dq.target(*values))
    return hit[1]


def fuse_qdq(gm: GraphModule) -> GraphModule:
    """In place: every static per-tensor ``quantize -> dequantize`` pair of ``gm`` (float32 in and
    out, 8-bit integers, the same qparams) becomes one :func:`_fake_quant` call: the same values,
    a third of the memory passes (issue 28: the q/dq of the reference graph were most of a scoring
    forward on CPU); every int8 per-token ``choose_qparams -> quantize -> dequantize`` becomes one
    :func:`~quantkit._qmath.fake_quantize_per_token` call; and every int8 weight's dequantize becomes
    its float32 value, computed once (the per-channel dequantize of every weight at every call was a
    fifth of the default search).
    For scoring copies only: the graph no longer has the ops a lowering matches."""
    constants: dict = {}
    for dq in list(gm.graph.nodes):
        if dq.op == "call_function" and dq.target in DEQUANTIZE_OPS:
            value = _constant_dequantize(gm, dq, constants)
            if value is not None:
                # named after the int8 weight: every scoring copy names one weight alike (Resumed matches by name)
                name = unique_attr_name(gm, "_qk_fp32_" + str(dq.args[0].target).replace(".", "_"), sep="_")
                gm.register_buffer(name, value, persistent=False)
                # what the artifact stores for it: the int8 weight (kept as an attribute, as its qparams are)
                # a new dict: a copy's meta shares its source's objects (scoring_copy updates it shallowly)
                gm.meta[SCORING_WEIGHTS_META_KEY] = {**gm.meta.get(SCORING_WEIGHTS_META_KEY, {}),
                                                     name: str(dq.args[0].target)}
                with gm.graph.inserting_before(dq):
                    const = gm.graph.get_attr(name)
                const.meta = dict(dq.meta)
                dq.replace_all_uses_with(const)
                gm.graph.erase_node(dq)
                continue
        if dq.op == "call_function" and dq.target is _DQ_TOKEN:
            _fuse_per_token(gm, dq)
            continue
        if dq.op != "call_function" or dq.target is not _DQ or dq.kwargs:
            continue
        q = dq.args[0]
        if not (isinstance(q, Node) and q.op == "call_function" and q.target is _Q and not q.kwargs):
            continue
        x, scale, zp, qmin, qmax, dtype = q.args[:6]
        out = dq.args[6] if len(dq.args) > 6 else None
        val = x.meta.get("val") if isinstance(x, Node) else None
        if (tuple(dq.args[1:6]) != (scale, zp, qmin, qmax, dtype) or dtype not in (torch.uint8, torch.int8)
                or out not in (None, torch.float32) or not isinstance(scale, float) or not isinstance(zp, int)
                or not (isinstance(val, torch.Tensor) and val.dtype == torch.float32)):
            continue
        with gm.graph.inserting_before(dq):
            fused = gm.graph.call_function(_fake_quant, (x, 1.0 / scale, scale, zp, qmin, qmax))
        fused.meta = dict(dq.meta)
        dq.replace_all_uses_with(fused)
        gm.graph.erase_node(dq)
        if not q.users:
            gm.graph.erase_node(q)
    gm.recompile()
    return gm


def _fuse_per_token(gm: GraphModule, dq: Node) -> None:
    """In place: ``choose_qparams_per_token(x, int8) -> quantize_per_token -> dequantize_per_token``
    (float32 in and out, the run-time qparams of ``x`` itself) becomes one
    :func:`~quantkit._qmath.fake_quantize_per_token` call (the same values; the decomposed ops are
    Python functions of seven passes, a third of a per-token scoring forward); anything else stays."""
    q = dq.args[0] if dq.args else None
    if not (isinstance(q, Node) and q.op == "call_function" and q.target is _Q_TOKEN and not q.kwargs
            and len(q.args) == 6):
        return
    x, scale, zp, qmin, qmax, dtype = q.args
    out = dq.args[6] if len(dq.args) > 6 else dq.kwargs.get("output_dtype", torch.float32)
    if tuple(dq.args[1:6]) != (scale, zp, qmin, qmax, dtype) or dtype is not torch.int8 or out is not torch.float32 \
            or set(dq.kwargs) - {"output_dtype"} or not isinstance(x, Node):
        return
    parts = []
    for node, index in ((scale, 0), (zp, 1)):
        if not (isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem
                and node.args[1] == index):
            return
        parts.append(node.args[0])
    choose = parts[0]
    val = x.meta.get("val")
    if not (parts[1] is choose and isinstance(choose, Node) and choose.op == "call_function"
            and choose.target is _CHOOSE_TOKEN and choose.args == (x, torch.int8) and not choose.kwargs
            and isinstance(val, torch.Tensor) and val.dtype == torch.float32):
        return
    with gm.graph.inserting_before(dq):
        fused = gm.graph.call_function(fake_quantize_per_token, (x, qmin, qmax))
    fused.meta = dict(dq.meta)
    dq.replace_all_uses_with(fused)
    for node in (dq, q, scale, zp, choose):  # each once nothing else reads it
        if not node.users:
            gm.graph.erase_node(node)


def scoring_copy(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` (its own graph, ``gm``'s tensors) with :func:`fuse_qdq` applied: what a
    search scores, computing exactly what ``gm`` computes."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    out = GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return fuse_qdq(out)


def _drop_dead(graph: torch.fx.Graph) -> None:
    """Erase what the rewiring left unused: quantize/dequantize, run-time qparams (a dynamic
    quantize's ``choose_qparams`` and the ``getitem`` nodes reading it), view-like ops and attributes."""
    dead_ops = QUANTIZE_OPS | DEQUANTIZE_OPS | CHOOSE_QPARAMS_OPS | _MOVES

    def dead(node: Node) -> bool:
        if node.users or node.op not in ("get_attr", "call_function"):
            return False
        if node.target is operator.getitem:
            src = node.args[0]
            return isinstance(src, Node) and src.op == "call_function" and src.target in CHOOSE_QPARAMS_OPS
        return node.op == "get_attr" or node.target in dead_ops

    for node in reversed(list(graph.nodes)):
        if dead(node):
            graph.erase_node(node)


def _ops(gm: GraphModule) -> list:
    return sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _same(a: GraphModule, b: GraphModule, batch) -> bool:
    """Whether two models run the same ops (as multisets) and give bit-equal outputs on ``batch``."""
    if _ops(a) != _ops(b):
        return False
    with torch.no_grad():
        xa, xb = call_model(a, batch), call_model(b, batch)
    la, lb = torch.utils._pytree.tree_leaves(xa), torch.utils._pytree.tree_leaves(xb)
    return len(la) == len(lb) and all(
        (torch.equal(u, v) if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) else u == v)
        for u, v in zip(la, lb))


def _flat_inputs(gm: GraphModule, args, kwargs) -> list:
    """The placeholders' values for a call ``gm(*args, **kwargs)`` (its captured input pytree)."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None:
        return list(args) + list(kwargs.values())
    import torch.fx._pytree as fx_pytree

    return list(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), info.in_spec))


def _same_value(a, b, same: set) -> bool:
    if isinstance(a, Node) or isinstance(b, Node):
        return isinstance(a, Node) and isinstance(b, Node) and a.name == b.name and a.name in same
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y, same) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_value(a[k], b[k], same) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


class _Kept(torch.fx.Interpreter):
    """Runs a graph, keeping the values of the nodes named in ``keep``."""

    def __init__(self, gm: GraphModule, keep: set) -> None:
        super().__init__(gm)
        self.keep, self.kept = keep, {}

    def run_node(self, n: Node):
        value = super().run_node(n)
        if n.name in self.keep:
            self.kept[n.name] = value
        return value


class Resumed:
    """Scores variants of one scoring graph from where each first differs from it (issue 28).

    A variant keeping a few layers float computes, up to its first changed node, exactly what the
    all-int8 graph computes. :meth:`plan` finds, for each variant, the nodes it shares with the
    base (same op, same inputs, the same tensors) and the shared values its changed nodes read;
    the base runs once per batch, keeping those values, and each variant runs only its changed
    nodes (:class:`torch.fx.Interpreter`, the same aten ops on the same values: bit-equal
    outputs). Plan every variant before scoring: the base keeps only what the plans need.
    """

    def __init__(self, base: GraphModule) -> None:
        self.base = base
        self._nodes = {n.name: n for n in base.graph.nodes}
        self._needed: set[str] = set()
        self._cache: dict = {}

    def plan(self, gm: GraphModule) -> torch.nn.Module:
        """A module computing what ``gm`` computes, resumed from the base's values."""
        same: set[str] = set()
        for n in gm.graph.nodes:
            b = self._nodes.get(n.name)
            if n.op == "output" or b is None or b.op != n.op or b.target != n.target:
                continue
            if n.op == "placeholder":
                same.add(n.name)
            elif n.op == "get_attr":
                if get_attr(gm, n.target) is get_attr(self.base, b.target):
                    same.add(n.name)
            elif n.op == "call_module":
                if gm.get_submodule(n.target) is self.base.get_submodule(b.target) and \
                        _same_value(n.args, b.args, same) and _same_value(n.kwargs, b.kwargs, same):
                    same.add(n.name)
            elif _same_value(n.args, b.args, same) and _same_value(n.kwargs, b.kwargs, same):
                same.add(n.name)
        frontier = {a.name for n in gm.graph.nodes if n.name not in same for a in n.all_input_nodes
                    if a.name in same}
        self._needed |= frontier
        self._cache.clear()  # a base run kept for fewer plans would miss values
        return _ResumedModule(self, gm, same, frontier)

    def values(self, args, kwargs) -> dict:
        leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        key = tuple((id(t), t.data_ptr(), tuple(t.shape)) for t in leaves)
        if key not in self._cache:
            if len(self._cache) >= 4:  # a few scoring batches; more would hold too much memory
                self._cache.pop(next(iter(self._cache)))
            run = _Kept(self.base, self._needed)
            run.run(*_flat_inputs(self.base, args, kwargs))
            self._cache[key] = (leaves, run.kept)  # leaves: keeps the ids valid while cached
        return self._cache[key][1]


class _ResumedModule(torch.nn.Module):
    def __init__(self, owner: Resumed, gm: GraphModule, same: set, frontier: set) -> None:
        super().__init__()
        self.owner, self.gm, self.same, self.frontier = owner, gm, same, frontier
        self.ran = 0  # nodes computed by the last call (for tests)

    def forward(self, *args, **kwargs):
        kept = self.owner.values(args, kwargs)
        self.ran = 0
        run = torch.fx.Interpreter(self.gm, garbage_collect_values=False)
        for n in self.gm.graph.nodes:
            if n.name in self.same:
                if n.name in self.frontier:
                    run.env[n] = kept[n.name]
            elif n.op == "output":
                out = torch.fx.node.map_arg(n.args[0], lambda a: run.env[a])
                return self.gm.graph._codegen.process_outputs(out)
            else:
                run.env[n] = run.run_node(n)
                self.ran += 1
        raise AssertionError("graph without an output node")
