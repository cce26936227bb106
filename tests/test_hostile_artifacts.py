"""Artifacts that try to run code, damaged or tampered artifacts, overwrites of foreign directories,
interrupted and killed writes, and round trips (issues 12 and 13).

Hostile ``model.pt2`` files are built from a real one by editing its members; each payload tries to
create a marker file. Control tests show that ``torch.export.load`` itself runs these payloads, so a
missing marker under ``quantkit.load`` means quantkit stopped them (not that the payload was inert).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit.export import _artifact, _atomic, _safe_pt2
from tests.models import make_mlp

ROOT = "model/"


class _Payload:
    """Unpickling this runs ``code`` (what an attacker would put in a pickle)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def _torch_pickle(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _chr_code(code: str) -> str:
    """``code`` as an expression without quotes: chr(..)+chr(..)."""
    return "+".join(f"chr({ord(c)})" for c in code)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A quantized MLP, its artifact directory and a batch of inputs."""
    torch.manual_seed(0)
    model, x = make_mlp()
    qmodel = quantkit.quantize(model, (x[:8],), [(b,) for b in x.split(32)], progress=False)
    path = quantkit.save(qmodel, tmp_path_factory.mktemp("saved") / "mlp")
    return qmodel, path, x


def _members(pt2: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(pt2) as zf:
        return {i.filename: zf.read(i.filename) for i in zf.infolist()}


def _write_zip(dst: Path, members: dict[str, bytes], *, compress: bool = False, extra: tuple = ()) -> None:
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as zf, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": intended in one case
        for name, data in list(members.items()) + list(extra):
            zf.writestr(name, data)


def _edit_json(members: dict, name: str, edit) -> None:
    doc = json.loads(members[ROOT + name])
    edit(doc)
    members[ROOT + name] = json.dumps(doc).encode()


def _hostile(src: Path, dst: Path, edit, **zip_kwargs) -> Path:
    """A copy of artifact ``src`` whose model.pt2 ``edit`` changed, with quantization.json's SHA-256
    updated to match (an attacker can recompute it), so only the archive checks can stop it."""
    dst.mkdir()
    members = _members(src / "model.pt2")
    extra = edit(members) or ()
    _write_zip(dst / "model.pt2", members, extra=extra, **zip_kwargs)
    doc = json.loads((src / "quantization.json").read_text())
    doc["model_sha256"] = hashlib.sha256((dst / "model.pt2").read_bytes()).hexdigest()
    (dst / "quantization.json").write_text(json.dumps(doc))
    return dst


# --- hostile archives -------------------------------------------------------------------------

def _sample_inputs(marker):
    def edit(m):
        m[ROOT + "data/sample_inputs/model.pt"] = _torch_pickle(((_Payload(f"open({str(marker)!r}, 'w')"),), {}))
    return edit


def _weight_pickle(marker):
    def edit(m):
        _edit_json(m, "data/weights/model_weights_config.json",
                   lambda d: d["config"]["model.fc1.bias"].update(use_pickle=True))
        entry = json.loads(m[ROOT + "data/weights/model_weights_config.json"])["config"]["model.fc1.bias"]
        m[ROOT + "data/weights/" + entry["path_name"]] = _torch_pickle(_Payload(f"open({str(marker)!r}, 'w')"))
    return edit


def _pickled_constant(path_name, dumps):
    """A constant member ``path_name`` marked ``use_pickle``, holding ``dumps(payload)``."""
    def make(marker):
        def edit(m):
            m[ROOT + "data/constants/model_constants_config.json"] = json.dumps({"config": {"c": {
                "path_name": path_name, "is_param": False, "use_pickle": True, "tensor_meta": None}}}).encode()
            m[ROOT + "data/constants/" + path_name] = dumps(_Payload(f"open({str(marker)!r}, 'w')"))
        return edit
    return make


_constant_pickle = _pickled_constant("tensor_constant_0", _torch_pickle)
_opaque_object = _pickled_constant("opaque_obj_0", pickle.dumps)
_custom_object = _pickled_constant("custom_obj_0", pickle.dumps)


def _legacy_weights(marker):
    def edit(m):
        m[ROOT + "data/weights/model.pt"] = _torch_pickle({"w": _Payload(f"open({str(marker)!r}, 'w')")})
    return edit


def _legacy_constants(marker):
    def edit(m):
        m[ROOT + "data/constants/model.pt"] = _torch_pickle({"c": _Payload(f"open({str(marker)!r}, 'w')")})
    return edit


def _aoti(marker):
    def edit(m):
        m[ROOT + "data/aotinductor/model/model.so"] = b"\x7fELF not really"
    return edit


def _old_format(marker):
    def edit(m):
        m[ROOT + "version"] = b"8.0"
    return edit


def _guard(marker):
    def edit(m):
        _edit_json(m, "models/model.json", lambda d: d.__setitem__(
            "guards_code", [f"open({str(marker)!r}, 'w') is not None"]))
    return edit


def _placeholder_name(marker):
    def edit(m):
        # the user input "x" becomes a default argument evaluated when FX compiles forward()
        evil = json.dumps(f"x=exec({_chr_code(f'open({str(marker)!r}, chr(119))')})")
        m[ROOT + "models/model.json"] = m[ROOT + "models/model.json"].decode().replace('"x"', evil).encode()
    return edit


def _expr_str(marker):
    def edit(m):
        def put(d):
            for tv in d["graph_module"]["graph"]["tensor_values"].values():
                for s in tv["sizes"]:
                    if "as_expr" in s:
                        s["as_expr"]["expr_str"] = f"0*len(str(exec({_chr_code(f'open({str(marker)!r}, chr(119))')})))"
                        return
        _edit_json(m, "models/model.json", put)
    return edit


def _weight_name(marker):
    def edit(m):
        new = 'model.fc1.b")+str(exec(' + _chr_code(f"open({str(marker)!r}, chr(119))") + '))+("'
        for k in list(m):
            if k.endswith(".json"):
                m[k] = m[k].decode().replace('"model.fc1.bias"', json.dumps(new)).encode()
    return edit


def _import_in_spec(marker):
    def edit(m):
        ctx = {"default_factory_module": "qk_evil_module", "default_factory_name": "f", "dict_context": []}
        spec = json.dumps([1, {"type": "collections.defaultdict", "context": ctx, "children_spec": []}])
        _edit_json(m, "models/model.json", lambda d: d["graph_module"]["module_call_graph"][0]["signature"]
                   .__setitem__("in_spec", spec))
    return edit


def _duplicate_member(marker):
    def edit(m):
        # two members with one name: zip readers disagree on which one counts
        return [(ROOT + "data/sample_inputs/model.pt", _torch_pickle(((_Payload("0"),), {})))]
    return edit


HOSTILE = {
    "sample-inputs-pickle": (_sample_inputs, "'data/sample_inputs/model.pt' holds Python objects that need a full unpickler"),
    "weight-marked-pickled": (_weight_pickle, "weight 'model.fc1.bias' is stored pickled and needs a full unpickler"),
    "constant-marked-pickled": (_constant_pickle, "constant 'c' is stored pickled and needs a full unpickler"),
    "opaque-object": (_opaque_object, "'data/constants/opaque_obj_0' is a pickled object that needs a full unpickler"),
    "torchscript-object": (_custom_object, "'data/constants/custom_obj_0' is a pickled object that needs a full unpickler"),
    "legacy-weights-file": (_legacy_weights, "'data/weights/model.pt' is a legacy pickled weights file"),
    "legacy-constants-file": (_legacy_constants, "'data/constants/model.pt' is a legacy pickled constants file"),
    "aotinductor-library": (_aoti, "is compiled native code"),
    "pre-2.8-format": (_old_format, "it is in the pre-2.8 pickled format"),
    "guard-code": (_guard, "is not a plain comparison of input sizes"),
    "placeholder-name": (_placeholder_name, "graph name 'x=exec(chr(111)"),
    "sympy-expression": (_expr_str, "symbolic size '0*len(str(exec("),
    "weight-name": (_weight_name, "is not a dotted Python name"),
    "pytree-import": (_import_in_spec, "input/output structure uses 'collections.defaultdict'"),
    "duplicate-member": (_duplicate_member, "member 'model/data/sample_inputs/model.pt' appears twice"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_archive_is_refused_without_running_it(case, saved, tmp_path, monkeypatch):
    _, good, _ = saved
    marker = tmp_path / "PWNED"
    (tmp_path / "qk_evil_module.py").write_text(f"open({str(marker)!r}, 'w')\nf = dict\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    make, message = HOSTILE[case]
    bad = _hostile(good, tmp_path / "bad", make(marker))
    before = {p.name: p.read_bytes() for p in bad.iterdir()}
    for read in (quantkit.load, _artifact.verify_artifact):
        with pytest.raises(quantkit.QuantkitError) as err:
            read(bad)
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"refusing to load {str(bad / 'model.pt2')!r}: "), text
        assert message in text, text
        assert not marker.exists(), f"{read.__name__} ran the payload"
    assert {p.name: p.read_bytes() for p in bad.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "qk_evil_module.py"]


@pytest.mark.parametrize("case", ["sample-inputs-pickle", "weight-marked-pickled", "constant-marked-pickled",
                                  "opaque-object", "legacy-weights-file", "guard-code", "placeholder-name",
                                  "sympy-expression", "pytree-import"])
def test_control_torch_export_load_runs_these_payloads(case, saved, tmp_path, monkeypatch):
    """The payloads are live: torch's own reader runs them (if this fails, torch closed that path)."""
    _, good, x = saved
    marker = tmp_path / "PWNED"
    (tmp_path / "qk_evil_module.py").write_text(f"open({str(marker)!r}, 'w')\nf = dict\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("qk_evil_module", None)
    bad = _hostile(good, tmp_path / "bad", HOSTILE[case][0](marker))
    try:
        torch.export.load(str(bad / "model.pt2")).module()(x[:4])  # guards run at the call
    except Exception:
        pass
    finally:
        sys.modules.pop("qk_evil_module", None)
    assert marker.exists(), f"torch.export.load no longer runs the {case} payload; update quantkit/export/_safe_pt2.py's notes"


@pytest.mark.parametrize("case", ["sample-inputs-pickle", "weight-marked-pickled", "constant-marked-pickled",
                                  "opaque-object", "legacy-weights-file", "legacy-constants-file"])
def test_unpickling_guard_stops_torch_export_load(case, saved, tmp_path):
    """Second guard: inside refuse_unsafe_unpickling even torch's own reader cannot unpickle code."""
    _, good, _ = saved
    marker = tmp_path / "PWNED"
    bad = _hostile(good, tmp_path / "bad", HOSTILE[case][0](marker))
    real_load = torch.load
    with pytest.raises(Exception):
        with _safe_pt2.refuse_unsafe_unpickling():
            torch.export.load(str(bad / "model.pt2"))
    assert not marker.exists()
    assert torch.load is real_load  # restored


def test_save_refuses_a_program_it_could_not_load_again(saved, tmp_path, monkeypatch):
    """A program torch would pickle (here: simulated by torch.export.save writing a pickled weight) is not saved."""
    qmodel, good, _ = saved
    members = _members(good / "model.pt2")
    _weight_pickle(tmp_path / "PWNED")(members)
    monkeypatch.setattr(torch.export, "save", lambda program, f: _write_zip(Path(f), members))
    with pytest.raises(quantkit.QuantkitError) as err:
        quantkit.save(qmodel, tmp_path / "out")
    assert str(err.value) == ("cannot save this program as a quantkit artifact: weight 'model.fc1.bias' is stored "
                              "pickled and needs a full unpickler (quantkit.load would refuse it); keep weights and "
                              "inputs plain tensors")
    assert list(tmp_path.iterdir()) == []


def test_compressed_or_foreign_members_are_refused(saved, tmp_path):
    _, good, _ = saved
    deflated = _hostile(good, tmp_path / "deflated", lambda m: None, compress=True)
    with pytest.raises(quantkit.QuantkitError, match=r"member 'model/data/weights/weight_0' is compressed"):
        quantkit.load(deflated)
    extra = _hostile(good, tmp_path / "extra", lambda m: m.__setitem__(ROOT + "extra/notes.txt", b"hi"))
    with pytest.raises(quantkit.QuantkitError, match=r"unexpected member 'extra/notes.txt'"):
        quantkit.load(extra)
    escape = _hostile(good, tmp_path / "escape", lambda m: m.__setitem__("other/evil.py", b"x"))
    with pytest.raises(quantkit.QuantkitError, match=r"member 'other/evil.py' is outside the archive root 'model/'"):
        quantkit.load(escape)


def test_program_json_of_the_wrong_shape_is_one_line(saved, tmp_path):
    _, good, _ = saved
    bad = _hostile(good, tmp_path / "bad", lambda m: _edit_json(
        m, "models/model.json", lambda d: d["graph_module"].__setitem__("graph", [1, 2])))
    with pytest.raises(quantkit.QuantkitError, match=r"^could not load '.*model.pt2': damaged archive "
                                                     r"\(AttributeError\); re-create it$"):
        quantkit.load(bad)


def test_plain_guards_and_shape_expressions_are_accepted():
    """What torch itself writes passes the checks; look-alikes that call things do not."""
    for guard in ["L['x'].size()[0] == 1", "L['kwargs']['input_ids'].size()[1] <= 512",
                  "2 <= L['x'].size()[0] and L['x'].stride()[0] == L['x'].size()[1]"]:
        _safe_pt2._check_guard(guard)
    for guard in ["__import__('os').system('true')", "L['x'].size()[0] == open('f').read()",
                  "L['x'].__class__", "(lambda: 1)() == 1"]:
        with pytest.raises(quantkit.QuantkitError, match="is not a plain comparison of input sizes"):
            _safe_pt2._check_guard(guard)
    symbol = _safe_pt2._symbol_re()
    for expr in ["Symbol('s77', positive=True, integer=True)", "Mul(Integer(2), Symbol('s0', integer=True))",
                 "FloorDiv(Symbol('s1', integer=True), Integer(2))", "Float('1.5', precision=53)"]:
        _safe_pt2._check_expr(expr, symbol)
    for expr in ["Symbol('s0').__class__", "eval(chr(49))", "Symbol('os', integer=True)", "s0 + getattr(s0, 'x')"]:
        with pytest.raises(quantkit.QuantkitError, match="symbolic size"):
            _safe_pt2._check_expr(expr, symbol)


# --- integrity: hash, truncation ----------------------------------------------------------------

def test_save_records_the_sha256_of_model_pt2(saved):
    _, path, _ = saved
    doc = json.loads((path / "quantization.json").read_text())
    assert doc["model_sha256"] == hashlib.sha256((path / "model.pt2").read_bytes()).hexdigest()
    assert _artifact.verify_artifact(path)["model_sha256"] == doc["model_sha256"]


def test_cli_style_writes_get_the_sha256_too(saved, tmp_path):
    """The CLI writes model.pt2 and quantization.json itself inside atomic_dir: the hash is added at commit."""
    qmodel, _, _ = saved
    program = _artifact.export_converted(qmodel)
    doc = _artifact.recipe_document(qmodel, recipe={"scheme": "w8a8"})
    with _artifact.atomic_dir(tmp_path / "cli", overwrite=False) as tmp:
        _artifact.write_json(tmp / "quantization.json", doc)  # before the model: order must not matter
        _artifact.write_program(program, tmp)
        (tmp / "report.md").write_text("# report\n")
    written = json.loads((tmp_path / "cli" / "quantization.json").read_text())
    assert written["model_sha256"] == hashlib.sha256((tmp_path / "cli" / "model.pt2").read_bytes()).hexdigest()
    assert written["recipe"] == {"scheme": "w8a8"}


@pytest.mark.parametrize("damage", ["truncated", "one-byte-flipped", "appended"])
def test_modified_model_pt2_is_reported(damage, saved, tmp_path):
    _, good, x = saved
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    data = (bad / "model.pt2").read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "one-byte-flipped":
        i = data.index(b"weight_0") + 200  # inside tensor bytes, so the zip itself still opens
        data = data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]
    else:
        data = data + b"\0"
    (bad / "model.pt2").write_bytes(data)
    for read in (quantkit.load, _artifact.verify_artifact):
        with pytest.raises(quantkit.QuantkitError) as err:
            read(bad)
        assert str(err.value) == (f"{str(bad / 'model.pt2')!r} was modified or truncated after it was written "
                                  "(its SHA-256 does not match quantization.json); re-create the artifact")
    assert (bad / "model.pt2").read_bytes() == data


def test_truncated_model_pt2_without_quantization_json(saved, tmp_path):
    """Nothing records its SHA-256: refused as unverified, and (opted in) the archive checks still run."""
    _, good, _ = saved
    (tmp_path / "model.pt2").write_bytes((good / "model.pt2").read_bytes()[:5000])
    with pytest.raises(quantkit.QuantkitError, match=r"cannot be verified: there is no quantization.json"):
        quantkit.load(tmp_path)
    with pytest.raises(quantkit.QuantkitError, match=r"could not load '.*model.pt2': not a .pt2 archive, or "
                                                     r"truncated \(BadZipFile\); re-create it$"):
        quantkit.load(tmp_path, allow_unverified=True)


def test_write_json_refuses_nan_and_inf(tmp_path):
    for value, where in ((float("nan"), "tensors[1].scale[0]"), (float("-inf"), "tensors[1].scale[0]")):
        doc = {"format": "x", "tensors": [{"scale": [1.0]}, {"scale": [value]}]}
        with pytest.raises(quantkit.QuantkitError) as err:
            _artifact.write_json(tmp_path / "q.json", doc)
        assert str(err.value) == (f"cannot write q.json: {where} is {value}, which JSON cannot hold; "
                                  "check the model and data for NaN/inf")
        assert not (tmp_path / "q.json").exists()
    _artifact.write_json(tmp_path / "q.json", {"a": [1.5, 2], "b": {"c": 1e-30}})
    assert json.loads((tmp_path / "q.json").read_text()) == {"a": [1.5, 2], "b": {"c": 1e-30}}


# --- overwrite: only our own artifacts ------------------------------------------------------------

def _snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("layout, message", [
    ("foreign-json", "holds a quantization.json that is not quantkit's; refusing to replace it"),
    ("broken-json", "holds a quantization.json that is not quantkit's; refusing to replace it"),
    ("extra-user-file", "also holds 'thesis.tex', which quantkit did not write; refusing to replace it"),
    ("extra-user-dir", "also holds 'data', which quantkit did not write; refusing to replace it"),
    ("no-model", "is not empty and is not a quantkit artifact (no model.pt2 with a quantization.json); refusing"),
])
def test_overwrite_refuses_directories_that_are_not_quantkit_artifacts(layout, message, saved, tmp_path):
    qmodel, good, _ = saved
    out = tmp_path / "out"
    shutil.copytree(good, out)
    if layout == "foreign-json":
        (out / "quantization.json").write_text(json.dumps({"format": "someone-elses", "version": 3}))
    elif layout == "broken-json":
        (out / "quantization.json").write_text("{not json")
    elif layout == "extra-user-file":
        (out / "thesis.tex").write_text("keep me")
    elif layout == "extra-user-dir":
        (out / "data").mkdir()
        (out / "data" / "x.csv").write_text("1,2")
    else:
        (out / "model.pt2").unlink()
    before = _snapshot(out)
    with pytest.raises(quantkit.QuantkitError) as err:
        quantkit.save(qmodel, out, overwrite=True)
    assert "\n" not in str(err.value) and message in str(err.value), str(err.value)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_replaces_a_quantkit_artifact_with_reports_and_tokenizer(saved, tmp_path):
    qmodel, good, x = saved
    out = tmp_path / "out"
    shutil.copytree(good, out)
    (out / "report.md").write_text("old report")
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    quantkit.save(qmodel, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.pt2", "quantization.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- atomic replacement ---------------------------------------------------------------------------

def test_replacement_uses_an_atomic_exchange_on_linux(saved, tmp_path, monkeypatch):
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux-only")
    qmodel, good, _ = saved
    out = tmp_path / "out"
    shutil.copytree(good, out)
    calls = []
    real = _atomic.exchange
    monkeypatch.setattr(_atomic, "exchange", lambda a, b: calls.append((a, b)) or real(a, b))
    real_rename = os.rename
    monkeypatch.setattr(_atomic.os, "rename", lambda a, b: pytest.fail(f"rename {a} -> {b} instead of exchange")
                        if Path(b) == out else real_rename(a, b))
    quantkit.save(qmodel, out, overwrite=True)
    assert len(calls) == 1 and calls[0][1] == out.absolute() and ".out.quantkit-tmp-" in calls[0][0].name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    quantkit.load(out)


def test_exchange_swaps_two_directories(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux-only")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "f").write_text("b")
    assert _atomic.exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "f").read_text() == "b" and (tmp_path / "b" / "f").read_text() == "a"
    with pytest.raises(FileNotFoundError):
        _atomic.exchange(tmp_path / "a", tmp_path / "missing")


@pytest.mark.parametrize("signal_exc", [KeyboardInterrupt, _atomic.Terminated, OSError])
def test_interruption_between_the_two_renames_restores_the_old_artifact(signal_exc, saved, tmp_path, monkeypatch):
    """Without an atomic exchange: old aside, new in; a failure in between puts the old one back."""
    qmodel, good, x = saved
    out = tmp_path / "out"
    shutil.copytree(good, out)
    before = _snapshot(out)
    monkeypatch.setattr(_atomic, "exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(a, b):
        if Path(b) == out.absolute() and ".quantkit-tmp-" in str(a):
            assert not out.exists()  # the old artifact is aside: this is the window
            raise signal_exc("interrupted between the renames")
        return real_rename(a, b)

    monkeypatch.setattr(_atomic.os, "rename", rename)
    with pytest.raises(signal_exc, match="interrupted between the renames"):
        quantkit.save(qmodel, out, overwrite=True)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_next_write_cleans_up_after_a_dead_writer(saved, tmp_path):
    qmodel, good, _ = saved
    dead = _dead_pid()
    (tmp_path / f".out.quantkit-tmp-{dead}-0a1b2c3d").mkdir()
    (tmp_path / f".out.quantkit-tmp-{dead}-0a1b2c3d" / "model.pt2").write_bytes(b"half")
    live = tmp_path / f".out.quantkit-tmp-{os.getppid()}-00000000"  # a running writer: left alone
    live.mkdir()
    (tmp_path / f".other.quantkit-tmp-{dead}-0a1b2c3d").mkdir()  # another path's: left alone
    quantkit.save(qmodel, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out", live.name, f".other.quantkit-tmp-{dead}-0a1b2c3d"])


def test_a_dead_writers_backup_is_restored_when_the_artifact_is_missing(saved, tmp_path):
    """Killed between 'old aside' and 'new in': the next write puts the old artifact back first."""
    qmodel, good, _ = saved
    dead = _dead_pid()
    backup = tmp_path / f".out.quantkit-old-{dead}-0a1b2c3d"
    shutil.copytree(good, backup)
    (tmp_path / f".out.quantkit-tmp-{dead}-0a1b2c3d").mkdir()
    before = _snapshot(backup)
    with pytest.raises(quantkit.QuantkitError, match="already exists; pass overwrite=True"):
        quantkit.save(qmodel, tmp_path / "out")
    assert _snapshot(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


_CHILD = r"""
import os, pathlib, sys, time
import quantkit
from quantkit.export import _artifact, _atomic
src, out, mode, ready = sys.argv[1:5]
model = quantkit.load(src)

def hold(where):
    pathlib.Path(ready).write_text(str(where))
    time.sleep(300)

if mode == "write":
    real = _artifact.write_program
    def write_program(program, directory):
        path = real(program, directory)
        hold(directory)
        return path
    _artifact.write_program = write_program
else:  # between the two renames of a replacement without exchange
    _atomic.exchange = lambda a, b: False
    real_rename = os.rename
    def rename(a, b):
        real_rename(a, b)
        if ".quantkit-old-" in str(b):
            hold(b)
    _atomic.os.rename = rename
quantkit.save(model, out, overwrite=True)
"""


def _run_child_until_ready(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", script, *args, str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"child never reached the write: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return proc, ready


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".quantkit-" in p.name)


def test_sigterm_during_save_removes_the_temporary_dir_and_keeps_the_old_artifact(saved, tmp_path):
    _, good, x = saved
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    shutil.copytree(good, out)
    before = _snapshot(out)
    proc, ready = _run_child_until_ready(tmp_path, _CHILD, str(good), str(out), "write")
    assert _leftovers(work)  # mid-write: the new artifact is in its temporary dir
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err[-2000:]  # the process still dies of SIGTERM ...
    assert _leftovers(work) == []  # ... after removing its temporary directory
    assert _snapshot(out) == before


@pytest.mark.parametrize("mode", ["write", "between-renames"])
def test_sigkill_during_save_never_loses_the_old_artifact(mode, saved, tmp_path):
    qmodel, good, x = saved
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    shutil.copytree(good, out)
    before = _snapshot(out)
    proc, ready = _run_child_until_ready(tmp_path, _CHILD, str(good), str(out), mode)
    proc.kill()
    proc.communicate(timeout=120)
    left = _leftovers(work)
    if mode == "write":
        assert [n.split("-")[1] for n in left] == ["tmp"] and _snapshot(out) == before
    else:  # the old artifact is aside under its -old- name, the final path is missing
        assert not out.exists() and sorted(n.split("-")[1] for n in left) == ["old", "tmp"]
    # the next write cleans up (and first puts the old artifact back)
    _artifact.check_out_dir(out, overwrite=True)
    assert _snapshot(out) == before and _leftovers(work) == []
    quantkit.save(qmodel, out, overwrite=True)
    assert _leftovers(work) == [] and sorted(p.name for p in work.iterdir()) == ["out"]
    torch.testing.assert_close(quantkit.load(out)(x[:4]), qmodel(x[:4]), rtol=0, atol=0)


_CLI_CHILD = r"""
import pathlib, sys, time
from quantkit.export import _artifact
from quantkit.cli import _quantize
from quantkit import cli
out, ready = sys.argv[1:3]

def run_quantize(args, say):
    with _artifact.atomic_dir(args.out, overwrite=args.force, flag="--force") as tmp:
        (tmp / "model.pt2").write_bytes(b"half written")
        pathlib.Path(ready).write_text(str(tmp))
        time.sleep(300)
    return 0

_quantize.run_quantize = run_quantize
sys.exit(cli.main(["quantize", "--out", out]))
"""


def test_cli_sigterm_exits_143_with_one_line_and_no_leftovers(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    proc, ready = _run_child_until_ready(tmp_path, _CLI_CHILD, str(work / "out"))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip() == "quantkit: interrupted (SIGTERM)", err[-2000:]
    assert list(work.iterdir()) == []


# --- round trips (issue 12) -----------------------------------------------------------------------

def test_batch_one_capture_saves_a_program_with_a_dynamic_batch(tmp_path):
    torch.manual_seed(0)
    model, x = make_mlp()
    qmodel = quantkit.quantize(model, (x[:1],), [(b,) for b in x.split(32)], progress=False)
    loaded = quantkit.load(quantkit.save(qmodel, tmp_path / "b1"))
    with torch.no_grad():
        for n in (16, 1, 3):
            torch.testing.assert_close(loaded(x[:n]), qmodel(x[:n]), rtol=0, atol=0)
    # the program records the example as it was given
    doc = json.loads((tmp_path / "b1" / "quantization.json").read_text())
    assert doc["example_inputs"]["args"] == [{"shape": [1, 64], "dtype": "float32"}]


def test_batch_one_capture_with_keyword_inputs(tmp_path):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 6)
    qmodel = quantkit.quantize(Two(), {"x": x[:1], "y": y[:1]},
                               [{"x": a, "y": b} for a, b in zip(x.split(16), y.split(16))], progress=False)
    loaded = quantkit.load(quantkit.save(qmodel, tmp_path / "kw"))
    torch.testing.assert_close(loaded(x=x[:16], y=y[:16]), qmodel(x=x[:16], y=y[:16]), rtol=0, atol=0)


def test_save_of_a_loaded_model_round_trips(saved, tmp_path):
    qmodel, path, x = saved
    loaded = quantkit.load(path)
    again = quantkit.save(loaded, tmp_path / "again")
    reloaded = quantkit.load(again)
    with torch.no_grad():
        for n in (1, 8, 50):
            torch.testing.assert_close(reloaded(x[:n]), qmodel(x[:n]), rtol=0, atol=0)
    first = json.loads((path / "quantization.json").read_text())
    second = json.loads((again / "quantization.json").read_text())
    assert {k: v for k, v in first.items() if k != "model_sha256"} == \
        {k: v for k, v in second.items() if k != "model_sha256"}
    assert second["model_sha256"] == hashlib.sha256((again / "model.pt2").read_bytes()).hexdigest()
    assert isinstance(reloaded.meta["quantkit_program"], torch.export.ExportedProgram)
