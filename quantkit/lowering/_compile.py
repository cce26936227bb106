"""compile: torch.compile a converted model with quantkit's int8 lowering applied first."""

from __future__ import annotations

import copy
import warnings

import torch
from torch.fx import GraphModule

from .._graph import DEQUANTIZE_OPS
# quantkit's own passes register themselves on import (int8, weight-only, FP8, bf16: see _registry)
from ._bf16 import resolve_float_dtype
from ._fp8 import FP8_KERNELS, has_fp8_qdq
from ._lower import Target
from ._onednn import exact_for_graph, why_reference
from ._per_token import lower_per_token  # noqa: F401  (registers the per-token int8 pass)
from ._registry import LoweringContext, run_lowerings
from ._weight_only import KERNELS_META_KEY, has_quant_ops, kernel_choices

__all__ = ["compile", "CPU_KERNELS", "LOWERING_META_KEY", "KERNELS_META_KEY", "REFERENCE_META_KEY", "kernel_choices",
           "why_reference"]

LOWERING_META_KEY = "quantkit_lowering"
# gm.meta: the one line saying why "auto" kept the int8 layers on the reference q/dq graph (absent when it did not)
REFERENCE_META_KEY = "quantkit_reference_reason"
# "auto": oneDNN int8 where it is exact (VNNI/AMX CPUs, or 7-bit activations: see
# _onednn.exact_for_graph), else the reference q/dq graph
CPU_KERNELS = ("auto", "onednn", "reference")


def _has_qdq(gm: GraphModule) -> bool:
    """Whether ``gm`` holds quantized_decomposed dequantize ops (a q/dq graph, e.g. torchao's)."""
    return any(n.op == "call_function" and n.target in DEQUANTIZE_OPS for n in gm.graph.nodes) or has_fp8_qdq(gm)


def _device_type(gm: GraphModule) -> str:
    devices = {t.device.type for t in list(gm.buffers()) + list(gm.parameters())}
    if len(devices) > 1:
        raise ValueError(f"the model's tensors are on several devices {sorted(devices)}; move it with .to(device) first")
    return devices.pop() if devices else "cpu"


def compile(converted: GraphModule, *, cpu_kernels: str = "auto", float_dtype: str = "auto",
            fp8_kernel: str = "scaled_mm", **torch_compile_kwargs):
    """``torch.compile`` a ``quantkit.convert`` result, running q/dq layers as fused int8 kernels.

    An FX pass first rewrites ``dq(x) -> linear <- dq(w_int8)`` (with a following relu/gelu and
    requantize fused in) into int8 kernels: quantkit's Triton ops on CUDA (plus int8 attention
    matmuls), oneDNN ``qlinear_pointwise`` on CPU with Inductor freezing on, so the weight
    prepack is folded. Unmatched q/dq stays as it is (reference numerics). The passes are the
    registered lowerings (``quantkit.lowering.register_lowering``: int8, weight-only, FP8, bf16 casts,
    and any a scheme adds), run in their order with one :class:`~quantkit.lowering.LoweringContext`.

    Ownership: ``converted`` is never modified; the pass works on a copy (inference-only),
    and the compiled module is new.

    Args:
        converted: the GraphModule returned by ``quantkit.convert`` (or any q/dq graph of
            ``quantized_decomposed`` ops, e.g. torchao's ``convert_pt2e`` result).
        cpu_kernels: ``"auto"`` uses oneDNN int8 where it is exact -- on VNNI / AMX CPUs, or
            on any x86 CPU when every linear/conv activation is 7-bit
            (``QuantConfig(activation="affine-uint7")``) -- and otherwise compiles the
            reference q/dq graph (also for a graph mixing 7-bit and 8-bit activations, and
            for per-token activations, int8 in -127..127: see ``_onednn.exact_for_graph``),
            recording why in one line (``meta["quantkit_reference_reason"]``, ``why_reference``);
            per-token linears become uint8 x int8 GEMMs that Inductor lowers to oneDNN
            (``_per_token.py``);
            ``"onednn"`` forces oneDNN (on AVX2-only CPUs with 8-bit activations its int16
            intermediate sums saturate: fast, not exact); ``"reference"`` never rewrites.
            Ignored on CUDA.
        float_dtype: what the ops that are not int8 GEMMs (attention, LayerNorm, GELU,
            softmax, adds, q/dq arithmetic) compute in on CPU: ``"auto"`` runs them in bf16
            when oneDNN int8 runs on a CPU with AMX (not AVX-512 BF16 alone: slower there) and
            the graph's attention (SDPA, float matmuls) is measured faster in bf16 at its
            shapes (int8-mixed-bf16, see
            ``lowering/_bf16.py``; outputs keep their float32 dtype, values differ from the
            reference at bf16 level), else float32; ``"bf16"`` forces bf16, ``"fp32"`` keeps
            float32. Ignored on CUDA.
        fp8_kernel: what FP8 linears run as: ``"scaled_mm"`` (``torch._scaled_mm``, default) or
            ``"triton"`` (quantkit's Triton FP8 GEMM, ``kernels/_fp8_gemm.py``). Ignored on CPU (``_scaled_mm``).
        **torch_compile_kwargs: passed to ``torch.compile`` (``dynamic``, ``fullgraph``,
            ``options``, ...). With oneDNN, calls run with Inductor ``freezing=True`` and no grad.

    Returns:
        The compiled module; ``._orig_mod.meta["quantkit_lowering"]`` counts the rewrites, and
        ``kernel_choices(compiled)`` says which int4 kernel the weight-only layers run and why
        (aten's where quantkit's cannot load here, with the reason).

    Example:
        >>> fast = quantkit.compile(quantkit.convert(prepared))
        >>> y = fast(x)
    """
    if not isinstance(converted, GraphModule) or not (converted.meta.get("quantkit_converted") or _has_qdq(converted)):
        raise TypeError(
            f"compile expects the GraphModule returned by quantkit.convert (or torchao's convert_pt2e), "
            f"got {type(converted).__name__}"
        )
    if fp8_kernel not in FP8_KERNELS:
        raise ValueError(f"unknown fp8_kernel {fp8_kernel!r}; use one of {list(FP8_KERNELS)}")
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"unknown cpu_kernels {cpu_kernels!r}; use one of {list(CPU_KERNELS)}")
    reason = None if _device_type(converted) == "cuda" else why_reference(converted)  # None: oneDNN is exact here
    if _device_type(converted) == "cuda":
        target = Target.TRITON
    elif cpu_kernels == "onednn" or (cpu_kernels == "auto" and reason is None):
        target = Target.ONEDNN
        if reason is not None:
            hint = (" (quantize with QuantConfig(weight_bits=7)" + ("" if "per-token" in reason else
                    " or activation='affine-uint7'") + " to make them exact)")
            warnings.warn("oneDNN int8 on a CPU without VNNI saturates int16 sums with 8-bit activations and weights; "
                          f"results are not exact{hint}", stacklevel=2)
            reason = None
    else:
        target = None
        if cpu_kernels != "auto":
            reason = None
    # validates on CUDA too; "auto" is bf16 only where oneDNN int8 runs (not weight-only graphs: no activation q/dq)
    dtype = resolve_float_dtype(float_dtype, onednn=target is Target.ONEDNN and _has_qdq(converted), graph=converted)
    gm = copy.deepcopy(converted)
    ctx = LoweringContext("cuda" if target is Target.TRITON else "cpu", target, cpu_kernels, dtype, fp8_kernel,
                          requested_float_dtype=float_dtype if isinstance(float_dtype, str) else
                          {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(float_dtype, "auto"))
    gm.meta[LOWERING_META_KEY] = counts = run_lowerings(gm, ctx)  # every registered pass that applies, in order
    if reason is not None:
        gm.meta[REFERENCE_META_KEY] = reason
    for p in gm.parameters():
        p.requires_grad_(False)  # inference graph: lets Inductor freeze (fold) the weights
    compiled = torch.compile(gm, **torch_compile_kwargs)
    # a graph whose quantized layers are all weight-only kernels now (weights prepacked above, float
    # ops float32) leaves nothing to Inductor's freezing: no _Frozen, whose per-call config patch
    # and input copies cost ~0.1 ms (measured, 4096x4096 int4 linear at M = 1; BENCHMARKS.md, issue 14)
    weight_only = counts.get("weight_only_int4") or counts.get("weight_only_int8")
    if target is Target.ONEDNN and not (weight_only and not counts.get("to_bf16")
                                        and not _has_qdq(gm) and not has_quant_ops(gm)):
        return _Frozen(compiled)
    return compiled


class _Frozen(torch.nn.Module):
    """Runs a compiled module with Inductor freezing on.

    torch.compile compiles lazily, at the first call, and ``options={"freezing": True}`` does
    not reach the freezing passes' fake-tensor propagation in torch 2.13 (it fails on
    ``onednn.qlinear_prepack``); the global config does, so it is set around each call.
    """

    def __init__(self, compiled) -> None:
        super().__init__()
        self.compiled = compiled

    @property
    def _orig_mod(self):
        return self.compiled._orig_mod

    def forward(self, *args, **kwargs):
        # Inductor's frozen graphs may write a residual add into the graph input's buffer
        # (measured, torch 2.13: the transformer block's x, for torchao's PT2E flow too), which
        # would change the caller's tensor; a copy costs one pass over the activations.
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return self.compiled(*args, **kwargs)
