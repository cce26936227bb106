"""prepare: fold batch norm, let the quantizer annotate, insert observers."""

from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule, Node

from quantkit.observers._tokens import token_dim

from ._fold_bn import fold_conv_bn
from ._sharing import ANNOTATION_KEY, EdgeOrNode, observers_for_annotations

__all__ = ["prepare", "OBSERVER_PREFIX", "is_observer_node", "mark_padding_aware"]

OBSERVER_PREFIX = "activation_post_process_"


def is_observer_node(node: Node, modules: dict[str, torch.nn.Module]) -> bool:
    from torchao.quantization.pt2e.observer import ObserverBase

    return node.op == "call_module" and isinstance(modules.get(str(node.target)), ObserverBase)


def _describe(key: EdgeOrNode) -> str:
    return f"{key[0].name} -> {key[1].name}" if isinstance(key, tuple) else key.name


class _Inserter:
    def __init__(self, gm: GraphModule, observers: dict[EdgeOrNode, torch.nn.Module]):
        self.gm = gm
        self.observers = observers
        self.count = 0
        self.modules = dict(gm.named_modules(remove_duplicate=False))
        self.device = next((t.device for t in list(gm.parameters()) + list(gm.buffers())), None)

    def insert_after(self, node: Node, obs: torch.nn.Module, key: EdgeOrNode) -> Node:
        while hasattr(self.gm, f"{OBSERVER_PREFIX}{self.count}"):
            self.count += 1
        name = f"{OBSERVER_PREFIX}{self.count}"
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
        if obs is None:
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
        node.args = tuple(self.observe_arg(node, a) for a in node.args)
        node.kwargs = {k: self.observe_arg(node, v) for k, v in node.kwargs.items()}
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
    """Mark the observers of activations laid out ``[batch, ..., tokens, ...]`` (or
    ``[batch * tokens, ...]``) as ``padding_aware``, so that :func:`quantkit.calibrate`
    can leave padding tokens out. The layout rule is :func:`quantkit.observers._tokens.token_dim`,
    with the sizes of the graph's ``attention_mask`` input (``[batch, tokens]``, the
    Hugging Face name); observers of weights, and any observer with a call site of
    another layout, stay unaware."""
    mask = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "attention_mask"), None)
    val = None if mask is None else mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return
    batch_size, token_size = val.shape
    tokens_symbol = None if isinstance(token_size, int) else next(iter(token_size.node.expr.free_symbols), None)
    batch = _concrete(batch_size, tokens_symbol)
    tokens = _concrete(token_size, tokens_symbol)
    modules = dict(gm.named_modules(remove_duplicate=False))
    aware: dict[int, tuple[torch.nn.Module, bool]] = {}
    for node in gm.graph.nodes:
        if not is_observer_node(node, modules):
            continue
        obs = modules[str(node.target)]
        src = node.args[0] if node.args else None
        while isinstance(src, Node) and is_observer_node(src, modules):
            src = src.args[0]
        shape = getattr(node.meta.get("val"), "shape", None)
        ok = not (isinstance(src, Node) and src.op == "get_attr") and shape is not None
        if ok:
            try:
                ok = token_dim([_concrete(s, tokens_symbol) for s in shape], batch, tokens) is not None
            except (TypeError, ValueError):  # a size we cannot evaluate
                ok = False
        prev = aware.get(id(obs), (obs, True))[1]
        aware[id(obs)] = (obs, prev and ok)
    for obs, ok in aware.values():
        if hasattr(obs, "padding_aware"):
            obs.padding_aware = ok


def prepare(model: GraphModule, quantizer) -> GraphModule:
    """Annotate ``model`` with ``quantizer`` and insert observers where it asks.

    Batch norms that follow convolutions are folded first. Observers are shared as
    the annotations say (``SharedQuantizationSpec``, implicit sharing of one tensor
    between its consumers), derived specs get observers that compute their qparams
    from others, and fixed specs get fixed qparams.

    Args:
        model: a GraphModule from :func:`quantkit.capture` (or ``torch.export(...).module()``).
        quantizer: a torchao-protocol ``Quantizer`` (quantkit's or torchao's own).

    Returns:
        A new prepared GraphModule (``model`` itself is not modified). Its outputs
        equal the float model's.
    """
    if not isinstance(model, GraphModule):
        raise TypeError(
            f"prepare expects a torch.fx.GraphModule, got {type(model).__name__}; call quantkit.capture(model, example_inputs) first"
        )
    if not hasattr(quantizer, "annotate"):
        raise TypeError(f"quantizer must implement the Quantizer protocol (annotate), got {type(quantizer).__name__}")
    meta = dict(model.meta)
    # work on a copy: the caller's captured graph stays float and can be prepared again
    model = copy.deepcopy(model)
    fold_conv_bn(model)
    model = quantizer.transform_for_annotation(model)
    quantizer.annotate(model)
    quantizer.validate(model)
    observers = observers_for_annotations(model)
    callback = getattr(quantizer, "prepare_obs_or_fq_callback", None)
    if callback is not None:
        callback(model, observers)
    inserter = _Inserter(model, observers)
    for node in list(model.graph.nodes):
        inserter.process(node)
    mark_padding_aware(model)
    prepared = GraphModule(model, model.graph)
    prepared.meta.update(meta)
    prepared.meta["quantkit_prepared"] = True
    return prepared
