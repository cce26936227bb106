"""Shared checks of the adversarial tests (``tests/test_hostile_*.py``).

The failure contract of the CLI: a non-zero exit, exactly one stderr line that starts with
``quantkit: error:`` (no traceback, no terminal escapes, no raw exception text), inputs byte-for-byte
unchanged, and nothing left behind beside ``--out``.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import torch

from quantkit import _hf
from quantkit.cli import main

__all__ = ["RAW_EXCEPTION", "_error", "_fails", "_no_leftovers", "_tiny_bert", "_tree", "_copy_dir", "_sentences_file"]

RAW_EXCEPTION = re.compile(r"\b(IndexError|AttributeError|RuntimeError|KeyError|TypeError|ValueError|"
                           r"AssertionError|NotImplementedError)\b:")


def _tree(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of ``path`` itself), keyed by relative name."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path) if p != path else p.name): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def _error(err: str) -> str:
    """The single error line; fails on anything else on stderr."""
    lines = [ln for ln in err.split("\n") if ln.strip()]
    assert len(lines) == 1, f"expected exactly one stderr line, got {lines!r}"
    line = lines[0]
    assert "\r" not in line and "\x1b" not in line, repr(line)
    assert "Traceback" not in err
    assert not RAW_EXCEPTION.search(line), line
    assert line.startswith("quantkit: error: "), line
    return line


def _no_leftovers(out: Path) -> None:
    assert not out.exists(), f"{out} was left behind"
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary dir left"


def _fails(argv: list[str], capsys, *, code: int, inputs: list[Path] = (), out: Path | None = None) -> str:
    """Run the CLI in-process, check the failure contract, return the error line."""
    before = {str(p): _tree(p) for p in inputs}
    rc = main(argv)
    captured = capsys.readouterr()
    line = _error(captured.err)
    assert rc == code, (rc, line)
    for p in inputs:
        assert _tree(p) == before[str(p)], f"input {p} changed"
    if out is not None:
        _no_leftovers(out)
    return line


_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tiny_bert(directory: Path, cls=None, num_labels: int = 3) -> Path:
    """A random-weight BERT (2 layers, hidden 32) with all-MiniLM-L6-v2's tokenizer."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=30522, max_position_embeddings=128, num_labels=num_labels)
    (cls or transformers.BertForSequenceClassification)(cfg).save_pretrained(str(directory), safe_serialization=True)
    for f in _TOKENIZER_FILES:
        shutil.copy(_hf.default_model_path() / f, directory / f)
    return directory




def _copy_dir(src: Path, tmp_path: Path) -> Path:
    """A private copy of a module-scoped model directory, for a test that damages it."""
    d = tmp_path / "model"
    shutil.copytree(src, d)
    return d


def _sentences_file(directory: Path, n: int) -> Path:
    """The first ``n`` bundled calibration sentences, one per line, in ``directory/sentences.txt``."""
    f = directory / "sentences.txt"
    f.write_text("\n".join(_hf.read_sentences(_hf.default_calibration_file())[:n]) + "\n", encoding="utf-8")
    return f
