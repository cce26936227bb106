"""prepare: fold batch norm, let the quantizer annotate, insert observers."""

from __future__ import annotations

import copy
import types

import torch
from torch.fx import GraphModule, Node

from quantkit.observers import QuantkitObserver
from quantkit.observers._tokens import token_dim

from .._graph import ANNOTATION_KEY, is_observer_module, is_observer_node, unique_attr_name
from ._fold_bn import fold_conv_bn
from ._kv_capture import install_length_check
from ._sharing import EdgeOrNode, observers_for_annotations

__all__ = [
    "prepare", "OBSERVER_PREFIX", "mark_padding_aware",
    "copy_sharing_parameters", "prepare_in_place", "is_prepared", "disallow_train_eval",
    "control_flow_subgraphs", "set_submodule", "from_attributes",
]

OBSERVER_PREFIX = "activation_post_process_"


# control-flow ops whose subgraph arguments (GraphModule attributes of the parent) run the
# model's own computation and are quantized like it: scan's combine_fn, while_loop's body_fn
# (torchao's prepare_pt2e/convert_pt2e recurse into the same two; while_loop's cond_fn only
# computes the loop condition)
_SUBGRAPH_ARGS = {
    torch.ops.higher_order.scan: (0,),
    torch.ops.higher_order.while_loop: (1,),
}


def control_flow_subgraphs(gm: GraphModule) -> list[str]:
    """Attribute names (targets) of the subgraphs of ``gm``'s control-flow ops that prepare and
    convert recurse into (``scan`` combine_fn, ``while_loop`` body_fn), each once."""
    names: list[str] = []
    for node in gm.graph.nodes:
        for i in _SUBGRAPH_ARGS.get(node.target, ()) if node.op == "call_function" else ():
            arg = node.args[i] if i < len(node.args) else None
            if isinstance(arg, Node) and arg.op == "get_attr" and str(arg.target) not in names:
                if isinstance(gm.get_submodule(str(arg.target)), GraphModule):
                    names.append(str(arg.target))
    return names


def set_submodule(gm: torch.nn.Module, target: str, module: torch.nn.Module) -> None:
    """Replace the submodule at dotted path ``target`` of ``gm`` with ``module``."""
    *path, attr = target.split(".")
    setattr(gm.get_submodule(".".join(path)) if path else gm, attr, module)


def is_prepared(gm: GraphModule) -> bool:
    """Whether ``gm`` came out of a prepare step (quantkit's or torchao's), observers or not."""
    return bool(gm.meta.get("quantkit_prepared")) or "_observed_graph_module_attrs" in gm.meta


_TRAIN_EVAL_MESSAGE = (
    "train() and eval() cannot switch an exported graph (quantkit's prepared and converted models are "
    "exported graphs); call torchao.quantization.pt2e.move_exported_model_to_eval(model) (or _to_train), "
    "or allow_exported_model_train_eval(model) first"
)


def _train(self, mode: bool = True):
    raise NotImplementedError(_TRAIN_EVAL_MESSAGE)


def _eval(self):
    raise NotImplementedError(_TRAIN_EVAL_MESSAGE)


def disallow_train_eval(gm: GraphModule) -> GraphModule:
    """Make ``gm.train()`` / ``gm.eval()`` raise, as on ``torch.export``'s modules (and torchao's
    prepared and converted ones): on a captured graph they would silently change nothing."""
    gm.train = types.MethodType(_train, gm)
    gm.eval = types.MethodType(_eval, gm)
    return gm


def copy_sharing_parameters(gm: GraphModule) -> GraphModule:
    """A deep copy of ``gm`` (graph, submodules, buffers, meta) whose parameters are ``gm``'s
    own tensors, not copies; observers are copied whole (their state is what differs).

    The quantkit passes that copy (prepare, convert) never write a parameter in place: they
    register new tensors on the copy (folded batch norm, int8 weights), so sharing is safe
    and a copy costs no weight memory.
    """
    observed = set()
    for m in gm.modules():
        if is_observer_module(m):
            observed.update(id(t) for t in list(m.parameters()) + list(m.buffers()))
    memo = {id(p): p for _, p in gm.named_parameters(remove_duplicate=False) if id(p) not in observed}
    return copy.deepcopy(gm, memo)


def _describe(key: EdgeOrNode) -> str:
    return f"{key[0].name} -> {key[1].name}" if isinstance(key, tuple) else key.name


def _writes_state(node: Node, arg: Node) -> bool:
    """Whether ``node`` writes in place into ``arg`` (its first argument, e.g. ``index_put_``,
    ``copy_``) and ``arg`` is module state (computed from attributes only, e.g. a buffer or a
    view of one): an observer there would make the op write into a dequantized copy instead
    of the buffer (torchao's prepare skips the same edges)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not node.args or node.args[0] is not arg:
        return False
    alias = schema.arguments[0].alias_info if schema.arguments else None
    if alias is None or not alias.is_write:
        return False
    return from_attributes(arg)


def from_attributes(node: Node) -> bool:
    """Whether ``node`` is computed from module attributes only (a weight, a buffer, a weight
    scaled by a batch norm, a view of one), not from the graph's inputs."""
    todo, seen, attrs = [node], set(), False
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if cur.op == "placeholder":
            return False
        attrs = attrs or cur.op == "get_attr"
        todo.extend(cur.all_input_nodes)
    return attrs


def _out_arguments(node: Node) -> set:
    """Positions and names of ``node``'s ``out=`` arguments (out-variant ops, e.g.
    ``clamp.out``): the op overwrites them without reading them, so they get no observer
    (after convert the op would write into a dequantized copy, not into its ``out`` tensor)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return set()
    return {key for i, a in enumerate(schema.arguments) if a.is_out for key in (i, a.name)}


class _Inserter:
    def __init__(self, gm: GraphModule, observers: dict[EdgeOrNode, torch.nn.Module]):
        self.gm = gm
        self.observers = observers
        self.count = 0
        self.modules = dict(gm.named_modules(remove_duplicate=False))
        self.device = next((t.device for t in list(gm.parameters()) + list(gm.buffers())), None)

    def insert_after(self, node: Node, obs: torch.nn.Module, key: EdgeOrNode) -> Node:
        name = unique_attr_name(self.gm, OBSERVER_PREFIX, start=self.count)
        self.count = int(name[len(OBSERVER_PREFIX):])
        if self.device is not None:
            obs.to(self.device)
        if getattr(obs, "node_name", "<unattached>") == "<unattached>":
            obs.node_name = _describe(key)
        self.gm.add_submodule(name, obs)
        self.modules[name] = obs
        with self.gm.graph.inserting_after(node):
            obs_node = self.gm.graph.call_module(name, (node,))
        if "val" in node.meta:
            obs_node.meta["val"] = node.meta["val"]
        return obs_node

    def original(self, arg: Node) -> Node:
        while is_observer_node(arg, self.modules):
            arg = arg.args[0]
        return arg

    def observe_arg(self, node: Node, arg):
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.observe_arg(node, a) for a in arg)
        if not isinstance(arg, Node):
            return arg
        orig = self.original(arg)
        obs = self.observers.get((orig, node))
        if obs is None or _writes_state(node, orig):
            return arg
        if self.observers.get(orig) is obs:
            return arg  # the producer's output observer already is this observer
        # another consumer already inserted this observer instance: reuse its node
        for user in arg.users:
            if is_observer_node(user, self.modules) and self.modules[str(user.target)] is obs:
                return user
        return self.insert_after(arg, obs, (orig, node))

    def process(self, node: Node) -> None:
        if ANNOTATION_KEY not in node.meta:
            return
        out = _out_arguments(node)
        node.args = tuple(a if i in out else self.observe_arg(node, a) for i, a in enumerate(node.args))
        node.kwargs = {k: v if k in out else self.observe_arg(node, v) for k, v in node.kwargs.items()}
        obs = self.observers.get(node)
        if obs is None or not isinstance(node.meta.get("val"), torch.Tensor):
            return
        obs_node = self.insert_after(node, obs, node)
        for user in list(node.users):
            if user is not obs_node:
                user.replace_input_with(node, obs_node)


# stand-ins for symbolic sizes when the token-layout rule is checked at prepare time:
# large primes, so that no static size or product of sizes collides with them
_BATCH, _TOKENS = 1_000_003, 1_000_033


def _concrete(size, tokens_symbol) -> int:
    """A size as an int: symbolic sizes with the token symbol -> _TOKENS, any other symbol
    -> _BATCH (export gives each input's dynamic batch dimension its own symbol)."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    subs = {sym: (_TOKENS if sym == tokens_symbol else _BATCH) for sym in expr.free_symbols}
    return int(expr.subs(subs))


def mark_padding_aware(gm: GraphModule) -> None:
    """Record on each observer of activations laid out ``[batch, ..., tokens, ...]`` (or
    ``[batch * tokens, ...]``) its token axis, so that :func:`quantkit.calibrate` can leave
    padding tokens out (``obs.token_axes``: one ``(layout, axis)`` pair per call site, the
    layout being the sizes with None for symbolic ones; :data:`quantkit.observers._tokens.FLAT`
    for flattened rows). The layout rule is
    :func:`quantkit.observers._tokens.token_dim`, applied here once, to the graph's symbolic
    shapes and the sizes of its ``attention_mask`` input (``[batch, tokens]``, the Hugging
    Face name). Observers of weights, and any observer with a call site of another layout
    (or two call sites of one layout with different token axes), are left unaware."""
    mask = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "attention_mask"), None)
    val = None if mask is None else mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return
    batch_size, token_size = val.shape
    tokens_symbol = None if isinstance(token_size, int) else next(iter(token_size.node.expr.free_symbols), None)
    batch = _concrete(batch_size, tokens_symbol)
    tokens = _concrete(token_size, tokens_symbol)
    modules = dict(gm.named_modules(remove_duplicate=False))
    axes: dict[int, tuple[torch.nn.Module, set | None]] = {}
    for node in gm.graph.nodes:
        if not is_observer_node(node, modules):
            continue
        obs = modules[str(node.target)]
        src = node.args[0] if node.args else None
        while isinstance(src, Node) and is_observer_node(src, modules):
            src = src.args[0]
        shape = getattr(node.meta.get("val"), "shape", None)
        axis = None
        if not (isinstance(src, Node) and src.op == "get_attr") and shape is not None:
            try:
                axis = token_dim([_concrete(s, tokens_symbol) for s in shape], batch, tokens)
            except (TypeError, ValueError):  # a size we cannot evaluate
                axis = None
        sites = axes.get(id(obs), (obs, set()))[1]
        if sites is not None and axis is not None:
            layout = tuple(s if isinstance(s, int) else None for s in shape)
            sites = None if any(lay == layout and a != axis for lay, a in sites) else sites | {(layout, axis)}
        else:
            sites = None
        axes[id(obs)] = (obs, sites)
    for obs, sites in axes.values():
        if isinstance(obs, QuantkitObserver):
            obs.token_axes = tuple(sorted(sites, key=repr)) if sites else ()


def prepare(model: GraphModule, quantizer) -> GraphModule:
    """Annotate a copy of ``model`` with ``quantizer`` and insert observers where it asks.

    Batch norms that follow convolutions are folded first. Observers are shared as
    the annotations say (``SharedQuantizationSpec``, implicit sharing of one tensor
    between its consumers), derived specs get observers that compute their qparams
    from others, and fixed specs get fixed qparams.

    Ownership: ``model`` is never modified. The result is a new GraphModule (its own graph,
    buffers and observers) that shares ``model``'s parameter tensors, which no quantkit
    pass writes in place, so preparing costs no weight memory; :func:`quantkit.calibrate`
    then updates the prepared model's observers in place, and :func:`quantkit.convert`
    returns another new module.

    Args:
        model: a GraphModule from :func:`quantkit.capture` (or ``torch.export(...).module()``).
        quantizer: a torchao-protocol ``Quantizer`` (quantkit's or torchao's own).

    Returns:
        The prepared GraphModule. Its outputs equal the float model's.
    """
    _check_arguments(model, quantizer)
    return prepare_in_place(copy_sharing_parameters(model), quantizer)


def _check_arguments(model, quantizer) -> None:
    if not isinstance(model, GraphModule):
        raise TypeError(
            f"prepare expects a torch.fx.GraphModule, got {type(model).__name__}; call quantkit.capture(model, example_inputs) first"
        )
    if not hasattr(quantizer, "annotate"):
        raise TypeError(f"quantizer must implement the Quantizer protocol (annotate), got {type(quantizer).__name__}")


def prepare_in_place(model: GraphModule, quantizer, *, qat=None) -> GraphModule:
    """:func:`prepare` without the copy: ``model`` itself is rewritten (its graph, and its
    folded conv weights replaced); for callers whose ``model`` is private (``quantize``).
    The subgraphs of ``scan`` (combine_fn) and ``while_loop`` (body_fn) are annotated and
    observed the same way, each as a graph of its own.

    ``qat``: the hooks of :func:`quantkit.prepare_qat` (``quantkit.pipeline._qat``): batch norms
    stay live (``after_annotation`` rewrites conv-BN pairs), observers become fake-quantize
    modules (``fake_quantize``) and ``finish`` makes the result trainable."""
    _check_arguments(model, quantizer)
    meta = dict(model.meta)
    if qat is None:
        fold_conv_bn(model)
    model = quantizer.transform_for_annotation(model)
    quantizer.annotate(model)
    quantizer.validate(model)
    if qat is not None:
        qat.after_annotation(model)
    observers = observers_for_annotations(model)
    if qat is not None:
        observers = qat.fake_quantize(model, observers)
    callback = getattr(quantizer, "prepare_obs_or_fq_callback", None)
    if callback is not None:
        callback(model, observers)
    inserter = _Inserter(model, observers)
    for node in list(model.graph.nodes):
        inserter.process(node)
    mark_padding_aware(model)
    # the bodies of scan / while_loop are graphs of their own: prepared the same way, in place
    for target in control_flow_subgraphs(model):
        set_submodule(model, target, prepare_in_place(model.get_submodule(target), quantizer, qat=qat))
    prepared = GraphModule(model, model.graph)
    prepared.meta.update(meta)
    prepared.meta["quantkit_prepared"] = True
    install_length_check(prepared)  # hooks do not travel to the new module (a no-op without a KV cache)
    return disallow_train_eval(prepared) if qat is None else qat.finish(prepared)
