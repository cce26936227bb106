"""Artifacts that cannot be verified, and printed fields that carry terminal controls (issue 26, items 8-9).

An artifact's ``quantization.json`` records the SHA-256 of ``model.pt2`` and a ``format_version``;
removing the digest (or writing an unknown version) must not turn the integrity check off.
``--allow-unverified`` / ``allow_unverified=True`` opt in, and say so. Every field the CLI
prints (inspect, eval, tables, its error line) shows C0/C1 controls and bidirectional
overrides as visible escapes (``\\x9c``, ``\\u202e``).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
import unicodedata
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit._text import printable
from quantkit.cli import main
from quantkit.export import _artifact
from tests._hostile import _fails, _tree
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs

pytest.importorskip("transformers")

# the characters of issue 26 item 9, one per class, and how they must be shown (written out by hand)
C0 = [("\x07", r"\x07"), ("\x1b", r"\x1b"), ("\t", r"\x09"), ("\r", r"\x0d"), ("\x00", r"\x00"), ("\x7f", r"\x7f"),
      ("\n", r"\x0a")]
C1 = [("\x9b", r"\x9b"), ("\x9c", r"\x9c"), ("\x9d", r"\x9d"), ("\x85", r"\x85"), ("\x90", r"\x90")]
BIDI = [("\u202e", r"\u202e"), ("\u202a", r"\u202a"), ("\u202b", r"\u202b"), ("\u202c", r"\u202c"),
        ("\u202d", r"\u202d"), ("\u2066", r"\u2066"), ("\u2067", r"\u2067"), ("\u2068", r"\u2068"),
        ("\u2069", r"\u2069"), ("\u200e", r"\u200e"), ("\u200f", r"\u200f"), ("\u061c", r"\u061c")]
BIDI_POINTS = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path, Path]:
    """``(artifact, weights, calib)``: a static int8 MLP written by ``quantkit quantize`` (with report.json)."""
    d = tmp_path_factory.mktemp("integrity")
    weights, calib = write_mlp_inputs(d, 24)
    out = d / "mlp-int8"
    assert main(mlp_quantize_args(weights, calib, out, "--recipe", "static")) == 0
    return out, weights, calib


@pytest.fixture
def art(made, tmp_path) -> Path:
    d = tmp_path / "art"
    shutil.copytree(made[0], d)
    return d


def _edit(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _eval_args(d: Path, *extra) -> list[str]:
    return ["eval", str(d), "--model", "tests.cli_factories:mlp", "--no-compile", "--quiet", *extra]


def _cli_fails(argv, capsys, art: Path, *, code: int = 1) -> str:
    """The failure contract, plus: nothing on stdout, nothing written beside the artifact."""
    around = sorted(p.name for p in art.parent.iterdir())
    line = _fails(argv, capsys, code=code, inputs=[art])
    assert sorted(p.name for p in art.parent.iterdir()) == around
    return line


def _load_fails(path: Path, **kwargs) -> str:
    before = _tree(path)
    with pytest.raises(quantkit.QuantkitError) as err:
        quantkit.load(path, **kwargs)
    assert _tree(path) == before
    text = str(err.value)
    assert "\n" not in text
    return text


# --- 8: a missing digest or an unknown format_version is refused -------------------------------

@pytest.mark.parametrize("how", ["absent", "null"])
def test_missing_digest_is_refused_by_load_inspect_and_eval(how, art, capsys):
    _edit(art / "quantization.json", lambda d: d.pop("model_sha256") if how == "absent" else d.update(model_sha256=None))
    why = "quantization.json records no SHA-256 of model.pt2 (model_sha256)"
    assert _load_fails(art) == (f"{str(art)!r} cannot be verified: {why}; re-create it with quantkit.save (or "
                                "quantkit quantize), or pass allow_unverified=True if you trust it")
    for argv in (["inspect", str(art)], _eval_args(art)):
        line = _cli_fails(argv, capsys, art)
        assert line == (f"quantkit: error: {str(art)!r} cannot be verified: {why}; re-create it with quantkit "
                        "quantize, or pass --allow-unverified if you trust it"), line
    with pytest.raises(quantkit.QuantkitError, match="cannot be verified"):
        _artifact.verify_artifact(art)


@pytest.mark.parametrize("version, shown", [(99, "99"), ("1", '"1"'), (-1, "-1"), (1.0, "1.0"), (True, "true"),
                                            (None, "null"), ([1], "[1]"), ("absent", None)])
def test_unknown_or_malformed_format_version_is_refused(version, shown, art, capsys):
    _edit(art / "quantization.json",
          lambda d: d.pop("format_version") if version == "absent" else d.update(format_version=version))
    why = ("quantization.json has no format_version" if shown is None else
           f"quantization.json has format_version {shown}, which this quantkit does not read (it reads 1)")
    assert _load_fails(art).startswith(f"{str(art)!r} cannot be verified: {why}; ")
    for argv in (["inspect", str(art)], _eval_args(art)):
        line = _cli_fails(argv, capsys, art)
        assert line.startswith(f"quantkit: error: {str(art)!r} cannot be verified: {why}; "), line
        assert line.endswith("or pass --allow-unverified if you trust it"), line


def test_a_directory_with_only_model_pt2_is_refused(art):
    (art / "quantization.json").unlink()
    assert _load_fails(art).startswith(f"{str(art)!r} cannot be verified: there is no quantization.json recording "
                                       "the SHA-256 of model.pt2; ")


# --- --allow-unverified opts in, and says so --------------------------------------------------

def test_allow_unverified_loads_and_warns(made, art):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    expected = quantkit.load(made[0])(x)
    _edit(art / "quantization.json", lambda d: d.update(format_version=99) or d.pop("model_sha256"))
    before = _tree(art)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = quantkit.load(art, allow_unverified=True)
    notes = [str(w.message) for w in seen if issubclass(w.category, _artifact.UnverifiedWarning)]
    assert len(notes) == 1 and "not verified" in notes[0] and "format_version 99" in notes[0], notes
    assert torch.equal(model(x), expected)
    assert _tree(art) == before


def test_allow_unverified_inspect_says_so_on_stderr(art, capsys):
    _edit(art / "quantization.json", lambda d: d.pop("model_sha256"))
    before = _tree(art)
    assert main(["inspect", str(art), "--allow-unverified"]) == 0
    printed = capsys.readouterr()
    assert printed.err == (f"quantkit: warning: {str(art)!r} is not verified (quantization.json records no SHA-256 "
                           "of model.pt2 (model_sha256)); read because of --allow-unverified\n")
    assert printed.out.startswith(f"{art}\n") and "tensors:" in printed.out
    assert _tree(art) == before


def test_allow_unverified_eval_runs_keeps_json_on_stdout_and_escapes_the_path(made, tmp_path, capsys):
    """The note goes to stderr, so ``eval --json`` stays JSON; the directory's name is printed escaped."""
    art = tmp_path / "art\u202egnp.\x9b2J"
    shutil.copytree(made[0], art)
    _edit(art / "quantization.json", lambda d: d.update(format_version="1"))
    before = _tree(art)
    assert main(_eval_args(art, "--allow-unverified", "--num", "4")) == 0
    printed = capsys.readouterr()
    lines = printed.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("quantkit: warning: ") and "is not verified" in lines[0], lines
    assert "\u202e" not in printed.out + printed.err and "\x9b" not in printed.out + printed.err
    assert printed.out.startswith(str(tmp_path) + r"/art\u202egnp.\x9b2J: ")
    assert main(_eval_args(art, "--allow-unverified", "--num", "4", "--json")) == 0
    printed = capsys.readouterr()
    # --num 4 caps the held-out split the artifact recorded: exactly min(4, its size) samples are evaluated
    heldout = json.loads((art / "quantization.json").read_text())["source"]["heldout"]
    assert json.loads(printed.out)["metric"]["samples"] == min(4, len(heldout)), printed.out
    assert len(printed.err.splitlines()) == 1
    assert _tree(art) == before


def test_allow_unverified_still_refuses_a_digest_that_does_not_match(art, capsys):
    _edit(art / "quantization.json", lambda d: d.update(model_sha256="0" * 64, format_version=99))
    text = _load_fails(art, allow_unverified=True)
    assert text == (f"{str(art / 'model.pt2')!r} was modified or truncated after it was written (its SHA-256 does "
                    "not match quantization.json); re-create the artifact")
    line = _cli_fails(["inspect", str(art), "--allow-unverified"], capsys, art)
    assert "was modified or truncated" in line


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_allow_unverified_keeps_the_archive_checks(art, tmp_path, capsys):
    """An unsealed model.pt2 with a pickle payload: opting out of the digest does not let it run.
    Positive control: torch.export.load of the same file runs it."""
    marker = tmp_path / "ran"
    src = art / "model.pt2"
    with zipfile.ZipFile(src) as zf:
        members = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    buf = io.BytesIO()
    torch.save(((_Payload(marker),), {}), buf)
    members["model/data/sample_inputs/model.pt"] = buf.getvalue()
    with zipfile.ZipFile(src, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    _edit(art / "quantization.json", lambda d: d.pop("model_sha256"))
    text = _load_fails(art, allow_unverified=True)
    assert text.startswith(f"refusing to load {str(src)!r}: "), text
    line = _cli_fails(["inspect", str(art), "--allow-unverified"], capsys, art)
    assert "refusing to load" in line
    assert not marker.exists()
    try:
        torch.export.load(str(src))
    except Exception:
        pass  # the payload's return value is no valid input; it has run by then
    assert marker.exists(), "torch.export.load no longer runs this payload: the test above proves nothing"


def test_an_artifact_from_before_the_digest_loads_opted_in_and_saves_verified(art, tmp_path):
    """quantkit's first artifacts (format_version 1, no model_sha256): loadable with allow_unverified,
    and quantkit.save of the loaded model writes a verifiable artifact."""
    _edit(art / "quantization.json", lambda d: d.pop("model_sha256"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _artifact.UnverifiedWarning)
        loaded = quantkit.load(art, allow_unverified=True)
    again = quantkit.save(loaded, tmp_path / "again")
    doc = json.loads((again / "quantization.json").read_text())
    assert doc["format_version"] == 1
    assert doc["model_sha256"] == hashlib.sha256((again / "model.pt2").read_bytes()).hexdigest()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verified: no warning
        quantkit.load(again)


# --- 9: control characters and bidirectional overrides are escaped -------------------------------

def _no_raw(text: str, chars) -> None:
    raw = [c for c, _ in chars if c in text and c != "\n"]
    assert not raw, f"raw {raw!r} printed"


@pytest.mark.parametrize("chars", [C0, C1, BIDI], ids=["C0", "C1", "bidi"])
def test_control_characters_from_report_json_are_escaped_in_inspect(chars, art, capsys):
    evil = "".join(c for c, _ in chars)
    shown = "".join(s for _, s in chars)
    _edit(art / "report.json", lambda d: (d.update(model=f"m{evil}m"), d["layers"][0].update(layer=f"fc{evil}")))
    before = _tree(art)
    assert main(["inspect", str(art)]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    _no_raw(printed.out, chars)
    assert f"  model:    m{shown}m\n" in printed.out
    table = [ln for ln in printed.out.splitlines() if ln.startswith("|")]
    assert any(ln.startswith(f"| fc{shown} ") for ln in table), table
    assert len({len(ln) for ln in table}) == 1, "columns measured before escaping"
    assert _tree(art) == before


@pytest.mark.parametrize("chars", [C0, C1, BIDI], ids=["C0", "C1", "bidi"])
def test_control_characters_from_quantization_json_are_escaped_in_inspect(chars, art, capsys):
    evil = "".join(c for c, _ in chars)
    shown = "".join(s for _, s in chars)
    _edit(art / "quantization.json", lambda d: (d["recipe"].update(scheme=f"w8{evil}"),
                                                d["versions"].update({f"pkg{evil}": "1"})))
    (art / "report.json").unlink()  # inspect then lists quantization.json's tensors
    _edit(art / "quantization.json", lambda d: d["tensors"][0].update(node=f"n{evil}"))
    before = _tree(art)
    assert main(["inspect", str(art)]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    _no_raw(printed.out, chars)
    assert f"scheme=w8{shown}" in printed.out and f"pkg{shown} 1" in printed.out
    assert any(ln.startswith(f"| n{shown} ") for ln in printed.out.splitlines())
    assert _tree(art) == before


def test_error_line_carrying_control_characters_is_escaped(made, tmp_path, capsys, monkeypatch):
    """A factory's exception text reaches the error line: each class of control is shown escaped."""
    _, weights, calib = made
    # the factory's message is cut at its first line break (str.splitlines: \n, \r, \x85, ...);
    # test_usage_error_line_is_escaped covers those
    chars = [(c, s) for c, s in C0 + C1 + BIDI if len(c.splitlines()) == 1 and c.splitlines()[0] == c]
    evil = "".join(c for c, _ in chars)
    shown = "".join(s for _, s in chars)
    (tmp_path / "evil_factory_d2.py").write_text(f"def make():\n    raise ValueError({evil!r} + ' done')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    argv = ["quantize", "evil_factory_d2:make", "--example-input", "8x64:float32", "--calib", str(calib),
            "--out", str(out), "--quiet"]
    line = _fails(argv, capsys, code=1, inputs=[calib, weights], out=out)
    _no_raw(line, chars)
    # the factory message after ANSI removal: "\x1b" followed by "\t" is no ANSI sequence, so it stays
    assert shown + " done" in line, line
    sys.modules.pop("evil_factory_d2", None)


def test_usage_error_line_is_escaped(art, capsys):
    """argparse echoes an unknown argument as given: line breaks other than \n stay on the line, escaped."""
    chars = [(c, s) for c, s in C0 + C1 + BIDI if c != "\n"] + [("\u2028", r"\u2028"), ("\x0c", r"\x0c")]
    evil = "".join(c for c, _ in chars)
    line = _cli_fails(["inspect", str(art), f"x\x9d0;t{evil}"], capsys, art, code=2)
    assert "x" + r"\x9d" + "0;t" + "".join(s for _, s in chars) in line, line
    _no_raw(line, chars)


def test_printable_escapes_every_control_and_bidi_character_and_keeps_text():
    """Against Unicode's own tables: every Cc character, and the bidirectional controls."""
    controls = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) == "Cc"]
    assert len(controls) == 65  # C0, DEL, C1
    for ch in controls + [chr(c) for c in BIDI_POINTS] + ["\u2028", "\u2029"]:
        out = printable(f"a{ch}b")
        assert out == f"a\\{'x' if ord(ch) < 256 else 'u'}{ord(ch):0{2 if ord(ch) < 256 else 4}x}b", (hex(ord(ch)), out)
        assert printable(out) == out
    for text in ("plain ascii ~!@#$%^&*()", "café naïve", "中文 テキスト", "emoji 👩\u200d💻", "\\x9c is literal"):
        assert printable(text) == text
    assert printable("two\nlines\tx", newlines=True) == "two\nlines\\x09x"


def test_check_out_dir_names_the_callers_flag(art):
    with pytest.raises(quantkit.QuantkitError) as err:
        _artifact.check_out_dir(art, overwrite=False, flag="--force")
    assert str(err.value) == f"output directory {str(art)!r} already exists; pass --force to replace it"
    with pytest.raises(quantkit.QuantkitError, match="pass overwrite=True"):
        _artifact.check_out_dir(art, overwrite=False)


def test_quantize_summary_escapes_the_output_path(made, tmp_path, capsys):
    _, weights, calib = made
    out = tmp_path / "o\u202etxt.\x9b2J"
    argv = [a for a in mlp_quantize_args(weights, calib, out, "--recipe", "static") if a != "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "\u202e" not in printed and "\x9b" not in printed
    assert f"wrote {tmp_path}/o" + r"\u202etxt.\x9b2J: " in printed, printed
