"""How far autotune's per-kernel latency estimate (quantkit/accuracy/_costmodel.py) is from compiled timings.

For each model and lowering, one process: the estimate (``Meter(measure=False)``: raw kernels timed
at their shapes, nothing compiled) next to the compiled model's time (``quantkit.compile`` / Inductor
freezing; the fastest of its calls after the compiling one, the estimator the kernel timings use),
their ratio, and how long each took. Lowerings: the float
model in fp32 (bf16 too where the CPU has native BF16), static W8A8 as ``quantkit.compile`` runs it
here (oneDNN on VNNI/AMX CPUs, the reference q/dq graph elsewhere), static W8A8 with oneDNN forced, and
per-token W8A8. Models: the tests' MLP and transformer block, and the bundled all-MiniLM-L6-v2.

Run: ``python benchmarks/bench_costmodel.py [--threads 1] [--batch 8] [--seq 128] [--models mlp,block,minilm]``.
A private cache directory is used (nothing is recalled from an earlier run). On a shared machine,
run with ``--threads 1``: multi-threaded timings there wait on descheduled threads (see
``_costmodel.time_kernel``) and compiled medians suffer the same.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests.models

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.accuracy import _costmodel, _latency  # noqa: E402
from quantkit.lowering._bf16 import bf16_supported  # noqa: E402
from quantkit.pipeline._inputs import call_model  # noqa: E402
from quantkit.quantizers import QuantConfig, W8A8Quantizer  # noqa: E402


def _models(names, batch: int, seq: int):
    from tests.models import make_mlp, make_transformer

    if "mlp" in names:
        m, x = make_mlp()
        yield "MLP", m, (x,), quantkit.capture(m, (x,)), [(x,)]
    if "block" in names:
        m, x = make_transformer()
        yield "transformer block", m, (x,), quantkit.capture(m, (x,)), [(x,)]
    if "minilm" in names:
        model, tok = _hf.load_hf_model(_hf.default_model_path(), progress=False)
        sents = _hf.read_sentences(_hf.default_calibration_file())[:batch * 2]
        data = _hf.tokenize(tok, sents, seq_len=seq, batch_size=batch)
        # every batch padded to seq: the estimate and the compiled model see one static shape
        data = [{k: torch.nn.functional.pad(v, (0, seq - v.shape[1])) for k, v in b.items()} for b in data]
        gm = quantkit.capture(model.eval(), data[0], dynamic_shapes=_hf.dynamic_shapes(data[0]))
        yield f"MiniLM {batch}x{seq}", model, data[0], gm, data[:1]


def _compiled_ms(make) -> tuple[float, float]:
    """(fastest, median) ms of a compiled model's calls after the compiling one, and the seconds taken."""
    t = time.perf_counter()
    fn = make()
    with torch.no_grad():
        fn()  # compiles
    ms = _costmodel.time_call(fn, budget_s=0.5, max_calls=30)  # the estimator the kernels use: fastest call
    return ms, time.perf_counter() - t


def _row(name: str, estimate, make) -> tuple:
    t = time.perf_counter()
    e = estimate()
    te = time.perf_counter() - t
    m, tm = _compiled_ms(make)
    print(f"  {name:<28} estimate {e:9.3f} ms ({te:5.1f} s)   compiled {m:9.3f} ms ({tm:5.1f} s)   "
          f"estimate/compiled {e / m:5.2f}", flush=True)
    return e, m


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--models", default="mlp,block,minilm")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    os.environ["QUANTKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-costmodel-")
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = ", ".join(f for f in ("avx2", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
                      if caps.get(f))
    print(f"machine: {platform.processor() or platform.machine()} ({flags}), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; load {os.getloadavg()[0]:.1f}")
    line = _costmodel.cpu_support_line()
    if line:
        print(line)
    ratios = []
    for name, model, inputs, gm, calib in _models(args.models.split(","), args.batch, args.seq):
        print(name)
        static = quantkit.quantize(gm, inputs, calib, W8A8Quantizer(QuantConfig()), progress=False)
        per_token = quantkit.quantize(gm, inputs, calib, W8A8Quantizer(QuantConfig(dynamic=True,
                                                                                 granularity="per-token")),
                                      progress=False)
        est, forced = _latency.Meter(gm, inputs), _latency.Meter(gm, inputs, cpu_kernels="onednn")

        def call(mod, dtype=None):
            return lambda: call_model(mod, _latency._fresh(inputs, dtype))

        rows = [("fp32", lambda: est.floats(bf16=False)["fp32_ms"], lambda: call(_latency._FrozenFloat(model)))]
        if bf16_supported():
            rows.append(("bf16", lambda: est.floats()["bf16_ms"],
                         lambda: call(_latency._FrozenFloat(copy.deepcopy(model).bfloat16()), torch.bfloat16)))
        rows += [("static W8A8 (auto)", lambda: est.int8(static, "static"), lambda: call(quantkit.compile(static))),
                 ("static W8A8 (oneDNN forced)", lambda: forced.int8(static, "static"),
                  lambda: call(quantkit.compile(static, cpu_kernels="onednn"))),
                 ("per-token W8A8 (auto)", lambda: est.int8(per_token, "per-token"),
                  lambda: call(quantkit.compile(per_token)))]
        got = [_row(*r) for r in rows]
        ratios += [e / m for e, m in got]
        # ordering: does the estimate rank the lowerings as the compiled timings do?
        order_e = sorted(range(len(got)), key=lambda i: got[i][0])
        order_m = sorted(range(len(got)), key=lambda i: got[i][1])
        print(f"  ranking fastest first: estimate {[rows[i][0] for i in order_e]}\n"
              f"                         compiled {[rows[i][0] for i in order_m]}")
    if ratios:
        print(f"estimate/compiled over all rows: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}..{max(ratios):.2f}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
