"""The lowering seam: passes register here and ``quantkit.compile`` runs every one that applies.

A lowering pass is a function ``fn(gm, ctx) -> dict[str, int]`` registered with
:func:`register_lowering`. ``compile`` deep-copies the converted graph, makes one
:class:`LoweringContext` (the device, the int8 target it chose, the user's options, the counts so
far) and calls each registered pass for that device in ``order``. A pass rewrites ``gm`` in place
and decides itself whether it applies (``ctx`` says everything ``compile`` decided); what it
returns is merged into ``gm.meta["quantkit_lowering"]`` with ``dict.update``, so it returns only
the counts it wants recorded (``{}`` when it did nothing).

quantkit's own passes register from their modules: the int8 GEMMs (``_lower.py``, order 100), per-token
int8 GEMMs (``_per_token.py``, 150), int8 SDPA (``_qsdpa.py``, 150), grouped-query attention without
repeated K/V (``_gqa.py``, 160), the weight-only GEMMs
(``_weight_only.py``, 200), FP8 (``_fp8.py``, 300), int8-mixed-bf16 (``_bf16.py``, 400), the bf16
float-fallback GEMMs (``_bf16.py``, 410), the fused per-token quantize (``_per_token_fuse.py``, 420)
and a KV-cache program's bf16 prompt attention (``_prefill_attention.py``, 430). A scheme adds its pass from its own file, e.g.::

    @register_lowering("mxfp4", order=250, devices=("cuda",))
    def lower_mxfp4(gm, ctx):
        return {"mxfp4_linear": rewrite(gm)} if ctx.cpu_kernels != "reference" else {}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch
from torch.fx import GraphModule

__all__ = ["DEVICES", "LoweringContext", "Lowering", "LoweringError", "register_lowering", "unregister_lowering",
           "registered_lowerings", "run_lowerings"]

DEVICES = ("cpu", "cuda")  # what a pass may run for: compile lowers CUDA graphs for "cuda", all others for "cpu"


class LoweringError(ValueError):
    """A lowering pass was registered with a bad name, order or device list."""


@dataclass(frozen=True)
class LoweringContext:
    """What ``quantkit.compile`` decided, handed to every lowering pass (read-only).

    Attributes:
        device: ``"cuda"`` for a graph on CUDA, else ``"cpu"``.
        target: the int8 GEMM target ``compile`` chose (a ``lowering.Target`` value: ``"onednn"``
            or ``"triton"``), or None where the q/dq int8 layers keep their reference ops.
        cpu_kernels: the ``cpu_kernels`` argument (``"auto"``, ``"onednn"``, ``"reference"``).
        float_dtype: what the float ops run in (``torch.float32`` or ``torch.bfloat16``).
        fp8_kernel: the ``fp8_kernel`` argument (``"scaled_mm"`` or ``"triton"``).
        counts: the rewrite counts recorded by the passes that ran before this one.
        requested_float_dtype: the ``float_dtype`` argument as the user gave it (``"auto"``, ``"bf16"``,
            ``"fp32"``): ``float_dtype`` is what it resolved to, and an explicit ``"fp32"`` is a request
            that no pass turns float work into bf16.
    """

    device: str
    target: Optional[str]
    cpu_kernels: str
    float_dtype: torch.dtype
    fp8_kernel: str
    counts: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    requested_float_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise LoweringError(f"unknown lowering device {self.device!r}; use one of {list(DEVICES)}")
        if not isinstance(self.counts, MappingProxyType):
            object.__setattr__(self, "counts", MappingProxyType(dict(self.counts)))


LoweringFn = Callable[[GraphModule, LoweringContext], Optional[Mapping[str, int]]]


@dataclass(frozen=True)
class Lowering:
    """One registered pass: its name, its place in the run order, the devices it runs for."""

    name: str
    order: int
    devices: tuple[str, ...]
    fn: LoweringFn


_REGISTRY: dict[str, Lowering] = {}


def _check(name, order, devices) -> tuple[str, ...]:
    if not isinstance(name, str) or not name:
        raise LoweringError(f"a lowering's name must be a non-empty string, got {name!r}")
    if not isinstance(order, int) or isinstance(order, bool):
        raise LoweringError(f"lowering {name!r}: order must be an int, got {order!r}")
    devices = (devices,) if isinstance(devices, str) else tuple(devices)
    unknown = [d for d in devices if d not in DEVICES]
    if not devices or unknown:
        raise LoweringError(f"lowering {name!r}: devices must be some of {list(DEVICES)}, got {list(devices)}")
    return devices


def register_lowering(name: str, *, order: int,
                      devices: tuple[str, ...] = DEVICES) -> Callable[[LoweringFn], LoweringFn]:
    """Register the decorated function as the lowering pass ``name``; returns it unchanged.

    Args:
        name: unique name of the pass (e.g. ``"weight_only"``).
        order: where it runs: passes run by increasing ``order`` (ties by name). quantkit's own
            passes use 100 (int8), 150 (per-token int8, int8 SDPA), 160 (grouped-query attention), 200 (weight-only), 300 (FP8),
            400 (bf16 casts), 410 (bf16 float-fallback GEMMs), 420 (fused per-token quantize),
            430 (bf16 prompt attention of KV-cache programs).
        devices: the devices it runs for, some of ``("cpu", "cuda")``.

    Registering a second, different function under a taken name raises :class:`LoweringError`
    (re-registering the same function, as a module reload does, replaces it).

    Example:
        >>> @register_lowering("mine", order=250, devices=("cpu",))
        ... def lower_mine(gm, ctx):
        ...     return {"mine": 0}
    """
    devices = _check(name, order, devices)

    def decorator(fn: LoweringFn) -> LoweringFn:
        if not callable(fn):
            raise LoweringError(f"lowering {name!r}: register a function fn(gm, ctx), got {type(fn).__name__}")
        old = _REGISTRY.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise LoweringError(f"a lowering named {name!r} is already registered (by {old.fn.__module__}); "
                                "choose another name or unregister_lowering it first")
        _REGISTRY[name] = Lowering(name, order, devices, fn)
        return fn

    return decorator


def unregister_lowering(name: str) -> None:
    """Remove the pass ``name`` (a no-op when there is none), e.g. at the end of a test."""
    _REGISTRY.pop(name, None)


def registered_lowerings(device: Optional[str] = None) -> list[Lowering]:
    """The registered passes in run order; only those that run for ``device`` when given."""
    return sorted((p for p in _REGISTRY.values() if device is None or device in p.devices),
                  key=lambda p: (p.order, p.name))


def run_lowerings(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """Run every registered pass for ``ctx.device`` on ``gm`` (in place), in order; return the merged counts.

    Each pass sees the counts of the passes before it in ``ctx.counts``.
    """
    counts: dict[str, int] = {}
    for p in registered_lowerings(ctx.device):
        step = dataclasses.replace(ctx, counts=counts)
        counts.update(p.fn(gm, step) or {})
    return counts
