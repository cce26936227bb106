"""The ``quantkit`` command line: quantize a checkpoint into an int8 directory, inspect it, evaluate it,
generate text with it.

Exit codes: 0 ok, 1 failed (bad input files, a model that cannot be captured, ...),
2 bad usage (unknown options or observer names, an existing --out without --force).
Errors are one line on stderr; set ``QUANTKIT_DEBUG=1`` for tracebacks and warnings.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import warnings

from .._text import printable, strip_ansi
from ..quantizers._scheme import available_schemes, scheme_info

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _UsageExit(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``quantkit: error: ...``) instead of usage + exit."""

    def error(self, message: str):
        raise _UsageExit(f"{message} (see {self.prog} --help)")


def _observer_help(role: str) -> str:
    try:
        from ._quantize import observer_roles

        return ", ".join(n for n, r in observer_roles().items() if role in r)
    except Exception:  # help must print even if the registry cannot be read
        return "see quantkit.observers.available()"


_UNVERIFIED_HELP = ("also read an artifact that cannot be verified (its quantization.json records no SHA-256 of "
                    "model.pt2, or has an unknown format_version); a warning says so. A SHA-256 that does not "
                    "match, and anything that could run code, are refused anyway")
_TASKS = ("auto", "feature-extraction", "sequence-classification", "token-classification", "masked-lm", "causal-lm")


def _build_parser(observers: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(prog="quantkit", description="int8 post-training quantization for PyTorch checkpoints")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{quantize,inspect,eval,generate}")

    q = sub.add_parser("quantize", help="quantize a checkpoint into an int8 artifact directory",
                       description="Quantize MODEL to int8 and write DIR: model.pt2, quantization.json, "
                                   "report.md and report.json.")
    q.add_argument("model", nargs="?", metavar="MODEL",
                   help="an HF model directory, or package.module:factory (imported as named, from the current "
                        "directory too); default: the bundled all-MiniLM-L6-v2")
    q.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (must not exist unless --force, nor lie inside an input)")
    q.add_argument("--task", choices=_TASKS, default="auto", metavar="TASK",
                   help="HF models: which head to load. auto (default): the architecture in config.json, so a "
                        "classifier keeps its classifier and a causal LM its lm_head; or one of "
                        + ", ".join(_TASKS[1:]) + ". The bundled model is feature-extraction (sentence embeddings)")
    q.add_argument("--device", metavar="NAME", help="calibrate and evaluate on cpu (default), cuda or cuda:N; "
                   "the artifact is saved for CPU either way")
    q.add_argument("--allow-missing-weights", action="store_true",
                   help="quantize even when checkpoint tensors are missing, unexpected or mis-shaped (they are "
                        "randomly initialised, seed 0); the report says so")
    src = q.add_argument_group("factory models")
    src.add_argument("--weights", metavar="FILE", help="a .safetensors or .pt state dict for the factory's model")
    src.add_argument("--example-input", metavar="SHAPE:DTYPE",
                     help="the factory model's input, e.g. 8x64:float32 (comma-separate several inputs)")
    data = q.add_argument_group("calibration")
    data.add_argument("--calib", metavar="PATH", help="a text file (one sample per line) or a directory of "
                      ".pt/.npy/.safetensors tensors; default: the bundled calibration sentences")
    data.add_argument("--num-calib", type=int, metavar="N",
                      help="calibrate on at most N samples (default: all but the held-out 20%%)")
    data.add_argument("--seq-len", type=int, default=128, metavar="L", help="truncate text to L tokens (default 128)")
    data.add_argument("--batch-size", type=int, default=32, metavar="B", help="batch size (default 32)")
    data.add_argument("--skip-nonfinite", action="store_true",
                      help="leave out samples holding NaN or inf (counted in the report) instead of failing")
    recipe = q.add_argument_group("recipe (the fields of quantkit.quantizers.QuantConfig)")
    from ._autotune import add_arguments as _autotune_arguments

    _autotune_arguments(recipe)  # --recipe auto|NAME, --target, --strict
    schemes = "; ".join(f"{n} ({scheme_info(n).description})" for n in available_schemes()).replace("%", "%%")
    recipe.add_argument("--scheme", choices=available_schemes(), metavar="NAME",
                        help=f"a registered scheme (quantkit.quantizers.available_schemes()): {schemes}. w8a8 is "
                             "the default; w8a8-dynamic = --dynamic, w8a8-per-token = --dynamic --granularity "
                             "per-token")
    recipe.add_argument("--kv-cache", choices=["fp8_e4m3", "fp8_e5m2", "int8"],
                        help="FP8 schemes: calibrated per-tensor scales for every attention's keys and values "
                             "(q/dq on K after rotary, and on V), recorded in quantization.json; with "
                             "--max-cache-len, any scheme: the cache is stored in that format")
    recipe.add_argument("--kv-granularity", choices=["per-tensor", "per-head"],
                        help="with --kv-cache: one K/V scale per tensor (default) or one per attention head")
    recipe.add_argument("--group-size", type=int, metavar="N",
                        help="weight-only schemes: input features per scale (default 128 for w4a16, 64 for nf4, "
                             "one per output channel for w8a16)")
    recipe.add_argument("--double-quant", action="store_true", default=None,
                        help="nf4: QLoRA's double quantization, the absmax scales stored as 8-bit floats in blocks "
                             "of 256 (4.127 instead of 4.5 bits per weight at groups of 64)")
    recipe.add_argument("--algorithm", choices=["rtn", "gptq", "awq", "awq+gptq"],
                        help="how weights are rounded (int and FP8 schemes): rtn (to nearest; default), gptq or awq "
                             "(need calibration data); awq+gptq: AWQ's scales then GPTQ's rounding (weight-only)")
    recipe.add_argument("--clip-search", action=argparse.BooleanOptionalAction, default=None,
                        help="weight-only with --algorithm gptq or awq+gptq: choose each group's range (shrinks of "
                             "its min/max down to 0.5) by the layer's output error under the calibration data "
                             "(default on for those; --no-clip-search: the groups' min/max, as the GPTQ paper)")
    recipe.add_argument("--activation", choices=["affine-uint8", "symmetric-int8", "affine-uint7"],
                        help="activation integers (default affine-uint8 static, symmetric-int8 dynamic); "
                             "affine-uint7 lets oneDNN run exactly on CPUs without VNNI")
    recipe.add_argument("--weight-bits", type=int, choices=range(2, 9), metavar="2..8",
                        help="W8A8 schemes: integer width of the int8 weights (default 8); 7 (-64..63) lets oneDNN "
                             "run 8-bit activations exactly on CPUs without VNNI (AVX2)")
    recipe.add_argument("--dynamic", action="store_true", default=None,
                        help="quantize activations at run time instead of calibrating them")
    recipe.add_argument("--granularity", choices=["per-tensor", "per-token"],
                        help="activation scales per tensor (default) or per token (needs --dynamic)")
    recipe.add_argument("--ops", metavar="LIST",
                        help="op families to quantize, comma-separated: linear, conv, matmul, add "
                             "(default linear,conv,matmul; CPU recipe: --activation affine-uint7 --ops linear)")
    recipe.add_argument("--observer", metavar="NAME",
                        help="activation observer (default minmax)"
                             + (f"; one of {_observer_help('activation')}" if observers else ""))
    recipe.add_argument("--weight-observer", default="per_channel_minmax", metavar="NAME",
                        help="weight observer (default per_channel_minmax)"
                             + (f"; one of {_observer_help('weight')}" if observers else ""))
    recipe.add_argument("--skip", nargs="+", action="extend", metavar="PATTERN",
                        help="keep modules whose names match these fnmatch patterns in float, e.g. 'pooler*'")
    acc = q.add_argument_group("accuracy")
    acc.add_argument("--smoothquant", metavar="ALPHA|auto",
                     help="SmoothQuant before quantizing: migration strength in [0, 1], or 'auto' per layer")
    acc.add_argument("--accuracy-budget", type=float, metavar="DROP",
                     help="keep the fewest layers float so the metric drops by at most DROP "
                          "(measured on the calibration samples), e.g. 0.002")
    acc.add_argument("--metric", default="cosine", metavar="NAME",
                     help="metric for --accuracy-budget: cosine (default), kl, top1, or module:function")
    q.add_argument("--format", default="pt2", metavar="FORMATS",
                   help="what DIR gets: pt2 (quantkit's artifact; default), compressed-tensors (an HF checkpoint "
                        "transformers and vLLM load; pip install 'quantkit[serve]') or pt2,compressed-tensors "
                        "(both: the HF directory in DIR/compressed-tensors), gguf (OUT is a .gguf file llama.cpp runs: "
                        "--scheme w4a16/w8a16 --group-size 32; pip install 'quantkit[gguf]') or pt2,gguf "
                        "(DIR/model.gguf)")
    q.add_argument("--skip-unsupported", action="store_true",
                   help="compressed-tensors: keep layers the format cannot express float (listed) instead of failing; "
                        "gguf: write them F16")
    q.add_argument("--quantize-lm-head", action="store_true",
                   help="compressed-tensors: quantize lm_head too, named in the targets (default: lm_head stays "
                        "float and is listed in ignore, as llm-compressor and vLLM expect)")
    q.add_argument("--float-dtype", choices=["bfloat16", "float16", "float32"],
                   help="compressed-tensors: dtype of the float tensors (norms, embeddings, float layers); "
                        "default bfloat16, what vLLM runs. gguf: float32 (default) or float16 (2-d float "
                        "tensors F16, as llama.cpp's converter writes them)")
    q.add_argument("--engine", choices=["vllm-cpu", "transformers"],
                   help="compressed-tensors: vllm-cpu (default) refuses schemes vLLM's CPU build cannot run "
                        "(w8a16, static fp8); transformers writes them anyway")
    mem = q.add_argument_group("memory (models larger than memory)")
    mem.add_argument("--max-memory", metavar="SIZE",
                     help="memory budget, e.g. 4GiB: a checkpoint the in-memory path would not fit is quantized "
                          "block by block (one layer's weights at a time, streamed from safetensors)")
    mem.add_argument("--sequential", action="store_true", help="quantize block by block whatever the model's size")
    mem.add_argument("--resume", action=argparse.BooleanOptionalAction, default=False,
                     help="continue an interrupted block-by-block run from its last completed block "
                          "(--no-resume: start over, discarding quantkit's own progress directory)")
    q.add_argument("--max-cache-len", type=int, metavar="N",
                   help="HF causal LMs: capture with a static KV cache of N positions, so that `quantkit generate "
                        "DIR` runs the artifact (with --kv-cache the cache is stored in that format)")
    q.add_argument("--force", action="store_true", help="replace DIR if it holds a quantkit artifact")
    q.add_argument("--quiet", action="store_true", help="no progress bars or summary")

    i = sub.add_parser("inspect", help="print a summary table of an artifact directory")
    i.add_argument("dir", metavar="DIR")
    i.add_argument("--allow-unverified", action="store_true", help=_UNVERIFIED_HELP)

    e = sub.add_parser("eval", help="compare an artifact with its float model: metric and latency "
                       "(perplexity and decode tokens/s for a causal LM given --data FILE.txt)",
                       description="Rebuild the float model DIR came from and compare: mean/min cosine "
                                   "(sentence embeddings for encoders, logits or outputs otherwise) and latency, "
                                   "compiled int8 against compiled float by default. eval never imports code an "
                                   "artifact names: a factory model is rebuilt only from --model.")
    e.add_argument("dir", metavar="DIR")
    e.add_argument("--model", metavar="MODEL",
                   help="the float model to compare with: an HF model directory or package.module:factory "
                        "(required for artifacts of factory models; default: the HF model DIR records)")
    e.add_argument("--weights", metavar="FILE", help="with a factory --model: its state dict (default: as recorded)")
    e.add_argument("--example-input", metavar="SHAPE:DTYPE",
                   help="with a factory --model: its input (default: as recorded)")
    e.add_argument("--task", choices=_TASKS, metavar="TASK", help="with an HF --model: which head (default: as recorded)")
    e.add_argument("--data", metavar="PATH",
                   help="evaluate on this text file or tensor directory (default: the held-out split)")
    e.add_argument("--num", type=int, metavar="N", help="evaluate on at most N samples")
    # a causal LM on a text file: perplexity (quantkit.metrics.perplexity) and decode tokens/s
    e.add_argument("--tokenizer", metavar="DIR", help="causal LMs: the tokenizer for --data (default: DIR/tokenizer, "
                   "else the recorded model's)")
    e.add_argument("--window", type=int, metavar="W", help="causal LMs: perplexity window in tokens (default 256, "
                   "at most the KV cache's length)")
    e.add_argument("--stride", type=int, metavar="S", help="causal LMs: tokens between windows (default: the window)")
    e.add_argument("--max-tokens", type=int, metavar="N", help="causal LMs: score the first N tokens of --data only")
    e.add_argument("--batch-size", type=int, metavar="B", help="batch size (default: as in quantize)")
    e.add_argument("--device", metavar="NAME", help="run on cpu (default), cuda or cuda:N")
    e.add_argument("--skip-nonfinite", action="store_true",
                   help="leave out samples holding NaN or inf (counted) instead of failing")
    comp = e.add_mutually_exclusive_group()
    comp.add_argument("--no-compile", dest="compile", action="store_false",
                      help="time the eager float model and the reference q/dq int8 graph instead of compiled ones")
    comp.add_argument("--compile", dest="compile", action="store_true",
                      help="compile both models (the default; kept for old command lines)")
    e.set_defaults(compile=True)
    e.add_argument("--allow-unverified", action="store_true", help=_UNVERIFIED_HELP)
    e.add_argument("--json", action="store_true", help="print the results as JSON")
    e.add_argument("--quiet", action="store_true", help="no progress bars")

    g = sub.add_parser("generate", help="generate text with a causal LM (artifact or HF folder), streaming tokens",
                       description="Continue --prompt with the causal LM in DIR, printing tokens as they come, "
                                   "then prefill and decode tokens/s on stderr. DIR is a quantkit artifact captured "
                                   "with a KV cache (its tokenizer in DIR/tokenizer or DIR) or an HF causal-LM "
                                   "folder (run in float, captured here with a static KV cache).")
    g.add_argument("dir", metavar="DIR")
    g.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="generate at most N tokens (default 32)")
    g.add_argument("--max-cache-len", type=int, metavar="N",
                   help="HF folders: KV-cache positions to capture (default: the prompt's tokens + N new tokens); "
                        "an artifact keeps the length it was captured with")
    g.add_argument("--no-compile", dest="compile", action="store_false",
                   help="run the program as it is instead of compiling it first (compiling takes a while once)")
    smp = g.add_argument_group("sampling (default: greedy)")
    smp.add_argument("--sample", action="store_true", help="sample the next token instead of taking the most likely")
    smp.add_argument("--temperature", type=float, default=1.0, metavar="T", help="with --sample: divide logits by T")
    smp.add_argument("--top-k", type=int, metavar="K", help="with --sample: keep the K most likely tokens")
    smp.add_argument("--top-p", type=float, metavar="P", help="with --sample: keep the nucleus of probability P")
    smp.add_argument("--seed", type=int, default=0, metavar="S", help="with --sample: the random seed (default 0)")
    g.add_argument("--allow-unverified", action="store_true", help=_UNVERIFIED_HELP)
    return parser


def _silence_imports() -> None:
    """torchao logs 'Failed to load ... .so' and torch's pytree warns at import; keep stderr for errors."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch logs warnings with tracebacks (e.g. when export fails); the CLI reports errors itself."""
    names = ["torch", "torchao", "transformers"] + [
        n for n in logging.root.manager.loggerDict if n.startswith(("torch.", "torchao.", "transformers."))]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# errors of the Python API name API calls; a CLI user gets the command-line equivalent
_CLI_WORDING = (
    (re.compile(r"run quantkit\.calibrate\(prepared, data\) before convert"),
     "calibrate on data that reaches it (--calib) or keep that layer float with --skip"),
    (re.compile(r"call quantkit\.prepare\(model, quantizer\) before convert"),
     "nothing is quantized: check --ops and --skip"),
    (re.compile(r"pad or crop it to the example's shape, or pass dynamic_shapes to quantkit\.capture"),
     "give every sample the shape of --example-input"),
    (re.compile(r"a dimension you marked dynamic is fixed by the model; pass dynamic_shapes explicitly"),
     "a dimension that varies between samples is fixed by the model; give every sample the same shape"),
    (re.compile(r"or pass dynamic_shapes explicitly"), "and check that the samples are the model's inputs"),
    (re.compile(r"check that example_inputs match the model's forward\(\) signature"),
     "check that the samples (--calib, --example-input) match the model's forward() signature"),
)
# "RuntimeError: ..." inside a message is Python's wording, not ours
_RAW_TYPES = re.compile(r"\b(?:[A-Za-z_][\w.]*\.)?(?:RuntimeError|IndexError|KeyError|AttributeError|TypeError|"
                        r"ValueError|AssertionError|NotImplementedError|ZeroDivisionError|OverflowError|"
                        r"ImportError|ModuleNotFoundError|StopIteration|Exception|UserError|Unsupported)\b:\s*")


def _one_line(exc: BaseException) -> str:
    text = strip_ansi(str(exc))
    # lines joined at "\n" only: other line breaks (\r, \x85, \u2028, ...) are shown escaped
    text = " ".join(ln.strip(" \t\r") for ln in text.split("\n") if ln.strip(" \t\r"))
    for pattern, words in _CLI_WORDING:
        text = pattern.sub(words, text)
    return _RAW_TYPES.sub("", text) or "no message"


def _private_inductor_cache() -> None:
    """Point Inductor at quantkit's checked 0700 folder (``kernels.private_inductor_cache``) unless the
    user chose one: its default, ``/tmp/torchinductor_$USER``, is made by whoever comes first and the
    libraries in it are loaded unchecked. Must run before anything touches Inductor."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    from ..kernels._kernel_cache import private_inductor_cache

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private_inductor_cache())


def _run(args) -> int:
    if args.command in ("quantize", "eval", "generate"):  # the commands that compile
        _private_inductor_cache()
    if args.command == "generate":
        from ._generate import run_generate

        return run_generate(args, print, _stderr_line)
    if args.command == "quantize":
        from ._quantize import run_quantize
        from ._torchrun import torchrun_group

        with torchrun_group(args):  # under torchrun: a process group; ranks other than 0 are quiet
            return run_quantize(args, (lambda *a, **k: None) if args.quiet else _say)
    from ._eval import run_eval, run_inspect

    return (run_inspect if args.command == "inspect" else run_eval)(args, print, _stderr_line)


def _say(text: str = "") -> None:
    """print() for quantize's summary: control characters and bidirectional overrides in it
    (a path, a model name) are shown as escapes."""
    print(printable(text, newlines=True))


def _stderr_line(line: str) -> None:
    """One write per line: under torchrun every rank shares one stderr pipe, and print()'s separate
    write of the newline let another rank's line land in between. Control characters and
    bidirectional overrides (from a path, a file, an exception) are shown as escapes, and a
    newline inside ``line`` too, so it stays one line."""
    sys.stderr.write(printable(line) + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Run the ``quantkit`` command line; returns the exit code."""
    _silence_imports()
    debug = bool(os.environ.get("QUANTKIT_DEBUG"))
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _build_parser(observers=any(a in ("-h", "--help") for a in argv))
    try:
        args = parser.parse_args(argv)
    except _UsageExit as exc:
        _stderr_line(f"quantkit: error: {_one_line(exc)}")
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    if args.version:
        from quantkit import __version__

        print(__version__)
        return EXIT_OK
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    with warnings.catch_warnings(), (contextlib.nullcontext() if debug else _quiet_torch_logs()):
        if not debug:
            warnings.simplefilter("ignore")
        from ..export._atomic import Terminated, sigterm_as_interrupt

        try:
            with sigterm_as_interrupt(redeliver=False):  # SIGTERM cleans up like Ctrl-C
                return _run(args)
        except KeyboardInterrupt as exc:
            sigterm = isinstance(exc, Terminated)
            _stderr_line(f"quantkit: interrupted{' (SIGTERM)' if sigterm else ''}")
            return 143 if sigterm else 130
        except BrokenPipeError:  # `quantkit inspect DIR | head`: the reader left, which is not an error
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            return EXIT_OK
        except Exception as exc:
            if debug:
                raise
            from ._inputs import UsageError
            from .._errors import QuantkitError
            from ..kernels._kernel_cache import KernelLoadError

            if isinstance(exc, UsageError):
                _stderr_line(f"quantkit: error: {_one_line(exc)}")
                return EXIT_USAGE
            if isinstance(exc, (QuantkitError, ValueError, TypeError, KernelLoadError)):  # user errors, one line
                _stderr_line(f"quantkit: error: {_one_line(exc)}")
            elif isinstance(exc, OSError) and exc.strerror:
                where = f" ({exc.filename})" if exc.filename else ""
                _stderr_line(f"quantkit: error: {exc.strerror}{where}; check the path and its permissions")
            else:  # a bug in quantkit or in the model: still one line, with how to see more
                _stderr_line(f"quantkit: error: unexpected failure ({_one_line(exc)}); set QUANTKIT_DEBUG=1 for the "
                      "traceback and report it")
            return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
