"""convert: replace observers with quantized_decomposed quantize/dequantize pairs, fold weights to int8."""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from quantkit.observers import QuantkitObserver
from quantkit.observers._base import empty_message

from .._errors import ConvertError
from ._prepare import (
    control_flow_subgraphs,
    copy_sharing_parameters,
    disallow_train_eval,
    is_observer_node,
    is_prepared,
    set_submodule,
)
from .._qmath import FLOAT8_DTYPES, is_per_channel, underlying_dtype
from ._convert_fp8 import emit_float8, is_float8_observer
from ._qat import fold_simulated_bn, is_qat, refuse_training
from ._convert_groupwise import emit_groupwise, is_groupwise

__all__ = [
    "convert", "convert_in_place", "emit_dynamic", "QPARAMS_META_KEY", "QUANTIZE_OPS", "DEQUANTIZE_OPS", "FOLDED_PREFIX",
]

# gm.meta entry listing every quantized tensor with its qparams (used by reports)
QPARAMS_META_KEY = "quantkit_qparams"

_OPS = torch.ops.quantized_decomposed
# every quantize/dequantize op convert emits (the debug and accuracy tools use these too)
QUANTIZE_OPS = frozenset({
    _OPS.quantize_per_tensor.default, _OPS.quantize_per_tensor.tensor,
    _OPS.quantize_per_channel.default, _OPS.quantize_per_token.default,
})
DEQUANTIZE_OPS = frozenset({
    _OPS.dequantize_per_tensor.default, _OPS.dequantize_per_tensor.tensor,
    _OPS.dequantize_per_channel.default, _OPS.dequantize_per_token.default,
})
_CHOOSE_QPARAMS = {
    torch.per_tensor_affine: _OPS.choose_qparams.tensor,
    torch.per_tensor_symmetric: _OPS.choose_qparams_symmetric.tensor,
}
_CHOOSE_OPS = frozenset(_CHOOSE_QPARAMS.values()) | {_OPS.choose_qparams_per_token.default}
# static quantization dtypes (torchao's convert_pt2e SUPPORTED_QDTYPES): float8 ones take the
# same quantize/dequantize_per_tensor/_per_channel ops with the float8 dtype argument
_SUPPORTED = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32) + FLOAT8_DTYPES
# folded quantized weights are buffers named as torchao's constant_fold (and Inductor's
# freezing) name theirs: _frozen_param0, _frozen_param1, ... (the first free index)
FOLDED_PREFIX = "_frozen_param"


def _attr(gm: torch.nn.Module, target: str):
    obj = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


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


def _constant_value(gm: GraphModule, node, memo: dict):
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
        value = _attr(gm, str(node.target))
    elif node.op == "call_function" and not getattr(node.target, "_nondeterministic_seeded", False):
        deps: list[Node] = []
        map_arg((node.args, node.kwargs), deps.append)
        if all(_constant_value(gm, d, memo) is not None for d in deps):
            args, kwargs = map_arg((node.args, node.kwargs), lambda n: memo[n])
            with torch.no_grad():
                value = node.target(*args, **kwargs)
    memo[node] = value
    return value


def _per_token(obs) -> bool:
    from quantkit.observers._base import PER_TOKEN

    return getattr(obs, "granularity", None) == PER_TOKEN


def _scalar(value) -> float:
    return float(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else float(value)


def emit_dynamic(graph: torch.fx.Graph, node: Node, obs) -> Node:
    """Insert, before the observer call ``node``, the run-time quantization of its input that
    the dynamic observer ``obs`` describes; return the dequantized value.

    Per tensor (``obs.qscheme`` affine or symmetric): ``choose_qparams[_symmetric].tensor``
    then ``quantize/dequantize_per_tensor.tensor`` (torchao's ``convert_pt2e`` emits the same);
    per token (``obs.granularity == "per-token"``): ``choose_qparams_per_token`` then
    ``quantize/dequantize_per_token``.
    """
    src = node.args[0]
    dtype = underlying_dtype(getattr(obs, "dtype", torch.float32))
    if dtype not in (torch.int8, torch.uint8):
        raise ConvertError(f"dynamic quantization supports int8 and uint8, got {dtype} at node '{node.name}'")
    val = src.meta.get("val") if isinstance(src, Node) else None
    float_out = val.dtype if isinstance(val, torch.Tensor) and val.is_floating_point() else torch.float32
    with graph.inserting_before(node):
        if _per_token(obs):
            choose = graph.call_function(_OPS.choose_qparams_per_token.default, (src, dtype))
            scale = graph.call_function(operator.getitem, (choose, 0))
            zp = graph.call_function(operator.getitem, (choose, 1))
            qargs = (scale, zp, obs.quant_min, obs.quant_max, dtype)
            q = graph.call_function(_OPS.quantize_per_token.default, (src,) + qargs)
            return graph.call_function(_OPS.dequantize_per_token.default, (q,) + qargs + (float_out,))
        qscheme = getattr(obs, "qscheme", torch.per_tensor_affine)
        if qscheme not in _CHOOSE_QPARAMS:
            raise ConvertError(
                f"dynamic quantization supports per-tensor qschemes only, got {qscheme} at node '{node.name}'"
            )
        eps = _scalar(getattr(obs, "eps", torch.finfo(torch.float32).eps))
        choose = graph.call_function(_CHOOSE_QPARAMS[qscheme], (src, obs.quant_min, obs.quant_max, eps, dtype))
        scale = graph.call_function(operator.getitem, (choose, 0))
        zp = graph.call_function(operator.getitem, (choose, 1))
        qargs = (scale, zp, obs.quant_min, obs.quant_max, dtype)
        q = graph.call_function(_OPS.quantize_per_tensor.tensor, (src,) + qargs)
        kwargs = {} if float_out == torch.float32 else {"out_dtype": float_out}
        return graph.call_function(_OPS.dequantize_per_tensor.tensor, (q,) + qargs, kwargs)


def _is_calibrated(obs) -> bool:
    flag = getattr(obs, "calibrated", None)
    if flag is not None:
        return bool(flag)
    min_val = getattr(obs, "min_val", None)
    if isinstance(min_val, torch.Tensor):
        return min_val.numel() > 0 and bool(torch.isfinite(min_val).all())
    return True


class _Converter:
    def __init__(self, gm: GraphModule, fold: bool = True):
        self.gm = gm
        self.fold = fold
        self.graph = gm.graph
        self.modules = dict(gm.named_modules(remove_duplicate=False))
        self.memo: dict = {}
        self.records: list[dict] = []

    def _new_attr(self, base: str, value: torch.Tensor) -> Node:
        i = 0
        while hasattr(self.gm, f"{base}{i}"):
            i += 1
        name = f"{base}{i}"
        self.gm.register_buffer(name, value)
        return self.graph.get_attr(name)

    def replace(self, node: Node) -> None:
        obs = self.modules[str(node.target)]
        if getattr(obs, "is_dynamic", False) and hasattr(obs, "dtype"):
            self.records.append({"node": getattr(obs, "node_name", node.name),
                                 "kind": "dynamic-per-token" if _per_token(obs) else "dynamic",
                                 "dtype": str(underlying_dtype(obs.dtype)).replace("torch.", "")})
        if is_groupwise(obs):  # weight-only int4/int8/NF4: one scale per group of input features
            emit_groupwise(self, node, obs)
            return
        if hasattr(obs, "convert") and not isinstance(obs, QuantkitObserver):
            # torchao's protocol: an observer that knows its own ops (torchao's affine and
            # group-wise observers) rewrites its node
            obs.convert(self.gm, node)
            return
        src = node.args[0]
        const = _constant_value(self.gm, src, self.memo)
        if is_float8_observer(obs):  # FP8 on the float8 grid: torchao's float8 ops (_convert_fp8)
            self._finish(node, obs, emit_float8(self, node, obs, const))
            return
        dtype = underlying_dtype(getattr(obs, "dtype", torch.float32))
        is_dynamic = bool(getattr(obs, "is_dynamic", False))
        out_kwargs = {}
        val = src.meta.get("val") if isinstance(src, Node) else None
        if isinstance(val, torch.Tensor) and val.dtype != torch.float32:
            out_kwargs = {"out_dtype": val.dtype}
        with self.graph.inserting_before(node):
            if dtype == torch.float16:
                conv = _OPS.convert_element_type.no_fuse
                out = self.graph.call_function(conv, (self.graph.call_function(conv, (src, torch.float16)), torch.float32))
            elif dtype not in _SUPPORTED:
                out = src  # nothing to quantize (e.g. a float passthrough observer)
            elif is_dynamic:
                out = emit_dynamic(self.graph, node, obs)
            else:
                scale, zp = obs.calculate_qparams()
                if is_per_channel(obs.qscheme):
                    axis = int(obs.ch_axis)
                    scale_node = self._new_attr("_qk_scale_", scale.detach().clone())
                    zp_node = self._new_attr("_qk_zero_point_", zp.detach().clone())
                    qargs = (scale_node, zp_node, axis, obs.quant_min, obs.quant_max, dtype)
                    q_op, dq_op = _OPS.quantize_per_channel.default, _OPS.dequantize_per_channel.default
                else:
                    qargs = (float(scale), int(zp), obs.quant_min, obs.quant_max, dtype)
                    q_op, dq_op = _OPS.quantize_per_tensor.default, _OPS.dequantize_per_tensor.default
                if isinstance(const, torch.Tensor) and self.fold:
                    # fold: store the integer tensor, keep only the dequantize in the graph
                    qvalue = q_op(const.detach(), *[self._literal(a) for a in qargs])
                    q = self._new_attr(FOLDED_PREFIX, qvalue)
                else:
                    q = self.graph.call_function(q_op, (src,) + qargs)
                out = self.graph.call_function(dq_op, (q,) + qargs, out_kwargs)
                self.records.append({
                    "node": getattr(obs, "node_name", node.name),
                    "kind": "weight" if isinstance(const, torch.Tensor) else "activation",
                    "dtype": str(dtype).replace("torch.", ""),
                    "qscheme": str(obs.qscheme).replace("torch.", ""),
                    "scale": scale.detach().reshape(-1).tolist(),
                    "zero_point": zp.detach().reshape(-1).tolist(),
                    "quant_min": obs.quant_min,
                    "quant_max": obs.quant_max,
                })
        self._finish(node, obs, out)

    def _finish(self, node: Node, obs, out: Node) -> None:
        if getattr(obs, "kv_role", None) and self.records and self.records[-1]["node"] == getattr(obs, "node_name", None):
            self.records[-1]["kv_cache"] = obs.kv_role  # a KV-cache scale (FP8Quantizer(kv_cache=...))
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    def _literal(self, arg):
        return _attr(self.gm, str(arg.target)) if isinstance(arg, Node) else arg


def _fold_constant_quantizes(conv: "_Converter") -> None:
    """Fold quantize ops whose input is a constant (weights quantized by an observer's own
    ``convert`` hook, e.g. torchao's affine ``quantize_affine``) into integer buffers, as
    quantkit's own weights are folded."""
    foldable = set(QUANTIZE_OPS)
    affine = getattr(torch.ops.torchao, "quantize_affine", None)
    if affine is not None:
        foldable.update({affine, affine.default})  # torchao's observers emit the packet
    for node in list(conv.graph.nodes):
        if node.op != "call_function" or node.target not in foldable:
            continue
        value = _constant_value(conv.gm, node, conv.memo)
        if isinstance(value, torch.Tensor):
            with conv.graph.inserting_before(node):
                folded = conv._new_attr(FOLDED_PREFIX, value.detach())
            node.replace_all_uses_with(folded)
            conv.graph.erase_node(node)


def _duplicate_dequantize(gm: GraphModule) -> None:
    """Give every consumer of a dequantize its own copy (the pattern Inductor matches). A
    dynamic requantization of the value (``choose_qparams`` + ``quantize(x, scale, zp)``) is one
    consumer: its choose_qparams reads the dequantize its quantize reads (as in torchao)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in DEQUANTIZE_OPS:
            continue
        users = [u for u in node.users if u.target not in _CHOOSE_OPS]
        for user in users[1:]:
            with gm.graph.inserting_after(node):
                copy = gm.graph.node_copy(node)
            user.replace_input_with(node, copy)


def _remove_unused_attributes(gm: GraphModule) -> None:
    used = set()
    for prefix, mod in gm.named_modules(remove_duplicate=False):
        if isinstance(mod, GraphModule):  # the graph itself and its control-flow subgraphs
            used.update(f"{prefix}.{n.target}" if prefix else str(n.target) for n in mod.graph.nodes if n.op == "get_attr")
    for name, _ in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        if name in used:
            continue
        *path, attr = name.split(".")
        owner = gm.get_submodule(".".join(path)) if path else gm
        if attr in owner._parameters:
            del owner._parameters[attr]
        elif attr in owner._buffers:
            del owner._buffers[attr]


def convert(prepared: GraphModule, *, fold_quantize: bool = True) -> GraphModule:
    """Return a converted copy of ``prepared``: every observer replaced with a
    ``quantized_decomposed`` quantize/dequantize pair.

    Static per-tensor observers become ``quantize_per_tensor``/``dequantize_per_tensor``
    with scalar qparams, per-channel ones ``*_per_channel`` with qparam buffers, dynamic
    ones ``choose_qparams`` + ``*_per_tensor.tensor`` (``*_per_token`` for per-token
    observers); static float8 (``float8_e4m3fn`` / ``float8_e5m2``) per-tensor specs take the
    same ops with the float8 dtype, as torchao's ``convert_pt2e``. Quantized constants (weights) are folded: the graph keeps an int8 buffer and
    its dequantize only, and the float weight is dropped. Every dequantize with several
    consumers is duplicated per consumer. Observers of quantkit, torchao (``prepare_pt2e``)
    and ``torch.ao`` are all accepted; an observer with a ``convert(model, node)`` method
    (torchao's protocol) rewrites its own node.

    Ownership: ``prepared`` is never modified and stays usable (calibrate it further,
    convert it again: the same data gives the same model). The result is a new
    GraphModule; the float parameters it keeps (biases, layers left float) are
    ``prepared``'s own tensors, not copies, and its int8 weights are new.

    Args:
        prepared: a model from :func:`quantkit.prepare` (or torchao's ``prepare_pt2e``).
        fold_quantize: fold quantized constants into integer buffers named ``_frozen_param<i>``
            (torchao's name); False keeps ``quantize(weight)`` in the graph, as torchao's
            ``convert_pt2e(fold_quantize=False)``.

    Raises:
        ConvertError: if the model has no observers, a float8 spec is per-channel or dynamic
            (no quantized_decomposed op runs them), or an activation observer that declares
            ``requires_calibration`` (all of quantkit's) has seen no data (calibrate first).
            Observers that do not declare it (torchao's, ``torch.ao``'s) are converted with
            whatever their ``calculate_qparams`` returns, as torchao's ``convert_pt2e`` does.
    """
    if not isinstance(prepared, GraphModule):
        raise TypeError(f"convert expects the GraphModule returned by quantkit.prepare, got {type(prepared).__name__}")
    _check_prepared(prepared)
    if not isinstance(fold_quantize, bool):
        raise TypeError(f"fold_quantize must be True or False, got {fold_quantize!r}")
    return convert_in_place(copy_sharing_parameters(prepared), fold_quantize=fold_quantize)


def _check_prepared(prepared: GraphModule) -> None:
    modules = dict(prepared.named_modules(remove_duplicate=False))
    if not is_prepared(prepared) and not any(is_observer_node(n, modules) for n in prepared.graph.nodes):
        raise ConvertError("the model has no observers; call quantkit.prepare(model, quantizer) before convert")


def _observe_weights_and_check(prepared: GraphModule) -> None:
    """Observe constants that calibration did not reach, then check every activation observer
    (of ``prepared`` and of its control-flow subgraphs) before anything is rewritten, so a
    failure leaves the prepared model as it was."""
    for target in control_flow_subgraphs(prepared):
        _observe_weights_and_check(prepared.get_submodule(target))
    modules = dict(prepared.named_modules(remove_duplicate=False))
    memo: dict = {}
    obs_nodes = [n for n in prepared.graph.nodes if is_observer_node(n, modules)]
    for node in obs_nodes:
        obs = modules[str(node.target)]
        const = _constant_value(prepared, node.args[0], memo)
        if isinstance(const, torch.Tensor) and not _is_calibrated(obs) and not getattr(obs, "is_dynamic", False):
            obs(const)
    for node in obs_nodes:
        obs = modules[str(node.target)]
        dtype = underlying_dtype(getattr(obs, "dtype", torch.float32))
        own_convert = (hasattr(obs, "convert") and not isinstance(obs, QuantkitObserver)) or is_float8_observer(obs)
        if dtype in FLOAT8_DTYPES and not own_convert and (is_per_channel(getattr(obs, "qscheme", None))
                                       or getattr(obs, "is_dynamic", False)):
            # torch's dequantize_per_channel subtracts int64 zero points from the float8 tensor,
            # which torch cannot promote (the model could not run); choose_qparams is integer-only
            kind = "dynamic" if getattr(obs, "is_dynamic", False) else "per-channel"
            raise ConvertError(
                f"{kind} {str(dtype).replace('torch.', '')} quantization at node "
                f"'{getattr(obs, 'node_name', node.name)}' has no quantized_decomposed ops; "
                "use a static per-tensor spec for float8"
            )
        algorithm = getattr(obs, "weight_algorithm", None)
        if algorithm not in (None, "rtn") and not getattr(obs, "has_fixed_qparams", True):
            raise ConvertError(
                f"the weight at node '{getattr(obs, 'node_name', node.name)}' is to be rounded by {algorithm}, "
                "which needs calibration data: run quantkit.calibrate(prepared, data) before convert"
            )
        # only observers that declare it are refused; others (torchao's) give their own defaults
        if getattr(obs, "requires_calibration", False) and not getattr(obs, "is_dynamic", False) \
                and not _is_calibrated(obs):
            where = getattr(obs, "node_name", node.name)
            shape = _empty_shape(node.args[0])
            if shape is not None or getattr(obs, "saw_empty", False):  # a zero-size dimension, not missing data
                raise ConvertError(empty_message(where, shape))
            hint = ("the model was never calibrated" if not prepared.meta.get("quantkit_calibrated_batches")
                    else "no calibration batch reached it")
            raise ConvertError(
                f"observer at node '{where}' has seen no data ({hint}); "
                "run quantkit.calibrate(prepared, data) before convert"
            )


def _empty_shape(arg) -> tuple | None:
    """The shape of the tensor ``arg`` holds when a dimension of it is known to be 0, else None."""
    val = arg.meta.get("val") if isinstance(arg, Node) else None
    if isinstance(val, torch.Tensor) and any(isinstance(d, int) and d == 0 for d in val.shape):
        return tuple(int(d) if isinstance(d, int) else str(d) for d in val.shape)
    return None


def _delete_unused_submodules(gm: GraphModule) -> None:
    """Delete the submodules (observers) that no node of ``gm`` reaches; unlike
    ``GraphModule.delete_all_unused_submodules``, a subgraph attribute (``get_attr`` of a
    scan / while_loop body) keeps its own submodules."""
    used = set()
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr"):
            atoms = str(node.target).split(".")
            used.update(".".join(atoms[:i]) for i in range(1, len(atoms) + 1))
            sub = gm.get_submodule(str(node.target)) if node.op == "call_module" or isinstance(
                _attr(gm, str(node.target)), torch.nn.Module) else None
            if sub is not None:
                used.update(f"{node.target}.{name}" for name, _ in sub.named_modules() if name)
    for name, _ in sorted(gm.named_modules(remove_duplicate=False), key=lambda kv: -kv[0].count(".")):
        if name and name not in used:
            *path, attr = name.split(".")
            try:
                owner = gm.get_submodule(".".join(path)) if path else gm
            except AttributeError:  # its parent was deleted already
                continue
            if attr in owner._modules:  # not yet deleted through another name of a shared module
                delattr(owner, attr)


def convert_in_place(prepared: GraphModule, *, fold_quantize: bool = True, _nested: bool = False) -> GraphModule:
    """:func:`convert` without the copy: the observers of ``prepared`` are consumed and its
    graph rewritten; for callers whose prepared model is private (``quantize``). On an
    error, ``prepared`` is left as it was. The subgraphs of ``scan`` / ``while_loop`` are
    converted first, each as a graph of its own (as torchao's ``convert_pt2e``)."""
    if not _nested:
        _check_prepared(prepared)
        fold_simulated_bn(prepared)  # QAT models: eval mode, batch norms folded for good
        _observe_weights_and_check(prepared)
    records: list[dict] = []
    for target in control_flow_subgraphs(prepared):
        sub = convert_in_place(prepared.get_submodule(target), fold_quantize=fold_quantize, _nested=True)
        records.extend(sub.meta.get(QPARAMS_META_KEY, []))
        set_submodule(prepared, target, sub)
    conv = _Converter(prepared, fold_quantize)
    # a prepared model whose quantizer annotated nothing has none: it converts to itself
    for node in [n for n in prepared.graph.nodes if is_observer_node(n, conv.modules)]:
        conv.replace(node)
    if fold_quantize:
        _fold_constant_quantizes(conv)
    _duplicate_dequantize(prepared)
    prepared.graph.eliminate_dead_code()
    _delete_unused_submodules(prepared)
    _remove_unused_attributes(prepared)
    prepared.recompile()
    converted = GraphModule(prepared, prepared.graph)
    converted.meta.update(prepared.meta)
    converted.meta.pop("quantkit_prepared", None)
    converted.meta["quantkit_converted"] = True
    converted.meta.pop("_observed_graph_module_attrs", None)
    converted.meta[QPARAMS_META_KEY] = records + conv.records
    return refuse_training(converted) if is_qat(converted) else disallow_train_eval(converted)
