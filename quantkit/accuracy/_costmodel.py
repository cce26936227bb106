"""A per-kernel estimate of a model's ``quantkit.compile`` latency on this CPU, without compiling it.

Why: Inductor takes tens of seconds to compile one whole model on a small CPU, and autotune only
needs to rank a handful of recipes. Their latency is mostly their GEMMs and attention, and a
recipe decides little more than which kernel each GEMM runs as. So the model enumerates the
graph's GEMMs (linear ``M x K x N``, float matmuls, SDPA), decides how each one runs after
``quantkit.compile`` here -- the same rules compile uses:

- oneDNN int8 (``onednn.qlinear_pointwise``) for a static per-tensor linear when compile picks
  oneDNN (``lowering/_onednn.exact_for_graph``: VNNI/AMX, or 7-bit activations or weights), and for a
  per-token / dynamic one under the same condition (the per-token lowering runs there only);
- else the reference graph: a float GEMM plus the quantize/dequantize arithmetic around it (and the
  int8 weight's dequantize, each call: the reference graph is compiled without freezing);
- ``quantkit::int8_sdpa_cpu`` for an SDPA on static int8 q, k, v (``lowering/_qsdpa.py``);
- float GEMMs and attention in bf16 where compile runs bf16 (``resolve_float_dtype``), else fp32;
  a fallback layer's GEMM (bf16 or int8 weight, float input) in bf16 wherever oneDNN int8 runs on a
  BF16 CPU (compile's ``float_layers_bf16``); a per-token GEMM input's quantize (with the GELU before
  it) as ``quantkit::per_token_quant_cpu`` runs it --

times each distinct raw kernel at its shape once (microseconds to milliseconds; cached per
machine by the caller), adds the elementwise rest as bytes moved over this CPU's measured copy
bandwidth, and sums. It never times bf16 where the CPU has no native BF16 (emulated bf16 is
~100x slower and says nothing): such a plan is never asked for, since compile keeps fp32 there.

The numbers estimate an idle machine (each kernel's fastest of several calls). They rank; they do
not predict: measured against compiled models on this repository's 2-core AVX2 machine (1 thread,
under load, ``benchmarks/bench_costmodel.py``, issue 28) the estimates were 0.4-0.9x the compiled
times, and ranked fp32 / static reference / forced oneDNN / per-token reference as the compiled
models did on the tests' MLP and transformer block (MiniLM 8x128: the same except a near tie).
"""

from __future__ import annotations

import functools
import math
import operator
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from quantkit.kernels import _per_token_quant_cpu as ptq

from .._graph import DEQUANTIZE_OPS, QUANTIZE_OPS
from ..lowering._bf16 import bf16_float_layer, bf16_supported, resolve_float_dtype
from ..lowering._onednn import exact_for_graph, exact_on_this_cpu
from ..lowering._qsdpa import SHAPE_OPS as _QSDPA_SHAPE_OPS, kernel_status as qsdpa_status
from ..pipeline._inputs import as_args_kwargs

__all__ = ["Kernel", "Plan", "plan", "estimate_ms", "cpu_support_line", "time_call", "time_kernel", "kernel_runner", "machine_runner", "node_shapes",
           "BANDWIDTH", "BANDWIDTH_BYTES", "OP_OVERHEAD", "FUSED_FRACTION"]

aten = torch.ops.aten
_Q = torch.ops.quantized_decomposed
# how a dequantize names its activation's granularity
_PER_TOKEN_DQ = {_Q.dequantize_per_token.default}
_DYNAMIC_DQ = {_Q.dequantize_per_tensor.tensor}
_LINEAR = {aten.linear.default}
_MATMUL = {aten.matmul.default, aten.bmm.default, aten.mm.default}
_SDPA = {aten.scaled_dot_product_attention.default}
# ops that move no data once compiled (views, shape arithmetic, tuple access)
_FREE = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.t.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.unbind.int, aten.alias.default, aten.detach.default, aten.sym_size.int, aten.dropout.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.contiguous.default, aten.view_as.default,
    operator.getitem, operator.mul, operator.add, operator.floordiv, operator.sub,
}
# names of the machine measurements (the same cache as the kernels)
BANDWIDTH, OP_OVERHEAD = "bandwidth", "op_overhead"
# the bandwidth timing reads and writes a 16 MiB fp32 tensor: past the L2/L3 of small CPUs
_BANDWIDTH_ELEMENTS = 1 << 22
BANDWIDTH_BYTES = 2 * 4 * _BANDWIDTH_ELEMENTS
# Inductor fuses chains of elementwise ops (q/dq arithmetic, GELU, adds, LayerNorm's pointwise
# part) into one loop each: of the bytes the unfused ops would move, about this fraction is
# moved. A round guess, not a fit: on MiniLM 8x128 the whole elementwise term is 1-2% of the
# estimate (GEMMs and SDPA are the rest), so it moves no ranking there (issue 28)
FUSED_FRACTION = 0.5


@dataclass(frozen=True)
class Kernel:
    """One raw kernel at one shape: ``op`` is ``linear`` (shape ``(M, K, N)``), ``qlinear``
    (oneDNN int8, ``(M, K, N)``), ``matmul`` (``(a shape, b shape)``), ``sdpa`` (``(q, k, v
    shapes, mask shape or ())``), ``qsdpa`` (``quantkit::int8_sdpa_cpu``, the same shape) or
    ``pertoken_qdq`` (the reference per-token choose/quantize/dequantize of an ``(M, K)`` activation),
    ``pertoken_quant`` (the per-token int8 quantize of an ``(M, K)`` activation before a oneDNN GEMM, with the
    activation step before it or ``""``: ``(M, K, step)``); ``dtype`` what it computes in (``fp32``, ``bf16``; ``qlinear``'s
    is its output's)."""

    op: str
    dtype: str
    shape: tuple

    def key(self) -> str:
        return f"kernel|{self.op}|{self.dtype}|{self.shape}".replace(" ", "")


@dataclass(frozen=True)
class Plan:
    """How a graph runs after ``quantkit.compile`` here: its distinct kernels with how many times
    each runs, the bytes its elementwise rest moves (before fusion), its op count, and the
    compile target (``onednn``, ``reference`` or ``float``) and float dtype it assumes."""

    kernels: tuple[tuple[Kernel, int], ...]
    elementwise_bytes: int
    elementwise_ops: int
    target: str
    float_dtype: str

    def gemms(self) -> Counter:
        """How many kernels of each ``(op, dtype)`` the plan runs (for tests and the report)."""
        out: Counter = Counter()
        for k, n in self.kernels:
            out[(k.op, k.dtype)] += n
        return out


def cpu_support_line() -> str | None:
    """One line saying why this CPU does not get the fast CPU paths, or None where it does.

    The fast paths need VNNI or AMX (exact int32 accumulation for oneDNN's int8 GEMMs) and native
    BF16 (the float parts and fallback layers in bf16); for the report of autotune and eval."""
    vnni, bf16 = exact_on_this_cpu(), bf16_supported()
    if vnni and bf16:
        return None
    missing = []
    if not vnni:
        missing.append("no VNNI/AMX: oneDNN int8 GEMMs would saturate their int16 sums with 8-bit weights, "
                       "so 8-bit int8 layers run the reference q/dq graph (fp32 GEMMs); the -w7 recipes' "
                       "7-bit weights run oneDNN exactly")
    if not bf16:
        missing.append("no native BF16 (AVX-512 BF16/AMX): float layers and attention stay fp32")
    return "this CPU gets no fast int8/bf16 paths: " + "; ".join(missing)


# --- shapes --------------------------------------------------------------------------------------

class _Shapes(torch.fx.Interpreter):
    """Runs a graph once on real inputs, recording each node's output shape and dtype."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def run_node(self, n: Node):
        value = super().run_node(n)
        if isinstance(value, torch.Tensor):
            self.out[n.name] = (tuple(value.shape), value.dtype)
        return value


def node_shapes(gm: GraphModule, inputs: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor-valued node's output ``(shape, dtype)`` when ``gm`` runs on ``inputs`` (one
    eager call of the graph; it is not modified)."""
    from torch.fx._pytree import tree_flatten_spec

    args, kwargs = as_args_kwargs(inputs)
    info = getattr(gm.graph._codegen, "pytree_info", None)
    flat = tree_flatten_spec((args, kwargs), info.in_spec) if info is not None and info.in_spec is not None \
        else list(args) + list(kwargs.values())
    rec = _Shapes(gm)
    with torch.no_grad():
        rec.run(*flat)
    return rec.out


# --- the plan -----------------------------------------------------------------------------------

def _has_qdq(gm: GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in DEQUANTIZE_OPS for n in gm.graph.nodes)


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def _dt(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _per_token_chain(dq: Node) -> set[str]:
    """The names of a per-token dequantize, its quantize and the choose_qparams (and getitems) behind it."""
    names = {dq.name}
    q = dq.args[0]
    if isinstance(q, Node):
        names.add(q.name)
        for a in q.args[1:3]:
            if isinstance(a, Node):
                names.add(a.name)
                if a.target is operator.getitem and isinstance(a.args[0], Node):
                    names.add(a.args[0].name)
    return names


# the activations a per-token quantize's prologue applies in quantkit::per_token_quant_cpu
_ACTIVATION_STEPS = {aten.gelu.default: "gelu", aten.relu.default: "relu"}
# ops between an activation and the quantize that cost nothing beside it (the kernel's column factor,
# bf16 round trips, views)
_PASS_THROUGH = {aten.mul.Tensor, aten.div.Tensor, aten._to_copy.default} | _FREE


def _activation_before(x) -> str:
    """The activation step (``"gelu"``, ``"gelu_tanh"``, ``"relu"``) a per-token quantize of ``x``
    applies first in ``quantkit::per_token_quant_cpu``, or ``""`` (a LayerNorm, an attention output)."""
    for _ in range(8):
        if not isinstance(x, Node) or x.op != "call_function":
            return ""
        step = _ACTIVATION_STEPS.get(x.target)
        if step == "gelu":
            approx = x.kwargs.get("approximate", x.args[1] if len(x.args) > 1 else "none")
            return "gelu_tanh" if approx == "tanh" else "gelu"
        if step:
            return step
        if x.target not in _PASS_THROUGH or not x.args:
            return ""
        x = x.args[0]
    return ""


def _int8_attention(sdpa: Node) -> bool:
    """Whether compile lowers this SDPA to ``quantkit::int8_sdpa_cpu`` (lowering/_qsdpa.py): static
    per-tensor dequantized q, k and v (through head-split views), and the kernel builds here."""
    def static_dq(a) -> bool:
        while isinstance(a, Node) and a.target in _QSDPA_SHAPE_OPS:
            a = a.args[0]
        return isinstance(a, Node) and a.target is _Q.dequantize_per_tensor.default
    if sdpa.kwargs.get("dropout_p") or sdpa.kwargs.get("enable_gqa") or not all(map(static_dq, sdpa.args[:3])):
        return False
    return qsdpa_status().available


def plan(gm: GraphModule, inputs: Any, *, cpu_kernels: str = "auto", float_dtype: str = "auto",
         shapes: dict | None = None) -> Plan:
    """How ``gm`` (a float graph or a ``quantkit.convert`` q/dq graph) runs after ``quantkit.compile``
    on this CPU, at ``inputs``' shapes (``shapes``: their :func:`node_shapes`, when known).

    ``cpu_kernels`` / ``float_dtype`` as ``quantkit.compile``'s; for a float graph ``float_dtype``
    ``"bf16"`` plans the model cast to bf16 (``"auto"``: fp32). ``gm`` is not modified.
    """
    shapes = node_shapes(gm, inputs) if shapes is None else shapes
    quantized = _has_qdq(gm)
    if not quantized:
        target, dtype = "float", (torch.bfloat16 if float_dtype in ("bf16", torch.bfloat16) else torch.float32)
    else:
        onednn = cpu_kernels == "onednn" or (cpu_kernels == "auto" and exact_for_graph(gm))
        target = "onednn" if onednn else "reference"
        dtype = resolve_float_dtype(float_dtype, onednn=onednn, graph=gm)
    fsize = 2 if dtype == torch.bfloat16 else 4
    # per-token / dynamic int8 GEMMs run oneDNN wherever the static ones do (exact_for_graph: VNNI/AMX,
    # or 7-bit weights on AVX2), or where cpu_kernels="onednn" forces it
    dyn_int8 = target == "onednn"
    # the conditions of compile's float_layers_bf16 pass (lowering/_bf16.lower_float_layers_bf16)
    float_layers_bf16 = target == "onednn" and bf16_supported() and float_dtype not in ("fp32", torch.float32)

    def shape(a) -> tuple[int, ...] | None:
        if isinstance(a, Node) and a.name in shapes:
            return shapes[a.name][0]
        return None

    kernels: Counter = Counter()
    absorbed: set[str] = set()  # q/dq nodes an int8 kernel takes in (no elementwise pass of their own)
    quantized_inputs: set = set()  # the quantize nodes of dynamic activations already counted
    extra = 0  # bytes of q/dq work the classification adds
    extra_ops = 0  # and its elementwise ops (a fallback layer's bf16 casts)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _LINEAR:
            x, w = n.args[0], n.args[1]
            xs, ws = shape(x), shape(w)
            if xs is None or ws is None:
                continue
            m, k, nn = _numel(xs[:-1]), xs[-1], ws[0]
            x_dq = isinstance(x, Node) and x.target in DEQUANTIZE_OPS
            w_dq = isinstance(w, Node) and w.target in DEQUANTIZE_OPS
            dynamic = x_dq and (x.target in _PER_TOKEN_DQ or x.target in _DYNAMIC_DQ)
            if x_dq and w_dq and target == "onednn" and (not dynamic or dyn_int8):
                kernels[Kernel("qlinear", _dt(dtype), (m, k, nn))] += 1
                absorbed.update({x.name, w.name})
                if dynamic:
                    extra += m * nn * 2 * fsize  # the per-token (or tensor) scale multiplies the GEMM's output
                    q = x.args[0]
                    if q not in quantized_inputs:  # siblings reading one quantize (q/k/v) share it
                        quantized_inputs.add(q)
                        if x.target in _PER_TOKEN_DQ and isinstance(q, Node) and q.args:
                            # the row amax + quantize (with a GELU or ReLU before it, where one feeds it):
                            # timed as the kernel runs it, not as bytes (the GELU's erf is compute-bound:
                            # 5.3 ms of 4096x1536 on the AMX Xeon, ~6x its bytes' time; issue 28)
                            kernels[Kernel("pertoken_quant", "fp32", (m, k, _activation_before(q.args[0])))] += 1
                            absorbed.update(_per_token_chain(x) - {x.name})
                        else:  # per-tensor: the amax and the quantize read x
                            extra += m * k * (2 * fsize + 1)
            else:
                # a fallback layer with a bf16 or int8 weight runs bf16 where compile's float_layers_bf16
                # pass runs (oneDNN int8 on a BF16 CPU, float32 not asked for)
                fallback_bf16 = float_layers_bf16 and not x_dq and bf16_float_layer(n)
                kernels[Kernel("linear", "bf16" if fallback_bf16 else _dt(dtype), (m, k, nn))] += 1
                if fallback_bf16 and dtype == torch.float32:  # its input cast to bf16, its output back
                    extra += m * k * (4 + 2) + m * nn * (2 + 4)
                    extra_ops += 2
                if x_dq and x.target in _PER_TOKEN_DQ:
                    # the reference per-token chain (row amax, scales, quantize, dequantize) is far slower
                    # compiled than its bytes say (measured, benchmarks/bench_costmodel.py): timed as it runs
                    kernels[Kernel("pertoken_qdq", "fp32", (m, k))] += 1
                    absorbed.update(_per_token_chain(x))
                if w_dq:
                    absorbed.add(w.name)
                    if target != "onednn":  # dequantized each call (no freezing): int8 read, float written and read
                        extra += k * nn * (1 + 2 * fsize)
        elif n.target in _MATMUL:
            a, b = shape(n.args[0]), shape(n.args[1])
            if a is not None and b is not None:
                kernels[Kernel("matmul", _dt(dtype), (a, b))] += 1
        elif n.target in _SDPA:
            q, k, v = (shape(a) for a in n.args[:3])
            mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            if None in (q, k, v):
                continue
            if quantized and cpu_kernels != "reference" and _int8_attention(n):
                kernels[Kernel("qsdpa", "fp32", (q, k, v, shape(mask) or ()))] += 1
            else:
                kernels[Kernel("sdpa", _dt(dtype), (q, k, v, shape(mask) or ()))] += 1
    moved, ops = extra, extra_ops
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target in _FREE or n.name in absorbed or n.name not in shapes:
            continue
        if n.target in _LINEAR or n.target in _MATMUL or n.target in _SDPA:
            continue
        if n.target in DEQUANTIZE_OPS and isinstance(n.args[0], Node) and n.args[0].op == "get_attr":
            if target == "onednn":
                continue  # a frozen weight's dequantize is folded into a constant
        out_shape, out_dtype = shapes[n.name]
        out_size = 1 if out_dtype in (torch.int8, torch.uint8) else (fsize if out_dtype.is_floating_point else 8)
        in_size = 1 if n.target in DEQUANTIZE_OPS else fsize
        moved += _numel(out_shape) * (in_size + out_size)
        ops += 1
    return Plan(tuple(sorted(kernels.items(), key=lambda kv: kv[0].key())), moved, ops, target, _dt(dtype))


# --- timing the kernels -----------------------------------------------------------------------

def time_call(fn: Callable[[], Any], *, budget_s: float = 0.05, max_calls: int = 50) -> float:
    """The fastest of several calls of ``fn``, in ms, after two warm-up calls: enough calls to fill
    about ``budget_s`` seconds (at least 3, at most ``max_calls``). The fastest, not the median:
    an estimate of the idle machine, least moved by other load."""
    with torch.no_grad():
        fn()
        fn()
        t = time.perf_counter()
        fn()
        first = time.perf_counter() - t
        times = [first]
        for _ in range(max(3, min(max_calls, int(budget_s / max(first, 1e-6))))):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return round(min(times) * 1e3, 6)


# a kernel of at least this many ms on one thread that ``threads`` threads run no faster than
# PARALLEL_DOUBT times that is timed again with them, after RETRY_PAUSE_S, up to PARALLEL_RETRIES times
PARALLEL_DOUBT, PARALLEL_RETRIES, RETRY_PAUSE_S, _RETRY_MIN_MS = 0.75, 2, 0.1, 0.1


def time_kernel(fn: Callable[[], Any], threads: int) -> float:
    """:func:`time_call` of ``fn`` with ``threads`` threads, or with one where that is faster.

    More threads are never slower on an idle CPU, but on a loaded one each parallel region waits
    for a descheduled thread: measured here (2 cores, load 8), a 512x256x64 linear took 0.21 ms at
    best and 28 ms in the median with 2 threads, 0.24 ms steadily with 1. The one-thread time caps
    what load does to the estimate.

    A shared machine also takes a core away for a moment now and then: on a 2-vCPU Zen 4 VM, idle,
    oneDNN's int8 GEMMs timed in one such moment came out at their one-thread time (1.55 against
    0.78 ms), the search then saw the int8 model no faster than bf16 and chose another recipe. So
    a kernel that the threads run no faster than ``PARALLEL_DOUBT`` times its one-thread time is
    timed again with them after a pause (up to ``PARALLEL_RETRIES`` times; the fastest counts):
    one that truly does not parallelise costs those retries, a disturbed one gets its real time."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        best = time_call(fn)
        if threads > 1:
            torch.set_num_threads(1)
            single = time_call(fn)
            for _ in range(PARALLEL_RETRIES):
                if single < _RETRY_MIN_MS or best < PARALLEL_DOUBT * single:
                    break
                time.sleep(RETRY_PAUSE_S)
                torch.set_num_threads(threads)
                best = min(best, time_call(fn))
            best = min(best, single)
    finally:
        torch.set_num_threads(before)
    return best


def kernel_runner(kernel: Kernel) -> Callable[[], Any]:
    """A call of ``kernel`` on random data of its shape (built once; the call is what is timed)."""
    dtype = torch.bfloat16 if kernel.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    if kernel.op == "linear":
        m, k, n = kernel.shape
        x, w, b = (torch.randn(s, generator=g).to(dtype) for s in ((m, k), (n, k), (n,)))
        return lambda: F.linear(x, w, b)
    if kernel.op == "qlinear":
        m, k, n = kernel.shape
        x = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        packed = torch.ops.onednn.qlinear_prepack(w, [m, k])
        scales, zps, bias = torch.rand(n, generator=g) * 0.01, torch.zeros(n, dtype=torch.int32), torch.randn(n)
        return lambda: torch.ops.onednn.qlinear_pointwise(x, 0.02, 128, packed, scales, zps, bias, 1.0, 0, dtype,
                                                          "none", [], "")
    if kernel.op == "matmul":
        a, b = (torch.randn(s, generator=g).to(dtype) for s in kernel.shape)
        return lambda: torch.matmul(a, b)
    if kernel.op == "pertoken_qdq":
        x = torch.randn(kernel.shape, generator=g)

        def run():
            s, z = _Q.choose_qparams_per_token(x, torch.int8)
            q = _Q.quantize_per_token(x, s, z, -128, 127, torch.int8)
            return _Q.dequantize_per_token(q, s, z, -128, 127, torch.int8, torch.float32)

        return run
    if kernel.op == "pertoken_quant":
        m, k, act = kernel.shape
        x = torch.randn((m, k), generator=g)
        if ptq.available():  # what compile runs for a per-token GEMM's input (lowering/_per_token_fuse.py)
            steps = ["mul_row", "add_col", act] if act else []
            row, cols = (torch.rand(m, 1, generator=g), [torch.randn(k, generator=g)]) if act else (None, [])
            return lambda: ptq.per_token_quant_cpu(x, steps, row_scale=row, cols=cols)
        fn = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}.get(act)

        def run():  # Inductor's loop instead: the same arithmetic, one eager op at a time (an upper bound)
            v = fn(x) if fn else x
            s = v.abs().amax(-1, keepdim=True).clamp_min(1e-5) / 127
            return (v * s.reciprocal()).round().clamp(-128, 127).add(128).to(torch.uint8), s

        return run
    if kernel.op == "qsdpa":
        q, k, v = (torch.randint(-128, 128, s, dtype=torch.int8, generator=g) for s in kernel.shape[:3])
        mask = torch.zeros(kernel.shape[3]) if kernel.shape[3] else None
        return lambda: torch.ops.quantkit.int8_sdpa_cpu(q, k, v, mask, 0.05, 0, 0.05, 0, 0.05, 0, None)
    if kernel.op == "sdpa":
        q, k, v = (torch.randn(s, generator=g).to(dtype) for s in kernel.shape[:3])
        mask = torch.zeros(kernel.shape[3], dtype=dtype) if kernel.shape[3] else None
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    raise ValueError(f"unknown kernel op {kernel.op!r}")


def machine_runner(name: str) -> Callable[[], Any]:
    """A call timing one machine constant: ``bandwidth`` (a 16 MiB fp32 tensor scaled: it moves
    :data:`BANDWIDTH_BYTES`) or ``op_overhead`` (one tiny op: the cost of a kernel call)."""
    if name == BANDWIDTH:
        a, b = torch.ones(_BANDWIDTH_ELEMENTS), torch.empty(_BANDWIDTH_ELEMENTS)
        return lambda: torch.mul(a, 1.0001, out=b)
    if name == OP_OVERHEAD:
        a = torch.ones(8)
        return lambda: torch.add(a, 1.0)
    raise ValueError(f"unknown machine constant {name!r}")


def estimate_ms(p: Plan, kernel_ms: Callable[[Kernel], float], bytes_per_ms: float, op_ms: float) -> float:
    """The plan's latency: its kernels' times, the elementwise bytes (``FUSED_FRACTION`` of them
    after fusion) over the bandwidth, and one op's overhead per kernel and per fused loop."""
    gemm = sum(kernel_ms(k) * n for k, n in p.kernels)
    loops = sum(n for _, n in p.kernels) + p.elementwise_ops * FUSED_FRACTION
    return gemm + FUSED_FRACTION * p.elementwise_bytes / bytes_per_ms + loops * op_ms

