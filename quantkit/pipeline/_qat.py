"""prepare_qat: quantization-aware training in the PT2E flow.

The quantizer annotates the exported graph as for PTQ; then (hooks of :func:`prepare_in_place`)
conv → batch norm pairs are rewritten into simulated folding and every observer becomes a
:class:`quantkit.observers.FakeQuantize`. ``.train()`` / ``.eval()`` switch the graph's batch
norms and dropouts (an exported graph ignores the module flag) and the fake-quantize modules.
:func:`fold_simulated_bn` is convert's hook: it folds the batch norms for good.
"""

from __future__ import annotations

import copy
import types

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.fake_quantize import FakeQuantizeBase
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec

from quantkit.observers._fake_quant import FakeQuantize

from .._errors import CaptureError, ConvertError
from .._graph import ANNOTATION_KEY, get_attr, unique_attr_name
from ._prepare import from_attributes, is_prepared, prepare_in_place

__all__ = ["prepare_qat", "set_training", "fold_simulated_bn", "refuse_training", "is_qat"]

aten = torch.ops.aten
QAT_META_KEY = "quantkit_qat"
# on a conv rewritten into simulated folding: the names of its parts, for convert
_FOLD_META_KEY = "quantkit_qat_conv_bn"

_CONVS = {
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
}
_BATCH_NORM = aten.batch_norm.default
_BN_TRAINING_ARG = 5  # batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)
_BN_EPS_ARG = 7
# dropout(input, p, train): the same signature for each
_DROPOUTS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
             aten.feature_alpha_dropout.default}
_DROPOUT_TRAIN_ARG = 2


def is_qat(gm: torch.nn.Module) -> bool:
    """Whether ``gm`` came out of :func:`prepare_qat` (or was converted from such a model)."""
    return isinstance(gm, GraphModule) and bool(gm.meta.get(QAT_META_KEY))


def prepare_qat(model: GraphModule, quantizer, *, freeze_observers_after: int | None = None) -> GraphModule:
    """Prepare a captured model for quantization-aware training.

    The quantizer annotates the graph as for :func:`quantkit.prepare` (quantkit's quantizers:
    ``W8A8Quantizer``, ``WeightOnlyQuantizer`` with int4/int8 group-wise weights, not NF4; or torchao's
    QAT ones such as ``X86InductorQuantizer`` with an ``is_qat=True`` config).
    Every observed edge gets a fake-quantize module (:class:`quantkit.observers.FakeQuantize`:
    the observer plus fake quantization with a straight-through estimator; a learnable scale and
    zero point where the quantizer's config says ``learnable_ranges=True``). Batch norms after
    convolutions stay live: the weight is fake-quantized after folding the batch norm's scale
    (simulated folding, Krishnamoorthi 2018, as torchao's ``prepare_qat_pt2e``), and
    :func:`quantkit.convert` folds them for good.

    The result is a trainable module in training mode: ``.train()`` / ``.eval()`` switch batch
    norm statistics, dropout and the fake-quantize observers (frozen in eval mode).

    Ownership: ``model`` is never modified; the result has its own copy of the parameters
    (training writes them).

    Args:
        model: a GraphModule from :func:`quantkit.capture` (``torch.export(...).module()``).
        quantizer: a torchao-protocol ``Quantizer``.
        freeze_observers_after: stop updating the qparams from the observers after this many
            training steps (None: they follow the data throughout training).

    Returns:
        The prepared GraphModule, in training mode.

    Example:
        >>> qat = quantkit.prepare_qat(quantkit.capture(model, (x,)), W8A8Quantizer())
        >>> opt = torch.optim.SGD(qat.parameters(), lr=0.01)   # then train as usual
        >>> qat.eval(); qmodel = quantkit.convert(qat)
    """
    if not isinstance(model, GraphModule) or not any("val" in n.meta for n in model.graph.nodes):
        raise CaptureError(
            f"prepare_qat expects a captured model (torch.fx.GraphModule from torch.export), got "
            f"{type(model).__name__}; call quantkit.capture(model, example_inputs) first")
    if model.meta.get("quantkit_converted"):
        raise ConvertError("prepare_qat got a converted (int8) model; pass the captured float model")
    if is_prepared(model):
        raise CaptureError("prepare_qat got a model that is already prepared; pass the captured float model")
    if not hasattr(quantizer, "annotate"):
        raise TypeError(f"quantizer must implement the Quantizer protocol (annotate), got {type(quantizer).__name__}")
    if freeze_observers_after is not None and (
            not isinstance(freeze_observers_after, int) or freeze_observers_after < 0):
        raise ValueError(f"freeze_observers_after must be a non-negative integer or None, got {freeze_observers_after!r}")
    return prepare_in_place(copy.deepcopy(model), quantizer, qat=_QatHooks(quantizer, freeze_observers_after))


class _QatHooks:
    """What :func:`prepare_in_place` does differently for QAT (its ``qat=`` argument)."""

    def __init__(self, quantizer, freeze_after: int | None) -> None:
        self.quantizer = quantizer
        self.freeze_after = freeze_after

    def after_annotation(self, gm: GraphModule) -> None:
        simulate_conv_bn(gm)

    def fake_quantize(self, gm: GraphModule, observers: dict) -> dict:
        return _fake_quantize(gm, observers, self.quantizer, self.freeze_after)

    def finish(self, gm: GraphModule) -> GraphModule:
        gm.meta[QAT_META_KEY] = True
        gm.train = types.MethodType(_train, gm)
        gm.eval = types.MethodType(_eval, gm)
        set_training(gm, True)
        return gm


# --- train / eval ---------------------------------------------------------------------------

def _train(self, mode: bool = True):
    set_training(self, mode)
    return self


def _eval(self):
    set_training(self, False)
    return self


def set_training(gm: GraphModule, mode: bool) -> GraphModule:
    """Put ``gm`` (and its control-flow subgraphs) in training or eval mode, in place: the
    ``training`` argument of every ``batch_norm`` and the ``train`` argument of every dropout in
    the graph (what ``.train()`` changes on the eager modules), the ``training`` flag of every
    submodule, and the observers of foreign (torchao) fake-quantize modules."""
    mode = bool(mode)
    for module in gm.modules():
        if isinstance(module, GraphModule):
            changed = False
            for node in module.graph.nodes:
                if node.op != "call_function":
                    continue
                if node.target is _BATCH_NORM:
                    index = _BN_TRAINING_ARG
                elif node.target in _DROPOUTS:
                    index = _DROPOUT_TRAIN_ARG
                else:
                    continue
                if len(node.args) > index and node.args[index] is not mode:
                    node.update_arg(index, mode)
                    changed = True
            if changed:
                module.recompile()
        if isinstance(module, FakeQuantizeBase) and not isinstance(module, FakeQuantize):
            module.enable_observer(mode)
    torch.nn.Module.train(gm, mode)
    return gm


_REFUSE_MESSAGE = ("the model is converted (int8 weights) and cannot be trained; train the model from "
                   "quantkit.prepare_qat, then convert it")


def _refuse_train(self, mode: bool = True):
    if mode:
        raise ConvertError(_REFUSE_MESSAGE)
    return self


def refuse_training(gm: GraphModule) -> GraphModule:
    """Make ``gm.train()`` raise a one-line :class:`ConvertError` (a converted QAT model);
    ``gm.eval()`` / ``train(False)`` are no-ops (it already runs in eval mode)."""
    gm.train = types.MethodType(_refuse_train, gm)
    gm.eval = types.MethodType(lambda self: self, gm)
    return gm


# --- fake quantization ------------------------------------------------------------------------

def _learnable(quantizer, node: Node) -> bool:
    config_for = getattr(quantizer, "config_for", None)
    config = config_for(node) if callable(config_for) else getattr(quantizer, "global_config", None)
    return bool(getattr(config, "learnable_ranges", False))


def _fake_quantize(gm: GraphModule, observers: dict, quantizer, freeze_after: int | None) -> dict:
    """Replace every observer of a plain static ``QuantizationSpec`` with a FakeQuantize that
    wraps it (shared observers stay shared); fixed, derived and dynamic ones stay observers."""
    eligible: dict[int, tuple] = {}
    for node in gm.graph.nodes:
        ann = node.meta.get(ANNOTATION_KEY)
        if ann is None:
            continue
        keys = [((arg, node), spec) for arg, spec in ann.input_qspec_map.items()]
        keys.append((node, ann.output_qspec))
        for key, spec in keys:
            if isinstance(spec, QuantizationSpec) and not spec.is_dynamic and key in observers:
                if getattr(observers[key], "scheme", None) == "nf4":  # codes index a table: no uniform grid
                    raise ValueError("NF4 weights cannot be fake-quantized for QAT; use the int4 scheme "
                                     "(WeightOnlyQuantizer(bits=4)) for quantization-aware training")
                eligible.setdefault(id(observers[key]), (key, spec))
    made: dict[int, torch.nn.Module] = {}
    out = {}
    for key, obs in observers.items():
        if id(obs) in made:
            out[key] = made[id(obs)]
            continue
        fq = obs
        if isinstance(obs, FakeQuantize):
            if freeze_after is not None and obs.freeze_after is None:
                obs.freeze_after = freeze_after
        elif not isinstance(obs, FakeQuantizeBase) and id(obs) in eligible:
            first, spec = eligible[id(obs)]
            src, user = first if isinstance(first, tuple) else (first, first)
            weight = from_attributes(src)
            channels = None
            val = src.meta.get("val")
            if spec.ch_axis is not None and isinstance(val, torch.Tensor) and getattr(obs, "ch_axis", None) is not None:
                channels = int(val.shape[int(obs.ch_axis)])
            fq = FakeQuantize(obs, learnable=_learnable(quantizer, user), weight=weight,
                              channels=channels, freeze_after=freeze_after)
        made[id(obs)] = fq
        out[key] = fq
    return out


# --- conv + batch norm: simulated folding --------------------------------------------------------

def _meta_like(new: Node, like: Node) -> Node:
    for k in ("val", "nn_module_stack", "source_fn_stack", "stack_trace"):
        if k in like.meta:
            new.meta[k] = like.meta[k]
    return new


def _scale_factor(graph: torch.fx.Graph, bn: Node) -> Node:
    """``gamma / sqrt(running_var + eps)``, as graph nodes (inserted at the current point)."""
    std = graph.call_function(aten.sqrt.default, (graph.call_function(aten.add.Tensor, (bn.args[4], bn.args[_BN_EPS_ARG])),))
    gamma = bn.args[1]
    if gamma is None:
        return graph.call_function(aten.reciprocal.default, (std,))
    return graph.call_function(aten.div.Tensor, (gamma, std))


def simulate_conv_bn(gm: GraphModule) -> int:
    """Rewrite each ``conv → batch_norm`` pair of ``gm`` in place into simulated folding
    (Krishnamoorthi 2018, section 3.2; torchao's ``_fuse_conv_bn_qat``)::

        s = gamma / sqrt(running_var + eps)
        y = conv(x, w * s, None) / s + b      # the weight edge w * s is what gets fake-quantized
        out = batch_norm(y, ...)              # live: batch statistics in training

    The conv's annotation follows (its weight spec moves to ``w * s``; its bias is no longer a
    conv input). Returns the number of pairs rewritten."""
    graph = gm.graph
    count = 0
    for conv in list(graph.nodes):
        if conv.op != "call_function" or conv.target not in _CONVS or len(conv.users) != 1:
            continue
        bn = next(iter(conv.users))
        if bn.target is not _BATCH_NORM or bn.args[0] is not conv:
            continue
        w = conv.args[1]
        bias = conv.args[2] if len(conv.args) > 2 else None
        if not (isinstance(w, Node) and w.op == "get_attr" and len(w.users) == 1):
            continue
        if not all(a is None or (isinstance(a, Node) and a.op == "get_attr") for a in bn.args[1:5]) \
                or bn.args[4] is None or not (bias is None or (isinstance(bias, Node) and bias.op == "get_attr")):
            continue
        dims = w.meta["val"].dim() if "val" in w.meta else 4
        with graph.inserting_before(conv):
            sf = _scale_factor(graph, bn)
            sf_w = graph.call_function(aten.reshape.default, (sf, [-1] + [1] * (dims - 1)))
            scaled = _meta_like(graph.call_function(aten.mul.Tensor, (w, sf_w)), w)
        conv.update_arg(1, scaled)
        if len(conv.args) > 2:
            conv.update_arg(2, None)
        with graph.inserting_after(conv):
            sf_o = graph.call_function(aten.reshape.default, (sf, [1, -1] + [1] * (dims - 2)))
        with graph.inserting_after(sf_o):
            y = _meta_like(graph.call_function(aten.div.Tensor, (conv, sf_o)), conv)
        last = y
        if bias is not None:
            with graph.inserting_after(y):
                b = graph.call_function(aten.reshape.default, (bias, [1, -1] + [1] * (dims - 2)))
            with graph.inserting_after(b):
                last = _meta_like(graph.call_function(aten.add.Tensor, (y, b)), conv)
        bn.update_arg(0, last)
        ann = conv.meta.get(ANNOTATION_KEY)
        if ann is not None:
            if w in ann.input_qspec_map:
                ann.input_qspec_map[scaled] = ann.input_qspec_map.pop(w)
            ann.input_qspec_map.pop(bias, None)
            if ann.output_qspec is not None:  # the conv's output is now y: quantize that instead
                last.meta[ANNOTATION_KEY] = QuantizationAnnotation(output_qspec=ann.output_qspec, _annotated=True)
                ann.output_qspec = None
        conv.meta[_FOLD_META_KEY] = {"bn": bn.name, "scaled": scaled.name,
                                     "weight": str(w.target), "bias": None if bias is None else str(bias.target)}
        count += 1
    if count:
        gm.recompile()
    return count


def _new_param(gm: GraphModule, base: str, value: torch.Tensor, like: Node) -> Node:
    name = unique_attr_name(gm, base)
    gm.register_parameter(name, torch.nn.Parameter(value.detach().clone(), requires_grad=False))
    node = gm.graph.get_attr(name)
    fake = like.meta.get("val")
    if fake is not None and getattr(fake, "fake_mode", None) is not None:
        node.meta["val"] = fake.fake_mode.from_tensor(value.detach(), static_shapes=True)
    return node


@torch.no_grad()
def fold_simulated_bn(gm: GraphModule) -> int:
    """Convert's hook for QAT models, in place: put ``gm`` in eval mode, then fold each batch norm
    of a simulated conv-BN pair into its conv for good (``w * s`` and ``(b - mean) * s + beta``
    from the running statistics, computed as the eval-mode graph computes ``w * s``, so the
    weight's fake quantization and the int8 weight agree). No-op for other models.
    Returns the number of batch norms folded."""
    if not is_qat(gm):
        return 0
    set_training(gm, False)
    nodes = {n.name: n for n in gm.graph.nodes}
    count = 0
    for conv in list(gm.graph.nodes):
        info = conv.meta.get(_FOLD_META_KEY)
        if info is None or info["bn"] not in nodes or info["scaled"] not in nodes:
            continue
        bn, scaled = nodes[info["bn"]], nodes[info["scaled"]]
        vals = [None if a is None else get_attr(gm, str(a.target)) for a in bn.args[1:5]]
        gamma, beta, mean, var = vals
        eps = bn.args[_BN_EPS_ARG]
        std = torch.sqrt(torch.add(var, eps))
        sf = torch.reciprocal(std) if gamma is None else torch.div(gamma, std)
        w = get_attr(gm, info["weight"])
        w_f = torch.mul(w, torch.reshape(sf, [-1] + [1] * (w.dim() - 1)))
        b = torch.zeros_like(mean) if info["bias"] is None else get_attr(gm, info["bias"])
        b_f = (b - mean) * sf + (0 if beta is None else beta)
        with gm.graph.inserting_before(scaled):
            w_node = _new_param(gm, "_qat_folded_weight", w_f, scaled)
            b_node = _new_param(gm, "_qat_folded_bias", b_f, scaled)
        scaled.replace_all_uses_with(w_node)
        if len(conv.args) > 2:
            conv.update_arg(2, b_node)
        else:
            conv.args = tuple(conv.args) + (b_node,)
        bn.replace_all_uses_with(conv)
        del conv.meta[_FOLD_META_KEY]
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count
