"""``quantkit generate DIR --prompt TEXT``: stream a causal LM's continuation of a prompt.

DIR is either a quantkit artifact of a program captured with a KV cache (``quantkit.load``; its
tokenizer must be in DIR/tokenizer, where ``quantkit quantize`` writes it, or in DIR) or a plain
Hugging Face causal-LM folder, which is captured here in float with ``max_cache_len`` positions.
Tokens are printed as they come; prefill and decode speeds go to stderr at the end, timed after
compilation (a warm-up call compiles both graphs first, its time printed on its own).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

import quantkit

from .. import _hf
from .._errors import QuantkitError
from .._text import printable
from ..export._artifact import RECIPE_FILE
from ..generation import GenerationError, SamplingConfig, generate_with_stats, program_cache_info
from ..pipeline._kv_capture import KVCacheError
from ._inputs import UsageError
from ._quantize import TOKENIZER_DIR

__all__ = ["run_generate"]


class _Streamer:
    """Prints the text of the tokens as they come (transformers' ``TextStreamer`` decoding: a word
    is printed once it is complete), with control characters shown as escapes."""

    def __init__(self, tokenizer, out=None) -> None:
        import transformers

        out = out or sys.stdout

        class Printing(transformers.TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                out.write(printable(text, newlines=True) + ("\n" if stream_end else ""))
                out.flush()

        self._inner = Printing(tokenizer, skip_prompt=False)

    def put(self, value: torch.Tensor) -> None:
        self._inner.put(value)

    def end(self) -> None:
        self._inner.end()


def _tokenizer(path: Path):
    """The tokenizer in DIR/tokenizer or DIR (transformers' own classes only, offline)."""
    import transformers

    why = "no tokenizer files"
    for where in (path / TOKENIZER_DIR, path):
        if not where.is_dir() or not any((where / f).is_file() for f in
                                         ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
            continue
        try:
            return transformers.AutoTokenizer.from_pretrained(str(where), local_files_only=True,
                                                              trust_remote_code=False)
        except Exception as exc:  # transformers raises many types
            first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
            why = f"{where.name}: {first}"
    raise QuantkitError(f"no tokenizer in {str(path)!r}: {why}; save the model's tokenizer there "
                        f"(tokenizer.save_pretrained(DIR) or DIR/{TOKENIZER_DIR})")


def _cli_words(exc: KVCacheError, artifact: bool) -> QuantkitError:
    """A cache error in the command line's terms (--max-new-tokens, --max-cache-len)."""
    text = re.sub(r"lower max_new_tokens to at most (\d+)", r"pass --max-new-tokens \1 or less,", str(exc))
    text = re.sub(r"max_new_tokens=(\d+)", r"--max-new-tokens \1", text)
    fix = "quantize the model again with a longer cache" if artifact else r"pass --max-cache-len \1"
    text = re.sub(r"capture (?:it )?with (?:a larger max_cache_len|max_cache_len >= (\d+))", fix, text)
    return QuantkitError(text)


def _program(path: Path, args, ids: torch.Tensor, warn):
    """``(program, artifact?)``: the loaded artifact, or the HF folder captured with a KV cache."""
    if (path / RECIPE_FILE).is_file():
        program = quantkit.load(path, allow_unverified=args.allow_unverified)
        info = program_cache_info(program)
        if info is None:
            raise QuantkitError(f"{str(path)!r} holds a program without a KV cache, which cannot generate; quantize "
                                "the causal LM again with a static KV cache (quantkit.capture(..., max_cache_len=N))")
        if args.max_cache_len is not None and args.max_cache_len != info["max_cache_len"]:
            raise UsageError(f"the artifact's KV cache holds {info['max_cache_len']} positions and cannot change; "
                                "drop --max-cache-len")
        return program, True
    _hf.check_hf_dir(path)
    model, _, _ = _hf.load_hf_checkpoint(path, task="auto", progress=False)
    n = args.max_cache_len if args.max_cache_len is not None else ids.shape[1] + args.max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None)
    if args.max_cache_len is None and limit is not None and n > limit:
        n = max(int(limit), ids.shape[1])  # the model's own maximum; generate() says if it is too short
    example = ids[:, : min(ids.shape[1], n)]
    return quantkit.capture(model, example, max_cache_len=int(n)), False


def run_generate(args, say, warn) -> int:
    """Generate from ``args.dir`` (see the module doc); ``say`` is unused (tokens stream to stdout)."""
    path = Path(args.dir)
    if not path.is_dir():
        raise QuantkitError(f"{args.dir!r} is not a directory; pass a quantkit artifact or an HF causal-LM folder")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be 0 or more, got {args.max_new_tokens}")
    if not args.sample and (args.top_k is not None or args.top_p is not None or args.temperature != 1.0):
        raise UsageError("--temperature, --top-k and --top-p apply to sampling; add --sample")
    if args.max_cache_len is not None and args.max_cache_len < 1:
        raise UsageError(f"--max-cache-len must be at least 1, got {args.max_cache_len}")
    try:
        sampling = SamplingConfig(do_sample=args.sample, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p)
    except GenerationError as exc:  # the same checks, in the command line's words
        text = re.sub(r"\b(temperature|top_k|top_p)\b", lambda m: "--" + m.group(1).replace("_", "-"), str(exc))
        raise UsageError(text.replace("use do_sample=False", "drop --sample")) from None
    tokenizer = _tokenizer(path)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise QuantkitError("the prompt is empty after tokenization; pass some text with --prompt")
    program, artifact = _program(path, args, ids, warn)
    generator = torch.Generator().manual_seed(args.seed) if args.sample else None
    try:
        _, stats = generate_with_stats(program, ids, args.max_new_tokens, sampling=sampling,
                                       eos_token_id=tokenizer.eos_token_id, compile=args.compile,
                                       generator=generator, streamer=_Streamer(tokenizer), warmup=True)
    except KVCacheError as exc:
        raise _cli_words(exc, artifact) from None
    parts = []
    if stats.compile_s:
        parts.append(f"compile {stats.compile_s:.1f} s")
    parts.append(f"prefill {stats.prompt_tokens} tokens at {stats.prefill_tokens_per_s:.1f} tokens/s")
    if stats.decode_steps:
        parts.append(f"decode {stats.decode_steps} tokens at {stats.decode_tokens_per_s:.1f} tokens/s")
    warn("quantkit: " + ", ".join(parts) + f" ({torch.get_num_threads()} threads)")
    return 0
