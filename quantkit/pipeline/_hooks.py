"""Calibration hooks: the seam where weight algorithms (GPTQ, AWQ, ...) join ``calibrate``.

A hook is registered by name at one point of calibration (llm-compressor's lifecycle
callbacks, in the spirit of torchao's handler registries)::

    @register_calibration_hook("awq", when="before_pass")
    def awq(cal: CalibrationRun) -> Callable[[], None] | None:
        ...  # None: nothing to do for this model; else the step to run at that point

- ``"before_pass"`` and ``"after_pass"``: ``hook(cal)`` is asked once per ``calibrate`` call,
  before anything runs (so its checks fail before any pass), with the :class:`CalibrationRun`;
  it returns ``None`` or a step, ``step()``, run before or after calibrate's own pass over the data;
- ``"after_block"``: the block-by-block run (``quantkit.sequential``) asks ``hook(block_run)``
  once per run with a :class:`BlockRun`; it returns ``None`` or an object with ``resume(done,
  block_file, observers)``, ``round(block, float_inputs) -> dict`` (called after each block's
  float pass; tensors to store with the block) and ``finish(block_index)``.

Hooks run in registration order. The library's own (GPTQ, AWQ) register themselves in
``quantkit.accuracy.rounding``, which ``import quantkit`` imports; since Python imports a package
before any of its submodules, ``import quantkit.pipeline`` registers them too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch.fx import GraphModule

from ._distributed import on_all_ranks

__all__ = ["WHEN", "CalibrationRun", "BlockRun", "register_calibration_hook", "calibration_hooks",
           "with_hooks"]

WHEN = ("before_pass", "after_block", "after_pass")

_HOOKS: dict[str, dict[str, Callable]] = {when: {} for when in WHEN}


@dataclass
class CalibrationRun:
    """What a ``before_pass``/``after_pass`` hook sees of one ``calibrate`` call.

    Args:
        prepared: the prepared model being calibrated (in place).
        data: the calibration batches as the caller passed them (a hook that passes over them
            more than once checks that they are re-iterable).
        max_batches: the caller's limit on batches per pass (per rank when distributed).
        distributed: this rank calibrates its shard and the statistics are synced across ranks.
        seen: batches of calibrate's own pass over every rank (set before the ``after_pass`` steps).
        meta: entries for ``prepared.meta``, written once every step and the pass succeeded.
        state: shared by the hooks of one call (e.g. a plan several hooks use).
    """

    prepared: GraphModule
    data: Iterable
    max_batches: int | None = None
    distributed: bool = False
    seen: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class BlockRun:
    """What an ``after_block`` hook sees of one block-by-block run (``quantkit.sequential``).

    Args:
        prepared: the prepared graph (weights absent until each block loads them).
        blocks: its partition blocks (``pipeline._partition``), in order.
        batches: the calibration batches (a list).
        partial_path: the run's progress directory (a hook may keep its own files below it).
        budget: bytes of activations the run may keep in memory (None: no limit).
        ledger: the progress directory's digests (``sequential._files.Ledger``).
    """

    prepared: GraphModule
    blocks: list
    batches: list
    partial_path: Path
    budget: int | None = None
    ledger: Any = None


def register_calibration_hook(name: str, *, when: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as calibration hook ``name`` at ``when`` (one of
    :data:`WHEN`); registering a name again replaces the hook, in its place.

    Raises:
        ValueError: ``when`` is not one of :data:`WHEN`, or ``name`` is empty.
    """
    if when not in WHEN:
        raise ValueError(f"calibration hook {name!r}: when must be one of {', '.join(WHEN)}, got {when!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a calibration hook needs a non-empty name, got {name!r}")

    def register(hook: Callable) -> Callable:
        _HOOKS[when][name] = hook
        return hook

    return register


def calibration_hooks(when: str) -> list[tuple[str, Callable]]:
    """The hooks registered at ``when``, as ``(name, hook)`` in registration order.

    Raises:
        ValueError: ``when`` is not one of :data:`WHEN`.
    """
    if when not in WHEN:
        raise ValueError(f"when must be one of {', '.join(WHEN)}, got {when!r}")
    return list(_HOOKS[when].items())


def with_hooks(cal: CalibrationRun, run: Callable[[], int]) -> Callable[[], int]:
    """Wrap calibrate's pass ``run`` (returns this rank's batch count) with the steps the
    ``before_pass``/``after_pass`` hooks return for ``cal``; ``run`` itself when none applies.

    Every hook is asked first (its checks raise before any pass). Under a process group the
    pass then exchanges error flags and counts (``_distributed.on_all_ranks``), so that
    ``cal.seen`` counts every rank's batches; the wrapper still returns this rank's count.
    """
    before = [s for s in (hook(cal) for _, hook in calibration_hooks("before_pass")) if s is not None]
    after = [s for s in (hook(cal) for _, hook in calibration_hooks("after_pass")) if s is not None]
    if not before and not after:
        return run
    def wrapped() -> int:
        for step in before:
            step()
        mine: list[int] = []
        own = lambda: mine.append(run()) or mine[0]  # noqa: E731
        cal.seen = on_all_ranks(own) if cal.distributed else own()
        for step in after:
            step()
        cal.prepared.meta.update(cal.meta)
        return mine[0]

    return wrapped
