"""W8A8Quantizer: static (or dynamic) int8 for linear, conv, matmul/bmm and optionally adds."""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)

from quantkit._graph import ANNOTATION_KEY, scoped_config, type_name
from quantkit._qmath import is_per_channel
from quantkit.observers import declared_qscheme
from quantkit.observers import get as get_observer
from quantkit.observers._declared import declaring
from quantkit.observers._fake_quant import FakeQuantize

from ._config import Granularity, QuantConfig
from ._scheme import quantizer_for

__all__ = ["W8A8Quantizer"]

aten = torch.ops.aten

_LINEAR = {aten.linear.default}
_CONV = {
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
}
_MATMUL = {aten.matmul.default, aten.bmm.default, aten.mm.default}
# addmm(bias, x, w[K, N]): HF's Conv1D (GPT-2) is a linear with its weight stored transposed
_ADDMM = {aten.addmm.default}
_ADD = {aten.add.Tensor}
_SDPA = {aten.scaled_dot_product_attention.default}
# ops that move values without changing them: quantization passes through them
_PASSTHROUGH = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.permute.default, aten.transpose.int, aten.t.default,
    aten.flatten.using_ints, aten.squeeze.dim, aten.unsqueeze.default,
    aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
    aten.adaptive_max_pool1d.default, aten.adaptive_max_pool2d.default,
}


def _has_elements(val: torch.Tensor) -> bool:
    """False when a dimension of ``val`` is known to be 0 (a zero-width layer, an empty slice):
    there is nothing to observe or quantize, so it stays float. Symbolic sizes count as non-zero."""
    return not any(isinstance(d, int) and d == 0 for d in val.shape)


def _is_float_tensor(arg) -> bool:
    """A graph node whose value is a floating-point tensor with elements."""
    if not isinstance(arg, Node):
        return False
    val = arg.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point() and _has_elements(val)


class W8A8Quantizer(Quantizer):
    """Static int8 weights and activations (or dynamic activations).

    Weights are symmetric int8 per output channel; activations are per tensor,
    affine uint8 by default. Covers linear, conv1d/2d/3d (batch norm is folded by
    ``quantkit.prepare``), matmul/bmm (attention) and, with ``"add"`` in
    ``QuantConfig.ops``, residual adds. Quantization is propagated through shape ops
    and max pooling with ``SharedQuantizationSpec``.

    Args:
        config: the global :class:`QuantConfig` (default ``QuantConfig()``).
        dynamic: shortcut for ``QuantConfig(dynamic=True)`` (only with ``config=None``).

    Example:
        >>> q = W8A8Quantizer().set_module_name("classifier", None)  # keep the head in float
    """

    def __init__(self, config: Optional[QuantConfig] = None, *, dynamic: Optional[bool] = None) -> None:
        super().__init__()
        if config is not None and not isinstance(config, QuantConfig):
            raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
        if config is None:
            config = QuantConfig(dynamic=bool(dynamic))
        elif dynamic is not None and dynamic != config.dynamic:
            raise ValueError("pass dynamic=... or a QuantConfig, not both with different values")
        self.global_config: Optional[QuantConfig] = config
        self.module_type_config: dict[str, Optional[QuantConfig]] = {}
        self.module_name_config: dict[str, Optional[QuantConfig]] = {}

    # --- configuration ------------------------------------------------------------
    @staticmethod
    def _check(config):
        if config is not None and not isinstance(config, QuantConfig):
            raise TypeError(f"expected a QuantConfig or None, got {type(config).__name__}")
        return config

    def set_global(self, config: Optional[QuantConfig]) -> "W8A8Quantizer":
        """Config for everything not matched by a module name or type; None keeps it float."""
        self.global_config = self._check(config)
        return self

    def set_module_type(self, module_type: type, config: Optional[QuantConfig]) -> "W8A8Quantizer":
        """Config for ops inside modules of ``module_type`` (e.g. ``torch.nn.Linear``); None keeps them float."""
        if not isinstance(module_type, type):
            raise TypeError(f"module_type must be a class such as torch.nn.Linear, got {module_type!r}")
        self.module_type_config[type_name(module_type)] = self._check(config)
        return self

    def set_module_name(self, module_name: str, config: Optional[QuantConfig]) -> "W8A8Quantizer":
        """Config for ops inside the submodule ``module_name`` (and its children); None keeps them float."""
        if not isinstance(module_name, str):
            raise TypeError(f"module_name must be a string, got {type(module_name).__name__}")
        self.module_name_config[module_name] = self._check(config)
        return self

    def config_for(self, node: Node) -> Optional[QuantConfig]:
        """The config that applies to ``node``: module name, then module type, then global."""
        return scoped_config(node, self.module_name_config, self.module_type_config, self.global_config)

    # --- specs ----------------------------------------------------------------------
    @staticmethod
    def act_spec(config: QuantConfig, *, per_token_ok: bool = False) -> QuantizationSpec:
        """Activation spec. Per-token scales apply only where the last dimension is the
        GEMM's reduction dimension (linear inputs, a matmul's left operand): elsewhere a
        scale per row would vary along K and could not be factored out of an int8 GEMM."""
        scheme = config.activation
        lo, hi = scheme.qrange_bits(config.activation_bits)
        ctor = get_observer("placeholder" if config.dynamic else config.act_observer)
        per_token = per_token_ok and config.granularity is Granularity.PER_TOKEN
        if per_token:
            ctor = ctor.with_args(per_token=True)
        if config.qat and not config.dynamic:
            ctor = FakeQuantize.with_args(observer=ctor, learnable=config.learnable_ranges)
        return QuantizationSpec(
            dtype=scheme.dtype, quant_min=lo, quant_max=hi, qscheme=scheme.qscheme,
            is_dynamic=config.dynamic, observer_or_fake_quant_ctr=ctor,
            # ch_axis only keeps implicit sharing from merging a per-token edge with a
            # per-tensor edge of the same tensor; the placeholder observer does not take it
            ch_axis=1 if per_token else None,
        )

    @staticmethod
    def weight_spec(config: QuantConfig, ch_axis: int = 0) -> QuantizationSpec:
        """Weight spec; ``ch_axis`` is the output-channel axis (0 for ``linear``/conv
        weights ``[N, K, ...]``, 1 for ``[K, N]`` weights of ``addmm``/``mm``)."""
        ctor = get_observer(config.weight_observer)
        # the observer declares its granularity (its default qscheme), whatever its class name
        per_channel = is_per_channel(declared_qscheme(ctor))
        if config.qat:
            ctor = FakeQuantize.with_args(observer=ctor, learnable=config.learnable_ranges, weight=True)
        elif config.weight_algorithm != "rtn":  # rounded by GPTQ/AWQ in quantkit.calibrate
            ctor = declaring(ctor, weight_algorithm=config.weight_algorithm)
        bits = config.weight_bits
        return QuantizationSpec(
            dtype=torch.int8, quant_min=-(2 ** (bits - 1)), quant_max=2 ** (bits - 1) - 1,
            qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
            ch_axis=ch_axis, is_dynamic=False, observer_or_fake_quant_ctr=ctor,
        )

    # --- annotation -----------------------------------------------------------------
    def annotate(self, model: GraphModule) -> GraphModule:
        for node in model.graph.nodes:
            if node.op != "call_function" or ANNOTATION_KEY in node.meta:
                continue
            config = self.config_for(node)
            if config is None:
                continue
            target = node.target
            if target in _LINEAR and "linear" in config.ops:
                self._annotate_weighted(node, config)
            elif target in _CONV and "conv" in config.ops:
                self._annotate_weighted(node, config)
            elif target in _ADDMM and "linear" in config.ops:
                self._annotate_weight_right(node, config, node.args[1], node.args[2])
            elif target in _MATMUL and "matmul" in config.ops:
                if not self._annotate_weight_right(node, config, *node.args[:2]):
                    self._annotate_inputs(node, config, node.args[:2])
            elif target in _ADD and "add" in config.ops:
                self._annotate_inputs(node, config, node.args[:2])
            elif target in _SDPA and "attention" in config.ops:
                self._annotate_sdpa(node, config)
        self._propagate(model)
        return model

    def _annotate_weighted(self, node: Node, config: QuantConfig) -> None:
        x, w = node.args[0], node.args[1]
        if not (_is_float_tensor(x) and isinstance(w, Node)):
            return
        w_val = w.meta.get("val")
        if isinstance(w_val, torch.Tensor) and not _has_elements(w_val):  # a zero-width layer stays float
            return
        qmap = {x: self.act_spec(config, per_token_ok=node.target in _LINEAR), w: self.weight_spec(config)}
        node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=qmap, _annotated=True)

    def _annotate_weight_right(self, node: Node, config: QuantConfig, x, w) -> bool:
        """``x @ w`` with ``w`` a 2-D parameter ``[K, N]`` (``addmm``, ``mm``/``matmul`` by a
        weight): ``x`` as an activation (per token where configured), ``w`` as a weight,
        per output channel along dim 1. Returns whether it annotated."""
        if not (_is_float_tensor(x) and _is_float_tensor(w) and w.op == "get_attr" and w.meta["val"].dim() == 2):
            return False
        qmap = {x: self.act_spec(config, per_token_ok=True), w: self.weight_spec(config, ch_axis=1)}
        node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=qmap, _annotated=True)
        return True

    def _annotate_inputs(self, node: Node, config: QuantConfig, inputs) -> None:
        if len(inputs) < 2 or not all(_is_float_tensor(a) for a in inputs):
            return
        qmap = {a: self.act_spec(config) for a in inputs}
        if node.target in _MATMUL:
            qmap[inputs[0]] = self.act_spec(config, per_token_ok=True)
        node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=qmap, _annotated=True)

    def _annotate_sdpa(self, node: Node, config: QuantConfig) -> None:
        """``scaled_dot_product_attention(q, k, v, ...)``: q, k and v as per-tensor activations
        (static or dynamic). The mask stays as it is and the softmax runs in float inside the op;
        its output is quantized by whatever consumes it (the output projection's input)."""
        qkv = node.args[:3]
        if len(qkv) < 3 or not all(_is_float_tensor(a) for a in qkv) or len(set(qkv)) < 3:
            return  # one tensor used as two of q/k/v would need one spec for both: left float
        node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
            input_qspec_map={a: self.act_spec(config) for a in qkv}, _annotated=True)

    def _propagate(self, model: GraphModule) -> None:
        """Move activation quantization above shape ops and max pools whose every
        consumer quantizes them, so the int8 tensor (not the float one) is moved."""
        for node in reversed(list(model.graph.nodes)):
            if node.op != "call_function" or node.target not in _PASSTHROUGH or ANNOTATION_KEY in node.meta:
                continue
            x = node.args[0]
            config = self.config_for(node)
            if config is None or config.dynamic or not _is_float_tensor(x) or x.op == "get_attr":
                continue
            spec = self.act_spec(config)
            users = list(node.users)
            if not users or not all(self._quantizes_input(u, node, spec) for u in users):
                continue
            node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                input_qspec_map={x: spec},
                output_qspec=SharedQuantizationSpec((x, node)),
                _annotated=True,
            )

    @staticmethod
    def _quantizes_input(user: Node, arg: Node, spec: QuantizationSpec) -> bool:
        ann = user.meta.get(ANNOTATION_KEY)
        if ann is None or arg not in ann.input_qspec_map:
            return False
        s = ann.input_qspec_map[arg]
        if isinstance(s, SharedQuantizationSpec):
            return True
        return isinstance(s, QuantizationSpec) and (s.dtype, s.qscheme, s.quant_min, s.quant_max) == (
            spec.dtype, spec.qscheme, spec.quant_min, spec.quant_max)

    def validate(self, model: GraphModule) -> None:
        pass

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        return model


quantizer_for(QuantConfig)(W8A8Quantizer)  # QuantConfig(...).quantizer() is W8A8Quantizer(config)
