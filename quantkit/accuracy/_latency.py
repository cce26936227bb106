"""Latency of quantized models on this machine, for autotune: estimated per kernel, or compiled and timed.

By default (``Meter(..., measure=False)``) nothing is compiled: the latency of a model is the
per-kernel estimate of :mod:`._costmodel` (its GEMMs and attention timed raw at their shapes, once
per machine, plus its elementwise bytes over the measured bandwidth), which takes milliseconds
per kernel instead of tens of seconds per Inductor compile. ``measure=True`` compiles each model
with ``quantkit.compile`` (Inductor freezing) and times it, keyed by the *lowered* graph's
structure so that no graph is compiled twice (benchmarks, ``--measure``-style flags). The two
are never mixed in one Meter: estimates are compared with estimates.

Under a torchrun launch every latency (kernel or model) is rank 0's, read from the launch's store
by the other ranks (:func:`quantkit.pipeline._distributed.rank0_value`), and timed with the thread
count one process would have on this machine (torchrun sets ``OMP_NUM_THREADS=1`` per rank):
latency-dependent choices are the same on every rank and the same as one process's.

A compiled measurement is keyed by what decides it: the float model's graph and input shapes, the
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

from ..lowering._bf16 import bf16_supported
from ..lowering._onednn import exact_for_graph, exact_on_this_cpu
from ..pipeline._distributed import launched_world, rank0_value
from ..pipeline._inputs import call_model
from . import _costmodel

__all__ = ["Meter", "cache_path", "structure_key", "MAX_MS", "valid_ms", "NOISE_MEASURED", "NOISE_ESTIMATED",
           "timing_threads"]

# timed calls per model after one warm-up (compile) call, and a wall-clock cap on them
CALLS, MAX_SECONDS = 5, 10.0
# kinds of lowering whose int8 GEMMs run on CPU only where oneDNN is exact (VNNI/AMX: the per-token
# lowering, issue 28); elsewhere quantkit.compile runs their GEMMs in float (BENCHMARKS issue 12:
# 0.57x fp32), so a measured latency is bounded below by the float model's
NO_INT8_KERNEL_ON_CPU = ("per-token", "dynamic")
# relative difference within which two latencies are ties. Measured: compiled medians of one model
# repeat within ~3% on an idle machine (issue 17); estimates are further from compiled latencies than
# that (benchmarks/bench_costmodel.py, issue 28), but two estimates share their kernel timings, so a
# difference below this is not a difference the model can see
NOISE_MEASURED, NOISE_ESTIMATED = 0.05, 0.10
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


def timing_threads() -> int:
    """The thread count latencies are timed with: this process's, or under a launch of several
    processes (torchrun sets ``OMP_NUM_THREADS=1`` per rank) the CPUs this process may run on,
    which is what one process gets by default here."""
    if launched_world() > 1:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            return max(1, os.cpu_count() or 1)
    return torch.get_num_threads()


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class _FrozenFloat(torch.nn.Module):
    """A float model compiled with Inductor freezing, as ``quantkit.compile`` runs int8."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.compiled = torch.compile(model)

    def forward(self, *args, **kwargs):
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return self.compiled(*args, **kwargs)


class Meter:
    """Estimates (default) or measures compiled latencies for one float model and input shape.

    Args:
        float_graph: the captured float model (its graph keys the cache, and is the float model
            the estimates plan).
        example_inputs: the batch every model is timed (or planned) on.
        cache: False: time every kernel (or model) again and write nothing.
        measure: True: compile each model with ``quantkit.compile`` and time it (slow: tens of
            seconds per model on a small CPU); False: the per-kernel estimate of
            :mod:`._costmodel`, nothing compiled.
        cpu_kernels: as ``quantkit.compile``'s (``"onednn"`` forces oneDNN int8), for both.

    Attributes:
        noise: the relative difference within which two of this Meter's latencies are ties
            (:data:`NOISE_MEASURED` or :data:`NOISE_ESTIMATED`).
        sources: what each latency this Meter returned came from, by label (``"fp32"``,
            ``"bf16"``, ``"int8:<kind>:<graph digest>"``): ``"estimated"``, ``"measured"`` (compiled
            and timed in this run) or ``"cache"`` (a compiled timing recalled from the cache).
        kernel_timings: how many raw kernel (and machine) timings the estimates used, by where
            they came from: ``{"measured": n, "cache": m}`` (``"rank 0"`` on other torchrun ranks).
        notes: one line per cache entry (or cache file) that was ignored and measured again
            because it is not a finite positive latency; for the report.
        measured: compilations (``measure=True``) or kernel timings done, not recalled.
    """

    def __init__(self, float_graph: GraphModule, example_inputs: Any, *, cache: bool = True,
                 measure: bool = False, cpu_kernels: str = "auto") -> None:
        self.float_graph = float_graph
        self.inputs = example_inputs
        self.cache = cache
        self.measure = measure
        self.cpu_kernels = cpu_kernels
        self.threads = timing_threads()
        cpu = platform.processor() or platform.machine()
        self.base = "|".join([structure_key(float_graph), _shapes(example_inputs), torch.__version__, cpu,
                              str(self.threads), _lowering_fingerprint()])
        # raw kernels do not depend on the model or on quantkit's lowering; the ISA cap changes oneDNN's kernels
        self.machine = "|".join(["costmodel", torch.__version__, cpu, str(self.threads),
                                 os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "-",
                                 "v1"])
        self.noise = NOISE_MEASURED if measure else NOISE_ESTIMATED
        self.kinds: dict[str, float] = {}  # lowering kind -> latency measured or recalled this run
        self.sources: dict[str, str] = {}
        self.kernel_timings: dict[str, int] = {}
        self.measured = 0
        self.notes: list[str] = []
        self._memo: dict[str, float] = {}  # cache key -> ms, this run (a graph is never timed twice)
        self._plans: dict[str, _costmodel.Plan] = {}

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

    def _lookup(self, key: str, measure: Callable[[], float]) -> tuple[float, str]:
        """``(ms, "cache" | "measured")``: the cache's valid entry for ``key``, or a new measurement (stored)."""
        if self.cache:
            doc = self._load()
            if key in doc:
                hit = doc[key]
                if valid_ms(hit):
                    return float(hit), "cache"
                what = "|".join(key.split("|")[6:]) or key  # the part after the model/machine fields
                self._note(f"latency cache entry {what} in {cache_path()} is {_describe(hit)}, not a finite "
                           f"positive number of ms up to {MAX_MS:g}; ignored and measured again")
        with _threads(self.threads):
            ms = measure()
        self.measured += 1
        self._store(key, ms)
        return ms, "measured"

    def _cached(self, key: str, measure: Callable[[], float]) -> tuple[float, str]:
        """As :meth:`_lookup`, once per key and run; under torchrun, rank 0's (looked up there)."""
        if key in self._memo:
            return self._memo[key], "memo"
        where: list[str] = []

        def on_rank0() -> float:
            ms, src = self._lookup(key, measure)
            where.append(src)
            return ms

        ms = rank0_value(key, on_rank0)
        self._memo[key] = ms
        return ms, where[0] if where else "rank 0"

    # --- estimates --------------------------------------------------------------------------

    def _raw_ms(self, name: str, runner: Callable[[], Callable[[], Any]]) -> float:
        """Ms of one raw timing (a kernel at its shapes, or a machine constant), once per machine
        and run (``runner()`` builds what :func:`._costmodel.time_kernel` times), counted in
        :attr:`kernel_timings` by where it came from."""
        ms, src = self._cached(f"{self.machine}|{name}", lambda: _costmodel.time_kernel(runner(), self.threads))
        if src != "memo":
            self.kernel_timings[src] = self.kernel_timings.get(src, 0) + 1
        return ms

    def plan(self, gm: GraphModule, **kw) -> _costmodel.Plan:
        """How ``gm`` runs after ``quantkit.compile`` here (see :func:`._costmodel.plan`), memoised by
        graph structure and options."""
        # exactness too: graphs of one structure lower differently when only their integer ranges differ
        # (7-bit weights or activations run oneDNN on CPUs without VNNI, 8-bit ones the reference graph)
        key = structure_key(gm) + str(exact_for_graph(gm)) + repr(sorted(kw.items()))
        if key not in self._plans:
            self._plans[key] = _costmodel.plan(gm, self.inputs, **kw)
        return self._plans[key]

    def estimate(self, gm: GraphModule, **kw) -> float:
        """The estimated ms of ``quantkit.compile(gm)`` (or of the float graph), nothing compiled;
        ``kw`` as :func:`._costmodel.plan`'s (``cpu_kernels``, ``float_dtype``)."""
        p = self.plan(gm, **kw)
        constant = lambda name: self._raw_ms(name, lambda: _costmodel.machine_runner(name))  # noqa: E731
        bandwidth = _costmodel.BANDWIDTH_BYTES / constant(_costmodel.BANDWIDTH)  # bytes per ms
        kernel_ms = lambda k: self._raw_ms(k.key(), lambda: _costmodel.kernel_runner(k))  # noqa: E731
        return round(_costmodel.estimate_ms(p, kernel_ms, bandwidth, constant(_costmodel.OP_OVERHEAD)), 3)

    # --- the agreed interface ---------------------------------------------------------------

    def int8(self, qmodel: GraphModule, kind: str) -> float:
        """Ms of ``quantkit.compile(qmodel)`` here: estimated, or (``measure=True``) the median of
        compiled calls, timed once per lowered graph structure (oneDNN int8, bf16 where compile uses it)."""
        label = f"int8:{kind}:{structure_key(qmodel)}"
        if self.measure:
            ms, src = self._compiled_ms(qmodel)
            self.sources[label] = src
        else:
            ms = self.estimate(qmodel, cpu_kernels=self.cpu_kernels)
            self.sources[label] = "estimated"
        self.kinds[kind] = min(ms, self.kinds.get(kind, ms))
        return ms

    def _compiled_ms(self, qmodel: GraphModule) -> tuple[float, str]:
        import warnings

        from quantkit.lowering._compile import compile as qk_compile

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # lazy: the lowering passes run now, Inductor at the first call
            compiled = qk_compile(qmodel, cpu_kernels=self.cpu_kernels)
        # keyed by what Inductor will compile: recipes whose converted graphs lower alike share one timing
        lowered = getattr(compiled, "_orig_mod", qmodel)

        def measure() -> float:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return _time(compiled, self.inputs)

        # the graph's ops, and how it runs: Inductor freezing (oneDNN) or not, and what the passes rewrote
        how = f"{type(compiled).__name__}:{sorted(lowered.meta.get('quantkit_lowering', {}).items())}" \
            if isinstance(lowered, GraphModule) else type(compiled).__name__
        ms, src = self._cached(f"{self.base}|int8|{structure_key(lowered)}|{hashlib.sha256(how.encode()).hexdigest()[:8]}",
                               measure)
        return ms, "cache" if src == "cache" else "measured"

    def kind(self, kind: str, build: Callable[[], GraphModule]) -> float:
        """The latency of a kind of lowering (``"static"``, ``"per-token"``), from a quickly built model
        of that kind when this run has seen none (estimated unless ``measure``). Measured, a kind
        without int8 kernels on this CPU takes the compiled float model's latency (a lower bound, and
        one compile fewer)."""
        if kind not in self.kinds:
            on_cpu = all(t.device.type == "cpu" for t in self.float_graph.parameters())
            if self.measure and kind in NO_INT8_KERNEL_ON_CPU and on_cpu and not exact_on_this_cpu():
                self.kinds[kind] = self.floats(self.float_graph, bf16=False)["fp32_ms"]
                self.sources[f"kind:{kind}"] = self.sources["fp32"]
            else:
                self.int8(build(), kind)
        return self.kinds[kind]

    def floats(self, model: torch.nn.Module | None = None, bf16: bool = True) -> dict:
        """Ms of the float model compiled in fp32 and, where this CPU has native BF16, in bf16.

        Returns ``{"fp32_ms", "bf16_ms", "bf16_native"}``; ``bf16_ms`` is None without native BF16
        (emulated bf16 is no comparison: ~100x slower) or with ``bf16=False``. Estimated from the
        float graph unless ``measure`` (then ``model``, default the float graph, is compiled
        with Inductor freezing and timed).
        """
        native = bf16_supported()
        model = self.float_graph if model is None else model
        if self.measure:
            fp32, src = self._cached(f"{self.base}|fp32", lambda: _time(_FrozenFloat(model), self.inputs))
            self.sources["fp32"] = "cache" if src == "cache" else "measured"
        else:
            fp32 = self.estimate(self.float_graph)
            self.sources["fp32"] = "estimated"
        out = {"fp32_ms": fp32, "bf16_ms": None, "bf16_native": native}
        if not (bf16 and native):
            return out
        if self.measure:
            half = copy.deepcopy(model).to(torch.bfloat16)
            ms, src = self._cached(f"{self.base}|bf16", lambda: _time(_FrozenFloat(half), self.inputs, torch.bfloat16))
            self.sources["bf16"] = "cache" if src == "cache" else "measured"
        else:
            ms = self.estimate(self.float_graph, float_dtype="bf16")
            self.sources["bf16"] = "estimated"
        out["bf16_ms"] = ms
        return out
