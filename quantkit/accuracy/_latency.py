"""Compiled latency of quantized models on this machine, for autotune, cached on disk.

A measurement is keyed by what decides it: the float model's graph and input shapes, the
quantized graph's op structure (recipes whose converted graphs have the same ops -- static
with min-max or histogram ranges, SmoothQuant folded into LayerNorm -- lower to the same
kernels and share one measurement), the torch version, the CPU and the thread count. The
cache is a JSON file in ``$QUANTKIT_CACHE_DIR`` (default ``~/.cache/quantkit``); delete it
to measure again. Numbers measured on a busy machine stay until then.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.fx import GraphModule

from ..pipeline._inputs import call_model

__all__ = ["Meter", "cache_path", "structure_key"]

# timed calls per model after one warm-up (compile) call, and a wall-clock cap on them
CALLS, MAX_SECONDS = 5, 10.0
# kinds of lowering with no int8 GEMM kernel on CPU: quantkit.compile runs their GEMMs in float
# (per-token activation scales: oneDNN/Inductor have no pattern for them, BENCHMARKS issue 12:
# 0.57x fp32), so their latency is bounded below by the float model's, measured
NO_INT8_KERNEL_ON_CPU = ("per-token", "dynamic")


def cache_path() -> Path:
    root = os.environ.get("QUANTKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "quantkit")
    return Path(root) / "latency.json"


@functools.cache
def _lowering_fingerprint() -> str:
    """A digest of quantkit's lowering source: a latency measured before the lowering changed (an
    upgrade, or a new fusion pass) is not reused for the new code."""
    from quantkit import lowering

    h = hashlib.sha256()
    for f in sorted(Path(lowering.__file__).parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def structure_key(gm: GraphModule) -> str:
    """A digest of a graph's op structure (ops and their order, not qparam values)."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        h.update(f"{n.op}:{getattr(n.target, '__name__', n.target) if n.op != 'get_attr' else ''};".encode())
    return h.hexdigest()[:16]


def _shapes(inputs: Any) -> str:
    if isinstance(inputs, torch.Tensor):
        return f"{tuple(inputs.shape)}:{inputs.dtype}"
    if isinstance(inputs, dict):
        return ",".join(f"{k}={_shapes(v)}" for k, v in sorted(inputs.items()))
    if isinstance(inputs, (tuple, list)):
        return "(" + ",".join(_shapes(v) for v in inputs) + ")"
    return type(inputs).__name__


def _fresh(inputs: Any, dtype: torch.dtype | None = None) -> Any:
    """A copy of every tensor (compiled frozen graphs may write into their inputs), floats cast to ``dtype``."""
    if isinstance(inputs, torch.Tensor):
        t = inputs.clone()
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    if isinstance(inputs, dict):
        return {k: _fresh(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_fresh(v, dtype) for v in inputs)
    return inputs


def _time(fn: Callable, inputs: Any, dtype: torch.dtype | None = None) -> float:
    """Median ms of ``CALLS`` calls after one warm-up call (which compiles)."""
    with torch.no_grad():
        call_model(fn, _fresh(inputs, dtype))
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < CALLS and (len(times) < 2 or time.perf_counter() - start < MAX_SECONDS):
            args = _fresh(inputs, dtype)
            t = time.perf_counter()
            call_model(fn, args)
            times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 3)


class _FrozenFloat(torch.nn.Module):
    """A float model compiled with Inductor freezing, as ``quantkit.compile`` runs int8."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.compiled = torch.compile(model)

    def forward(self, *args, **kwargs):
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return self.compiled(*args, **kwargs)


class Meter:
    """Measures (or recalls) compiled latencies for one float model and input shape.

    Args:
        float_graph: the captured float model (its graph keys the cache).
        example_inputs: the batch every model is timed on.
        cache: False: measure every time and write nothing.
    """

    def __init__(self, float_graph: GraphModule, example_inputs: Any, *, cache: bool = True) -> None:
        self.float_graph = float_graph
        self.inputs = example_inputs
        self.cache = cache
        self.base = "|".join([structure_key(float_graph), _shapes(example_inputs), torch.__version__,
                              platform.processor() or platform.machine(), str(torch.get_num_threads()),
                              _lowering_fingerprint()])
        self.kinds: dict[str, float] = {}  # lowering kind -> latency measured or recalled this run
        self.measured = 0  # compilations done (not recalled from the cache)

    def _load(self) -> dict:
        try:
            doc = json.loads(cache_path().read_text(encoding="utf-8"))
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}

    def _store(self, key: str, ms: float) -> None:
        if not self.cache:
            return
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = self._load()
            doc[key] = ms
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc, indent=0, sort_keys=True), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:  # a read-only home: measure again next time
            pass

    def _cached(self, key: str, measure: Callable[[], float]) -> float:
        hit = self._load().get(key) if self.cache else None
        if isinstance(hit, (int, float)) and hit > 0:
            return float(hit)
        ms = measure()
        self.measured += 1
        self._store(key, ms)
        return ms

    def int8(self, qmodel: GraphModule, kind: str) -> float:
        """Median ms of ``quantkit.compile(qmodel)`` (oneDNN int8, bf16 elsewhere where supported)."""
        import warnings

        from quantkit.lowering._compile import compile as qk_compile

        def measure() -> float:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return _time(qk_compile(qmodel), self.inputs)

        ms = self._cached(f"{self.base}|int8|{structure_key(qmodel)}", measure)
        self.kinds[kind] = min(ms, self.kinds.get(kind, ms))
        return ms

    def kind(self, kind: str, build: Callable[[], GraphModule]) -> float:
        """The latency of a kind of lowering (``"static"``, ``"per-token"``), measuring a quickly
        built model of that kind when this run has not seen one; for a kind without int8 kernels
        on CPU, the compiled float model's latency (a lower bound, and one compile fewer)."""
        if kind not in self.kinds:
            on_cpu = all(t.device.type == "cpu" for t in self.float_graph.parameters())
            if kind in NO_INT8_KERNEL_ON_CPU and on_cpu:
                self.kinds[kind] = self.floats(self.float_graph, bf16=False)["fp32_ms"]
            else:
                self.int8(build(), kind)
        return self.kinds[kind]

    def floats(self, model: torch.nn.Module, bf16: bool = True) -> dict[str, float]:
        """Median ms of the float model compiled in fp32 and in bf16 (Inductor freezing both)."""
        out = {"fp32_ms": self._cached(f"{self.base}|fp32", lambda: _time(_FrozenFloat(model), self.inputs))}
        if not bf16:
            return out
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        out["bf16_ms"] = self._cached(f"{self.base}|bf16",
                                      lambda: _time(_FrozenFloat(bf16), self.inputs, torch.bfloat16))
        return out
