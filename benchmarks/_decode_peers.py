"""The engines bench_decode.py times: transformers (eager / torch.compile), torchao int4, quantkit, llama.cpp.

Every engine answers ``run(prompt, steps) -> (prefill_s, [step_s, ...])``: one prefill call over
``prompt [1, L]`` (which yields the first new token), then ``steps`` greedy decode steps, each timed
on its own (the step's forward and its argmax, what a user waits for per token). An engine whose
package is missing raises :class:`Missing` with one line when it is built, and the bench skips it.

Models come from HF folders on disk (SmolLM2 from ``tests/_smollm2``, the random 1B-shape Llama
written once by :func:`llama_1b_dir`), so every engine reads the same weights; llama.cpp reads a
GGUF made from the same folder by llama.cpp's own converter (:func:`gguf_files`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

__all__ = ["Missing", "cache_dir", "llama_1b_dir", "gguf_files", "ENGINES", "build"]

LLAMA_CPP_VERSION = "0.3.36"


class Missing(RuntimeError):
    """An engine cannot be built here (a package is missing); the message is one line."""


def cache_dir() -> Path:
    """``$QUANTKIT_BENCH_CACHE`` or ``~/.cache/quantkit-bench``: the 1B folder, llama.cpp's converter, GGUFs."""
    env = os.environ.get("QUANTKIT_BENCH_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit-bench"
    root.mkdir(parents=True, exist_ok=True)
    return root


# Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, tied
# embeddings); the vocabulary is SmolLM2's 49,152 (not 128,256), so SmolLM2's tokenizer serves
# llama.cpp's converter and the embedding costs 100M parameters instead of 263M.
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True,
                max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5)


def llama_1b_dir(tokenizer_dir: Path, seed: int = 0) -> Path:
    """An HF folder with a random-weight Llama of 1B shapes (seeded; written once, atomically)."""
    import transformers

    out = cache_dir() / f"llama-1b-shape-seed{seed}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = transformers.LlamaConfig(**LLAMA_1B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    del model
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _converter() -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` from the llama-cpp-python source package (fetched once)."""
    src = cache_dir() / "src"
    root = src / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    script = root / "convert_hf_to_gguf.py"
    if script.is_file() and (root / "conversion").is_dir() and (root / "gguf-py").is_dir():
        return script
    src.mkdir(parents=True, exist_ok=True)
    sdist = src / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not sdist.is_file():
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(src)], capture_output=True, text=True)
        if r.returncode != 0 or not sdist.is_file():
            raise Missing(f"could not fetch llama-cpp-python=={LLAMA_CPP_VERSION}'s source package for its GGUF "
                          f"converter: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as t:
        members = [m for m in t.getmembers() if m.name.startswith((prefix + "gguf-py/", prefix + "conversion/"))
                   or m.name == prefix + "convert_hf_to_gguf.py"]
        t.extractall(src, members=members, filter="data")
    return script


def gguf_files(hf_dir: Path, kinds=("Q4_0", "Q8_0")) -> dict[str, Path]:
    """GGUFs of ``hf_dir``: llama.cpp's converter to F16, then ``llama_model_quantize`` to each kind (cached)."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise Missing(f"llama-cpp-python is not installed ({exc}): pip install llama-cpp-python=={LLAMA_CPP_VERSION}")
    out = cache_dir() / "gguf" / hf_dir.name
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "model-F16.gguf"
    files = {k: out / f"model-{k}.gguf" for k in kinds}
    if all(p.is_file() for p in files.values()):
        return files
    if not f16.is_file():
        tmp = f16.with_suffix(".tmp")
        r = subprocess.run([sys.executable, str(_converter()), str(hf_dir), "--outtype", "f16", "--outfile", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise Missing(f"llama.cpp's convert_hf_to_gguf.py failed on {hf_dir.name}: {tail}")
        os.replace(tmp, f16)
    ftypes = {"Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    for kind, path in files.items():
        if path.is_file():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftypes[kind]
        params.nthread = 2
        tmp = path.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise Missing(f"llama_model_quantize to {kind} failed (rc={rc})")
        os.replace(tmp, path)
    return files


# ---------------------------------------------------------------- engines


class _TorchEngine:
    """A ``step(ids, positions) -> logits`` callable timed as prefill + greedy decode steps."""

    def __init__(self, forward, reset=None):
        self.forward, self.reset = forward, reset

    @torch.no_grad()
    def run(self, prompt: torch.Tensor, steps: int) -> tuple[float, list[float]]:
        if self.reset is not None:
            self.reset()
        length = prompt.shape[1]
        ids = prompt.clone()
        positions = torch.arange(length)
        torch._dynamo.mark_dynamic(ids, 1)  # one prefill graph for every context (compiled rows)
        torch._dynamo.mark_dynamic(positions, 0)
        t0 = time.perf_counter()
        token = self.forward(ids, positions)[:, -1].argmax(-1)
        prefill = time.perf_counter() - t0
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            token = self.forward(token.reshape(1, 1).clone(), torch.tensor([length + i]))[:, -1].argmax(-1)
            times.append(time.perf_counter() - t0)
        return prefill, times


class _HFStatic(torch.nn.Module):
    """An HF causal LM over its own ``StaticCache``: ``forward(ids, cache_position) -> last logits``."""

    def __init__(self, model, max_cache_len: int):
        super().__init__()
        import transformers

        self.model = model
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)

    def forward(self, ids, cache_position):
        # logits of the last position only, as transformers' generate asks in prefill
        return self.model(input_ids=ids, cache_position=cache_position, cache=self.cache,
                          use_cache=True, logits_to_keep=1).logits


def _hf_model(folder: Path, dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def _hf(folder, max_cache_len, dtype, compiled, shared):
    key = ("hf", dtype)
    if key not in shared:
        shared[key] = _hf_model(folder, dtype)
    wrapper = _HFStatic(shared[key], max_cache_len)
    fwd = torch.compile(wrapper) if compiled else wrapper
    return _TorchEngine(fwd, wrapper.cache.reset)


def _torchao_int4(folder, max_cache_len, shared, group_size=64):
    try:
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import quantize_
    except ImportError as exc:
        raise Missing(f"torchao's CPU int4 (PrototypeInt4WeightOnlyConfig, Int4OpaqueTensor) is missing: {exc}")
    # torchao 0.18: Int4WeightOnlyConfig has no CPU packing format (plain, preshuffled, plain_int32,
    # tile_packed_to_4d are CUDA/XPU/NPU); CPU int4 weight-only is the prototype config, whose
    # Int4OpaqueTensor runs aten._weight_int4pack_mm_for_cpu. Activations bf16 (tinygemm's dtype).
    model = _hf_model(folder, torch.bfloat16)
    # set_inductor_config=False: its recommended settings are process-wide and would change the other
    # compiled rows of this run (they are GPU/Triton tuning knobs)
    quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False))
    wrapper = _HFStatic(model, max_cache_len)
    return _TorchEngine(torch.compile(wrapper), wrapper.cache.reset)


class _QuantkitEngine:
    """quantkit: capture with a static cache, weight-only RTN, convert, then ``generate_with_stats``
    (it compiles once, ``warmup=True`` keeps that out of the timings). Each step's time is the gap
    between the streamer's consecutive tokens (the loop's own work included)."""

    def __init__(self, folder, max_cache_len, scheme: str, shared, group_size=64, without=(), dtype=torch.float32):
        import dataclasses

        import quantkit
        key = ("hf", dtype)
        if key not in shared:
            shared[key] = _hf_model(folder, dtype)
        example = torch.zeros(1, 8, dtype=torch.long)
        gm = quantkit.capture(shared[key], example, max_cache_len=max_cache_len)
        config = quantkit.get_scheme(scheme)
        if getattr(config, "group_size", None) is not None:
            config = dataclasses.replace(config, group_size=group_size)
        prepared = quantkit.prepare(gm, config.quantizer())
        quantkit.calibrate(prepared, [(example, torch.arange(example.shape[1]))], progress=False)  # RTN: unused
        self.program = quantkit.convert(prepared)
        self.compile_s = None
        self.run_program = self.program
        if without:  # compile now, with those lowering passes left out (an A/B of one pass)
            from quantkit.generation._generate import _compiled
            from quantkit.lowering import register_lowering, registered_lowerings, unregister_lowering

            removed = [p for p in registered_lowerings() if p.name in without]
            for p in removed:
                unregister_lowering(p.name)
            try:  # generate runs a compiled program as it is: LRU eviction cannot recompile it with the pass
                self.run_program = _compiled(self.program)[0]
            finally:
                for p in removed:
                    register_lowering(p.name, order=p.order, devices=p.devices)(p.fn)

    def run(self, prompt, steps):
        from quantkit.generation import generate_with_stats

        stamps = []

        class _Clock:
            def put(self, tokens):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        _, stats = generate_with_stats(self.run_program, prompt, steps + 1, warmup=True, streamer=_Clock())
        if stats.compile_s:
            self.compile_s = stats.compile_s
        # stamps: prompt, first token (after prefill), then one per decode step
        return stats.prefill_s, [b - a for a, b in zip(stamps[1:], stamps[2:])]


class _LlamaCppEngine:
    def __init__(self, path: Path, max_cache_len: int, threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=max_cache_len, n_batch=max_cache_len,
                                   n_ubatch=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    def _last(self):
        return int(self.llm.scores[self.llm.n_tokens - 1].argmax())

    def run(self, prompt, steps):
        llm = self.llm
        llm.reset()
        tokens = prompt[0].tolist()
        t0 = time.perf_counter()
        llm.eval(tokens)
        token = self._last()
        prefill = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            llm.eval([token])
            token = self._last()
            times.append(time.perf_counter() - t0)
        return prefill, times


def _llama_cpp(folder, max_cache_len, kind, shared, threads):
    key = ("gguf", folder)
    if key not in shared:
        shared[key] = gguf_files(folder)
    return _LlamaCppEngine(shared[key][kind], max_cache_len, threads)


# row name -> (label, builder(folder, max_cache_len, shared, threads))
ENGINES = {
    "hf-fp32": ("transformers eager fp32, StaticCache",
                lambda f, n, s, t: _hf(f, n, torch.float32, False, s)),
    "hf-bf16": ("transformers eager bf16, StaticCache",
                lambda f, n, s, t: _hf(f, n, torch.bfloat16, False, s)),
    "hf-fp32-compiled": ("transformers fp32, torch.compile",
                         lambda f, n, s, t: _hf(f, n, torch.float32, True, s)),
    "hf-bf16-compiled": ("transformers bf16, torch.compile",
                         lambda f, n, s, t: _hf(f, n, torch.bfloat16, True, s)),
    "torchao-int4": ("torchao 0.18 int4 g64 weight-only (CPU, bf16 act), compiled",
                     lambda f, n, s, t: _torchao_int4(f, n, s)),
    "quantkit-w4a16": ("quantkit w4a16 g64 RTN, generate (compiled)",
                       lambda f, n, s, t: _QuantkitEngine(f, n, "w4a16", s)),
    "quantkit-w4a16-repeat-kv": ("quantkit w4a16 g64 RTN without the gqa_attention pass (K/V repeated per head)",
                                 lambda f, n, s, t: _QuantkitEngine(f, n, "w4a16", s, without=("gqa_attention",))),
    "quantkit-w4a16-bf16": ("quantkit w4a16 g64 RTN of the bf16 model (bf16 activations and cache)",
                            lambda f, n, s, t: _QuantkitEngine(f, n, "w4a16", s, dtype=torch.bfloat16)),
    "quantkit-w4a16-fp32-prompt-attn": ("quantkit w4a16 g64 RTN without the prefill_attention_bf16 pass "
                                        "(prompt attention in float32)",
                                        lambda f, n, s, t: _QuantkitEngine(f, n, "w4a16", s,
                                                                           without=("prefill_attention_bf16",))),
    "quantkit-w8a16": ("quantkit w8a16 RTN, generate (compiled)",
                       lambda f, n, s, t: _QuantkitEngine(f, n, "w8a16", s)),
    "llamacpp-q4_0": ("llama.cpp Q4_0 (llama-cpp-python)",
                      lambda f, n, s, t: _llama_cpp(f, n, "Q4_0", s, t)),
    "llamacpp-q8_0": ("llama.cpp Q8_0 (llama-cpp-python)",
                      lambda f, n, s, t: _llama_cpp(f, n, "Q8_0", s, t)),
}


def build(row: str, folder: Path, max_cache_len: int, shared: dict, threads: int):
    """The engine of ``row`` (a key of :data:`ENGINES`); raises :class:`Missing` when it cannot run here."""
    try:
        return ENGINES[row][1](folder, max_cache_len, shared, threads)
    except ImportError as exc:
        raise Missing(f"{row}: {exc}") from None
