"""Capture a Hugging Face causal LM with a static KV cache: one program for prefill and decode.

``quantkit.capture(model, example, max_cache_len=N)`` exports a wrapper whose forward is
``(input_ids, cache_position) -> logits``. The cache (a transformers ``StaticCache``, or the
int8/FP8 cache of :mod:`quantkit.pipeline._kv_cache`) lives in the wrapper as buffers: every tensor
attribute of every cache layer is registered as a non-persistent buffer, and the forward rebinds
the layers to those buffers before it runs, so torch.export traces reads and in-place writes
(``index_copy_``) of the module's own state rather than of constants it would lift out of the
graph. The exported program therefore mutates its buffers on each call, like
``transformers.integrations.executorch.TorchExportableModuleWithStaticCache``.

The sequence dimension of ``input_ids`` and ``cache_position`` is dynamic (1..N), so prefill of
any prompt length and one-token decode share the program; the batch is fixed to the example's
(the cache is allocated for it). A call writes K/V at ``cache_position`` and attends to cache
slots ``<= position`` (the static cache's causal mask), so stale slots beyond the current
position never matter: a new sequence starts again at ``cache_position = arange(L)``, which is
also what calibration feeds.

``gm.meta["quantkit_kv_cache"]`` records the cache's shape and format (:func:`kv_cache_info`);
it is kept by prepare/convert (they copy ``meta``) and by save/load (``quantization.json``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import Dim

from quantkit.quantizers._fp8 import KV_CACHE_FORMATS

from .._errors import CalibrationError, CaptureError, KVCacheError, QuantkitError
from .._text import summarise
from ._inputs import as_args_kwargs
from ._kv_cache import build_static_cache

__all__ = ["KV_CACHE_META_KEY", "KVCacheError", "capture_with_cache", "kv_cache_info", "check_fits",
           "install_length_check", "resolve_buffers", "example_batch_size", "lm_calibration_batches"]

KV_CACHE_META_KEY = "quantkit_kv_cache"
# cache-layer attributes that count written tokens: derived from cache_position on each call, not state
_COUNTERS = frozenset({"cumulative_length"})


def _causal_lm_config(model: torch.nn.Module):
    """The model's text config, after checking that ``model`` is a decoder-only LM with an output head."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    head = getattr(model, "get_output_embeddings", None)
    if config is None or not callable(head) or head() is None:
        raise CaptureError(f"max_cache_len needs a Hugging Face causal LM with an lm_head, got {name}; "
                           "load it with transformers.AutoModelForCausalLM (not AutoModel)")
    if getattr(config, "is_encoder_decoder", False):
        raise CaptureError(f"max_cache_len supports decoder-only causal LMs; {name} is an encoder-decoder model")
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _kv_shape(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` from an HF config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(config.num_hidden_layers), int(kv_heads), int(head_dim)


def _input_ids(example_inputs: Any) -> torch.Tensor:
    args, kwargs = as_args_kwargs(example_inputs)
    ids = kwargs.get("input_ids") if kwargs else (args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise CaptureError("with max_cache_len, example_inputs must be token ids [batch, length] (a LongTensor) "
                           "or a tokenizer dict with input_ids")
    return ids.to(torch.long).contiguous()  # a strided view would put its stride in the guards


def example_batch_size(example_inputs: Any) -> int:
    """The batch of the token ids in ``example_inputs``: the batch a KV program is captured for."""
    return int(_input_ids(example_inputs).shape[0])


def _ids_and_mask(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, dict):
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    elif isinstance(batch, (tuple, list)) and batch:
        ids, mask = batch[0], None
    else:
        ids, mask = batch, None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        raise CalibrationError(f"a calibration batch of a KV-cache program must be token ids [batch, length] (a "
                               f"LongTensor, (ids,), (ids, cache_position) or a dict with input_ids); got "
                               f"{type(ids).__name__} {list(getattr(ids, 'shape', []))}")
    return ids.to(torch.long), mask


def lm_calibration_batches(batches, *, batch_size: int, max_cache_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, cache_position)`` batches of full sequences for a KV program of batch ``batch_size``.

    Each batch's rows start a fresh sequence at ``cache_position = arange(L)`` (what calibration of a
    KV program feeds). A batch of another size than the program's is taken row by row when the
    program's batch is 1, each row without its padding (``attention_mask == 0``); a batch already
    given as ``(ids, cache_position)`` keeps its positions.

    Raises:
        CalibrationError: no batches, a batch that is not token ids, another batch size than the
            program's (which is not 1), or a sequence longer than ``max_cache_len`` (one line).
    """
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for batch in batches:
        ids, mask = _ids_and_mask(batch)
        given = batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
        if ids.shape[0] == batch_size and (mask is None or bool(mask.bool().all())):
            rows = [(ids, given)]
        elif batch_size == 1:
            keep = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
            rows = [(ids[i][keep[i]].unsqueeze(0), None) for i in range(ids.shape[0]) if bool(keep[i].any())]
        else:
            raise CalibrationError(f"the program's KV cache holds a batch of {batch_size}, but a calibration batch "
                                   f"has {ids.shape[0]} unpadded rows; batch the calibration data by {batch_size} "
                                   "(or capture with a batch-1 example)")
        for row, positions in rows:
            if row.shape[1] > max_cache_len:
                raise CalibrationError(f"a calibration sequence has {row.shape[1]} tokens, more than "
                                       f"max_cache_len={max_cache_len}; cut the sequences to at most "
                                       f"{max_cache_len} tokens or capture a longer cache")
            pos = positions if isinstance(positions, torch.Tensor) else torch.arange(row.shape[1], device=row.device)
            out.append((row, pos))
    if not out:
        raise CalibrationError("calibration got no batches; pass at least one batch of token ids")
    return out


def _check_length(max_cache_len, config, length: int) -> int:
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int):
        raise CaptureError(f"max_cache_len must be an int, got {type(max_cache_len).__name__}")
    limit = getattr(config, "max_position_embeddings", None)
    if max_cache_len < 1 or (limit is not None and max_cache_len > limit):
        bound = f"1..{limit} (the model's max_position_embeddings)" if limit is not None else "at least 1"
        raise CaptureError(f"max_cache_len must be {bound}, got {max_cache_len}")
    if length > max_cache_len:
        raise CaptureError(f"the example has {length} tokens, more than max_cache_len={max_cache_len}; "
                           "pass a shorter example or a larger max_cache_len")
    return max_cache_len


class _CachedLM(torch.nn.Module):
    """``forward(input_ids, cache_position) -> logits`` over a static cache held as buffers.

    The model's children are this module's children (the model itself is held outside the module
    tree), so the captured graph names its layers as capturing the model without a cache does
    (``model.layers.0.self_attn.q_proj``, ``lm_head``): layer names in recipes and skip lists
    mean the same in both programs."""

    def __init__(self, model: torch.nn.Module, cache) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "_lm", model)  # not a submodule: no "model." prefix on every name
        self._cache = cache
        self._slots: list[tuple[Any, str, str]] = []  # (cache layer, attribute, buffer name)
        for i, layer in enumerate(cache.layers):
            for attr, value in list(vars(layer).items()):
                if isinstance(value, torch.Tensor) and attr not in _COUNTERS:
                    name = f"kv_cache_{i}_{attr}"
                    self.register_buffer(name, value, persistent=False)
                    self._slots.append((layer, attr, name))

    @property
    def buffer_names(self) -> list[str]:
        return [name for _, _, name in self._slots]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        # the layers must read and write this module's buffers: under export these are the traced
        # state, whereas the tensors the layers were built with would be lifted as constants
        for layer, attr, name in self._slots:
            setattr(layer, attr, getattr(self, name))
        # where this call writes (StaticLayer appends at cumulative_length): a fresh copy per layer,
        # so that the layer's own increment touches no state (_drop_dead_counter_updates erases it)
        start = cache_position[0]
        for layer in self._cache.layers:
            for attr in _COUNTERS:
                if isinstance(getattr(layer, attr, None), torch.Tensor):
                    setattr(layer, attr, start.clone())
        positions = cache_position.unsqueeze(0).expand(input_ids.shape[0], -1)
        out = self._lm(input_ids=input_ids, position_ids=positions, cache=self._cache, use_cache=True)
        return out.logits


def _drop_dead_counter_updates(gm: torch.fx.GraphModule) -> int:
    """Erase in-place updates of temporaries that nothing reads afterwards; returns how many.

    They are the cache layers' counter increments (``cumulative_length.add_(L)``) on the per-call
    copies ``_CachedLM.forward`` makes. Left in, the graph mutates a value that crosses block
    boundaries: GPTQ's block cache (``accuracy.rounding._gptq_blocks``) replays each block on
    stored values, and a replayed increment would move every later write past the cache's end.
    Only ops on non-state values (not a placeholder or attribute) whose result and target have
    no later reader are erased, so the program computes exactly what it did.
    """
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    dead = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.users or not str(node.target).startswith("aten.add_."):
            continue
        target = node.args[0]
        val = target.meta.get("val") if isinstance(target, torch.fx.Node) else None
        if (not isinstance(val, torch.Tensor) or val.dim() != 0 or val.is_floating_point()
                or target.op in ("placeholder", "get_attr")):
            continue
        if all(order[user] < order[node] for user in target.users if user is not node):
            dead.append(node)
    for node in dead:
        gm.graph.erase_node(node)
    if dead:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return len(dead)


def capture_with_cache(model: torch.nn.Module, example_inputs: Any, *, max_cache_len: int,
                       kv_cache: str | None = None, kv_scales=None) -> tuple[torch.fx.GraphModule, dict]:
    """Export a causal LM with a static KV cache of ``max_cache_len`` positions (see the module doc).

    Args:
        model: an HF causal LM (``AutoModelForCausalLM``); switched to eval mode.
        example_inputs: token ids ``[B, L]`` or a tokenizer dict; ``B`` becomes the program's batch.
        max_cache_len: cache positions, ``1..config.max_position_embeddings``; ``L`` must not exceed it.
        kv_cache: ``None`` (the model's dtype), ``"int8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        kv_scales: the ``KVScales`` of :func:`quantkit.pipeline._kv_cache.calibrate_kv_scales`
            (quantized formats).

    Returns:
        ``(gm, record)``: the GraphModule ``gm(input_ids, cache_position) -> logits [B, L, vocab]``,
        which updates its cache buffers in place (``gm.meta["quantkit_kv_cache"]`` describes the
        cache), and the inputs and dynamic shapes it was traced with, which ``capture`` records
        for ``export_converted`` to re-export the converted graph.

    Raises:
        CaptureError: not a causal LM, a bad ``max_cache_len``, an example longer than it, or an
            export failure (one line).
    """
    model.eval()
    config = _causal_lm_config(model)
    ids = _input_ids(example_inputs)
    n = _check_length(max_cache_len, config, ids.shape[1])
    if kv_cache is not None and kv_cache not in KV_CACHE_FORMATS:
        raise CaptureError(f"kv_cache must be one of {', '.join(KV_CACHE_FORMATS)} or None, got {kv_cache!r}")
    batch = int(ids.shape[0])
    num_layers, kv_heads, head_dim = _kv_shape(config)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cache = build_static_cache(config, max_cache_len=n, batch_size=batch, dtype=dtype, device=device,
                               kv_cache=kv_cache, scales=kv_scales)
    wrapper = _CachedLM(model, cache)
    if n >= 2 and ids.shape[1] < 2:  # torch.export specialises a size-1 dim: trace a 2-token example
        ids = torch.cat([ids, ids], dim=1)
    args = (ids.to(device), torch.arange(ids.shape[1], device=device))
    if n >= 2:
        seq = Dim("seq_len", min=1, max=n)
        dynamic_shapes = ({1: seq}, {0: seq})
    else:
        dynamic_shapes = None
    try:
        with torch.no_grad():
            ep = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # torch.export raises many types; summarise them all
        raise CaptureError(f"torch.export could not capture {type(model).__name__} with a static KV cache: "
                           f"{summarise(exc)}") from exc
    gm = ep.module()
    _drop_dead_counter_updates(gm)
    granularity = getattr(kv_scales, "granularity", None) if kv_cache is not None else None
    gm.meta[KV_CACHE_META_KEY] = {
        "max_cache_len": n, "batch_size": batch, "num_layers": num_layers, "num_kv_heads": kv_heads,
        "head_dim": head_dim, "format": kv_cache, "granularity": granularity,
        "buffers": wrapper.buffer_names,
    }
    install_length_check(gm)
    return gm, {"args": args, "kwargs": {}, "dynamic_shapes": dynamic_shapes}


def kv_cache_info(gm: torch.nn.Module) -> dict | None:
    """The static KV cache a program holds (``gm.meta["quantkit_kv_cache"]``), or None.

    Keys: ``max_cache_len``, ``batch_size``, ``num_layers``, ``num_kv_heads``, ``head_dim``,
    ``format`` (None, ``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``), ``granularity`` and
    ``buffers`` (the names of the cache buffers in ``gm``). Survives prepare, convert, save and load.
    """
    meta = getattr(gm, "meta", None)
    info = meta.get(KV_CACHE_META_KEY) if isinstance(meta, dict) else None
    return dict(info) if isinstance(info, dict) else None


def check_fits(info: dict, batch_size: int, start: int, length: int) -> None:
    """Raise :class:`KVCacheError` (one line) unless ``length`` tokens of a batch of ``batch_size``
    written from position ``start`` fit the cache ``info`` (:func:`kv_cache_info`) describes.

    Generation calls it before each step: the program itself only bounds the call's length."""
    n, b = info["max_cache_len"], info["batch_size"]
    if batch_size != b:
        raise KVCacheError(f"the program's KV cache holds a batch of {b}, got {batch_size}; capture it with an "
                           f"example of batch {batch_size}")
    if length < 1 or start < 0 or start + length > n:
        what = f"{length} tokens from position {start}" if start else f"a prompt of {length} tokens"
        raise KVCacheError(f"{what} does not fit the KV cache of max_cache_len={n}; capture with a larger "
                           "max_cache_len or shorten the prompt")


def _length_hook(module, args, kwargs):
    info = kv_cache_info(module)
    ids = args[0] if args else kwargs.get("input_ids")
    if info is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    if ids.shape[1] > info["max_cache_len"] or ids.shape[0] != info["batch_size"]:
        check_fits(info, int(ids.shape[0]), 0, int(ids.shape[1]))
    return None


def install_length_check(gm: torch.nn.Module) -> torch.nn.Module:
    """Make calls of ``gm`` longer than its cache (or of another batch) a one-line
    :class:`KVCacheError` instead of torch.export's guard error. Shapes only: no device sync.
    A program without a KV-cache record (:func:`kv_cache_info`) is returned as it is: no hook.
    Hooks do not travel through prepare/convert (new modules); they and ``load`` install it again."""
    if kv_cache_info(gm) is not None and not getattr(gm, "_quantkit_length_check", False):
        gm.register_forward_pre_hook(_length_hook, with_kwargs=True)
        gm._quantkit_length_check = True
    return gm


def resolve_buffers(info: dict, module: torch.nn.Module) -> dict:
    """``info`` with its buffer names as ``module`` (a reloaded program) holds them.

    Re-exporting a converted graph for save nests it one module deeper (``model.<name>``), so
    each recorded name is matched as the module's buffer of that name or ending in ``.<name>``.

    Raises:
        QuantkitError: a recorded cache buffer is missing from ``module`` (one line).
    """
    names = [n for n, _ in module.named_buffers()]
    resolved = []
    for name in info.get("buffers", []):
        hits = [n for n in names if n == name] or [n for n in names if n.endswith("." + name)]
        if len(hits) != 1:
            raise QuantkitError(f"the program's KV-cache buffer {name!r} is "
                                f"{'missing' if not hits else 'ambiguous'}; re-create the artifact")
        resolved.append(hits[0])
    return {**info, "buffers": resolved}
