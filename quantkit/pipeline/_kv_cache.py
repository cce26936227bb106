"""Static KV caches for captured causal LMs: float, or stored in int8 / FP8 with fixed scales.

``build_static_cache`` gives the transformers ``Cache`` that ``quantkit.capture(max_cache_len=...)``
wraps: every layer is allocated up front (``torch.export`` cannot trace a lazy allocation), and every
tensor attribute of a layer (``keys``, ``values``, ``cumulative_length``, the scales) is meant to become
a buffer of the captured program, mutated in place on each call.

With ``kv_cache="int8" | "fp8_e4m3" | "fp8_e5m2"`` each layer is a :class:`QuantizedStaticLayer`: the
store holds the narrow dtype, ``update`` quantizes the new K/V with the layer's fixed scales and
``index_copy_``s them in, then hands the attention the dequantized full cache. Scales are symmetric,
per tensor or per KV head, and come from :func:`calibrate_kv_scales` (absmax of the post-RoPE keys
and the values the eager model writes into its cache). The quantize/dequantize are ``quantkit._qmath``'s:
an int8 per-tensor cache reads as a static ``dequantize_per_tensor`` with a Python scale, the form
``lowering._qsdpa`` hands to the int8 attention kernel.

transformers is an optional dependency: it is imported inside the functions that need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from quantkit._errors import CalibrationError, QuantkitError
from quantkit._qmath import (
    DEFAULT_EPS,
    dequantize,
    dequantize_float8,
    float8_scale,
    quantize,
    quantize_float8,
    symmetric_divisor,
)
from quantkit.quantizers._fp8 import KV_CACHE_FORMATS

__all__ = [
    "KV_CACHE_FORMATS",
    "KV_GRANULARITIES",
    "KVScales",
    "build_static_cache",
    "calibrate_kv_scales",
    "observe_kv_amax",
    "cache_bytes",
    "quantized_layer_class",
]

# KV_CACHE_FORMATS: format name -> stored dtype, the names FP8Quantizer(kv_cache=...) takes
KV_GRANULARITIES = ("per-tensor", "per-head")  # FP8Quantizer(kv_granularity=...)'s
# symmetric int8 in [-127, 127], as FP8Quantizer.kv_spec and compressed-tensors' kv_cache_scheme store it
_INT8_MIN, _INT8_MAX = -127, 127


def _check_format(kv_cache: str) -> torch.dtype:
    if kv_cache not in KV_CACHE_FORMATS:
        raise QuantkitError(f"kv_cache={kv_cache!r} is not a KV-cache format; use one of "
                            f"{', '.join(map(repr, KV_CACHE_FORMATS))} (or None for a float cache)")
    return KV_CACHE_FORMATS[kv_cache]


def _check_granularity(granularity: str) -> None:
    if granularity not in KV_GRANULARITIES:
        raise QuantkitError(f"granularity={granularity!r} is not a KV-cache granularity; use "
                            f"{' or '.join(map(repr, KV_GRANULARITIES))}")


def _scale_from_amax(amax: torch.Tensor, kv_cache: str) -> torch.Tensor:
    """Symmetric scale of ``[-amax, amax]`` in the format: ``amax / 127`` for int8 (floored at eps,
    as ``choose_qparams``), ``amax / float8_max`` for FP8 (``_qmath.float8_scale``)."""
    dtype = _check_format(kv_cache)
    amax = amax.detach().float().reshape(-1)
    if dtype == torch.int8:
        return torch.clamp(amax / symmetric_divisor(_INT8_MIN, _INT8_MAX), min=DEFAULT_EPS)
    return float8_scale(amax, dtype)


@dataclass(frozen=True)
class KVScales:
    """Fixed scales of a quantized KV cache: one per tensor (shape ``[1]``) or one per KV head
    (shape ``[num_kv_heads]``) for the keys and for the values of every layer.

    ``dequantized = stored * scale``; the stored value is ``round(x / scale)`` clamped to
    ``[-127, 127]`` for int8, or ``x / scale`` rounded to the nearest FP8 value for FP8.

    Args:
        format: ``"int8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        granularity: ``"per-tensor"`` or ``"per-head"``.
        key_scales / value_scales: one float32 tensor per layer.
    """

    format: str
    granularity: str
    key_scales: tuple[torch.Tensor, ...]
    value_scales: tuple[torch.Tensor, ...]

    def __post_init__(self):
        _check_format(self.format)
        _check_granularity(self.granularity)
        object.__setattr__(self, "key_scales", tuple(self.key_scales))
        object.__setattr__(self, "value_scales", tuple(self.value_scales))
        if not self.key_scales or len(self.key_scales) != len(self.value_scales):
            raise QuantkitError(f"KVScales needs one key and one value scale per layer; got "
                                f"{len(self.key_scales)} key and {len(self.value_scales)} value scales")
        for role, scales in (("key", self.key_scales), ("value", self.value_scales)):
            for i, s in enumerate(scales):
                if not isinstance(s, torch.Tensor) or s.dim() != 1 or s.dtype != torch.float32:
                    raise QuantkitError(f"KVScales {role} scale of layer {i} must be a 1-d float32 tensor; "
                                        f"got {type(s).__name__} {getattr(s, 'shape', '')} {getattr(s, 'dtype', '')}")
                if self.granularity == "per-tensor" and s.numel() != 1:
                    raise QuantkitError(f"KVScales per-tensor {role} scale of layer {i} has {s.numel()} values; "
                                        "expected 1 (use granularity='per-head' for one per KV head)")
                if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
                    raise QuantkitError(f"KVScales {role} scale of layer {i} must be finite and positive; "
                                        f"got {s.tolist()}")

    @property
    def num_layers(self) -> int:
        return len(self.key_scales)

    @classmethod
    def from_amax(cls, key_amax, value_amax, *, kv_cache: str, granularity: str) -> "KVScales":
        """Scales of observed absolute maxima (one tensor per layer: ``[1]`` or ``[num_kv_heads]``)."""
        return cls(kv_cache, granularity,
                   tuple(_scale_from_amax(a, kv_cache) for a in key_amax),
                   tuple(_scale_from_amax(a, kv_cache) for a in value_amax))


def quantized_layer_class():
    """The :class:`QuantizedStaticLayer` class (defined on first use: it subclasses transformers'
    ``StaticLayer``, and transformers is imported lazily)."""
    return _layer_classes()[0]


_CLASSES: list = []


def _layer_classes():
    if _CLASSES:
        return _CLASSES
    from transformers.cache_utils import DynamicLayer, StaticLayer

    class QuantizedStaticLayer(StaticLayer):
        """A ``StaticLayer`` whose ``keys``/``values`` are stored in int8 or FP8 with fixed scales.

        ``update`` quantizes the new states, writes them at ``cumulative_length`` (no data-dependent
        control flow: it traces into one program for prefill and decode) and returns the dequantized
        full cache in the attention's dtype. The scale tensors are attributes of the layer, so a
        capture wrapper registers them as buffers with the store.
        """

        def __init__(self, max_cache_len: int, *, kv_cache: str, granularity: str,
                     key_scale: torch.Tensor, value_scale: torch.Tensor):
            super().__init__(max_cache_len)
            self.kv_cache = kv_cache
            self.granularity = granularity
            self.storage_dtype = _check_format(kv_cache)
            self.key_scale = key_scale.detach().float().clone()
            self.value_scale = value_scale.detach().float().clone()
            # an int8 per-tensor scale also goes into the graph as a Python number: the static
            # dequantize_per_tensor the int8 attention lowering reads the integers through
            self._key_scale_f = float(self.key_scale) if self.key_scale.numel() == 1 else None
            self._value_scale_f = float(self.value_scale) if self.value_scale.numel() == 1 else None

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.batch_size, self.num_heads = key_states.shape[:2]
            self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
            self.dtype = key_states.dtype  # the attention's dtype: what update returns
            for role, scale in (("key", self.key_scale), ("value", self.value_scale)):
                if self.granularity == "per-head" and scale.numel() != self.num_heads:
                    raise QuantkitError(f"per-head {role} scale has {scale.numel()} values but the layer has "
                                        f"{self.num_heads} KV heads; calibrate the scales on this model")
            shape = (self.batch_size, self.num_heads, self.max_cache_len)
            self.keys = torch.zeros(shape + (self.k_head_dim,), dtype=self.storage_dtype, device=self.device)
            self.values = torch.zeros(shape + (self.v_head_dim,), dtype=self.storage_dtype, device=self.device)
            self.cumulative_length = self.cumulative_length.to(self.device)
            self.key_scale = self.key_scale.to(self.device)
            self.value_scale = self.value_scale.to(self.device)
            if self.storage_dtype == torch.int8 and self.granularity == "per-head":
                # quantize_per_channel takes its zero points as a tensor: zeros (symmetric)
                self.key_zero_point = torch.zeros(self.num_heads, dtype=torch.int64, device=self.device)
                self.value_zero_point = torch.zeros(self.num_heads, dtype=torch.int64, device=self.device)
            self.is_initialized = True

        # --- quantization with the fixed scales --------------------------------------------
        def _quantize(self, x: torch.Tensor, role: str) -> torch.Tensor:
            scale = getattr(self, f"{role}_scale")
            if self.storage_dtype == torch.int8:
                if self.granularity == "per-tensor":
                    return quantize(x, getattr(self, f"_{role}_scale_f"), 0, _INT8_MIN, _INT8_MAX, torch.int8)
                return quantize(x, scale, getattr(self, f"{role}_zero_point"), _INT8_MIN, _INT8_MAX,
                                torch.int8, axis=1)
            return quantize_float8(x.float(), self._fp8_scale(scale), self.storage_dtype)

        def _dequantize(self, q: torch.Tensor, role: str) -> torch.Tensor:
            scale = getattr(self, f"{role}_scale")
            if self.storage_dtype == torch.int8:
                if self.granularity == "per-tensor":
                    out = dequantize(q, getattr(self, f"_{role}_scale_f"), 0, _INT8_MIN, _INT8_MAX, torch.int8)
                else:
                    out = dequantize(q, scale, getattr(self, f"{role}_zero_point"), _INT8_MIN, _INT8_MAX,
                                     torch.int8, axis=1)
            else:
                out = dequantize_float8(q, self._fp8_scale(scale))
            return out.to(self.dtype)

        def _fp8_scale(self, scale: torch.Tensor) -> torch.Tensor:
            # [1] broadcasts as it is; one scale per KV head broadcasts as [1, H, 1, 1]
            return scale if self.granularity == "per-tensor" else scale.view(1, -1, 1, 1)

        def _write(self, store: torch.Tensor, positions: torch.Tensor, q: torch.Tensor) -> None:
            if store.dtype == torch.int8:
                store.index_copy_(2, positions, q)
            else:  # CPU index_copy_ has no float8 kernel: copy the bytes
                store.view(torch.uint8).index_copy_(2, positions, q.view(torch.uint8))

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            """Quantize and store the new states at ``cumulative_length``; return the dequantized
            full ``[B, H, max_cache_len, D]`` keys and values (unwritten slots read 0, masked)."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            kv_length = key_states.shape[-2]
            positions = torch.arange(kv_length, device=self.device) + self.cumulative_length
            self.cumulative_length.add_(kv_length)
            self._write(self.keys, positions, self._quantize(key_states, "key"))
            self._write(self.values, positions, self._quantize(value_states, "value"))
            return self._dequantize(self.keys, "key"), self._dequantize(self.values, "value")

        def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
            """The full dequantized store (keys, values), as the attention reads it."""
            return self._dequantize(self.keys, "key"), self._dequantize(self.values, "value")

    class ObservingLayer(DynamicLayer):
        """A float ``DynamicLayer`` that records the running absmax of every K/V it is given
        (per tensor: ``[1]``; per KV head: ``[H]``), for :func:`calibrate_kv_scales`."""

        def __init__(self, per_head: bool, key_amax: Optional[torch.Tensor], value_amax: Optional[torch.Tensor]):
            super().__init__()
            self.per_head = per_head
            self.key_amax, self.value_amax = key_amax, value_amax

        def _amax(self, x: torch.Tensor, old: Optional[torch.Tensor]) -> torch.Tensor:
            x = x.detach().float().abs()
            new = x.amax(dim=(0, 2, 3)) if self.per_head else x.amax().reshape(1)
            return new if old is None else torch.maximum(old, new)

        def update(self, key_states, value_states, *args, **kwargs):
            self.key_amax = self._amax(key_states, self.key_amax)
            self.value_amax = self._amax(value_states, self.value_amax)
            return super().update(key_states, value_states, *args, **kwargs)

    _CLASSES.extend([QuantizedStaticLayer, ObservingLayer])
    return _CLASSES


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def build_static_cache(config, *, max_cache_len: int, batch_size: int, dtype: torch.dtype = torch.float32,
                       kv_cache: Optional[str] = None, scales: Optional[KVScales] = None,
                       device: torch.device | str = "cpu"):
    """A transformers ``StaticCache`` for ``config``, every layer allocated now (export needs its tensors).

    Args:
        config: the model's ``PretrainedConfig`` (a full-attention decoder: Llama, Qwen2, ...).
        max_cache_len: tokens the cache holds (prefill + generated).
        batch_size: the batch the program is captured for.
        dtype: the attention's dtype (the float store's dtype; what a quantized store dequantizes to).
        kv_cache: None for a float store, or ``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``.
        scales: the :class:`KVScales` of a quantized store (from :func:`calibrate_kv_scales`).

    Returns:
        A ``transformers.StaticCache`` whose layers are ``StaticLayer`` (float) or
        :class:`QuantizedStaticLayer`.

    Raises:
        QuantkitError: a bad format, missing or mismatched scales, a non-positive size, or a model
        whose cache layers are not plain full-attention ones (sliding windows are data-dependent).
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer
    from transformers.configuration_utils import get_head_shapes

    if int(max_cache_len) < 1 or int(batch_size) < 1:
        raise QuantkitError(f"a static KV cache needs max_cache_len >= 1 and batch_size >= 1; "
                            f"got max_cache_len={max_cache_len}, batch_size={batch_size}")
    if kv_cache is not None:
        _check_format(kv_cache)
        if scales is None:
            raise QuantkitError(f"kv_cache={kv_cache!r} needs its scales: pass "
                                "scales=calibrate_kv_scales(model, batches, kv_cache=...)")
        if not isinstance(scales, KVScales):
            raise QuantkitError(f"scales must be a KVScales; got {type(scales).__name__}")
        if scales.format != kv_cache:
            raise QuantkitError(f"the scales were calibrated for kv_cache={scales.format!r}, "
                                f"not {kv_cache!r}; calibrate them for {kv_cache!r}")
    elif scales is not None:
        raise QuantkitError("scales were given for a float KV cache; pass kv_cache='int8' or an FP8 format")

    text = _text_config(config)
    cache = StaticCache(config=text, max_cache_len=int(max_cache_len))
    for i, layer in enumerate(cache.layers):
        if type(layer) is not StaticLayer:
            raise QuantkitError(f"cache layer {i} is a {type(layer).__name__}; a static KV cache here supports "
                                "full-attention layers only (no sliding window or chunked attention)")
    if kv_cache is not None:
        if scales.num_layers != len(cache.layers):
            raise QuantkitError(f"the scales are for {scales.num_layers} layers but the model has "
                                f"{len(cache.layers)}; calibrate them on this model")
        layer_cls = quantized_layer_class()
        cache.layers = [layer_cls(int(max_cache_len), kv_cache=kv_cache, granularity=scales.granularity,
                                  key_scale=k, value_scale=v)
                        for k, v in zip(scales.key_scales, scales.value_scales)]
    num_heads, head_dim = get_head_shapes(text)
    cache.early_initialization(int(batch_size), num_heads, head_dim, dtype, torch.device(device))
    return cache


def _batch_kwargs(batch) -> dict:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    if isinstance(batch, dict):
        return dict(batch)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return {"input_ids": batch[0]}
    raise CalibrationError(f"a KV-scale calibration batch must be input_ids (a LongTensor), a dict of model "
                           f"inputs or a tuple starting with input_ids; got {type(batch).__name__}")


@torch.no_grad()
def observe_kv_amax(model, batches: Iterable, *, granularity: str = "per-tensor"):
    """Absolute maxima of the K (after RoPE) and V the eager model writes into its cache.

    Runs ``model`` over ``batches`` with an observing cache (float, like ``DynamicCache``).

    Returns:
        ``(key_amax, value_amax)``: one float32 tensor per layer, ``[1]`` per tensor or
        ``[num_kv_heads]`` per head. ``KVScales.from_amax`` turns them into any format's scales
        (one calibration pass serves int8 and both FP8 formats).
    """
    from transformers import DynamicCache

    _check_granularity(granularity)
    _, observing_cls = _layer_classes()
    n_layers = getattr(_text_config(model.config), "num_hidden_layers", None)
    key_amax: list = [None] * (n_layers or 0)
    value_amax: list = [None] * (n_layers or 0)
    seen = 0
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            cache = DynamicCache(config=model.config)
            cache.layers = [observing_cls(granularity == "per-head", k, v) for k, v in zip(key_amax, value_amax)]
            model(**_batch_kwargs(batch), cache=cache, use_cache=True)
            key_amax = [layer.key_amax for layer in cache.layers]
            value_amax = [layer.value_amax for layer in cache.layers]
            seen += 1
    finally:
        model.train(was_training)
    if seen == 0:
        raise CalibrationError("KV-cache calibration got no batches; pass at least one input_ids tensor")
    missing = [i for i, a in enumerate(key_amax) if a is None]
    if missing or not key_amax:
        raise CalibrationError(f"the model never wrote to its KV cache (layers {missing}); "
                               "KV-cache calibration needs a causal LM that takes cache=")
    return key_amax, value_amax


def calibrate_kv_scales(model, batches: Iterable, *, kv_cache: str, granularity: str = "per-tensor") -> KVScales:
    """Scales of a quantized KV cache, from the K (after RoPE) and V the eager model caches.

    Runs ``model`` (an eager transformers causal LM) over ``batches`` with an observing cache that
    records each layer's absmax, per tensor or per KV head (:func:`observe_kv_amax`), and turns it
    into symmetric scales. Values past the calibrated range are clamped (int8) or saturate (FP8)
    when stored: calibrate on enough text (a few thousand tokens) that held-out text rarely exceeds it.

    Args:
        model: the float ``PreTrainedModel``.
        batches: input_ids tensors ``[B, L]`` (or dicts of model inputs), full sequences.
        kv_cache: ``"int8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        granularity: ``"per-tensor"`` or ``"per-head"``.

    Example:
        >>> scales = calibrate_kv_scales(model, [ids], kv_cache="int8")
        >>> cache = build_static_cache(model.config, max_cache_len=256, batch_size=1, kv_cache="int8", scales=scales)
    """
    _check_format(kv_cache)
    _check_granularity(granularity)
    key_amax, value_amax = observe_kv_amax(model, batches, granularity=granularity)
    return KVScales.from_amax(key_amax, value_amax, kv_cache=kv_cache, granularity=granularity)


def cache_bytes(gm_or_cache) -> int:
    """Bytes of a stored KV cache: the key/value stores plus their scales and zero points
    (the 0-d ``cumulative_length`` counters are bookkeeping, not cache, and are left out).

    Accepts a transformers ``Cache`` (from :func:`build_static_cache`) or a captured program whose
    ``meta["quantkit_kv_cache"]["buffers"]`` names its cache buffers.
    """
    if hasattr(gm_or_cache, "layers") and not isinstance(gm_or_cache, torch.nn.Module):
        total = 0
        for layer in gm_or_cache.layers:
            total += sum(_stored_bytes(v) for v in vars(layer).values() if isinstance(v, torch.Tensor))
        return total
    meta = getattr(gm_or_cache, "meta", None)
    info = meta.get("quantkit_kv_cache") if isinstance(meta, dict) else None
    if not info:
        raise QuantkitError(f"{type(gm_or_cache).__name__} has no KV cache: capture the model with "
                            "max_cache_len=N, or pass the Cache from build_static_cache")
    named = dict(gm_or_cache.named_buffers())
    total = 0
    for name in info["buffers"]:
        t = named.get(name)
        if t is None:
            raise QuantkitError(f"the program's KV-cache buffer {name!r} is missing")
        total += _stored_bytes(t)
    return total


def _stored_bytes(t: torch.Tensor) -> int:
    # a 0-d integer tensor is a layer's cumulative_length counter: bookkeeping, not cache
    if t.dim() == 0 and not t.dtype.is_floating_point:
        return 0
    return t.numel() * t.element_size()
