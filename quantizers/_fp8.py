"""FP8Quantizer: float8 (E4M3) weights and activations, static or dynamic per token, and
calibrated KV-cache scales."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec

from quantkit._graph import ANNOTATION_KEY
from quantkit._qmath import default_qrange, dequantize_float8, float8_scale, is_per_channel, quantize_float8
from quantkit.observers import declared_qscheme
from quantkit.observers import get as get_observer
from quantkit.observers._declared import declaring
from quantkit.observers._fp8 import Float8DynamicObserver, check_float8_method, float8_observer, kv_cache_observer

from ._config import QUANTIZABLE_OPS, Granularity, parse_choice
from ._scheme import SchemeConfig, register_scheme
from ._w8a8 import _MATMUL, W8A8Quantizer, _is_float_tensor

__all__ = ["FP8Config", "FP8Quantizer", "KV_CACHE_FORMATS", "FP8_GPTQ_PERCDAMP"]

aten = torch.ops.aten

# the formats a KV cache can be stored in (``kv_cache=``): dtype and symmetric range
KV_CACHE_FORMATS = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
_KV_GRANULARITIES = ("per-tensor", "per-head")
_WEIGHT_GRANULARITIES = ("per-channel", "per-tensor")
_WEIGHT_ALGORITHMS = ("rtn", "gptq", "awq")  # quantkit.accuracy._wscheme.WEIGHT_ALGORITHMS
# GPTQ's dampening for E4M3 weights. all-MiniLM-L6-v2 (BENCHMARKS.md "FP8: GPTQ-rounded E4M3 weights"), bench
# split, GPTQ E4M3 weights alone, held-out mean / min cosine: 0.01 (GPTQ's usual value) 0.99846 / 0.98707 --
# below round-to-nearest's min (0.99009); 0.1: 0.99880 / 0.99160; 1.0: 0.99868 / 0.99144. On the CLI split
# (fp8-dynamic) 0.01 and 0.1 tie on the mean (0.9983) and 0.1's min is lower (0.9918 vs 0.9939): not decisive
FP8_GPTQ_PERCDAMP = 0.1
_SDPA = {aten.scaled_dot_product_attention.default}
# ops between an attention-score matmul and its softmax, or between the softmax and the
# matmul with V (scaling, masking, dropout, dtype casts)
_SCORE_OPS = {
    aten.div.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.add.Tensor,
    aten.dropout.default, aten.to.dtype, aten._to_copy.default, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.view.default, aten.reshape.default, aten.clone.default,
    aten.contiguous.default,
}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}


@dataclass(frozen=True)
class FP8Config(SchemeConfig):
    """What :class:`FP8Quantizer` does to one part of the model (``quantizer()`` builds one for the
    whole model, no KV cache). Presets ``fp8`` and ``fp8-dynamic`` are registered below.

    Args:
        dynamic: quantize activations at run time (no calibration) instead of with
            calibrated per-tensor scales.
        granularity: ``"per-tensor"`` or ``"per-token"`` (dynamic only: a token's scale is
            known only when the token is).
        weight_granularity: ``"per-channel"`` (one scale per output channel) or ``"per-tensor"``.
        act_observer: registered observer for static activations (``"minmax"``, ``"mse"``,
            ``"percentile"``, ...; the MSE search runs on the E4M3 grid).
        ops: op families to quantize: ``"linear"``, ``"matmul"`` (matmul/bmm), ``"conv"``.
        weight_algorithm: how linear weights are rounded onto the E4M3 grid: ``"rtn"`` (to
            nearest, default), ``"gptq"`` (GPTQ's error feedback, run by ``quantkit.calibrate``;
            same scales, other codes) or ``"awq"``.
        gptq_percdamp: GPTQ's dampening (fraction of the mean Hessian diagonal added to it) for
            the E4M3 weights; see :data:`FP8_GPTQ_PERCDAMP` for the default and its measurement.
    """

    dynamic: bool = False
    granularity: Granularity | str = Granularity.PER_TENSOR
    weight_granularity: str = "per-channel"
    act_observer: str = "minmax"
    ops: frozenset = field(default_factory=lambda: frozenset({"linear", "matmul"}))
    weight_algorithm: str = "rtn"
    gptq_percdamp: float = FP8_GPTQ_PERCDAMP

    VERSION = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"dynamic must be True or False, got {self.dynamic!r}")
        if self.weight_algorithm not in _WEIGHT_ALGORITHMS:
            raise ValueError(f"unknown weight_algorithm {self.weight_algorithm!r}; use one of {list(_WEIGHT_ALGORITHMS)}")
        if isinstance(self.gptq_percdamp, bool) or not isinstance(self.gptq_percdamp, (int, float)) \
                or not 0.0 < float(self.gptq_percdamp) <= 1.0:
            raise ValueError(f"gptq_percdamp must be in (0, 1], got {self.gptq_percdamp!r}")
        granularity = parse_choice(Granularity, self.granularity, "granularity")
        if granularity is Granularity.PER_TOKEN and not self.dynamic:
            raise ValueError("static FP8 activations are per tensor: per-token scales are chosen at run time; "
                             "pass dynamic=True for granularity='per-token'")
        object.__setattr__(self, "granularity", granularity)
        if self.weight_granularity not in _WEIGHT_GRANULARITIES:
            raise ValueError(f"unknown weight_granularity {self.weight_granularity!r}; use one of "
                             f"{list(_WEIGHT_GRANULARITIES)}")
        ops = frozenset([self.ops] if isinstance(self.ops, str) else self.ops)
        unknown = ops - (QUANTIZABLE_OPS - {"add"})
        if unknown:
            raise ValueError(f"FP8Quantizer cannot quantize op families {sorted(unknown)}; choose from "
                             f"['conv', 'linear', 'matmul']")
        object.__setattr__(self, "ops", ops)
        ctor = get_observer(self.act_observer)  # raises ValueError naming the known observers
        if not self.dynamic:
            # builds one to check it can measure an FP8 activation (refuses KL/L2, per-channel ones)
            lo, hi = default_qrange(torch.float8_e4m3fn)
            try:
                probe = ctor(dtype=torch.float8_e4m3fn, qscheme=torch.per_tensor_symmetric,
                             quant_min=lo, quant_max=hi, is_dynamic=False)
            except (TypeError, ValueError):  # e.g. a per-channel observer refuses a per-tensor qscheme
                probe = None
            check_float8_method(probe)
            if probe is None or getattr(probe, "is_dynamic", False) or is_per_channel(declared_qscheme(ctor)):
                raise ValueError(f"observer {self.act_observer!r} cannot measure a static per-tensor FP8 "
                                 "activation; use 'minmax', 'moving_average_minmax', 'mse' or 'percentile'")

    @property
    def activation_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def quantizer(self) -> "FP8Quantizer":
        """``FP8Quantizer`` with these settings for the whole model (no KV cache)."""
        return FP8Quantizer(dynamic=self.dynamic, granularity=self.granularity,
                            weight_granularity=self.weight_granularity, act_observer=self.act_observer,
                            ops=self.ops, weight_algorithm=self.weight_algorithm, gptq_percdamp=self.gptq_percdamp)

    # what SmoothQuant's alpha search (quantkit.accuracy._smoothquant) scores a candidate with
    def fake_quant_activations(self, xs: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """``xs`` ([tokens, K]) after this config's E4M3 activation quantization: per token, dynamic
        per tensor, or static over the calibrated ``[lo, hi]``."""
        if self.dynamic and self.granularity is Granularity.PER_TOKEN:
            amax = xs.abs().amax(-1, keepdim=True)
        elif self.dynamic:
            amax = xs.abs().amax()
        else:
            amax = torch.maximum(lo.abs(), hi.abs())
        scale = float8_scale(amax, self.activation_dtype)
        return dequantize_float8(quantize_float8(xs, scale, self.activation_dtype), scale)

    def fake_quant_weight(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` ([N, K]) as convert stores it: E4M3, amax / 448 per output channel or per tensor."""
        amax = w.abs().amax(1, keepdim=True) if self.weight_granularity == "per-channel" else w.abs().amax()
        scale = float8_scale(amax, torch.float8_e4m3fn)
        return dequantize_float8(quantize_float8(w, scale, torch.float8_e4m3fn), scale)


class FP8Quantizer(W8A8Quantizer):
    """Float8 E4M3 weights and activations for linear, matmul and bmm (conv on request).

    Weights are ``float8_e4m3fn`` with ``scale = amax / 448``, per output channel (or per
    tensor) and are stored as float8 (1 byte) once converted. Activations are E4M3 too:
    static per tensor from calibration (any per-tensor observer; ``"mse"`` searches the
    E4M3 grid), or dynamic per tensor / per token (scales computed at run time). ``convert``
    emits torchao's float8 ops (``quantize/dequantize_affine_float8_non_decomposed``;
    dynamic scales from ``choose_scale_float8``); ``quantkit.compile`` runs the layers as
    ``torch._scaled_mm``.

    With ``kv_cache``, the key and value inputs of every attention (``scaled_dot_product_attention``,
    or the two matmuls around an eager softmax) get calibrated static scales in that format,
    per tensor or per head (``kv_granularity``); with rotary embeddings these are the keys
    after rotation. They are recorded in ``quantization.json`` (``"kv_cache": "key"/"value"``).

    Args:
        dynamic: dynamic activations (no calibration needed except for a KV cache).
        granularity: ``"per-tensor"`` or ``"per-token"`` (dynamic only).
        weight_granularity: ``"per-channel"`` (default) or ``"per-tensor"``.
        kv_cache: ``None``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` or ``"int8"``.
        kv_granularity: ``"per-tensor"`` (default) or ``"per-head"``.
        act_observer: observer for static activations (and the KV cache).
        ops: op families (default ``{"linear", "matmul"}``).
        weight_algorithm: ``"rtn"`` (default), ``"gptq"`` or ``"awq"``: how linear weights are
            rounded onto the E4M3 grid (GPTQ/AWQ run in ``quantkit.calibrate``).
        gptq_percdamp: GPTQ's dampening for them (default :data:`FP8_GPTQ_PERCDAMP`).

    Example:
        >>> prepared = quantkit.prepare(gm, FP8Quantizer(dynamic=True, granularity="per-token"))
    """

    def __init__(self, dynamic: bool = False, granularity: str = "per-tensor",
                 weight_granularity: str = "per-channel", kv_cache: Optional[str] = None, *,
                 kv_granularity: str = "per-tensor", act_observer: str = "minmax",
                 ops=frozenset({"linear", "matmul"}), weight_algorithm: str = "rtn",
                 gptq_percdamp: float = FP8_GPTQ_PERCDAMP) -> None:
        super().__init__()
        self.global_config = FP8Config(dynamic=dynamic, granularity=granularity,
                                       weight_granularity=weight_granularity, act_observer=act_observer, ops=ops,
                                       weight_algorithm=weight_algorithm, gptq_percdamp=gptq_percdamp)
        if kv_cache is not None and kv_cache not in KV_CACHE_FORMATS:
            raise ValueError(f"unknown kv_cache {kv_cache!r}; use None or one of {list(KV_CACHE_FORMATS)}")
        if kv_granularity not in _KV_GRANULARITIES:
            raise ValueError(f"unknown kv_granularity {kv_granularity!r}; use one of {list(_KV_GRANULARITIES)}")
        self.kv_cache = kv_cache
        self.kv_granularity = kv_granularity

    @staticmethod
    def _check(config):
        if config is not None and not isinstance(config, FP8Config):
            raise TypeError(f"expected an FP8Config or None, got {type(config).__name__}")
        return config

    # --- specs ----------------------------------------------------------------------
    @staticmethod
    def act_spec(config: FP8Config, *, per_token_ok: bool = False) -> QuantizationSpec:
        """E4M3 activation spec: a calibrated per-tensor observer on the float8 grid, or a
        dynamic one (per token where the last dimension is the GEMM's reduction dimension)."""
        dtype = config.activation_dtype
        lo, hi = default_qrange(dtype)
        if config.dynamic:
            per_token = per_token_ok and config.granularity is Granularity.PER_TOKEN
            ctor = Float8DynamicObserver.with_args(per_token=per_token)
        else:
            per_token = False
            ctor = float8_observer(get_observer(config.act_observer))
        return QuantizationSpec(
            dtype=dtype, quant_min=lo, quant_max=hi, qscheme=torch.per_tensor_symmetric,
            is_dynamic=config.dynamic, observer_or_fake_quant_ctr=ctor,
            ch_axis=1 if per_token else None,  # only keeps per-token and per-tensor edges apart
        )

    @staticmethod
    def weight_spec(config: FP8Config, ch_axis: int = 0) -> QuantizationSpec:
        """E4M3 weight spec, ``scale = amax / 448`` per output channel (``ch_axis``) or per tensor."""
        dtype = torch.float8_e4m3fn
        lo, hi = default_qrange(dtype)
        per_channel = config.weight_granularity == "per-channel"
        ctor = get_observer("per_channel_minmax" if per_channel else "minmax")
        if config.weight_algorithm == "gptq":  # rounded in quantkit.calibrate, with FP8's dampening
            ctor = declaring(ctor, weight_algorithm="gptq", gptq_percdamp=float(config.gptq_percdamp))
        elif config.weight_algorithm != "rtn":
            ctor = declaring(ctor, weight_algorithm=config.weight_algorithm)
        return QuantizationSpec(
            dtype=dtype, quant_min=lo, quant_max=hi,
            qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
            ch_axis=ch_axis, is_dynamic=False, observer_or_fake_quant_ctr=float8_observer(ctor),
        )

    def kv_spec(self, config: FP8Config, role: str) -> QuantizationSpec:
        """Static spec of a key or value tensor ``[batch, heads, seq, head_dim]`` in the
        ``kv_cache`` format, per tensor or per head (axis 1)."""
        dtype = KV_CACHE_FORMATS[self.kv_cache]
        lo, hi = default_qrange(dtype)
        if dtype == torch.int8:
            lo = -127  # symmetric int8: [-127, 127], as KV-cache int8 formats store it
        per_head = self.kv_granularity == "per-head"
        if per_head:
            ctor = get_observer("per_channel_minmax")
        else:
            ctor = get_observer("minmax" if config.dynamic else config.act_observer)
        if dtype != torch.int8:
            ctor = float8_observer(ctor)
        return QuantizationSpec(
            dtype=dtype, quant_min=lo, quant_max=hi,
            qscheme=torch.per_channel_symmetric if per_head else torch.per_tensor_symmetric,
            ch_axis=1 if per_head else None, is_dynamic=False,
            observer_or_fake_quant_ctr=kv_cache_observer(ctor, role),
        )

    # --- annotation -----------------------------------------------------------------
    def annotate(self, model: GraphModule) -> GraphModule:
        if self.kv_cache is not None:
            self._annotate_kv(model)
        return super().annotate(model)

    def kv_cache_sites(self, model: GraphModule) -> list[str]:
        """Names of the nodes of ``model`` where a KV cache is quantized (each attention's
        ``scaled_dot_product_attention``, or the key and value matmuls of an eager one), outside
        the modules set to None; empty when the model has no attention, so ``kv_cache`` would do nothing."""
        return [node.name for node, _, _ in self._kv_nodes(model)]

    def _kv_nodes(self, model: GraphModule):
        """``(node, config, roles)`` of every KV-cache site not yet annotated; ``roles`` maps the
        node's key/value inputs to ``"key"``/``"value"``."""
        for node in model.graph.nodes:
            if node.op != "call_function" or ANNOTATION_KEY in node.meta:
                continue
            config = self.config_for(node)
            if config is None:
                continue
            if node.target in _SDPA:
                q, k, v = node.args[:3]
                if _is_float_tensor(k) and _is_float_tensor(v):
                    yield node, config, {k: "key", v: "value"}
            elif node.target in _MATMUL:
                role = _eager_attention_role(node)
                if role is not None and all(_is_float_tensor(a) for a in node.args[:2]):
                    yield node, config, {node.args[1]: role}

    def _annotate_kv(self, model: GraphModule) -> None:
        for node, config, roles in list(self._kv_nodes(model)):
            qmap = {arg: self.kv_spec(config, role) for arg, role in roles.items()}
            if node.target in _MATMUL and "matmul" in config.ops:
                qmap[node.args[0]] = self.act_spec(config, per_token_ok=True)
            node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=qmap, _annotated=True)

    @staticmethod
    def _quantizes_input(user: Node, arg: Node, spec: QuantizationSpec) -> bool:
        # a KV-cache edge keeps its own q/dq: it is never moved above the shape ops before it
        ann = user.meta.get(ANNOTATION_KEY)
        s = ann.input_qspec_map.get(arg) if ann is not None else None
        if getattr(getattr(s, "observer_or_fake_quant_ctr", None), "kv_role", None):
            return False
        return W8A8Quantizer._quantizes_input(user, arg, spec)


def _eager_attention_role(node: Node) -> Optional[str]:
    """``"key"`` for a matmul whose output reaches a softmax through score ops (``q @ kᵀ``),
    ``"value"`` for one whose left input comes from a softmax (``p @ v``), else None."""
    cur = node
    for _ in range(8):  # forward from the scores to the softmax
        users = list(cur.users)
        if len(users) != 1 or users[0].op != "call_function":
            break
        cur = users[0]
        if cur.target in _SOFTMAX:
            return "key"
        if cur.target not in _SCORE_OPS:
            break
    cur = node.args[0]
    for _ in range(8):  # back from the probabilities to the softmax
        if not isinstance(cur, Node) or cur.op != "call_function":
            return None
        if cur.target in _SOFTMAX:
            return "value"
        if cur.target not in _SCORE_OPS:
            return None
        cur = cur.args[0]
    return None


register_scheme("fp8", FP8Config(),
                description="E4M3 weights per output channel, calibrated static E4M3 activations per tensor")
register_scheme("fp8-dynamic", FP8Config(dynamic=True, granularity="per-token"),
                description="E4M3 weights per output channel, E4M3 activations per token at run time")
