"""Caches are data, and the kernel cache is ours (issue 26, items 6 and 7).

* The int4 CPU kernel's library is built into quantkit's own 0700 cache folder and loaded only after
  its SHA-256 matches the record written when quantkit built it: a library planted over it (one whose
  constructor writes a marker file) never runs, and the reason is reported; the same file loaded
  with ``ctypes.CDLL`` does write the marker (the positive control).
* Cache folders that are group/other-writable, another user's, or symlinks are refused; a damaged
  digest record is refused with a reason.
* The autotune latency cache takes finite positive numbers only; anything else is measured again
  with a note, and the file is JSON (never unpickled), written atomically, links not followed.

The kernel-cache tests build one tiny kernel per module (a few seconds of compiling) and copy that
cache per test; none compiles the int4 kernel itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit.accuracy import _costmodel, _latency
from quantkit.kernels import _int4_cpu, _kernel_cache
from quantkit.lowering._weight_only import KERNELS_META_KEY, kernel_choices, lower_weight_only
from quantkit.quantizers import WeightOnlyQuantizer
from tests._hostile import _tree

_PROBE_SOURCE = "#include <cstdint>\nvoid kernel(int64_t* x) { x[0] += 1; }\n"
_PROBE = ("qk_hostile_probe", ["int64_t*"], _PROBE_SOURCE)
_PLANT_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  const char* p = getenv("QK_PLANT_MARKER");
  FILE* f = p ? fopen(p, "w") : NULL;
  if (f) { fputs("planted library ran\n", f); fclose(f); }
}
"""


def _version_dir(root: Path) -> Path:
    # the layout the issue asks for: <QUANTKIT_CACHE_DIR>/kernels/<torch version>/
    return root / "kernels" / torch.__version__.replace("/", "_")


@pytest.fixture(scope="module")
def planted_so(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the planted library")
    d = tmp_path_factory.mktemp("plant")
    (d / "plant.c").write_text(_PLANT_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(d / "plant.so"), str(d / "plant.c")], check=True,
                   capture_output=True, timeout=120)
    return d / "plant.so"


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A kernel cache in which quantkit built the probe kernel (``QUANTKIT_CACHE_DIR`` root)."""
    root = tmp_path_factory.mktemp("built") / "cache"
    inductor = tmp_path_factory.mktemp("inductor")
    saved = {k: os.environ.get(k) for k in ("QUANTKIT_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ.update(QUANTKIT_CACHE_DIR=str(root), TORCHINDUCTOR_CACHE_DIR=str(inductor))
    try:
        fn = _kernel_cache.load(*_PROBE)
    except _kernel_cache.KernelLoadError as exc:
        pytest.skip(f"no C++ toolchain for Inductor's builder here: {exc}")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    x = torch.zeros(1, dtype=torch.int64)
    fn(x)
    assert int(x) == 1
    assert not any(inductor.rglob("*")), "the build wrote into Inductor's cache"
    return root


@pytest.fixture
def cache(built_cache, tmp_path, monkeypatch) -> Path:
    """A copy of the built cache (a fresh folder: nothing of it is loaded in this process yet)."""
    root = tmp_path / "cache"
    shutil.copytree(built_cache, root, symlinks=True)  # copy2 keeps the 0700 modes
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(root))
    monkeypatch.setenv("QK_PLANT_MARKER", str(tmp_path / "MARKER"))
    return root


def _libraries(root: Path) -> list[Path]:
    libs = sorted(_version_dir(root).glob("*.so"))
    assert libs, f"no library under {_version_dir(root)}"
    return libs


def _plant(root: Path, planted_so: Path) -> list[Path]:
    """Copy the planted library over every library in the cache, as the issue's attack did."""
    libs = _libraries(root)
    for lib in libs:
        os.chmod(lib, 0o700)
        shutil.copyfile(planted_so, lib)
    return libs


def _refused(match: str, marker: Path) -> str:
    with pytest.raises(_kernel_cache.KernelLoadError) as info:
        _kernel_cache.load(*_PROBE)
    msg = str(info.value)
    assert match in msg and "\n" not in msg, msg
    assert not marker.exists(), "the planted library ran"
    return msg


def _control_runs(lib: Path, marker: Path) -> None:
    """Positive control: the same file, loaded without quantkit's check, runs its payload."""
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(lib)], check=True, timeout=60,
                   env=dict(os.environ, QK_PLANT_MARKER=str(marker)))
    assert marker.read_text() == "planted library ran\n"
    marker.unlink()


@pytest.fixture
def int4_gate(monkeypatch):
    """Pretend this CPU runs the int4 kernel (the check before any compiling), status recomputed."""
    monkeypatch.setattr(_int4_cpu, "_cpu_gate", lambda: None)
    _int4_cpu._loaded.cache_clear()
    yield
    _int4_cpu._loaded.cache_clear()


# ---------------------------------------------------------------------------------------------- kernels

def test_built_cache_is_private_and_its_digest_recorded(built_cache):
    vdir = _version_dir(built_cache)
    for d in (built_cache / "kernels", vdir):
        assert d.is_dir() and not d.is_symlink() and (d.stat().st_mode & 0o777) == 0o700, (d, oct(d.stat().st_mode))
    record = json.loads((vdir / "digests.json").read_text())
    libs = _libraries(built_cache)
    assert {lib.name: hashlib.sha256(lib.read_bytes()).hexdigest() for lib in libs} == record


def test_verified_copy_loads_without_rebuilding(cache, monkeypatch):
    # the control for the tampering tests below: the untouched copy is loaded (not rebuilt) and runs
    monkeypatch.setattr(_kernel_cache, "_build", lambda *a: pytest.fail("rebuilt a verified library"))
    fn = _kernel_cache.load(*_PROBE)
    x = torch.tensor([41], dtype=torch.int64)
    fn(x)
    assert int(x) == 42


def test_planted_library_is_not_loaded(cache, planted_so, tmp_path):
    marker = tmp_path / "MARKER"
    libs = _plant(cache, planted_so)
    before = _tree(cache)
    msg = _refused("does not match the SHA-256", marker)
    assert libs[0].name in msg and "delete" in msg
    assert _tree(cache) == before, "the refused cache was modified"
    _control_runs(libs[0], marker)


def test_library_without_a_record_is_not_loaded(cache, planted_so, tmp_path):
    _plant(cache, planted_so)
    (_version_dir(cache) / "digests.json").write_text("{}")
    _refused("has no digest", tmp_path / "MARKER")


@pytest.mark.parametrize("record", [
    "not json {", "", "[]", '{"x.so": 5}', '{"x.so": "zz"}', '"a string"', "[" * 100_000,
    '{"x.so": {"sha256": "00"}}',
])
def test_damaged_digest_record_is_refused(cache, planted_so, tmp_path, record):
    _plant(cache, planted_so)
    (_version_dir(cache) / "digests.json").write_text(record)
    msg = _refused("digest record", tmp_path / "MARKER")
    assert "not a JSON object of SHA-256 digests" in msg


def test_forged_record_for_a_planted_library_is_still_checked(cache, planted_so, tmp_path):
    # a record naming the planted bytes is trusted only inside the checked 0700 folder: here the
    # library itself is a symlink to a planted file elsewhere, which is not followed
    vdir = _version_dir(cache)
    lib = _libraries(cache)[0]
    outside = tmp_path / "elsewhere.so"
    shutil.copyfile(planted_so, outside)
    lib.unlink()
    lib.symlink_to(outside)
    (vdir / "digests.json").write_text(json.dumps({lib.name: hashlib.sha256(outside.read_bytes()).hexdigest()}))
    _refused("without following a link", tmp_path / "MARKER")
    _control_runs(outside, tmp_path / "MARKER")


@pytest.mark.parametrize("level", ["kernels", "version"])
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_writable_cache_folder_is_refused(cache, planted_so, tmp_path, level, mode, monkeypatch):
    _plant(cache, planted_so)
    d = cache / "kernels" if level == "kernels" else _version_dir(cache)
    os.chmod(d, mode)
    monkeypatch.setattr(_kernel_cache, "_build", lambda *a: pytest.fail("built into a refused folder"))
    msg = _refused("writable by group or others", tmp_path / "MARKER")
    assert str(d) in msg and oct(mode) in msg


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("level", ["kernels", "version"])
def test_cache_folder_of_another_user_is_refused(cache, planted_so, tmp_path, level):
    _plant(cache, planted_so)
    d = cache / "kernels" if level == "kernels" else _version_dir(cache)
    os.chown(d, 65534, 65534)
    msg = _refused("owned by uid 65534", tmp_path / "MARKER")
    assert str(d) in msg


def test_symlinked_cache_folder_is_refused(cache, planted_so, tmp_path):
    # the version folder swapped for a link to a private-looking folder holding planted files and a
    # record that matches them
    vdir = _version_dir(cache)
    other = tmp_path / "other"
    shutil.copytree(vdir, other)
    for lib in other.glob("*.so"):
        os.chmod(lib, 0o700)
        shutil.copyfile(planted_so, lib)
    (other / "digests.json").write_text(json.dumps({p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                                    for p in other.glob("*.so")}))
    shutil.rmtree(vdir)
    vdir.symlink_to(other, target_is_directory=True)
    _refused("is a symlink or not a directory", tmp_path / "MARKER")


def test_verify_checks_without_loading(cache, planted_so, tmp_path):
    # what inspect uses: the same checks as loading, without building, loading or writing anything
    assert _kernel_cache.verify(*_PROBE) is True
    _plant(cache, planted_so)
    before = _tree(cache)
    with pytest.raises(_kernel_cache.KernelLoadError, match="does not match the SHA-256"):
        _kernel_cache.verify(*_PROBE)
    assert not (tmp_path / "MARKER").exists() and _tree(cache) == before


def test_status_without_building_creates_nothing(tmp_path, monkeypatch, int4_gate):
    root = tmp_path / "never-created"
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(root))
    monkeypatch.setattr(_kernel_cache, "_build", lambda *a: pytest.fail("status(build=False) compiled"))
    status = quantkit.kernels.int4_cpu_status(build=False)
    assert status.available and "not built yet" in status.reason, status
    assert not root.exists()


def test_private_inductor_cache_is_created_0700_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "root"))
    path = _kernel_cache.private_inductor_cache()
    assert path == tmp_path / "root" / "inductor" and (path.stat().st_mode & 0o777) == 0o700
    os.chmod(path, 0o777)  # e.g. made by someone else's umask, or another user's planting ground
    with pytest.raises(_kernel_cache.KernelLoadError, match="writable by group or others"):
        _kernel_cache.private_inductor_cache()
    os.chmod(path, 0o700)
    path.rmdir()
    path.symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(_kernel_cache.KernelLoadError, match="symlink"):
        _kernel_cache.private_inductor_cache()


def test_refused_int4_kernel_is_reported_and_lowering_says_why(cache, tmp_path, int4_gate):
    # the int4 kernel on a CPU that could run it, with a damaged cache: no silent fallback
    (_version_dir(cache) / "digests.json").write_text("{broken")
    status = quantkit.kernels.int4_cpu_status()
    assert not status.available and status.fault
    assert "digests.json" in status.reason and "delete" in status.reason, status.reason
    assert status.describe().startswith("quantkit::int4_linear_cpu: unavailable (")
    x = torch.randn(2, 64)
    gm = _int4_model(x)
    with pytest.warns(RuntimeWarning, match="instead of quantkit::int4_linear_cpu"):
        counts = lower_weight_only(gm, "cpu")
    assert counts["weight_only_int4"] == 2
    [choice] = gm.meta[KERNELS_META_KEY]
    assert choice["kernel"] == "aten._weight_int4pack_mm_for_cpu" and choice["layers"] == 2
    assert "digests.json" in choice["reason"]
    [line] = kernel_choices(gm)
    assert line.startswith("int4 weight-only: 2 layers on aten._weight_int4pack_mm_for_cpu (") and "\n" not in line
    with pytest.raises(ValueError, match="int4_kernel='quantkit' cannot run here: .*digests.json"):
        lower_weight_only(_int4_model(x), "cpu", int4_kernel="quantkit")


def test_int4_kernel_on_a_cpu_without_vnni_says_why(monkeypatch, recwarn):
    # ONEDNN_MAX_CPU_ISA=AVX2 emulates a CPU without AVX-512 (tests/test_int4_cpu_kernel.py)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    _int4_cpu._loaded.cache_clear()
    try:
        status = quantkit.kernels.int4_cpu_status()
        assert not status.available and not status.fault and "AVX512-VNNI" in status.reason
        gm = _int4_model(torch.randn(2, 64))
        lower_weight_only(gm, "cpu")
        [line] = kernel_choices(gm)
        assert "aten._weight_int4pack_mm_for_cpu" in line and "AVX512-VNNI" in line, line
        assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]  # a plain CPU: a note, no warning
    finally:
        _int4_cpu._loaded.cache_clear()


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 32), torch.nn.Linear(32, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _int4_model(x):
    torch.manual_seed(0)
    prepared = quantkit.prepare(quantkit.capture(_Two().eval(), (x,)), WeightOnlyQuantizer(bits=4, group_size=32))
    quantkit.calibrate(prepared, [x], progress=False)
    return quantkit.convert(prepared)


# ----------------------------------------------------------------------------------------- latency cache

class _Tiny(torch.nn.Module):
    def forward(self, x):
        return x * 2


@pytest.fixture
def meter_env(tmp_path, monkeypatch):
    """A private latency cache and stand-in timers: 7.0 ms per measurement (compiled model or raw
    kernel of the cost model), counted."""
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "qkcache"))
    calls = []
    monkeypatch.setattr(_latency, "_time", lambda fn, inputs, dtype=None: calls.append(1) or 7.0)
    monkeypatch.setattr(_costmodel, "time_kernel", lambda fn, threads: calls.append(1) or 7.0)
    gm = torch.fx.symbolic_trace(_Tiny())
    return gm, calls, tmp_path / "qkcache" / "latency.json"


def _fp32(gm) -> tuple[float, _latency.Meter]:
    meter = _latency.Meter(gm, (torch.randn(2, 3),), measure=True)
    return meter.floats(gm, bf16=False)["fp32_ms"], meter


def _with_value(path: Path, raw: str) -> None:
    """Rewrite the single cached entry's value as the raw JSON text ``raw``."""
    [key] = json.loads(path.read_text())
    path.write_text("{" + json.dumps(key) + ": " + raw + "}")


def test_valid_latency_is_recalled(meter_env):
    # the control for the tests below: a finite positive entry is used, not measured again
    gm, calls, path = meter_env
    assert _fp32(gm)[0] == 7.0 and len(calls) == 1
    _with_value(path, "3.5")
    ms, meter = _fp32(gm)
    assert ms == 3.5 and len(calls) == 1 and meter.notes == []


@pytest.mark.parametrize("raw", ["Infinity", "-Infinity", "NaN", "1e400", "-1", "0", "0.0", "1e300", '"12.5"',
                                 "true", "null", '{"ms": 1.0}', "[1.0]", '[[[[{"a": [1]}]]]]'])
def test_bad_latency_entries_are_measured_again_with_a_note(meter_env, raw):
    gm, calls, path = meter_env
    _fp32(gm)
    _with_value(path, raw)
    ms, meter = _fp32(gm)
    assert ms == 7.0 and len(calls) == 2, "the bad entry was used instead of measuring again"
    [note] = meter.notes
    assert "fp32" in note and "ignored and measured again" in note and "\n" not in note, note
    assert not any(ord(c) < 32 or ord(c) == 127 for c in note), note
    assert list(json.loads(path.read_text()).values()) == [7.0]  # rewritten with the measurement


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "[" * 100_000, "pickle", "\ufeff{}x"])
def test_latency_cache_that_is_not_a_json_object_is_ignored(meter_env, tmp_path, content):
    gm, calls, path = meter_env
    marker = tmp_path / "PICKLE_MARKER"
    path.parent.mkdir(parents=True)
    if content == "pickle":
        payload = pickle.dumps({"k": _Payload(marker)})
        pickle.loads(payload)  # positive control: unpickling runs the payload
        assert marker.exists()
        marker.unlink()
        path.write_bytes(payload)
    else:
        path.write_text(content)
    ms, meter = _fp32(gm)
    assert ms == 7.0 and len(calls) == 1
    [note] = meter.notes
    assert str(path) in note and "ignored" in note, note
    assert not marker.exists(), "the cache was unpickled"
    assert list(json.loads(path.read_text()).values()) == [7.0]


def test_latency_cache_symlink_is_not_followed(meter_env, tmp_path):
    gm, calls, path = meter_env
    _fp32(gm)
    [key] = json.loads(path.read_text())
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps({key: 0.001}))  # a planted "fast" number behind a link
    before = _tree(victim)
    path.unlink()
    path.symlink_to(victim)
    ms, meter = _fp32(gm)
    assert ms == 7.0 and len(calls) == 2, "read through the link"
    assert any("symlink" in n for n in meter.notes), meter.notes
    assert _tree(victim) == before, "wrote through the link"
    assert not path.is_symlink() and json.loads(path.read_text()) == {key: 7.0}
    assert [p.name for p in path.parent.iterdir()] == ["latency.json"], "temporary file left behind"


def test_latency_cache_fifo_does_not_hang(meter_env):
    gm, calls, path = meter_env
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    ms, meter = _fp32(gm)
    assert ms == 7.0 and any("not a regular file" in n for n in meter.notes), meter.notes


# ------------------------------------------------------------------------ the attack, end to end

@pytest.fixture(scope="module")
def int4_cache(tmp_path_factory):
    """A kernel cache in which quantkit built its two int4 libraries (``QUANTKIT_CACHE_DIR`` root).

    Compiling them takes ~15-30 s here: the price of planting over the real kernel's files, as the
    issue's attack did, rather than a stand-in's."""
    root = tmp_path_factory.mktemp("int4") / "cache"
    saved, gate = os.environ.get("QUANTKIT_CACHE_DIR"), _int4_cpu._cpu_gate
    os.environ["QUANTKIT_CACHE_DIR"] = str(root)
    _int4_cpu._cpu_gate = lambda: None  # build on any CPU: building runs none of the AVX-512 code
    _int4_cpu._loaded.cache_clear()
    try:
        status = _int4_cpu.status()
    finally:
        _int4_cpu._cpu_gate = gate
        _int4_cpu._loaded.cache_clear()
        if saved is None:
            os.environ.pop("QUANTKIT_CACHE_DIR", None)
        else:
            os.environ["QUANTKIT_CACHE_DIR"] = saved
    if not status.available:
        pytest.skip(f"quantkit's int4 kernel does not build here: {status.reason}")
    assert len(list(_version_dir(root).glob("*.so"))) == 2
    return root


@pytest.mark.slow
def test_planted_int4_kernel_does_not_run_in_eval(int4_cache, planted_so, tmp_path, monkeypatch, capsys, int4_gate):
    from quantkit.cli import main
    from tests.cli_factories import mlp_quantize_args, write_mlp_inputs

    root = tmp_path / "cache"
    shutil.copytree(int4_cache, root, symlinks=True)
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(root))
    marker = tmp_path / "MARKER"
    monkeypatch.setenv("QK_PLANT_MARKER", str(marker))
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    weights, calib = write_mlp_inputs(inputs, calib_rows=24)
    out = tmp_path / "out"
    assert main(mlp_quantize_args(weights, calib, out, "--scheme", "w4a16", "--group-size", "32")) == 0
    libs = _plant(root, planted_so)  # over both hash-named int4 libraries
    _int4_cpu._loaded.cache_clear()
    before = {p: _tree(p) for p in (inputs, out)}
    capsys.readouterr()
    rc = main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--weights", str(weights), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 0 and not err.strip(), err
    assert not marker.exists(), "the planted library ran during eval"
    status = _int4_cpu.status()
    assert not status.available and status.fault and "does not match the SHA-256" in status.reason, status
    assert {p: _tree(p) for p in (inputs, out)} == before
    _control_runs(libs[0], marker)


def test_int4_status_without_building_sees_a_planted_library(int4_cache, planted_so, tmp_path, monkeypatch, int4_gate):
    root = tmp_path / "cache"
    shutil.copytree(int4_cache, root, symlinks=True)
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(root))
    monkeypatch.setenv("QK_PLANT_MARKER", str(tmp_path / "MARKER"))
    assert quantkit.kernels.int4_cpu_status(build=False).reason.startswith("built and verified in ")
    _plant(root, planted_so)
    status = quantkit.kernels.int4_cpu_status(build=False)
    assert not status.available and status.fault and "does not match the SHA-256" in status.reason, status
    assert not (tmp_path / "MARKER").exists()


def test_ignored_latency_entries_reach_the_autotune_report(meter_env):
    """The issue's case: a cache entry of Infinity decided the recipe without a word. Every entry of a
    first search is rewritten to Infinity; the second search measures again, picks what the clean one
    picked, and its report (and ``str(report)``) lists each ignored entry."""
    from tests.cli_factories import mlp

    _, calls, path = meter_env
    torch.manual_seed(0)
    model = mlp().eval()
    calib = [(torch.randn(16, 64),) for _ in range(4)]
    held = [(torch.randn(16, 64),) for _ in range(2)]
    _, clean = quantkit.autotune(model, calib[0], calib, held, target=0.99)
    assert clean.notes == [] and calls
    entries = json.loads(path.read_text())
    path.write_text("{" + ", ".join(f"{json.dumps(k)}: Infinity" for k in entries) + "}")
    measured = len(calls)
    _, again = quantkit.autotune(model, calib[0], calib, held, target=0.99)
    assert again.chosen == clean.chosen
    assert len(calls) > measured, "the Infinity entries were used instead of measuring again"
    assert again.notes and all("ignored and measured again" in n for n in again.notes), again.notes
    assert all(f"note: {n}" in str(again) for n in again.notes)
