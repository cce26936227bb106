"""CPU model benchmark for issue 4: float eager / float compiled / torchao PT2E int8 / quantkit int8.

Issue 17 adds bf16 compiled (the float model in bf16, Inductor freezing: a CPU user's real
alternative) and a ratio column against it; quantkit's ``auto`` int8 runs its float ops in bf16
on CPUs with AVX-512 BF16 / AMX where the model's attention is large enough to gain (the rule in
``quantkit/lowering/_bf16.py``; a note row says what it chose), and the "float ops fp32" / "float
ops bf16" rows force each choice on the same int8 model.

Every variant of a model is timed in the same process, interleaved round by round, and
reported as the median latency and as ratios to fp32 eager, with the SQNR of each int8
variant against the float output (int8 paths are only worth their speed if they are right;
for MiniLM also the mean cosine of the sentence embeddings). MiniLM is calibrated on the
bundled sentences (``quantkit._hf``), the other models on their benchmark input.

Every call gets a fresh copy of the inputs: torchao's compiled transformer block writes its
output into its input tensor (the residual add is done in place on the graph input), which
silently fed every later variant a different input (measured: quantkit's block at 13 dB and
1.8 ms after torchao's run, 49.8 dB alone). A variant that mutates its inputs is noted.

    python benchmarks/bench_models.py [--models mlp,block,minilm] [--reps N] [--threads N] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit._qmath import sqnr  # noqa: E402
from quantkit.lowering._onednn import exact_on_this_cpu  # noqa: E402
from quantkit.quantizers import QuantConfig, W8A8Quantizer  # noqa: E402
from tests.models import TransformerBlock  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp():
    torch.manual_seed(0)
    x = (torch.randn(256, 1024),)
    return MLP().eval(), x, [x]


def _block():
    torch.manual_seed(0)
    x = (torch.randn(32, 16, 64),)
    return TransformerBlock(d=64).eval(), x, [x]


def _minilm(calib_batches: int = 4):
    m, tok = _hf.load_hf_model(_hf.default_model_path())
    m.config.return_dict = False
    sents = _hf.read_sentences(_hf.default_calibration_file())
    batches = [(b["input_ids"], b["attention_mask"]) for b in _hf.tokenize(tok, sents, seq_len=128, batch_size=32)]
    batches = [b for b in batches if len(b[0]) == 32]
    # time and score on a batch the calibration did not see
    return SentenceEmbedder(m).eval(), batches[-1], batches[:calib_batches]


class SentenceEmbedder(torch.nn.Module):
    """(input_ids, attention_mask) -> mean-pooled embeddings, as a tensor (torch.export friendly)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        return _hf.embed(self.encoder(input_ids, attention_mask), attention_mask)


MODELS = {"mlp": _mlp, "block": _block, "minilm": _minilm}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@functools.lru_cache(maxsize=None)
def _torchao_lift_up():
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401

    # importing the quantizer installs a global pre-grad pass; keep it to torchao's own runs
    lift_up = torch._inductor.config.pre_grad_custom_pass
    torch._inductor.config.pre_grad_custom_pass = None
    return lift_up


def _torchao(model, inputs, calib):
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    lift_up = _torchao_lift_up()
    gm = torch.export.export(model, inputs).module()
    q = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())
    p = prepare_pt2e(gm, q)
    for b in calib:
        p(*b)
    compiled = torch.compile(convert_pt2e(p))

    def run(*args):
        with torch._inductor.config.patch(freezing=True, pre_grad_custom_pass=lift_up), torch.no_grad():
            return compiled(*args)

    return run


def _quantkit(model, inputs, calib, cpu_kernels, activation="affine-uint8", ops=None, float_dtype="auto"):
    cfg = QuantConfig(activation=activation) if ops is None else QuantConfig(activation=activation, ops=ops)
    p = quantkit.prepare(quantkit.capture(model, inputs), W8A8Quantizer(cfg))
    quantkit.calibrate(p, calib, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantkit.compile(quantkit.convert(p), cpu_kernels=cpu_kernels, float_dtype=float_dtype)


def _bf16(model):
    """The float model in bf16, compiled with Inductor freezing (a CPU user's real alternative)."""
    compiled = torch.compile(copy.deepcopy(model).to(torch.bfloat16))

    def run(*args):
        args = tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return compiled(*args)

    return run


def _where(e: BaseException) -> str:
    """' inside torchao (file:line function)' when the innermost frame of ``e`` is torchao's code."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or "/torchao/" not in tb.tb_frame.f_code.co_filename:
        return ""
    path = tb.tb_frame.f_code.co_filename.split("/torchao/", 1)[1]
    return f" inside torchao ({path}:{tb.tb_lineno} {tb.tb_frame.f_code.co_name}), not this benchmark"


def _fresh(inputs):
    return tuple(a.clone() for a in inputs)


def bench(name: str, reps: int) -> list[str]:
    model, inputs, calib = MODELS[name]()
    variants, notes = {}, []
    variants["fp32 eager"] = model
    variants["fp32 compiled"] = torch.compile(copy.deepcopy(model))
    # each int8 flow gets its own copy of the model: export/prepare must not leak between them
    linear = frozenset({"linear"})
    builds = [
        ("bf16 compiled", lambda: _bf16(model)),
        ("torchao PT2E int8 compiled", lambda: _torchao(copy.deepcopy(model), inputs, calib)),
        ("quantkit int8 compiled (auto)", lambda: _quantkit(copy.deepcopy(model), inputs, calib, "auto")),
        ("quantkit int8 compiled (auto, float ops fp32)",
         lambda: _quantkit(copy.deepcopy(model), inputs, calib, "auto", float_dtype="fp32")),
        ("quantkit int8 compiled (auto, float ops bf16)",
         lambda: _quantkit(copy.deepcopy(model), inputs, calib, "auto", float_dtype="bf16")),
        ("quantkit int8 compiled (7-bit act, auto)",
         lambda: _quantkit(copy.deepcopy(model), inputs, calib, "auto", "affine-uint7")),
    ]
    if exact_on_this_cpu():
        # with VNNI/AMX "auto" already takes oneDNN: "onednn forced" compiles the same graph (the
        # 120.9 vs 102.7 ms between them on MiniLM in an earlier run was run-to-run spread)
        notes.append("onednn forced: same graph as auto on this CPU (VNNI/AMX), not timed")
    else:
        builds.append(("quantkit int8 compiled (onednn forced)",
                       lambda: _quantkit(copy.deepcopy(model), inputs, calib, "onednn")))
    if name in ("minilm", "block"):
        # issue 28: static int8 with q, k, v quantized and the SDPA on quantkit::int8_sdpa_cpu
        with_attention = frozenset(QuantConfig().ops | {"attention"})
        builds.append(("quantkit int8 compiled (auto, int8 attention)",
                       lambda: _quantkit(copy.deepcopy(model), inputs, calib, "auto", ops=with_attention)))
    if name == "block":
        # torchao's X86InductorQuantizer leaves the attention matmuls float (Inductor then
        # matches them into one SDPA kernel); the same coverage in quantkit:
        builds += [
            ("quantkit int8 compiled (linear only, onednn forced, 8-bit)",
             lambda: _quantkit(copy.deepcopy(model), inputs, calib, "onednn", ops=linear)),
            ("quantkit int8 compiled (linear only, 7-bit act, auto)",
             lambda: _quantkit(copy.deepcopy(model), inputs, calib, "auto", "affine-uint7", ops=linear)),
        ]
    for label, build in builds:
        try:
            variants[label] = build()
        except Exception as e:  # record and go on: e.g. torchao's quantizer on MiniLM
            notes.append(f"{label}: failed{_where(e)}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        lowering = getattr(getattr(variants[label], "_orig_mod", None), "meta", {}).get("quantkit_lowering")
        if lowering is not None and "(auto)" in label:
            counts = ", ".join(f"{k} {v}" for k, v in lowering.items() if v and not k.startswith("to_"))
            notes.append(f"{label}: float ops in {'bf16' if lowering.get('to_bf16') else 'fp32'}"
                         + (f"; {counts}" if counts else ""))
    with torch.no_grad():
        ref = _first(model(*_fresh(inputs))).float()
        quality, times = {}, {k: [] for k in variants}
        for k, f in variants.items():  # warm up: compiles happen here
            args = _fresh(inputs)
            out = _first(f(*args)).float()
            quality[k] = f"{sqnr(ref, out):.1f}"
            if name == "minilm":
                quality[k] += f" / cos {_hf.cosine(ref, out).mean():.4f}"
            if any(not torch.equal(a, b) for a, b in zip(args, inputs)):
                notes.append(f"{k}: writes into its input tensors (each call gets a fresh copy)")
        order = list(variants)
        for r in range(reps):
            # a new order every round: a fixed order gave every other variant a constant penalty
            # (block, 2 threads: 9 ms at even positions vs 2 ms at odd ones for the same graph)
            random.Random(r).shuffle(order)
            for k in order:
                f = variants[k]
                args = _fresh(inputs)
                t = time.perf_counter()
                f(*args)
                times[k].append(time.perf_counter() - t)
    base = statistics.median(times["fp32 eager"])
    bf16 = statistics.median(times["bf16 compiled"]) if "bf16 compiled" in times else math.nan
    rows = [f"| {name} | {k} | {statistics.median(v) * 1e3:.2f} | {base / statistics.median(v):.2f}x | "
            f"{bf16 / statistics.median(v):.2f}x | {quality[k]} |" for k, v in times.items()]
    return rows + [f"| {name} | note | {n} | | | |" for n in notes]


def profile(name: str, reps: int = 3) -> None:
    """torch.profiler tables (top ops by self CPU time) of fp32 eager and quantkit's default int8."""
    from torch.profiler import profile as torch_profile

    model, inputs, calib = MODELS[name]()
    variants = {"fp32 eager": model,
                "quantkit int8 compiled (auto)": _quantkit(copy.deepcopy(model), inputs, calib, "auto")}
    with torch.no_grad():
        for label, f in variants.items():
            f(*_fresh(inputs))  # compile / warm up outside the profile
            with torch_profile() as prof:
                for _ in range(reps):
                    f(*_fresh(inputs))
            print(f"\n{name}, {label}: {reps} calls")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,block,minilm")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed rounds per model (default: mlp 20, block 300, minilm 5)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing, print torch.profiler tables of fp32 eager and quantkit int8 (auto)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) first (on a shared machine 1 thread keeps ratios stable)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        for name in args.models.split(","):
            profile(name)
        return
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    print(f"machine: {model_name}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| model | variant | median ms | speed vs fp32 eager | speed vs bf16 compiled | "
          "SQNR vs float (dB) [/ embedding cosine] |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        reps = args.reps or {"mlp": 20, "block": 300, "minilm": 5}[name]
        for row in bench(name, reps):
            print(row, flush=True)


if __name__ == "__main__":
    main()
