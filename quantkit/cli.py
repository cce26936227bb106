"""The ``quantkit`` command line: quantize a checkpoint into an int8 directory, inspect it, evaluate it.

Exit codes: 0 ok, 1 failed (bad input files, a model that cannot be captured, ...),
2 bad usage (unknown options or observer names, an existing --out without --force).
Errors are one line on stderr; set ``QUANTKIT_DEBUG=1`` for tracebacks and warnings.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _UsageExit(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``quantkit: error: ...``) instead of usage + exit."""

    def error(self, message: str):
        raise _UsageExit(f"{message} (see {self.prog} --help)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="quantkit", description="int8 post-training quantization for PyTorch checkpoints")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{quantize,inspect,eval}")

    q = sub.add_parser("quantize", help="quantize a checkpoint into an int8 artifact directory",
                       description="Quantize MODEL to int8 and write DIR: model.pt2, quantization.json, "
                                   "report.md and report.json.")
    q.add_argument("model", nargs="?", metavar="MODEL",
                   help="an HF model directory, or package.module:factory; default: the bundled all-MiniLM-L6-v2")
    q.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist unless --force)")
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
    recipe = q.add_argument_group("recipe")
    recipe.add_argument("--scheme", choices=["w8a8", "w8a8-dynamic", "w8a8-per-token"], default="w8a8",
                        help="static int8 activations (calibrated, default w8a8), dynamic per tensor, or "
                             "dynamic per token (most accurate on transformers, with --smoothquant 0.5)")
    recipe.add_argument("--observer", metavar="NAME", help="activation observer (default minmax)")
    recipe.add_argument("--weight-observer", default="per_channel_minmax", metavar="NAME",
                        help="weight observer (default per_channel_minmax)")
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
    q.add_argument("--force", action="store_true", help="replace DIR if it holds a quantkit artifact")
    q.add_argument("--quiet", action="store_true", help="no progress bars or summary")

    i = sub.add_parser("inspect", help="print a summary table of an artifact directory")
    i.add_argument("dir", metavar="DIR")

    e = sub.add_parser("eval", help="compare an artifact with its float model: metric and latency",
                       description="Rebuild the float model DIR came from and compare: mean/min cosine "
                                   "(sentence embeddings for encoders, outputs otherwise) and latency.")
    e.add_argument("dir", metavar="DIR")
    e.add_argument("--data", metavar="PATH",
                   help="evaluate on this text file or tensor directory (default: the held-out split)")
    e.add_argument("--num", type=int, metavar="N", help="evaluate on at most N samples")
    e.add_argument("--batch-size", type=int, metavar="B", help="batch size (default: as in quantize)")
    e.add_argument("--compile", action="store_true", help="also time quantkit.compile(int8) where available")
    e.add_argument("--json", action="store_true", help="print the results as JSON")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
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


def _one_line(exc: BaseException) -> str:
    text = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())
    return text or type(exc).__name__


def _run(args) -> int:
    say = (lambda *a, **k: None) if getattr(args, "quiet", False) else print
    if args.command == "quantize":
        from ._cli_quantize import run_quantize

        return run_quantize(args, say)
    from ._cli_eval import run_eval, run_inspect

    return run_inspect(args, print) if args.command == "inspect" else run_eval(args, print)


def main(argv: list[str] | None = None) -> int:
    """Run the ``quantkit`` command line; returns the exit code."""
    _silence_imports()
    debug = bool(os.environ.get("QUANTKIT_DEBUG"))
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageExit as exc:
        print(f"quantkit: error: {exc}", file=sys.stderr)
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
        from ._atomic import Terminated, sigterm_as_interrupt

        try:
            with sigterm_as_interrupt(redeliver=False):  # SIGTERM cleans up like Ctrl-C
                return _run(args)
        except KeyboardInterrupt as exc:
            sigterm = isinstance(exc, Terminated)
            print(f"quantkit: interrupted{' (SIGTERM)' if sigterm else ''}", file=sys.stderr)
            return 143 if sigterm else 130
        except Exception as exc:
            if debug:
                raise
            from ._cli_inputs import UsageError
            from ._errors import QuantkitError

            if isinstance(exc, UsageError):
                print(f"quantkit: error: {_one_line(exc)}", file=sys.stderr)
                return EXIT_USAGE
            if isinstance(exc, (QuantkitError, ValueError, TypeError, OSError)):
                print(f"quantkit: error: {_one_line(exc)}", file=sys.stderr)
            else:  # a bug in quantkit or in the model: still one line, with how to see more
                print(f"quantkit: error: {type(exc).__name__}: {_one_line(exc)} "
                      "(set QUANTKIT_DEBUG=1 for the traceback)", file=sys.stderr)
            return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
