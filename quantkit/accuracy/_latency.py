"""Compiled latency of quantized models on this machine, for autotune, cached on disk.

A measurement is keyed by what decides it: the float model's graph and input shapes, the
quantized graph's op structure (recipes whose converted graphs have the same ops -- static
with min-max or histogram ranges, SmoothQuant folded into LayerNorm -- lower to the same
kernels and share one measurement), the torch version, the CPU and the thread count. The
cache is a JSON file in ``$QUANTKIT_CACHE_DIR`` (default ``~/.cache/quantkit``); delete it
to measure again. Numbers measured on a busy machine stay until then.

The cache is data, never code: it is parsed as JSON only (never unpickled), it must be an object
mapping keys to milliseconds, and an entry counts only when it is a finite number in
(0, :data:`MAX_MS`] -- ``Infinity`` once made static recipes look unmeasurably slow and silently
chose per-token. Anything else (NaN, infinities, zero, negative, strings, booleans, nested values,
a file that is not JSON, too large, or a symlink) is ignored and measured again, with a line in
:attr:`Meter.notes` for the report. Writes go to a fresh temporary file (``O_EXCL``, so a link planted
at a temporary name is never followed) renamed over the cache, which replaces a symlink there rather
than writing through it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import platform
import stat
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.fx import GraphModule

from ..pipeline._inputs import call_model

__all__ = ["Meter", "cache_path", "structure_key", "MAX_MS", "valid_ms"]

# timed calls per model after one warm-up (compile) call, and a wall-clock cap on them
CALLS, MAX_SECONDS = 5, 10.0
# kinds of lowering with no int8 GEMM kernel on CPU: quantkit.compile runs their GEMMs in float
# (per-token activation scales: oneDNN/Inductor have no pattern for them, BENCHMARKS issue 12:
# 0.57x fp32), so their latency is bounded below by the float model's, measured
NO_INT8_KERNEL_ON_CPU = ("per-token", "dynamic")
# the largest latency the cache accepts: an hour per call, far beyond anything _time measures (it
# stops after MAX_SECONDS once two calls are timed); larger values are not measurements
MAX_MS = 3.6e6
_MAX_BYTES = 16 << 20  # a cache file larger than this is not one quantkit wrote (~100 bytes an entry)


def cache_path() -> Path:
    root = os.environ.get("QUANTKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "quantkit")
    return Path(root) / "latency.json"


def valid_ms(value: Any) -> bool:
    """Whether a cached value is a latency: a finite int or float in (0, MAX_MS] (not a bool)."""
    return type(value) in (int, float) and math.isfinite(value) and 0 < value <= MAX_MS


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON array"
    text = ascii(value)  # escapes control characters
    return text if len(text) <= 40 else text[:37] + "..."


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

    Attributes:
        notes: one line per cache entry (or cache file) that was ignored and measured again
            because it is not a finite positive latency; for the report.
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
        self.notes: list[str] = []  # cache entries (or the cache file) ignored, one line each, for the report

    def _note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def _load(self, quiet: bool = False) -> dict:
        """The cache's entries; {} (and a note unless ``quiet``) when the file is not a JSON object."""
        path = cache_path()
        why = None
        data = b""
        try:
            # no link followed; O_NONBLOCK: a FIFO planted at the path must not block the open
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            why = "a symlink (not followed)" if os.path.islink(path) else f"unreadable ({exc.strerror})"
        else:
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    why = "not a regular file"
                else:
                    try:
                        data = f.read(_MAX_BYTES + 1)
                    except OSError as exc:
                        why = f"unreadable ({exc.strerror})"
        if why is None:
            if len(data) > _MAX_BYTES:
                why = f"larger than {_MAX_BYTES >> 20} MiB"
            else:
                try:
                    doc = json.loads(data.decode("utf-8"))  # JSON only: never unpickled
                except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
                    why = "not JSON"
                else:
                    if isinstance(doc, dict):
                        return doc
                    why = f"{_describe(doc)}, not a JSON object"
        if not quiet:
            self._note(f"latency cache {path} is {why}; ignored, latencies measured again")
        return {}

    def _store(self, key: str, ms: float) -> None:
        if not self.cache:
            return
        path = cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            doc = {k: v for k, v in self._load(quiet=True).items() if valid_ms(v)}
            doc[key] = ms
            # a fresh name (O_EXCL: a link planted at a temporary name is never followed), then a rename,
            # which replaces a symlink at the cache path instead of writing through it
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(json.dumps(doc, indent=0, sort_keys=True))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:  # a read-only home: measure again next time
            pass

    def _cached(self, key: str, measure: Callable[[], float]) -> float:
        if self.cache:
            doc = self._load()
            if key in doc:
                hit = doc[key]
                if valid_ms(hit):
                    return float(hit)
                what = "|".join(key.split("|")[6:]) or key  # the part after the model/machine fields
                self._note(f"latency cache entry {what} in {cache_path()} is {_describe(hit)}, not a finite "
                           f"positive number of ms up to {MAX_MS:g}; ignored and measured again")
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
