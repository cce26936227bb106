"""convert: replace each observer with what the emitter of its kind emits (``quantkit.pipeline.emit``),
fold quantized constants, give every dequantize its own consumer."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from quantkit.observers._base import empty_message

from .._errors import ConvertError
from .._graph import (
    DEQUANTIZE_OPS,
    CHOOSE_QPARAMS_OPS,
    FOLDED_PREFIX,
    QPARAMS_META_KEY,
    QUANTIZE_OPS,
    constant_value,
    get_attr,
    is_calibrated,
    is_observer_node,
    mutated_attributes,
)
from .._qdq import PER_TOKEN, emit_dynamic
from .._qmath import underlying_dtype
from ._float_fallback import finish_recorded_float_layers
from ._kv_capture import install_length_check
from ._prepare import control_flow_subgraphs, copy_sharing_parameters, disallow_train_eval, is_prepared, set_submodule
from ._qat import fold_simulated_bn, is_qat, refuse_training
from .emit import ConvertContext, emitter_for

__all__ = [
    "convert", "convert_in_place", "emit_dynamic", "QPARAMS_META_KEY", "QUANTIZE_OPS", "DEQUANTIZE_OPS", "FOLDED_PREFIX",
    "mutated_attributes",
]

def _record_dynamic(ctx: ConvertContext, node: Node, obs) -> None:
    """A dynamic observer's record (whatever its kind): no qparams, the run-time granularity."""
    if getattr(obs, "is_dynamic", False) and hasattr(obs, "dtype"):
        per_token = getattr(obs, "granularity", None) == PER_TOKEN
        ctx.records.append({"node": getattr(obs, "node_name", node.name),
                            "kind": "dynamic-per-token" if per_token else "dynamic",
                            "dtype": str(underlying_dtype(obs.dtype)).replace("torch.", "")})


def _fold_constant_quantizes(conv: ConvertContext) -> None:
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
        value = conv.constant(node)
        if isinstance(value, torch.Tensor):
            with conv.graph.inserting_before(node):
                folded = conv.new_attr(FOLDED_PREFIX, value.detach())
            node.replace_all_uses_with(folded)
            conv.graph.erase_node(node)


def _duplicate_dequantize(gm: GraphModule) -> None:
    """Give every consumer of a dequantize its own copy (the pattern Inductor matches). A
    dynamic requantization of the value (``choose_qparams`` + ``quantize(x, scale, zp)``) is one
    consumer: its choose_qparams reads the dequantize its quantize reads (as in torchao)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in DEQUANTIZE_OPS:
            continue
        users = [u for u in node.users if u.target not in CHOOSE_QPARAMS_OPS]
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
    (torchao's protocol) rewrites its own node. Each observer is rewritten by the emitter
    registered for its kind (``obs.qkind``, see :mod:`quantkit.pipeline.emit`), so a new kind
    registers an emitter instead of editing this function.

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
        const = constant_value(prepared, node.args[0], memo)
        if isinstance(const, torch.Tensor) and not is_calibrated(obs) and not getattr(obs, "is_dynamic", False):
            obs(const)
    for node in obs_nodes:
        obs = modules[str(node.target)]
        emitter_for(obs).check(prepared, node, obs)
        algorithm = getattr(obs, "weight_algorithm", None)
        if algorithm not in (None, "rtn") and not getattr(obs, "has_fixed_qparams", True):
            raise ConvertError(
                f"the weight at node '{getattr(obs, 'node_name', node.name)}' is to be rounded by {algorithm}, "
                "which needs calibration data: run quantkit.calibrate(prepared, data) before convert"
            )
        # only observers that declare it are refused; others (torchao's) give their own defaults
        if getattr(obs, "requires_calibration", False) and not getattr(obs, "is_dynamic", False) \
                and not is_calibrated(obs):
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
                get_attr(gm, str(node.target)), torch.nn.Module) else None
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
    conv = ConvertContext(prepared, fold_quantize)
    # a prepared model whose quantizer annotated nothing has none: it converts to itself
    for node in [n for n in prepared.graph.nodes if is_observer_node(n, conv.modules)]:
        obs = conv.modules[str(node.target)]
        _record_dynamic(conv, node, obs)
        emitter_for(obs).emit(conv, node, obs)
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
    if not _nested:  # layers a KeepFloat(..., float_weights="bf16") kept float: bf16 weights, no stray q/dq
        finish_recorded_float_layers(converted)
    install_length_check(converted)  # hooks do not travel to the new module (a no-op without a KV cache)
    return refuse_training(converted) if is_qat(converted) else disallow_train_eval(converted)
