"""Graph and module helpers that every stage shares (the one home of each).

- dotted attributes: :func:`get_attr` / :func:`set_attr` (``"encoder.layer.0.weight"``);
- fresh attribute names: :func:`unique_attr_name`;
- which modules a node came from, read from torch.export's ``nn_module_stack``:
  :func:`type_name`, :func:`module_scopes`, :func:`scoped_config`;
- the op families of quantized graphs (:data:`QUANTIZE_OPS`, :data:`DEQUANTIZE_OPS`,
  :data:`CHOOSE_QPARAMS_OPS`, the float8 and group-wise sets), the annotation key, the names convert
  gives folded weights (:data:`FOLDED_PREFIX`) and its qparams record (:data:`QPARAMS_META_KEY`);
- explicit per-channel input scales that SmoothQuant/AWQ insert where ``1/s`` folds into no op
  (:data:`INPUT_SCALE_PREFIX`, :func:`explicit_input_scales`);
- observers in a graph: :func:`is_observer_module`, :func:`is_observer_node`, :func:`is_calibrated`;
- constants: :func:`mutated_attributes`, :func:`constant_value`;
- a node's example tensor from torch.export: :func:`example_value`.

This module sits at the bottom of the import graph beside ``_qmath``, ``_qdq`` and ``_errors``: it
imports nothing from quantkit but those, so observers, quantizers, kernels and every stage may use it.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from . import _qdq  # registers quantkit::unpack_int4 / dequantize_nf4 (GROUPWISE_DEQUANTIZE_OPS)

__all__ = [
    "get_attr", "set_attr", "unique_attr_name", "type_name", "module_scopes", "scoped_config",
    "QUANTIZE_OPS", "DEQUANTIZE_OPS", "CHOOSE_QPARAMS_OPS", "FLOAT8_QUANTIZE_OPS", "FLOAT8_DEQUANTIZE_OPS",
    "FLOAT8_CHOOSE_OPS", "GROUPWISE_DEQUANTIZE_OPS", "ANNOTATION_KEY", "FOLDED_PREFIX", "QPARAMS_META_KEY",
    "is_observer_module", "is_observer_node", "is_calibrated", "mutated_attributes", "constant_value",
    "example_value", "INPUT_SCALE_PREFIX", "explicit_input_scales",
]

# --- op families and names of quantized graphs -------------------------------------------------
_OPS = torch.ops.quantized_decomposed
_AO = torch.ops.torchao
# every quantize/dequantize op convert emits (the debug and accuracy tools use these too)
QUANTIZE_OPS = frozenset({
    _OPS.quantize_per_tensor.default, _OPS.quantize_per_tensor.tensor,
    _OPS.quantize_per_channel.default, _OPS.quantize_per_token.default,
})
DEQUANTIZE_OPS = frozenset({
    _OPS.dequantize_per_tensor.default, _OPS.dequantize_per_tensor.tensor,
    _OPS.dequantize_per_channel.default, _OPS.dequantize_per_token.default,
})
# the run-time qparams ops of dynamic quantization
CHOOSE_QPARAMS_OPS = frozenset(_qdq.CHOOSE_QPARAMS.values()) | {_OPS.choose_qparams_per_token.default}
# FP8 on the float8 grid: torchao's float8 affine ops (pipeline/emit/_float8.py)
FLOAT8_QUANTIZE_OPS = frozenset({_AO.quantize_affine_float8_non_decomposed.default})
FLOAT8_DEQUANTIZE_OPS = frozenset({_AO.dequantize_affine_float8_non_decomposed.default})
FLOAT8_CHOOSE_OPS = frozenset({_AO.choose_scale_float8.default})
# group-wise weights: torch's per-group dequantize, NF4's table look-up
GROUPWISE_DEQUANTIZE_OPS = frozenset({_OPS.dequantize_per_channel_group.default,
                                      torch.ops.quantkit.dequantize_nf4.default,
                                      torch.ops.quantkit.dequantize_group.default})  # remainder groups
# node.meta key of a quantizer's annotation (torchao's Q_ANNOTATION_KEY)
ANNOTATION_KEY = "quantization_annotation"
# folded quantized weights are buffers named as torchao's constant_fold (and Inductor's
# freezing) name theirs: _frozen_param0, _frozen_param1, ... (the first free index)
FOLDED_PREFIX = "_frozen_param"
# gm.meta entry listing every quantized tensor with its qparams (used by reports)
QPARAMS_META_KEY = "quantkit_qparams"


# --- dotted attributes ------------------------------------------------------------------------
def get_attr(root: torch.nn.Module, target: str):
    """The object at the dotted path ``target`` below ``root`` (a tensor, a module, ...)."""
    obj = root
    for atom in str(target).split("."):
        obj = getattr(obj, atom)
    return obj


def set_attr(root: torch.nn.Module, target: str, value: torch.Tensor, *, detach: bool = True) -> None:
    """Put ``value`` at the dotted path ``target`` below ``root``, in place.

    A parameter stays a parameter (``requires_grad=False``), a buffer stays a buffer, anything
    else becomes a plain attribute. The tensor that was there before (possibly the caller's) is
    replaced, not modified. ``detach=False`` stores ``value`` itself (for a tensor that must keep
    its identity, e.g. a fake tensor being materialized).
    """
    *path, name = str(target).split(".")
    owner = root.get_submodule(".".join(path)) if path else root
    if detach:
        value = value.detach()
    if name in owner._parameters:
        owner._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def unique_attr_name(root: torch.nn.Module, base: str, *, sep: str = "", start: int = 0) -> str:
    """The first of ``f"{base}{sep}{i}"`` for ``i = start, start + 1, ...`` that ``root`` does not have."""
    i = start
    while hasattr(root, f"{base}{sep}{i}"):
        i += 1
    return f"{base}{sep}{i}"


# --- module scopes ----------------------------------------------------------------------------
# strict-mode export prefixes module names with the traced ``self``
_EXPORT_PREFIXES = ("L['self'].", "L__self__.")


def type_name(t) -> str:
    """``"torch.nn.modules.linear.Linear"`` for a class (or the string export recorded)."""
    return t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}"


def _strip(fqn: str) -> str:
    for prefix in _EXPORT_PREFIXES:
        if fqn.startswith(prefix):
            fqn = fqn[len(prefix):]
    return fqn


def module_scopes(node: Node) -> list[tuple[str, str]]:
    """``(module name, module type name)`` of every module enclosing ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(_strip(str(fqn)), type_name(t)) for fqn, t in stack.values()]


def scoped_config(node: Node, by_name: dict, by_type: dict, default):
    """The setting that applies to ``node``: the longest module name in ``by_name`` enclosing it (the
    module or a parent), else the innermost enclosing module type in ``by_type`` (type names, see
    :func:`type_name`), else ``default``. Values may be None (keep the node float)."""
    scopes = module_scopes(node)
    best, best_len = None, -1
    for name, cfg in by_name.items():
        for fqn, _ in scopes:
            if (fqn == name or fqn.startswith(name + ".")) and len(name) > best_len:
                best, best_len = cfg, len(name)
    if best_len >= 0:
        return best
    for _, tname in reversed(scopes):  # innermost module first
        if tname in by_type:
            return by_type[tname]
    return default


# --- observers in a graph -----------------------------------------------------------------------
def _observer_bases() -> tuple[type, ...]:
    from torch.ao.quantization.fake_quantize import FakeQuantizeBase as AoFakeQuantizeBase
    from torch.ao.quantization.observer import ObserverBase as AoObserverBase
    from torchao.quantization.pt2e.fake_quantize import FakeQuantizeBase
    from torchao.quantization.pt2e.observer import AffineQuantizedObserverBase, ObserverBase

    return (ObserverBase, AffineQuantizedObserverBase, FakeQuantizeBase, AoObserverBase, AoFakeQuantizeBase)


def is_observer_module(module) -> bool:
    """Whether ``module`` is an observer or fake-quantize module (quantkit's, torchao's or
    ``torch.ao``'s): what :func:`quantkit.convert` replaces with quantize/dequantize ops."""
    return isinstance(module, _observer_bases())


def is_observer_node(node: Node, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether ``node`` calls an observer module (``modules``: ``dict(gm.named_modules())``)."""
    return node.op == "call_module" and is_observer_module(modules.get(str(node.target)))


def is_calibrated(obs) -> bool:
    """Whether ``obs`` has qparams to give: its ``calibrated`` flag where it declares one, else
    (torchao's and ``torch.ao``'s observers) a finite ``min_val``; True when it has neither."""
    flag = getattr(obs, "calibrated", None)
    if flag is not None:
        return bool(flag)
    min_val = getattr(obs, "min_val", None)
    if isinstance(min_val, torch.Tensor):
        return min_val.numel() > 0 and bool(torch.isfinite(min_val).all())
    return True


# --- constants ----------------------------------------------------------------------------------
def _writes(user: Node, arg: Node) -> tuple[bool, bool]:
    """``(writes, aliases)``: whether op ``user`` writes into its input ``arg`` (in place, e.g.
    ``index_put_``, ``copy_``), and whether its output is a view of it (e.g. ``select``)."""
    schema = getattr(user.target, "_schema", None)
    if user.op != "call_function" or schema is None:
        return False, False
    writes = aliases = False
    for i, a in enumerate(schema.arguments):
        value = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
        if value is arg and a.alias_info is not None:
            writes = writes or a.alias_info.is_write
            aliases = True
    returns_alias = any(r.alias_info is not None for r in schema.returns)
    return writes, aliases and returns_alias and not writes


def mutated_attributes(gm: GraphModule) -> set[str]:
    """Targets of ``get_attr`` nodes the graph writes in place, directly or through a view:
    state (e.g. a buffer updated by ``index_put_``), not constants to fold."""
    mutated = set()
    modules = dict(gm.named_modules(remove_duplicate=False))
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        todo = [node]
        while todo:
            cur = todo.pop()
            for user in cur.users:
                writes, view = _writes(user, cur)
                if writes:
                    mutated.add(str(node.target))
                elif view or is_observer_node(user, modules):  # observers pass their input on
                    todo.append(user)
    return mutated


def constant_value(gm: GraphModule, node, memo: dict):
    """Evaluate ``node`` if it depends only on module attributes that the graph never writes;
    else return None. ``memo`` caches values; its ``"mutated"`` entry lists the written ones."""
    if not isinstance(node, Node):
        return node
    if node in memo:
        return memo[node]
    if "mutated" not in memo:
        memo["mutated"] = mutated_attributes(gm)
    value = None
    if node.op == "get_attr" and str(node.target) not in memo["mutated"]:
        value = get_attr(gm, str(node.target))
    elif node.op == "call_function" and not getattr(node.target, "_nondeterministic_seeded", False):
        deps: list[Node] = []
        map_arg((node.args, node.kwargs), deps.append)
        if all(constant_value(gm, d, memo) is not None for d in deps):
            args, kwargs = map_arg((node.args, node.kwargs), lambda n: memo[n])
            with torch.no_grad():
                value = node.target(*args, **kwargs)
    memo[node] = value
    return value


def example_value(node) -> torch.Tensor | None:
    """The example tensor torch.export recorded for ``node`` (``meta["val"]``), or None: not a node,
    no value recorded (nodes a pass made), or not a tensor."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


# the buffers of ``x * (1/s)`` that SmoothQuant and AWQ insert before linears (accuracy._folding.insert_mul)
INPUT_SCALE_PREFIX = "_qk_smooth_inv_"


def explicit_input_scales(gm: GraphModule) -> list[Node]:
    """The ``mul`` nodes of ``gm`` that scale an activation by an inserted :data:`INPUT_SCALE_PREFIX`
    buffer (an export with no tensor for them must refuse or fold them)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.mul.Tensor
            and any(isinstance(a, Node) and a.op == "get_attr" and str(a.target).startswith(INPUT_SCALE_PREFIX)
                    for a in n.args)]
