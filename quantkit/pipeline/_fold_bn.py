"""Fold eval-mode batch norm into the preceding convolution or linear (before annotation)."""

from __future__ import annotations

import warnings

import torch
from torch.fx import GraphModule, Node
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from .._graph import get_attr, set_attr

__all__ = ["fold_conv_bn"]

_CONVS = {
    torch.ops.aten.conv1d.default: False,
    torch.ops.aten.conv2d.default: False,
    torch.ops.aten.conv3d.default: False,
    torch.ops.aten.conv1d.padding: False,  # padding="same" / "valid"
    torch.ops.aten.conv2d.padding: False,
    torch.ops.aten.conv3d.padding: False,
    torch.ops.aten.conv_transpose1d.default: True,
    torch.ops.aten.conv_transpose2d.input: True,
    torch.ops.aten.conv_transpose3d.input: True,
}
_LINEAR = torch.ops.aten.linear.default
# target -> index of eps among the positional args
_BATCH_NORMS = {
    torch.ops.aten.batch_norm.default: 7,
    torch.ops.aten._native_batch_norm_legit_no_training.default: 6,
}


def _constant(gm: GraphModule, node) -> torch.Tensor | None:
    if node is None:
        return None
    if not isinstance(node, Node) or node.op != "get_attr":
        raise _NotFoldable
    return get_attr(gm, str(node.target)).detach()


class _NotFoldable(Exception):
    pass


def fold_conv_bn(gm: GraphModule) -> int:
    """Fold ``conv → batch_norm`` and ``linear → batch_norm`` (eval mode) into the conv's
    or linear's weight and bias, in place (new parameter tensors replace the old ones on
    ``gm``; the old tensors are not written).

    A pair is folded only when the conv's output feeds the batch norm alone, the
    batch norm runs in inference mode, and the conv's weight is used by no other node.
    A linear is folded only when its output is 2-D ``[N, features]``: on ``[N, C, L]``,
    ``BatchNorm1d`` normalizes dim 1, not the linear's features (a warning says so).

    Returns:
        The number of batch norms folded.
    """
    folded = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target not in _BATCH_NORMS:
            continue
        if bn.target is torch.ops.aten.batch_norm.default and bn.args[5]:
            continue  # training-mode batch norm: statistics come from the batch
        conv = bn.args[0]
        if not (isinstance(conv, Node) and conv.op == "call_function" and (conv.target in _CONVS or conv.target is _LINEAR)):
            continue
        out = conv.meta.get("val")
        if conv.target is _LINEAR and not (isinstance(out, torch.Tensor) and out.dim() == 2):
            warnings.warn(
                f"Not fusing linear+bn at '{conv.name}': its output is {getattr(out, 'dim', lambda: '?')()}-D, where "
                "BatchNorm1d normalizes dim 1, not the linear's features; the batch norm stays",
                stacklevel=3,
            )
            continue
        if len(conv.users) != 1 or len(conv.args[1].users) != 1:
            continue
        try:
            conv_w = _constant(gm, conv.args[1])
            conv_b = _constant(gm, conv.args[2] if len(conv.args) > 2 else None)
            bn_w, bn_b, bn_rm, bn_rv = (_constant(gm, a) for a in bn.args[1:5])
        except _NotFoldable:
            continue
        if bn_rm is None or bn_rv is None:
            continue
        eps = bn.args[_BATCH_NORMS[bn.target]]
        if conv.target is _LINEAR:
            bn_w = torch.ones_like(bn_rm) if bn_w is None else bn_w  # BatchNorm1d(affine=False)
            bn_b = torch.zeros_like(bn_rm) if bn_b is None else bn_b
            weight, bias = fuse_linear_bn_weights(conv_w, conv_b, bn_rm, bn_rv, eps, bn_w, bn_b)
        else:
            weight, bias = fuse_conv_bn_weights(
                conv_w, conv_b, bn_rm, bn_rv, eps, bn_w, bn_b, transpose=_CONVS[conv.target]
            )
        # the targets are get_attr nodes' (they exist): a parameter stays a parameter, a buffer a buffer
        set_attr(gm, str(conv.args[1].target), weight.detach())
        args = list(conv.args) + [None] * (3 - len(conv.args))
        if isinstance(args[2], Node):
            set_attr(gm, str(args[2].target), bias.detach())
        else:
            bias_name = str(conv.args[1].target).replace(".", "_") + "_folded_bias"
            gm.register_parameter(bias_name, torch.nn.Parameter(bias.detach(), requires_grad=False))
            with gm.graph.inserting_before(conv):
                bias_node = gm.graph.get_attr(bias_name)
            if "val" in conv.args[1].meta:
                fake = conv.args[1].meta["val"]
                bias_node.meta["val"] = fake.fake_mode.from_tensor(bias.detach(), static_shapes=True)
            args[2] = bias_node
        conv.args = tuple(args)
        if bn.target is torch.ops.aten.batch_norm.default:
            bn.replace_all_uses_with(conv)
        else:
            # _native_batch_norm_legit_no_training returns a tuple; users take item 0
            for user in list(bn.users):
                user.replace_all_uses_with(conv)
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return folded
