"""calibrate: run representative batches through a prepared model so observers see ranges."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.fx import GraphModule

from quantkit.observers._tokens import token_mask

from .._errors import CalibrationError, QuantkitError
from .._graph import is_observer_module, is_observer_node
from ._distributed import calibrate_synced, use_distributed
from ._hooks import CalibrationRun, with_hooks
from ._inputs import call_model
from ._prepare import from_attributes

__all__ = ["calibrate", "run_batches", "one_batch_suffices"]


def _total(data: Any, max_batches: int | None) -> int | None:
    try:
        n = len(data)
    except TypeError:
        n = None
    if max_batches is not None:
        n = max_batches if n is None else min(n, max_batches)
    return n


def _padding_mask(batch) -> torch.Tensor | None:
    """The batch's ``attention_mask`` (Hugging Face convention: 1 = real token), if it
    has padding."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or bool(mask.bool().all()):
        return None
    return mask


def run_batches(model: torch.nn.Module, data: Iterable, *, progress: bool, max_batches: int | None,
                desc: str, what: str, skip_padding: bool = False) -> int:
    """Run ``model`` on each batch of ``data`` under no_grad; returns the batch count.
    With ``skip_padding``, observers leave out the tokens a batch's ``attention_mask``
    marks as padding."""
    if isinstance(data, (torch.Tensor, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(
            f"{what} data must be an iterable of batches (e.g. a list of tensors, tuples or dicts, "
            f"or a DataLoader), got {type(data).__name__}; wrap a single batch in a list"
        )
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be at least 1, got {max_batches}")
    from tqdm.auto import tqdm

    seen = 0
    bar = tqdm(total=_total(data, max_batches), desc=desc, unit="batch", disable=not progress, leave=False)
    try:
        with torch.no_grad():
            for batch in data:
                if max_batches is not None and seen >= max_batches:
                    break
                try:
                    with token_mask(_padding_mask(batch) if skip_padding else None):
                        call_model(model, batch)
                except QuantkitError:
                    raise
                except (AssertionError, RuntimeError) as exc:
                    first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
                    if "Guard failed" in first or "guard" in first.lower():
                        raise CalibrationError(
                            f"{what} batch {seen} does not match the captured shapes ({first.strip()}); "
                            "pad or crop it to the example's shape, or pass dynamic_shapes to quantkit.capture"
                        ) from exc
                    raise
                seen += 1
                bar.update(1)
    finally:
        bar.close()
    return seen


def calibrate(prepared: GraphModule, data: Iterable, *, progress: bool = True,
              max_batches: int | None = None, skip_padding: bool = True,
              distributed: bool | str = "auto") -> GraphModule:
    """Run ``data`` through a prepared model so its observers record ranges.

    Ownership: works in place (recording ranges into the prepared model's observers is
    its job); calling it again adds more data to the same statistics.

    Args:
        prepared: the output of :func:`quantkit.prepare` (or of torchao's ``prepare_pt2e``).
        data: an iterable of batches; each batch is a tensor, a tuple of positional
            arguments or a dict of keyword arguments. Batch sizes may vary.
        progress: show a progress bar.
        max_batches: stop after this many batches.
        skip_padding: for dict batches with an ``attention_mask`` (Hugging Face style),
            observers leave out the padding tokens it marks (0), so that ranges describe
            real tokens only. Applies to observers of ``[batch, ..., tokens, ...]``
            activations of a graph with an ``attention_mask`` input.
        distributed: ``"auto"`` (default): when ``torch.distributed`` is initialised with
            more than one process, ``data`` is this rank's shard (``quantkit.shard(batches)``)
            and the observers are reduced across ranks afterwards
            (:func:`quantkit.observers.sync`: every rank ends with the observers of one
            process that saw all shards in rank order); ``True`` requires a process group;
            ``False`` calibrates this process alone. ``max_batches`` then counts per rank.
            GPTQ/AWQ weight rounding syncs its statistics after each pass (AWQ's |x| and row
            sample, each block's Hessians), so every rank rounds to the same integers; the
            Hessians equal one process merging the ranks' observers in rank order (see
            ``quantkit.accuracy.rounding._sync``). Weight algorithms join through the calibration
            hooks (``pipeline._hooks``).

    Returns:
        ``prepared`` itself (calibration updates it in place).

    Raises:
        CalibrationError: no batches, NaN/inf activations (the message names the node),
            or a batch whose shape the captured graph cannot take.
    """
    if not isinstance(prepared, GraphModule) or not (
            prepared.meta.get("quantkit_prepared", False) or any(is_observer_module(m) for m in prepared.modules())):
        raise TypeError("calibrate expects a model returned by quantkit.prepare (or torchao's prepare_pt2e)")
    def run(limit: int | None = max_batches) -> int:
        return run_batches(prepared, data, progress=progress, max_batches=limit, desc="calibrating",
                           what="calibration", skip_padding=skip_padding)

    def observe() -> int:
        # observers of weights only (weight-only RTN, GPTQ and AWQ, dynamic activations): every
        # further batch would leave every statistic as the first left it (issue 31: 20 of
        # SmolLM2's 29 s of RTN, one whole forward of GPTQ's). Asked when the pass starts, after
        # the before-pass hooks (AWQ) have changed the graph; the hooks still see every batch.
        return run(1) if one_batch_suffices(prepared) else run()

    synced = use_distributed(distributed)
    # the registered hooks (GPTQ/AWQ, when weights ask for them), their statistics synced pass by
    # pass under a process group (quantkit.accuracy.rounding)
    hooked = with_hooks(CalibrationRun(prepared, data, max_batches, synced), observe)
    seen = calibrate_synced(prepared, hooked, data) if synced else hooked()
    if seen == 0:
        raise CalibrationError(
            "calibration data is empty: no batches were run; pass at least one representative batch"
        )
    prepared.meta["quantkit_calibrated_batches"] = prepared.meta.get("quantkit_calibrated_batches", 0) + seen
    return prepared


def one_batch_suffices(prepared: GraphModule) -> bool:
    """Whether calibrating ``prepared`` on one batch gives every observer the statistics that any
    number of batches gives: each observer that records statistics watches a constant (a weight,
    a weight scaled by a norm) and declares ``repeat_invariant`` (a running min/max: the same
    tensor seen again changes nothing), and run-time (dynamic) observers record nothing. A
    dynamic or per-token recipe with min/max weights then calibrates in one forward instead of
    one per batch (issue 28: 1.1 s each in the default search). False for any other graph,
    e.g. with activation observers, GPTQ's Hessians or moving averages."""
    modules = dict(prepared.named_modules(remove_duplicate=False))
    found = False
    for node in prepared.graph.nodes:
        if not is_observer_node(node, modules):
            continue
        obs = modules[str(node.target)]
        if getattr(obs, "is_dynamic", False):
            continue
        src = node.args[0] if node.args else None
        if not (getattr(obs, "repeat_invariant", False) and isinstance(src, torch.fx.Node) and from_attributes(src)):
            return False
        found = True
    return found
