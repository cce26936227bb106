"""Adversarial command lines and files for ``quantkit quantize / eval / inspect``.

Every case checks the exit code, that stderr is exactly one line (no traceback, no ANSI
escape, no raw ``IndexError:``-style exception text), that the inputs are byte-for-byte
unchanged, and that no output (or temporary directory) is left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quantkit import _hf
from quantkit.cli import main
from tests._hostile import RAW_EXCEPTION, _copy_dir, _error, _fails, _no_leftovers, _sentences_file, _tiny_bert, _tree  # noqa: F401,E501

transformers = pytest.importorskip("transformers")

# bad command lines must fail before anything heavy runs (measured: < 2 s; generous for a loaded CI box)
FAST_S = 10


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return _tiny_bert(tmp_path_factory.mktemp("bert") / "bert-cls")


@pytest.fixture
def bert_copy(bert_dir, tmp_path) -> Path:
    return _copy_dir(bert_dir, tmp_path)


@pytest.fixture(scope="module")
def sentences(tmp_path_factory) -> Path:
    return _sentences_file(tmp_path_factory.mktemp("text"), 20)


def _edit_safetensors(model_dir: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(model_dir / "model.safetensors"))
    edit(sd)
    save_file(sd, str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    from safetensors.torch import save_file

    from tests.cli_factories import mlp

    d = tmp_path_factory.mktemp("mlp")
    torch.manual_seed(1)
    save_file(mlp().state_dict(), str(d / "mlp.safetensors"))
    calib = d / "calib"
    calib.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        torch.save(torch.randn(8, 64, generator=gen), calib / f"b{i}.pt")
    return d / "mlp.safetensors", calib


def _mlp_args(weights, calib, out, *extra, factory="tests.cli_factories:mlp"):
    return ["quantize", factory, "--recipe", "static", "--weights", str(weights), "--example-input", "8x64:float32",
            "--calib", str(calib), "--out", str(out), "--quiet", *extra]


@pytest.fixture(scope="module")
def mlp_artifact(mlp_files, tmp_path_factory) -> Path:
    weights, calib = mlp_files
    out = tmp_path_factory.mktemp("art") / "mlp-int8"
    assert main(_mlp_args(weights, calib, out)) == 0
    return out


@pytest.fixture
def artifact(mlp_artifact, tmp_path) -> Path:
    d = tmp_path / "artifact"
    shutil.copytree(mlp_artifact, d)
    return d


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    doc = edit(doc) or doc
    path.write_text(json.dumps(doc))


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was noticed")

    monkeypatch.setattr(_hf, "load_hf_checkpoint", refuse)


# --- 13.2: eval never imports code an artifact names ---------------------------------------------

_EVIL = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported")

def build():
    from tests.cli_factories import mlp
    return mlp()
'''


def _plant(artifact: Path, where: Path) -> Path:
    """An importable module ``quantkit_evil`` in ``where`` that writes a marker when imported,
    and a quantization.json naming it as the factory of the float model."""
    marker = where / "MARKER"
    (where / "quantkit_evil.py").write_text(_EVIL.format(marker=str(marker)))
    _edit_json(artifact / "quantization.json",
               lambda d: d["source"]["model"].update(factory="quantkit_evil:build"))
    return marker


def test_eval_does_not_import_the_factory_an_artifact_names(artifact, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    marker = _plant(artifact, cwd)
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))  # importable: only eval's refusal keeps it from running
    line = _fails(["eval", str(artifact), "--quiet"], capsys, code=2, inputs=[artifact])
    assert "--model quantkit_evil:build" in line and "does not import code" in line, line
    assert not marker.exists(), "eval imported a module named by quantization.json"
    # asked explicitly, the same factory is imported (the positive control for the marker)
    assert main(["eval", str(artifact), "--model", "quantkit_evil:build", "--no-compile", "--json", "--quiet"]) == 0
    assert marker.exists()
    res = json.loads(capsys.readouterr().out)
    assert res["metric"]["mean_cosine"] > 0.999, res


def test_eval_console_script_in_a_hostile_directory(artifact, tmp_path):
    """The real executable, run from the directory holding the module (``''`` on sys.path)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    marker = _plant(artifact, cwd)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    proc = subprocess.run([sys.executable, "-m", "quantkit", "eval", str(artifact), "--quiet"],
                          capture_output=True, text=True, cwd=cwd, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "--model" in _error(proc.stderr)
    assert not marker.exists()


@pytest.mark.parametrize("command, edit, needle", [
    ("eval", lambda d: d["source"].update(model=["x"]), "source.model is list"),
    ("eval", lambda d: d["source"]["model"].update(kind="plugin"), "kind 'plugin'"),
    ("eval", lambda d: d["source"]["model"].update(factory="os:system; rm -rf /"), "is not package.module:factory"),
    ("eval", lambda d: d["source"]["model"].update(task=7), "'task' is int"),
    ("eval-recorded", lambda d: d["source"].update(model={"kind": "hf", "path": "/nonexistent/model"}),
     "does not exist"),
    ("eval", lambda d: d["source"].update(heldout="abc"), "source.heldout"),
    ("eval", lambda d: d["source"].update(heldout=[0, 10**6]), "source.heldout"),
    ("eval", lambda d: d["source"].update(samples="many"), "source.samples"),
    ("eval", lambda d: d["source"].update(seq_len=-1), "source.seq_len"),
    ("eval", lambda d: d["source"].update(data={"kind": "tensors", "path": 5}), "source.data"),
    ("eval", lambda d: d["source"].update(data={"kind": "tensors", "path": "/nonexistent/calib"}), "does not exist"),
    ("eval", lambda d: d.update(source="x"), "'source' is str"),
    ("inspect", lambda d: d.update(recipe=["a"]), "'recipe' is list"),
    ("inspect", lambda d: d.update(tensors={"a": 1}), "'tensors' is dict"),
    ("inspect", lambda d: d.update(tensors=[1, 2]), "not objects"),
    ("inspect", lambda d: [d], "is not a quantkit quantization.json"),
])
def test_hostile_quantization_json(command, edit, needle, artifact, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _edit_json(artifact / "quantization.json", edit)
    argv = {"eval": ["eval", str(artifact), "--model", "tests.cli_factories:mlp", "--quiet", "--no-compile"],
            "eval-recorded": ["eval", str(artifact), "--quiet", "--no-compile"],
            "inspect": ["inspect", str(artifact)]}[command]
    line = _fails(argv, capsys, code=1, inputs=[artifact])
    assert needle in line, line


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(layers=[1, 2]), "not objects"),
    (lambda d: d.update(metric="great"), "'metric' is str"),
    (lambda d: [d], "not an object"),
])
def test_hostile_report_json(edit, needle, artifact, capsys):
    _edit_json(artifact / "report.json", edit)
    assert needle in _fails(["inspect", str(artifact)], capsys, code=1, inputs=[artifact])


def test_quantization_json_that_is_not_json(artifact, capsys):
    (artifact / "quantization.json").write_bytes(b"\xff\xfe{not json")
    assert "not readable JSON" in _fails(["eval", str(artifact), "--quiet"], capsys, code=1, inputs=[artifact])


# --- 13.3: strict checkpoint loading -------------------------------------------------------------

@pytest.mark.parametrize("case, needle", [
    ("missing", "1 missing (bert.encoder.layer.0.attention.self.query.weight)"),
    ("extra", "1 unexpected (extra.thing)"),
    ("mis-shaped", "1 mis-shaped (classifier.weight: checkpoint [4, 32], model [3, 32])"),
])
def test_checkpoint_tensors_that_do_not_fit(case, needle, bert_copy, sentences, tmp_path, capsys):
    if case == "missing":
        _edit_safetensors(bert_copy, lambda sd: sd.pop("bert.encoder.layer.0.attention.self.query.weight"))
    elif case == "extra":
        _edit_safetensors(bert_copy, lambda sd: sd.update({"extra.thing": torch.zeros(2)}))
    else:
        _edit_safetensors(bert_copy, lambda sd: sd.update({"classifier.weight": torch.zeros(4, 32)}))
    out = tmp_path / "out"
    t0 = time.perf_counter()
    line = _fails(["quantize", str(bert_copy), "--calib", str(sentences), "--out", str(out), "--quiet"], capsys,
                  code=1, inputs=[bert_copy, sentences], out=out)
    assert time.perf_counter() - t0 < FAST_S, "the mismatch must be found before calibration"
    assert needle in line and "do not fit BertForSequenceClassification" in line, line
    assert "--allow-missing-weights" in line


@pytest.mark.parametrize("n_positions", [128, None])
def test_config_of_another_architecture_over_bert_weights(bert_copy, sentences, tmp_path, capsys, n_positions):
    """With sizes that fit the checkpoint, the weights' names do not fit the class; with GPT-2's default
    1024 positions over BERT's 128-row table, the size check (before anything is built) says so first."""
    transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=30522, n_positions=n_positions or 1024,
                            architectures=["GPT2LMHeadModel"]).save_pretrained(str(bert_copy))
    out = tmp_path / "out"
    line = _fails(["quantize", str(bert_copy), "--calib", str(sentences), "--out", str(out), "--quiet"], capsys,
                  code=1, inputs=[bert_copy, sentences], out=out)
    if n_positions is None:
        assert "n_positions = 1024" in line and "bert.embeddings.position_embeddings.weight has 128 rows" in line
        return
    assert "do not fit GPT2LMHeadModel" in line
    assert re.search(r"\d+ missing \(.*\), \d+ unexpected \(bert\.", line), line


def test_architecture_transformers_does_not_have(bert_copy, tmp_path, capsys, no_model_loading):
    _edit_json(bert_copy / "config.json", lambda d: d.update(architectures=["EvilModelForPwning"]))
    out = tmp_path / "out"
    line = _fails(["quantize", str(bert_copy), "--out", str(out)], capsys, code=1, inputs=[bert_copy], out=out)
    assert "'EvilModelForPwning'" in line and "custom model code is never run" in line and "--task" in line


def test_allow_missing_weights_is_reported(bert_copy, sentences, tmp_path, capsys):
    """A base checkpoint loaded with a head (--task sequence-classification): the head is missing.
    With --allow-missing-weights it quantizes, and stdout, report.json and report.md say so."""
    base = tmp_path / "base"
    _tiny_bert(base, cls=transformers.BertModel)
    out = tmp_path / "out"
    args = ["quantize", str(base), "--task", "sequence-classification", "--calib", str(sentences), "--out", str(out),
            "--quiet", "--num-calib", "8"]
    line = _fails(args, capsys, code=1, inputs=[base], out=out)
    assert "2 missing (classifier.bias, classifier.weight)" in line, line
    assert main(args + ["--allow-missing-weights"]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    assert "warning: --allow-missing-weights" in printed.out and "classifier.weight" in printed.out
    rep = json.loads((out / "report.json").read_text())
    assert rep["weights_not_loaded"]["missing"] == ["classifier.bias", "classifier.weight"]
    assert "**Warning: the checkpoint does not fit BertForSequenceClassification" in (out / "report.md").read_text()


def test_factory_weights_that_do_not_fit(mlp_files, tmp_path, capsys):
    weights, calib = mlp_files
    from safetensors.torch import load_file, save_file

    sd = load_file(str(weights))
    sd["fc2.weight"] = torch.zeros(5, 5)
    sd["junk"] = torch.zeros(1)
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad))
    out = tmp_path / "out"
    line = _fails(_mlp_args(bad, calib, out), capsys, code=1, inputs=[bad, calib], out=out)
    assert "1 unexpected (junk), 1 mis-shaped (fc2.weight: checkpoint [5, 5], model [128, 128])" in line, line


# --- 13.5: honest numbers ----------------------------------------------------------------------

def _nan_calib(tmp_path: Path) -> Path:
    calib = tmp_path / "nan-calib"
    calib.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        x = torch.randn(8, 64, generator=gen)
        if i == 1:
            x[3, 5] = float("nan")
        torch.save(x, calib / f"b{i}.pt")
    return calib


def test_nan_in_calibration_and_heldout_data(mlp_files, tmp_path, capsys):
    weights, _ = mlp_files
    calib = _nan_calib(tmp_path)
    out = tmp_path / "out"
    line = _fails(_mlp_args(weights, calib, out), capsys, code=1, inputs=[calib], out=out)
    assert "b1.pt[3] holds NaN or inf (1 of 24 samples do)" in line and "--skip-nonfinite" in line, line
    assert main(_mlp_args(weights, calib, out, "--skip-nonfinite")) == 0
    rep = json.loads((out / "report.json").read_text(), parse_constant=_no_constants)
    assert rep["data"]["nonfinite_skipped"] == 1 and rep["data"]["nonfinite_examples"] == ["b1.pt[3]"]
    assert rep["data"]["calibration_samples"] + rep["data"]["heldout_samples"] == 23
    assert "1 samples holding NaN or inf were left out" in (out / "report.md").read_text()


def _no_constants(name):
    raise AssertionError(f"non-standard JSON constant {name}")


def test_nan_in_eval_data(artifact, tmp_path, capsys):
    data = tmp_path / "eval-data"
    data.mkdir()
    x = torch.randn(6, 64)
    x[4, 0] = float("inf")
    torch.save(x, data / "x.pt")
    argv = ["eval", str(artifact), "--model", "tests.cli_factories:mlp", "--data", str(data), "--no-compile",
            "--quiet", "--json"]
    line = _fails(argv, capsys, code=1, inputs=[data, artifact])
    assert "x.pt[4] holds NaN or inf" in line, line
    assert main(argv + ["--skip-nonfinite"]) == 0
    res = json.loads(capsys.readouterr().out, parse_constant=_no_constants)
    assert res["samples_nonfinite_skipped"] == 1 and res["metric"]["samples"] == 5


def test_model_that_outputs_inf(mlp_files, tmp_path, capsys):
    """exp() of the MLP: finite on the calibration data, inf on large inputs given to eval."""
    weights, calib = mlp_files
    from safetensors.torch import save_file

    from tests.cli_factories import exp_head

    torch.manual_seed(1)
    model = exp_head()
    w = tmp_path / "exp.safetensors"
    save_file(model.state_dict(), str(w))
    out = tmp_path / "exp-int8"
    assert main(_mlp_args(w, calib, out, factory="tests.cli_factories:exp_head")) == 0
    rep = (out / "report.json").read_text()
    json.loads(rep, parse_constant=_no_constants)
    big = tmp_path / "big"
    big.mkdir()
    torch.save(torch.full((2, 64), 1e4), big / "big.pt")
    line = _fails(["eval", str(out), "--model", "tests.cli_factories:exp_head", "--data", str(big), "--no-compile",
                   "--quiet"], capsys, code=1, inputs=[big, out])
    assert "the float model produced NaN or inf for sample big.pt[0]" in line, line


# --- 13.6 / 13.7: outputs, observers, raw exceptions ---------------------------------------------

def test_out_inside_the_model_directory(bert_copy, tmp_path, capsys, no_model_loading):
    out = bert_copy / "int8"
    line = _fails(["quantize", str(bert_copy), "--out", str(out)], capsys, code=2, inputs=[bert_copy], out=out)
    assert "is inside the input directory" in line


def test_out_inside_the_calibration_directory(mlp_files, tmp_path, capsys):
    weights, calib = mlp_files
    out = calib / "sub" / "int8"
    line = _fails(_mlp_args(weights, calib, out), capsys, code=2, inputs=[calib], out=out)
    assert "is inside the input directory" in line


def test_out_under_a_regular_file(bert_dir, tmp_path, capsys, no_model_loading):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "sub" / "int8"
    t0 = time.perf_counter()
    line = _fails(["quantize", str(bert_dir), "--out", str(out)], capsys, code=1, inputs=[bert_dir, blocker])
    assert time.perf_counter() - t0 < FAST_S
    assert "is not a directory" in line and "cannot be created" in line, line


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create entries in: a read-only one (not as root), or /sys."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d
    probe = Path("/sys")
    try:
        os.rmdir(__import__("tempfile").mkdtemp(dir=probe))
    except OSError:
        return probe
    pytest.skip("running as root with a writable /sys: no unwritable directory to test with")


def test_unwritable_out_fails_before_loading(bert_dir, tmp_path, capsys, no_model_loading):
    parent = _unwritable_dir(tmp_path)
    out = parent / "quantkit-test" / "int8"
    t0 = time.perf_counter()
    line = _fails(["quantize", str(bert_dir), "--out", str(out)], capsys, code=1, inputs=[bert_dir])
    assert time.perf_counter() - t0 < FAST_S
    assert "is not writable" in line, line
    assert not out.parent.exists()


@pytest.mark.parametrize("flag, role", [("--observer", "activations"), ("--weight-observer", "weights")])
def test_dynamic_only_observer_is_refused_up_front(flag, role, tmp_path, capsys, no_model_loading):
    """'placeholder' records nothing (it marks dynamic activations): it used to be listed, then fail
    after calibration; per-channel observers cannot measure per-tensor activations."""
    out = tmp_path / "out"
    line = _fails(["quantize", "--out", str(out), flag, "placeholder"], capsys, code=2, out=out)
    assert f"observer 'placeholder' cannot measure {role}" in line
    assert "placeholder" not in line.split("available:")[1]
    if flag == "--observer":
        line = _fails(["quantize", "--out", str(out), flag, "per_channel_minmax"], capsys, code=2, out=out)
        assert "per_channel_minmax" not in line.split("available:")[1] and "minmax" in line


def test_factory_sample_with_other_inputs(mlp_files, tmp_path, capsys):
    """A file holding two tensors among one-tensor files: named, before torch.stack sees it."""
    weights, _ = mlp_files
    calib = tmp_path / "calib"
    calib.mkdir()
    torch.save(torch.randn(4, 64), calib / "a.pt")
    torch.save(torch.randn(4, 64), calib / "b.pt")
    out = tmp_path / "out"
    torch.save((torch.randn(4, 64), torch.randn(4, 64)), calib / "c.pt")
    line = _fails(_mlp_args(weights, calib, out), capsys, code=1, inputs=[calib], out=out)
    assert "has 2 tensors, --example-input has 1" in line, line


@pytest.mark.parametrize("case, needle", [
    ("float-ids", "float32 tensor, but this text model takes token ids"),
    ("out-of-vocab", "outside the model's vocabulary of 30522"),
    ("ragged-dicts", "holds different inputs from sample"),
    ("ragged-shapes", "samples batched together need equal shapes"),
])
def test_hf_tensor_data_that_cannot_be_batched(case, needle, bert_dir, tmp_path, capsys):
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(4):
        if case == "float-ids":
            obj = torch.randn(4, 10)
        elif case == "out-of-vocab":
            obj = torch.full((4, 10), 40000)
        elif case == "ragged-dicts":
            ids = torch.randint(0, 1000, (2, 10))
            obj = {"input_ids": ids} if i % 2 else {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}
        else:
            obj = (torch.randint(0, 1000, (2, 10 + i)), torch.ones(2, 10 + i, dtype=torch.long))
        torch.save(obj, calib / f"{i}.pt")
    out = tmp_path / "out"
    line = _fails(["quantize", str(bert_dir), "--calib", str(calib), "--out", str(out), "--quiet"], capsys,
                  code=1, inputs=[calib, bert_dir], out=out)
    assert needle in line, line


def test_api_wording_is_mapped_to_flags(mlp_files, tmp_path, capsys):
    """--ops add on a model without adds: nothing to quantize. The API's message says to call
    quantkit.prepare; the CLI user is told about the flags instead."""
    weights, calib = mlp_files
    out = tmp_path / "out"
    line = _fails(_mlp_args(weights, calib, out, "--ops", "add"), capsys, code=1, inputs=[calib], out=out)
    assert "check --ops and --skip" in line and "quantkit.prepare" not in line, line


def test_ansi_escapes_are_stripped(mlp_files, tmp_path, capsys):
    _, calib = mlp_files
    out = tmp_path / "out"
    line = _fails(["quantize", "tests.cli_factories:ansi_error", "--example-input", "8x64:float32", "--calib",
                   str(calib), "--out", str(out), "--quiet"], capsys, code=1, inputs=[calib], out=out)
    assert "failed when called: boom in the factory" in line


@pytest.mark.parametrize("argv, needle", [
    (["--scheme", "w8a8", "--dynamic"], "--dynamic conflicts with --scheme w8a8"),
    (["--scheme", "w8a8-per-token", "--granularity", "per-tensor"], "conflicts with --scheme w8a8-per-token"),
    (["--granularity", "per-token"], "needs --dynamic"),
    (["--dynamic", "--granularity", "per-token", "--activation", "affine-uint8"], "use --activation symmetric-int8"),
    (["--dynamic", "--observer", "kl"], "--observer has no effect with dynamic activations"),
    (["--ops", "linear,attention"], "unknown op families ['attention'] for --ops"),
    (["--device", "cuda:7"], "--device cuda:7 is not available"),
    (["--device", "gpu"], "--device 'gpu' is not cpu, cuda or cuda:N"),
    (["--task", "vision"], "invalid choice: 'vision'"),
])
def test_conflicting_or_unavailable_flags(argv, needle, tmp_path, capsys, no_model_loading):
    if argv[:2] == ["--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    out = tmp_path / "out"
    t0 = time.perf_counter()
    line = _fails(["quantize", "--out", str(out), *argv], capsys, code=2, out=out)
    assert needle in line, line
    assert time.perf_counter() - t0 < FAST_S


def test_terminal_escapes_in_artifact_json_are_not_printed(artifact, capsys):
    """Strings an artifact's JSON holds reach the terminal through inspect: control characters
    (e.g. a screen-clearing escape) are shown as visible escapes."""
    _edit_json(artifact / "report.json", lambda d: d.update(model="\x1b[2J\x1b]0;pwned\x07mlp"))
    _edit_json(artifact / "quantization.json", lambda d: d["recipe"].update(skip=["\x1b[31mfc1"]))
    before = _tree(artifact)
    assert main(["inspect", str(artifact)]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    assert "\x1b" not in printed.out and "\x07" not in printed.out
    assert r"model:    \x1b[2J\x1b]0;pwned\x07mlp" in printed.out
    assert _tree(artifact) == before


# --- pickle payloads in the files quantize reads ------------------------------------------

class _Payload:
    """Unpickling this runs ``exec`` of a line that writes ``marker`` (what a hostile .pt does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def _hostile_pt(path: Path, marker: Path, wrap) -> Path:
    torch.save(wrap(_Payload(marker)), path)
    return path


@pytest.mark.parametrize("wrap", [lambda p: p, lambda p: {"x": torch.zeros(8, 64), "evil": p},
                                  lambda p: (torch.zeros(8, 64), p)], ids=["bare", "in-dict", "in-tuple"])
def test_pickle_payload_in_calibration_tensors_never_runs(mlp_files, tmp_path, capsys, wrap):
    weights, _ = mlp_files
    calib, marker, out = tmp_path / "calib", tmp_path / "MARKER", tmp_path / "out"
    calib.mkdir()
    _hostile_pt(calib / "b0.pt", marker, wrap)
    line = _fails(_mlp_args(weights, calib, out), capsys, code=1, inputs=[calib], out=out)
    assert "could not read calibration tensor file" in line and "b0.pt" in line, line
    assert not marker.exists(), "a pickle payload in calibration data ran"
    # the positive control: the file really runs code when unpickled without weights_only
    torch.load(str(calib / "b0.pt"), weights_only=False)
    assert marker.exists()


def test_pickle_payload_in_weights_file_never_runs(mlp_files, tmp_path, capsys):
    _, calib = mlp_files
    marker, out = tmp_path / "MARKER", tmp_path / "out"
    weights = _hostile_pt(tmp_path / "mlp.pt", marker, lambda p: {"fc1.weight": torch.zeros(2), "evil": p})
    line = _fails(_mlp_args(weights, calib, out), capsys, code=1, inputs=[weights, calib], out=out)
    assert "could not read weights" in line and "mlp.pt" in line, line
    assert not marker.exists(), "a pickle payload in --weights ran"


def test_pickle_payload_in_hf_checkpoint_never_runs(bert_copy, sentences, tmp_path, capsys):
    """An HF directory whose only weights are a hostile pytorch_model.bin."""
    marker, out = tmp_path / "MARKER", tmp_path / "out"
    from safetensors.torch import load_file

    sd = load_file(str(bert_copy / "model.safetensors"))
    (bert_copy / "model.safetensors").unlink()
    sd["evil"] = _Payload(marker)
    torch.save(sd, bert_copy / "pytorch_model.bin")
    rc = main(["quantize", str(bert_copy), "--calib", str(sentences), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    line = _error(err)
    assert rc == 1, line
    assert "hold pickled objects that are not tensors" in line and "model.safetensors" in line, line
    assert not marker.exists(), "a pickle payload in pytorch_model.bin ran"
    _no_leftovers(out)


def test_closed_stdout_is_not_an_error(mlp_artifact, monkeypatch, capsys):
    """`quantkit inspect DIR | head -2`: the reader closing the pipe ends the command quietly."""

    class _ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            raise ValueError("no descriptor")  # main() must not depend on one

    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    rc = main(["inspect", str(mlp_artifact)])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert rc == 0 and err == "", (rc, err)
    assert main(["inspect", str(mlp_artifact)]) == 0  # and normally it prints its table
    assert "int8 weights" in capsys.readouterr().out
