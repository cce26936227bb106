"""``quantkit eval DIR --data FILE.txt`` of a causal LM: perplexity on held-out text and decode tokens/s.

A program with a KV cache is always evaluated this way; a full-sequence program is when its float
model is an HF causal LM (or it was saved from Python and ``--tokenizer`` is given). The program's
perplexity is ``quantkit.metrics.perplexity`` (the strided method), the float model's beside it
when it can be rebuilt, and a KV program's decode speed comes from ``generation.generate_with_stats``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from .. import _hf
from ..generation import generate_with_stats
from ..metrics import perplexity, resolve_window
from . import _inputs as inputs, _report as report
from ._eval_source import float_spec, load_program, read_source
from ._quantize import TOKENIZER_DIR
from .._errors import QuantkitError

__all__ = ["is_causal_lm", "run_perplexity", "DECODE_PROMPT", "DECODE_TOKENS"]


DECODE_PROMPT, DECODE_TOKENS = 32, 32  # the timed generation: prompt tokens, new tokens (greedy)


def _recorded_causal_lm(doc: dict, args) -> bool:
    """Whether the float model (``--model``, else the one quantization.json records) is an HF causal LM:
    an architecture transformers can generate with, not an encoder-decoder."""
    if args.model is not None:
        if inputs.is_factory_name(args.model):
            return False
        path, task = Path(args.model), args.task or "auto"
    else:
        model = (doc.get("source") or {}).get("model")
        if not isinstance(model, dict) or model.get("kind") != "hf" or not isinstance(model.get("path"), str):
            return False
        path, task = Path(model["path"]), model.get("task", "auto")
    if task == "causal-lm":
        return True
    if task != "auto" or not (path / "config.json").is_file():
        return False
    try:
        cls, _ = _hf.model_class(path, "auto")
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (QuantkitError, OSError, ValueError):
        return False  # the comparison path reports a broken float model in its own words
    return cls.can_generate() and not config.get("is_encoder_decoder", False)


def is_causal_lm(doc: dict, args) -> bool:
    """eval measures perplexity for a program with a KV cache (always), and for a causal LM given
    a text file (``--data FILE``): one whose float model (recorded, or ``--model``) is an HF causal
    LM, or one saved from Python (no float model recorded) given ``--tokenizer``. A causal LM
    without ``--data`` is compared with its float model, as any other model."""
    if isinstance(doc.get("kv_cache"), dict):
        return True
    if args.data is None or Path(args.data).is_dir():
        return False
    if not doc.get("source") and args.model is None:
        return args.tokenizer is not None
    return _recorded_causal_lm(doc, args)


def _read_text(arg: str | None) -> tuple[Path, str]:
    """The text of ``--data``: an existing, non-empty UTF-8 file (one line of error otherwise)."""
    if arg is None:
        raise inputs.UsageError("this artifact is a causal LM with a KV cache: pass --data FILE.txt (held-out "
                                "text) to measure its perplexity")
    path = Path(arg)
    if not path.exists():
        raise QuantkitError(f"--data {arg!r} does not exist; pass a UTF-8 text file of held-out text")
    if not path.is_file():
        raise QuantkitError(f"--data {arg!r} is not a file; perplexity is measured on one UTF-8 text file")
    raw = path.read_bytes()
    if b"\0" in raw:
        raise QuantkitError(f"--data {arg!r} is binary (it holds NUL bytes), not text; pass a UTF-8 text file")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise QuantkitError(f"--data {arg!r} is not UTF-8 text (byte {exc.start}); pass a UTF-8 text file") from None
    if not text.strip():
        raise QuantkitError(f"--data {arg!r} is empty; pass a file of held-out text")
    return path, text


def _tokenizer(path: Path, doc: dict, args):
    """``--tokenizer``, else the artifact's ``tokenizer/``, else the recorded HF model's own."""
    import transformers

    candidates = [Path(args.tokenizer)] if args.tokenizer else [path / TOKENIZER_DIR]
    model = (doc.get("source") or {}).get("model")
    if not args.tokenizer and isinstance(model, dict) and model.get("kind") == "hf" and isinstance(model.get("path"), str):
        candidates.append(Path(model["path"]))
    for folder in candidates:
        if folder.is_dir() and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                   "vocab.txt", "tokenizer.model")):
            try:
                return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                                  trust_remote_code=False)
            except Exception as exc:  # a damaged tokenizer folder: one line
                raise QuantkitError(f"the tokenizer in {str(folder)!r} does not load ({' '.join(str(exc).split())[:150]}); "
                                    "pass --tokenizer DIR (an HF tokenizer directory)") from None
        if args.tokenizer:
            raise QuantkitError(f"--tokenizer {args.tokenizer!r} is not a tokenizer directory (no tokenizer.json "
                                "or tokenizer_config.json); pass the HF model or tokenizer directory")
    raise QuantkitError(f"{str(path)!r} holds no tokenizer (no {TOKENIZER_DIR}/ folder) and records no HF model "
                        "that has one; pass --tokenizer DIR (an HF tokenizer directory)")


def _float_lm(path: Path, doc: dict, args):
    """(the float model to compare with, None) or (None, why not)."""
    if doc.get("source"):
        source = read_source(path, doc)
        spec, allow = float_spec(args, source), source.allow_missing_weights
    elif args.model is not None:
        spec, allow = inputs.ModelSpec.from_args(args.model, args.weights, args.example_input, args.task or "auto"), False
    else:
        return None, "no float model to compare with (the artifact was saved from Python): pass --model DIR"
    spec.check()
    return inputs.load_model(spec, progress=False, allow_mismatch=allow).model.eval(), None


def _decode_speed(program, ids: torch.Tensor, info: dict, compile_: bool) -> tuple[dict | None, str | None]:
    """Greedy prefill and decode tokens/s of a KV program (``generation.generate_with_stats``, after its
    warm-up: compilation is not timed): (numbers, None), or (None, why not)."""
    prompt_len = max(1, min(DECODE_PROMPT, info["max_cache_len"] // 2, ids.shape[1]))
    new = min(DECODE_TOKENS, info["max_cache_len"] - prompt_len + 1)
    if new < 2:
        return None, f"decode tokens/s not measured: the KV cache of {info['max_cache_len']} positions is too short"
    prompt = ids[:, :prompt_len].expand(int(info["batch_size"]), -1).contiguous()
    _, stats = generate_with_stats(program, prompt, new, compile=compile_, warmup=True)  # greedy, no eos
    return {"prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens, "batch_size": stats.batch_size,
            "compiled": compile_, "compile_s": round(stats.compile_s, 2),
            "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 1),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 1)}, None


def run_perplexity(path: Path, doc: dict, args, say, warn, device: torch.device) -> int:
    """``quantkit eval DIR --data FILE.txt`` of a causal LM: the program's perplexity on the file (and the
    float model's, when it can be rebuilt), and decode tokens/s when the program has a KV cache."""
    kv = doc.get("kv_cache") if isinstance(doc.get("kv_cache"), dict) else None
    if args.num is not None:
        raise inputs.UsageError("--num counts samples; a causal LM's perplexity takes --max-tokens N")
    for flag, v in (("--window", args.window), ("--stride", args.stride), ("--max-tokens", args.max_tokens)):
        if v is not None and v < (2 if flag != "--stride" else 1):
            raise inputs.UsageError(f"{flag} must be at least {2 if flag != '--stride' else 1}, got {v}")
    data, text = _read_text(args.data)
    tokenizer = _tokenizer(path, doc, args)
    # one stream, longer than the tokenizer's model_max_length: windows cut it (its warning is no error here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids
    if args.max_tokens is not None:
        ids = ids[:, :args.max_tokens]
    if ids.shape[1] < 2:
        raise QuantkitError(f"--data {args.data!r} gives {ids.shape[1]} token; perplexity needs at least 2")
    program = load_program(path, device, allow_unverified=args.allow_unverified)
    batch_size = args.batch_size or 1
    # the default window: the program's own length (a full-sequence program), else 256 within a KV cache
    window = args.window or resolve_window(program)
    if args.stride is not None and args.stride > window:
        raise inputs.UsageError(f"--stride must be at most the window ({window}), got {args.stride}")
    result = {"data": str(data), "tokens": int(ids.shape[1]), "window": window, "stride": args.stride or window,
              "device": str(device)}
    result["perplexity"] = perplexity(program, ids, window=window, stride=args.stride, batch_size=batch_size)
    float_model, why = _float_lm(path, doc, args)
    if float_model is not None:
        float_model.to(device)
        result["float_perplexity"] = perplexity(float_model, ids, window=window, stride=args.stride,
                                                batch_size=batch_size)
        del float_model
    else:
        result["float_note"] = why
    speed, note = (None, "decode tokens/s not measured: the program has no KV cache (capture it with "
                         "max_cache_len=N to generate)") if kv is None else _decode_speed(program, ids, kv, args.compile)
    if speed is not None:
        result["decode"] = speed
    else:
        result["decode_note"] = note
    if args.json:
        say(json.dumps(report.json_safe(result), indent=2, allow_nan=False), block=True)
        return 0
    say(f"{path}: perplexity on {str(data)!r} ({result['tokens']} tokens, window {window}, "
        f"stride {result['stride']})")
    line = f"  quantized: {result['perplexity']:.4f}"
    if "float_perplexity" in result:
        f = result["float_perplexity"]
        line += f"   float: {f:.4f}   ({100 * (result['perplexity'] / f - 1):+.2f}%)"
    say(line)
    if "float_note" in result:
        say(f"  ({result['float_note']})")
    if speed is not None:
        say(f"decode: {speed['decode_tokens_per_s']:.1f} tokens/s, prefill {speed['prefill_tokens_per_s']:.1f} tokens/s "
            f"({speed['prompt_tokens']}-token prompt, {speed['new_tokens']} new, batch {speed['batch_size']}, "
            f"{'compiled' if speed['compiled'] else 'eager'}, {device}, {torch.get_num_threads()} threads)")
    else:
        say(note)
    return 0
