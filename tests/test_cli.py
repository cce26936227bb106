"""The quantkit command line: the default model end to end, factory models, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import quantkit
from quantkit import _hf
from quantkit.cli import main

# the console script installed beside this interpreter (PATH may not have the venv)
_QUANTKIT = shutil.which("quantkit", path=os.path.dirname(sys.executable)) or shutil.which("quantkit") or "quantkit"

ROOT = Path(__file__).resolve().parents[1]
# issue 5 asked for under 3 minutes; since issue 17 the default searches recipes (--recipe auto: 166 s
# alone on this 2-core machine with a cold latency cache, 301 s with another test run beside it), so the
# bound here is 6 minutes -- a guard against runaway searches, not the speed target
DEFAULT_QUANTIZE_BUDGET_S = 360
# issue 17: the default (--recipe auto) meets held-out mean cosine >= 0.999 on the bundled model
MIN_MEAN_COSINE = 0.999
# issue 5: an all-int8 artifact is <= 0.3x the fp32 safetensors; each linear autotune keeps float
# (its fallback recipe) adds its fp32 weight back: 384x1536 or 384x384 floats
MAX_SIZE_RATIO = 0.3


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", "import sys; from quantkit.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, cwd=cwd, env=env)


def _error_line(stderr: str) -> str:
    """The one error line; progress bars (\\r-separated) before it are not errors."""
    lines = [ln for ln in stderr.split("\n") if ln.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    assert "Traceback" not in stderr
    line = lines[0].split("\r")[-1]
    assert line.startswith("quantkit: error: "), line
    return line


def _no_leftovers(out: Path) -> None:
    assert not out.exists(), f"{out} was left behind"
    if out.parent.exists():
        assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary dir left"


# --- the bundled default model, quantized once for the module --------------------------

@pytest.fixture(scope="module")
def default_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("default") / "minilm-int8"
    t0 = time.perf_counter()
    proc = subprocess.run([_QUANTKIT, "quantize", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", f"stderr should stay clean: {proc.stderr!r}"
    return out, elapsed


@pytest.mark.slow
def test_default_quantize_artifact(default_artifact):
    out, elapsed = default_artifact
    assert elapsed < DEFAULT_QUANTIZE_BUDGET_S, f"quantize took {elapsed:.0f} s"
    for name in ("model.pt2", "quantization.json", "report.md", "report.json", "tokenizer"):
        assert (out / name).exists(), name
    rep = json.loads((out / "report.json").read_text())
    assert rep["metric"]["mean_cosine"] >= MIN_MEAN_COSINE, rep["metric"]
    assert rep["data"]["heldout_samples"] == 80 and rep["data"]["calibration_samples"] == 320
    assert not rep["data"]["heldout_is_calibration"]
    fp32 = (_hf.default_model_path() / "model.safetensors").stat().st_size
    assert rep["size"]["float_bytes"] == fp32
    # the search met the target, and what it kept float is the recipe's --skip list
    auto = rep["autotune"]
    assert auto["mode"] == "auto" and auto["met"] is True and auto["target"] == 0.999, auto
    chosen = next(t for t in auto["trials"] if t["recipe"] == auto["chosen"])
    assert chosen["status"] == "met" and chosen["score"] >= 0.999
    kept = [name.split(" ")[0] for name in chosen["details"].get("float_layers", [])]
    doc = json.loads((out / "quantization.json").read_text())
    assert sorted(doc["recipe"]["skip"]) == sorted(kept)
    assert set(doc["recipe"]) >= {"scheme", "activation", "dynamic", "granularity", "observer", "weight_algorithm"}
    # size: int8 everywhere but the kept linears, each of which costs at most its fp32 weight
    float_extra = 0
    for name in kept:
        mod = name.split(".")[-1] if "." in name else name
        float_extra += (384 * 384 if mod in ("query", "key", "value") or name.endswith("attention.output.dense")
                        else 384 * 1536) * 4
    ratio = (out / "model.pt2").stat().st_size / fp32
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / fp32
    limit = MAX_SIZE_RATIO + float_extra / fp32
    assert ratio <= limit and total <= limit, (ratio, total, limit)
    # every linear of the encoder is listed with a per-layer SQNR; all but the kept ones (and the
    # embeddings) are int8
    layers = {r["layer"]: r for r in rep["layers"]}
    assert len([n for n in layers if n.startswith("encoder.layer.")]) == 6 * 6
    # kept layers read float inputs (their weights float, or int8 where that met the target)
    assert sorted(n for n, r in layers.items() if r["weight"] == "float" or r["weight"].endswith(", float input")) \
        == sorted(kept)
    assert all(r["weight"].startswith("int8") for n, r in layers.items() if n not in kept)
    # (no layer broken: the autotuned histogram ranges clip, so layer 0's value lands near 9 dB)
    assert all(r["sqnr_db"] > 5 for r in layers.values()), layers
    speed = rep["autotune"]["speed"]
    assert speed["vs_fp32"] > 0
    # the chosen fallback's latency is its int8 model's (a few layers float on its base), not a float
    # graph's: estimated on a scoring copy (float constants, fused q/dq) it read 5x its base's
    base = next((b for b in auto["trials"] if b["recipe"] == chosen.get("details", {}).get("base")), None)
    if base is not None and chosen["latency_ms"] and base["latency_ms"]:
        extra = len(chosen["details"]["float_layers"]) / 37
        assert chosen["latency_ms"] <= base["latency_ms"] * (1 + 4 * extra), (chosen, base)
    # bf16 is compared only where the CPU computes it natively (emulated bf16 is no alternative a user picks)
    assert (speed["vs_bf16"] > 0) if speed["bf16_native"] else ("vs_bf16" not in speed and speed["bf16_ms"] is None)
    assert doc["source"]["model"] == {"kind": "default", "task": "feature-extraction"}
    assert {"quantkit", "torch", "torchao"} <= set(doc["versions"])
    weights = [t for t in doc["tensors"] if t["kind"] == "weight"]
    assert len(weights) == len([r for r in layers.values() if r["weight"] != "float"])
    word = next(t for t in weights if t["node"].startswith("embeddings_word_embeddings"))
    assert len(word["scale"]) == 30522 and set(word["zero_point"]) == {0}  # one scale per row, symmetric
    md = (out / "report.md").read_text()
    assert "embedding cosine" in md and "encoder.layer.5.output.dense" in md


@pytest.mark.slow
def test_default_artifact_loads_with_torch_export_only(default_artifact):
    """model.pt2 loads with torch.export.load after `import quantkit` alone (no transformers), holds
    int8 weights and no fp32 copy of them, and takes other batch sizes and sequence lengths."""
    out, _ = default_artifact
    # the linears autotune kept float (its fallback recipe's --skip) are the only big float matrices,
    # unless they kept int8 weights (float_weights "int8": their inputs alone stay float)
    recipe = json.loads((out / "quantization.json").read_text())["recipe"]
    kept = 0 if recipe.get("float_weights") == "int8" else len(recipe["skip"])
    script = f"""
import sys, torch, quantkit
ep = torch.export.load({str(out / 'model.pt2')!r})
assert "transformers" not in sys.modules
tensors = list(ep.state_dict.values()) + list(ep.constants.values())
by = {{}}
for t in tensors:
    by[t.dtype] = by.get(t.dtype, 0) + t.numel() * t.element_size()
big_float = [tuple(t.shape) for t in tensors if t.is_floating_point() and t.dim() == 2 and t.numel() >= 384 * 384]
assert len(big_float) == {kept}, big_float
assert by[torch.int8] > 0.5 * by[torch.float32], by
ids = torch.randint(1000, 2000, (3, 11))
out = ep.module()(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids))
assert type(out) is dict and out["last_hidden_state"].shape == (3, 11, 384), type(out)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert proc.stderr == "", proc.stderr  # import quantkit keeps torchao's import noise off stderr


@pytest.mark.slow
def test_default_eval_and_inspect(default_artifact, capsys):
    out, _ = default_artifact
    # one batch for the 80 held-out samples: the q/dq reference graph dequantizes every weight per call
    assert main(["eval", str(out), "--json", "--quiet", "--batch-size", "80", "--no-compile"]) == 0
    res = json.loads(capsys.readouterr().out)
    rep = json.loads((out / "report.json").read_text())
    assert res["data"] == "held-out split" and res["metric"]["samples"] == 80
    assert res["metric"]["mean_cosine"] >= MIN_MEAN_COSINE, res["metric"]
    # the saved program reproduces what quantize measured on the in-memory model
    assert res["metric"]["mean_cosine"] == pytest.approx(rep["metric"]["mean_cosine"], abs=1e-4)
    for key in ("float (eager)", "int8 (q/dq reference)"):
        assert res["latency"][key]["median_ms_per_batch"] > 0
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "encoder.layer.0.attention.self.query" in text and "embedding cosine mean" in text
    assert "scheme=w8a8" in text


# --- factory models: small and fast ------------------------------------------------------

@pytest.fixture
def mlp_inputs(tmp_path):
    from safetensors.torch import save_file

    from tests.cli_factories import mlp

    torch.manual_seed(1)
    weights = tmp_path / "mlp.safetensors"
    save_file(mlp().state_dict(), str(weights))
    calib = tmp_path / "calib"
    calib.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        torch.save(torch.randn(16, 64, generator=gen), calib / f"b{i}.pt")
    import numpy as np

    np.save(calib / "c.npy", torch.randn(8, 64, generator=gen).numpy())
    torch.save(torch.randn(64, generator=gen), calib / "single.pt")  # one sample, no batch dim
    return weights, calib


def _factory_args(weights, calib, out, *extra):
    return ["quantize", "tests.cli_factories:mlp", "--weights", str(weights), "--example-input", "8x64:float32",
            "--calib", str(calib), "--out", str(out), "--quiet", *_fixed(extra), *extra]


# tests not about recipes fix the recipe (no --recipe auto search); hand-written recipe flags fix it already
_HAND_WRITTEN = ("--scheme", "--activation", "--dynamic", "--granularity", "--observer", "--smoothquant",
                 "--accuracy-budget", "--recipe")


def _fixed(extra) -> tuple:
    return () if any(str(a).startswith(_HAND_WRITTEN) for a in extra) else ("--recipe", "static")


def test_factory_quantize_eval_inspect(mlp_inputs, tmp_path, capsys):
    weights, calib = mlp_inputs
    out = tmp_path / "mlp-int8"
    assert main(_factory_args(weights, calib, out)) == 0
    rep = json.loads((out / "report.json").read_text())
    # 57 samples: 11 held out (20%), 46 calibrate
    assert rep["data"]["heldout_samples"] == 11 and rep["data"]["calibration_samples"] == 46
    assert rep["metric"]["name"] == "output cosine" and rep["metric"]["mean_cosine"] > 0.999, rep["metric"]
    assert rep["metric"]["sqnr_db"] > 25, rep["metric"]
    assert [r["layer"] for r in rep["layers"]] == ["fc1", "fc2", "fc3"]
    src = json.loads((out / "quantization.json").read_text())["source"]["model"]
    assert src == {"kind": "factory", "factory": "tests.cli_factories:mlp", "weights": str(weights),
                   "example_input": "8x64:float32"}

    # eval rebuilds the float model from the recorded factory + weights (not from the artifact)
    capsys.readouterr()
    assert main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--no-compile", "--json", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["metric"]["mean_cosine"] == pytest.approx(rep["metric"]["mean_cosine"], abs=1e-6)
    # ... and on other data
    other = tmp_path / "other"
    other.mkdir()
    torch.save(torch.randn(5, 64), other / "x.pt")
    assert main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--data", str(other), "--no-compile",
                 "--json", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["data"] == "given data" and res["metric"]["samples"] == 5

    assert main(["inspect", str(out)]) == 0
    assert "fc2" in capsys.readouterr().out


def test_force_replaces_an_artifact_and_keeps_it_on_failure(mlp_inputs, tmp_path, capsys):
    weights, calib = mlp_inputs
    out = tmp_path / "mlp-int8"
    assert main(_factory_args(weights, calib, out)) == 0
    (out / "report.md").write_text("old")  # an artifact file: the old run's report
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    # a failing --force run leaves the old artifact as it was
    assert main(_factory_args(weights, blank, out, "--force")) == 1
    assert (out / "report.md").read_text() == "old"
    assert main(_factory_args(weights, calib, out, "--force", "--skip", "fc3")) == 0
    assert (out / "report.md").read_text() != "old"
    rep = json.loads((out / "report.json").read_text())
    assert rep["recipe"]["skip"] == ["fc3"]
    assert [r["weight"] for r in rep["layers"]][-1] == "float"
    _no_leftovers(tmp_path / "nothing")
    capsys.readouterr()


def test_force_refuses_a_directory_that_is_not_an_artifact(mlp_inputs, tmp_path, capsys):
    weights, calib = mlp_inputs
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.tex").write_text("keep me")
    assert main(_factory_args(weights, calib, out, "--force")) == 1
    assert "refusing to replace" in _error_line(capsys.readouterr().err)
    assert (out / "thesis.tex").read_text() == "keep me"


@pytest.mark.parametrize("scheme, kind", [("w8a8-dynamic", "dynamic"), ("w8a8-per-token", "dynamic-per-token")])
def test_dynamic_schemes(scheme, kind, mlp_inputs, tmp_path, capsys):
    weights, calib = mlp_inputs
    out = tmp_path / "dyn"
    assert main(_factory_args(weights, calib, out, "--scheme", scheme)) == 0
    doc = json.loads((out / "quantization.json").read_text())
    assert {t["kind"] for t in doc["tensors"]} == {"weight", kind}
    assert doc["recipe"]["scheme"] == scheme and doc["recipe"]["observer"] is None
    assert json.loads((out / "report.json").read_text())["metric"]["mean_cosine"] > 0.999
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    n_dynamic = sum(t["kind"] == kind for t in doc["tensors"])
    assert f"0 static activations, {n_dynamic} dynamic activations" in capsys.readouterr().out


# --- bad input: one line, non-zero exit, no DIR, nothing big loaded ----------------------

@pytest.fixture
def no_model_loading(monkeypatch):
    """Bad command lines must fail before any model is loaded."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was noticed")

    monkeypatch.setattr(_hf, "load_hf_checkpoint", refuse)


def _hf_dir(tmp_path: Path, *, config=True, weights: bytes | None = b"") -> Path:
    d = tmp_path / "hfmodel"
    d.mkdir()
    if config:
        shutil.copy(_hf.default_model_path() / "config.json", d / "config.json")
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return d


def _truncated_safetensors() -> bytes:
    return (_hf.default_model_path() / "model.safetensors").read_bytes()[:1 << 20]


@pytest.mark.parametrize("case, expect, code", [
    ("missing-model", "does not exist", 1),
    ("corrupt-safetensors", "not a valid safetensors file", 1),
    ("truncated-safetensors", "not a valid safetensors file", 1),
    ("no-config", "has no config.json", 1),
    ("empty-calib", "is empty", 1),
    ("blank-calib", "only blank lines", 1),
    ("missing-calib", "does not exist", 1),
    ("unknown-observer", "unknown observer 'nope' for --observer; available: ", 2),
    ("unknown-weight-observer", "unknown observer 'nope' for --weight-observer", 2),
    ("out-exists", "already exists; pass --force", 2),
    ("out-is-input", "would overwrite the input", 2),
    ("bad-example-input", "is not SHAPE:DTYPE", 2),
    ("factory-without-example", "needs --example-input", 2),
    ("bad-scheme", "invalid choice", 2),
])
def test_bad_input(case, expect, code, tmp_path, capsys, no_model_loading):
    out = tmp_path / "out" / "int8"
    args = ["quantize", "--out", str(out)]
    if case == "missing-model":
        args.insert(1, str(tmp_path / "no-such-model"))
    elif case == "corrupt-safetensors":
        args.insert(1, str(_hf_dir(tmp_path, weights=b"\x00garbage" * 100)))
    elif case == "truncated-safetensors":
        args.insert(1, str(_hf_dir(tmp_path, weights=_truncated_safetensors())))
    elif case == "no-config":
        args.insert(1, str(_hf_dir(tmp_path, config=False)))
    elif case in ("empty-calib", "blank-calib"):
        f = tmp_path / "calib.txt"
        f.write_text("" if case == "empty-calib" else "\n   \n\t\n")
        args += ["--calib", str(f)]
    elif case == "missing-calib":
        args += ["--calib", str(tmp_path / "nope.txt")]
    elif case == "unknown-observer":
        args += ["--observer", "nope"]
    elif case == "unknown-weight-observer":
        args += ["--weight-observer", "nope"]
    elif case == "out-exists":
        out.mkdir(parents=True)
    elif case == "out-is-input":
        model = _hf_dir(tmp_path)
        args = ["quantize", str(model), "--out", str(model), "--force"]
        out = None
    elif case == "bad-example-input":
        args = ["quantize", "tests.cli_factories:mlp", "--example-input", "8by64", "--out", str(out)]
    elif case == "factory-without-example":
        args = ["quantize", "tests.cli_factories:mlp", "--out", str(out)]
    elif case == "bad-scheme":
        args += ["--scheme", "int4"]
    t0 = time.perf_counter()
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == code, err
    assert expect in _error_line(err)
    assert time.perf_counter() - t0 < 10, "bad input should fail before anything big is loaded"
    if case == "out-exists":
        assert out.is_dir() and not any(out.iterdir())  # left exactly as it was
    elif out is not None:
        _no_leftovers(out)
        assert not out.parent.exists(), "parent directories created for DIR were left behind"


def test_skip_pattern_matching_nothing(mlp_inputs, tmp_path, capsys):
    weights, calib = mlp_inputs
    out = tmp_path / "x"
    assert main(_factory_args(weights, calib, out, "--skip", "fc9*")) == 1
    assert "--skip 'fc9*' matches no module" in _error_line(capsys.readouterr().err)
    _no_leftovers(out)


def test_factory_that_cannot_be_exported(mlp_inputs, tmp_path, capsys):
    _, calib = mlp_inputs
    out = tmp_path / "dd"
    rc = main(["quantize", "tests.cli_factories:data_dependent", "--example-input", "8x64:float32",
               "--calib", str(calib), "--out", str(out), "--quiet"])
    assert rc == 1
    line = _error_line(capsys.readouterr().err)
    assert "torch.export could not capture _DataDependent" in line and "torch.cond" in line
    _no_leftovers(out)


@pytest.mark.parametrize("factory, expect", [
    ("tests.cli_factories:not_a_module", "not a torch.nn.Module"),
    ("tests.cli_factories:nothing_here", "has no callable 'nothing_here'"),
    ("tests.no_such_module:mlp", "could not import 'tests.no_such_module'"),
])
def test_bad_factory(factory, expect, mlp_inputs, tmp_path, capsys):
    _, calib = mlp_inputs
    out = tmp_path / "bad"
    assert main(["quantize", factory, "--example-input", "8x64:float32", "--calib", str(calib),
                 "--out", str(out), "--quiet"]) == 1
    assert expect in _error_line(capsys.readouterr().err)
    _no_leftovers(out)


def test_calibration_tensors_must_match_example_input(mlp_inputs, tmp_path, capsys):
    weights, _ = mlp_inputs
    calib = tmp_path / "wrong"
    calib.mkdir()
    torch.save(torch.randn(4, 63), calib / "x.pt")
    out = tmp_path / "o"
    assert main(_factory_args(weights, calib, out)) == 1
    assert "does not match --example-input 8x64:float32" in _error_line(capsys.readouterr().err)
    _no_leftovers(out)


def test_weights_that_do_not_fit(tmp_path, mlp_inputs, capsys):
    _, calib = mlp_inputs
    bad = tmp_path / "bad.pt"
    torch.save({"fc1.weight": torch.zeros(3, 3)}, bad)
    out = tmp_path / "o"
    assert main(_factory_args(bad, calib, out)) == 1
    assert "do not fit 'tests.cli_factories:mlp'" in _error_line(capsys.readouterr().err)
    _no_leftovers(out)


def test_console_script_stderr_is_one_line(tmp_path):
    """The real executable: no torchao/pytree import noise, exit code 2, one line."""
    out = tmp_path / "o"
    proc = subprocess.run([_QUANTKIT, "quantize", "--out", str(out), "--observer", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    line = _error_line(proc.stderr)
    assert "unknown observer 'nope'" in line and "minmax" in line
    _no_leftovers(out)


def test_usage():
    assert main([]) == 2
    assert main(["--version"]) == 0
    assert main(["eval"]) == 2  # DIR missing


def test_eval_and_inspect_reject_non_artifacts(tmp_path, capsys):
    for cmd in (["eval", str(tmp_path)], ["inspect", str(tmp_path)], ["eval", str(tmp_path / "nope")]):
        assert main(cmd) == 1
        assert "quantkit" in _error_line(capsys.readouterr().err)


def test_smoothquant_and_accuracy_budget(mlp_inputs, tmp_path, capsys):
    weights, calib = mlp_inputs
    out = tmp_path / "mlp-fallback"
    assert main(_factory_args(weights, calib, out, "--smoothquant", "auto", "--accuracy-budget", "1e-3")) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["recipe"]["smoothquant"] == "auto" and rep["recipe"]["accuracy_budget"] == 1e-3
    fb = rep["fallback"]
    assert fb["met"] and fb["drop"] <= 1e-3, fb
    assert 0.0 <= fb["int8_gemm_fraction"] <= 1.0
    # the artifact still loads and matches its own report
    capsys.readouterr()
    assert main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--no-compile", "--json", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["metric"]["mean_cosine"] == pytest.approx(rep["metric"]["mean_cosine"], abs=1e-6)


@pytest.mark.parametrize("extra,needle", [
    (["--smoothquant", "2"], "alpha"),
    (["--accuracy-budget", "-1"], "--accuracy-budget"),
    (["--accuracy-budget", "0.01", "--metric", "nope"], "nope"),
])
def test_accuracy_flags_bad_usage(mlp_inputs, tmp_path, capsys, extra, needle):
    weights, calib = mlp_inputs
    out = tmp_path / "bad"
    assert main(_factory_args(weights, calib, out, *extra)) == 2
    line = _error_line(capsys.readouterr().err)
    assert needle in line
    assert not out.exists()


def test_accuracy_budget_that_keeps_everything_float_fails_cleanly(mlp_inputs, tmp_path, capsys):
    weights, calib = mlp_inputs
    out = tmp_path / "allfloat"
    assert main(_factory_args(weights, calib, out, "--accuracy-budget", "0")) == 1
    assert "keeps every layer float" in _error_line(capsys.readouterr().err)
    assert not out.exists()


def test_hf_causal_lm_with_token_id_tensors(tmp_path, capsys):
    """An HF causal LM directory (no tokenizer) calibrated on a directory of 1-D token-id
    tensors, one sequence per file: captured without its KV cache, every linear int8."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=100)
    model_dir, calib = tmp_path / "llama", tmp_path / "ids"
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(model_dir))
    calib.mkdir()
    for i in range(10):
        torch.save({"input_ids": torch.randint(0, 100, (12,))}, calib / f"{i}.pt")
    out = tmp_path / "out"
    assert main(["quantize", str(model_dir), "--calib", str(calib), "--out", str(out), "--quiet",
                 "--recipe", "static"]) == 0
    doc = json.loads((out / "quantization.json").read_text())
    # q, k, v, o, gate, up, down + embedding + lm_head: --task auto keeps LlamaForCausalLM's head
    assert sum(t["kind"] == "weight" for t in doc["tensors"]) == 7 + 1 + 1
    assert doc["source"]["model"]["task"] == "auto" and doc["source"]["output"] == "token-logits"
    rep = json.loads((out / "report.json").read_text())
    assert rep["data"]["calibration_samples"] == 8 and rep["data"]["heldout_samples"] == 2
    assert rep["metric"]["name"] == "token logits cosine" and rep["metric"]["samples"] == 2
    assert rep["metric"]["mean_cosine"] > 0.99 and rep["metric"]["top1_agreement"] >= 0.9, rep["metric"]


# --- HF checkpoints: --task, strict loading of legitimate checkpoints (issue 12/13) ------------

_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tiny_bert(directory: Path, cls_name: str = "BertForSequenceClassification", num_labels: int = 3) -> Path:
    """A random-weight BERT (2 layers, hidden 32) with all-MiniLM-L6-v2's tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=30522, max_position_embeddings=128, num_labels=num_labels)
    getattr(transformers, cls_name)(cfg).save_pretrained(str(directory), safe_serialization=True)
    for f in _TOKENIZER_FILES:
        shutil.copy(_hf.default_model_path() / f, directory / f)
    return directory


@pytest.fixture(scope="module")
def bert_cls(tmp_path_factory) -> Path:
    return _tiny_bert(tmp_path_factory.mktemp("bert") / "bert-cls", num_labels=5)


@pytest.fixture(scope="module")
def few_sentences(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("text") / "sentences.txt"
    f.write_text("\n".join(_hf.read_sentences(_hf.default_calibration_file())[:40]) + "\n", encoding="utf-8")
    return f


def test_task_auto_keeps_the_classifier(bert_cls, few_sentences, tmp_path, capsys):
    """BertForSequenceClassification through the CLI: the artifact returns [batch, 5] logits that
    match the float classifier's, loaded independently with transformers."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "cls-int8"
    assert main(["quantize", str(bert_cls), "--calib", str(few_sentences), "--out", str(out), "--quiet",
                 "--num-calib", "16", "--recipe", "static"]) == 0
    doc = json.loads((out / "quantization.json").read_text())
    assert doc["source"]["model"]["task"] == "auto" and doc["source"]["output"] == "logits"
    assert any(t["node"].startswith("classifier") for t in doc["tensors"] if t["kind"] == "weight")
    rep = json.loads((out / "report.json").read_text())
    assert rep["metric"]["name"] == "logits cosine" and rep["metric"]["top1_agreement"] >= 0.9, rep["metric"]
    assert rep["model"].endswith("(BertForSequenceClassification)")

    ref_model = transformers.BertForSequenceClassification.from_pretrained(str(bert_cls)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    enc = dict(tok(_hf.read_sentences(few_sentences)[:8], padding=True, return_tensors="pt"))
    with torch.no_grad():
        ref = ref_model(**enc).logits
        got = quantkit.load(out)(**enc)["logits"]
    assert got.shape == ref.shape == (8, 5)
    cos = torch.nn.functional.cosine_similarity(ref.double(), got.double(), dim=-1)
    assert cos.min() >= 0.99, cos

    capsys.readouterr()
    assert main(["eval", str(out), "--no-compile", "--json", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["metric"]["name"] == "logits cosine"
    assert res["metric"]["mean_cosine"] == pytest.approx(rep["metric"]["mean_cosine"], abs=1e-6)


def test_task_feature_extraction_on_a_classifier_checkpoint(bert_cls, few_sentences, tmp_path):
    """An explicit --task loads the encoder only: its head is left out on purpose (not a mismatch),
    and the metric is the sentence-embedding cosine."""
    out = tmp_path / "enc-int8"
    assert main(["quantize", str(bert_cls), "--task", "feature-extraction", "--calib", str(few_sentences),
                 "--out", str(out), "--quiet", "--num-calib", "8", "--recipe", "static"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["metric"]["name"] == "embedding cosine" and "weights_not_loaded" not in rep
    assert rep["model"].endswith("(BertModel)")
    ids = torch.randint(1000, 2000, (2, 7))
    y = quantkit.load(out)(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids))
    assert y["last_hidden_state"].shape == (2, 7, 32) and "logits" not in y


def test_legitimate_checkpoints_load_strictly(tmp_path):
    """Benign differences are not mismatches: the bundled model; an old checkpoint that stored the
    non-persistent position_ids buffer; a tied lm_head (GPT-2) that the checkpoint does not store."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    _, _, fit = _hf.load_hf_checkpoint(_hf.default_model_path(), progress=False)
    assert fit.clean and fit.architecture == "BertModel"

    old = _tiny_bert(tmp_path / "old")
    sd = load_file(str(old / "model.safetensors"))
    sd["bert.embeddings.position_ids"] = torch.arange(128)[None]
    save_file(sd, str(old / "model.safetensors"))
    _, _, fit = _hf.load_hf_checkpoint(old, progress=False)
    assert fit.clean, fit

    torch.manual_seed(0)
    gpt = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)
                                 ).save_pretrained(str(gpt))
    assert "lm_head.weight" not in load_file(str(gpt / "model.safetensors"))  # tied to wte
    model, _, fit = _hf.load_hf_checkpoint(gpt, progress=False)
    assert fit.clean and type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


# --- the recipe flags are QuantConfig's fields (issue 12) ------------------------------------------

def test_cpu_recipe_flags(mlp_inputs, tmp_path, capsys):
    """README's CPU recipe QuantConfig(activation="affine-uint7", ops={"linear"}) as flags: recorded
    in quantization.json, and every activation is quantized to 0..127."""
    weights, calib = mlp_inputs
    out = tmp_path / "u7"
    assert main(_factory_args(weights, calib, out, "--activation", "affine-uint7", "--ops", "linear")) == 0
    doc = json.loads((out / "quantization.json").read_text())
    assert doc["recipe"]["activation"] == "affine-uint7" and doc["recipe"]["ops"] == ["linear"]
    assert doc["recipe"]["scheme"] == "w8a8" and doc["recipe"]["dynamic"] is False
    acts = [t for t in doc["tensors"] if t["kind"] == "activation"]
    assert acts and {(t["quant_min"], t["quant_max"]) for t in acts} == {(0, 127)}, acts[0]
    # explicit flags and the --scheme shorthand give the same recipe
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(_factory_args(weights, calib, a, "--dynamic", "--granularity", "per-token")) == 0
    assert main(_factory_args(weights, calib, b, "--scheme", "w8a8-per-token")) == 0
    ra, rb = (json.loads((d / "quantization.json").read_text())["recipe"] for d in (a, b))
    assert ra == rb and ra["scheme"] == "w8a8-per-token" and ra["activation"] == "symmetric-int8"
    assert "affine-uint7" in (out / "report.md").read_text()
    capsys.readouterr()


# --- eval: compiled by default, with a fallback ---------------------------------------------------

def test_eval_falls_back_when_compilation_fails(mlp_inputs, tmp_path, capsys, monkeypatch):
    weights, calib = mlp_inputs
    out = tmp_path / "mlp-int8"
    assert main(_factory_args(weights, calib, out, "--device", "cpu")) == 0

    def broken(*a, **k):
        raise RuntimeError("no C++ compiler\nsecond line")

    monkeypatch.setattr(quantkit, "compile", broken)
    capsys.readouterr()
    assert main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--quiet"]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    assert "compilation failed (no C++ compiler second line)" in printed.out
    assert "int8 (q/dq reference)" in printed.out and "int8 speedup over float:" in printed.out


@pytest.mark.slow
def test_eval_compiles_both_models(mlp_inputs, tmp_path, capsys):
    """Default eval: torch.compile'd float vs quantkit.compile'd int8, timed interleaved (~30 s:
    two Inductor compilations)."""
    weights, calib = mlp_inputs
    out = tmp_path / "mlp-int8"
    assert main(_factory_args(weights, calib, out)) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--quiet", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rep = json.loads((out / "report.json").read_text())
    assert res["compiled"] is True and "note" not in res, res
    assert set(res["latency"]) == {"float (compiled)", "int8 (compiled)"}
    assert res["speedup"] > 0 and all(v["batches"] >= 12 for v in res["latency"].values())
    # the compiled int8 model computes what the reference q/dq graph computes
    assert res["metric"]["mean_cosine"] == pytest.approx(rep["metric"]["mean_cosine"], abs=2e-3)


@pytest.mark.gpu
def test_quantize_on_cuda_saves_a_cpu_artifact(mlp_inputs, tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    weights, calib = mlp_inputs
    out = tmp_path / "cuda-int8"
    assert main(_factory_args(weights, calib, out, "--device", "cuda")) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["device"].startswith("cuda") and rep["metric"]["mean_cosine"] > 0.999
    q = quantkit.load(out)
    assert all(t.device.type == "cpu" for t in list(q.parameters()) + list(q.buffers()))
    assert q(torch.randn(3, 64)).shape == (3, 32)
    capsys.readouterr()
    assert main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--device", "cuda", "--no-compile",
                 "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"].startswith("cuda")


def test_tokenizer_outputs_the_model_does_not_take_are_dropped(few_sentences, tmp_path):
    """A BERT-style tokenizer beside a DistilBERT classifier returns token_type_ids, which
    DistilBERT's forward does not take: the CLI feeds the model only the inputs it names."""
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "distil"
    torch.manual_seed(0)
    cfg = transformers.DistilBertConfig(vocab_size=30522, dim=32, hidden_dim=64, n_layers=2, n_heads=2,
                                        num_labels=4, max_position_embeddings=128)
    transformers.DistilBertForSequenceClassification(cfg).save_pretrained(str(model_dir), safe_serialization=True)
    for f in _TOKENIZER_FILES:
        shutil.copy(_hf.default_model_path() / f, model_dir / f)
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert "token_type_ids" in tok(["a test"])  # the case this test is about
    out = tmp_path / "distil-int8"
    assert main(["quantize", str(model_dir), "--calib", str(few_sentences), "--out", str(out), "--quiet",
                 "--num-calib", "8", "--recipe", "static"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["metric"]["name"] == "logits cosine" and rep["metric"]["min_cosine"] >= 0.99, rep["metric"]
    enc = dict(tok(_hf.read_sentences(few_sentences)[:4], padding=True, return_tensors="pt"))
    enc.pop("token_type_ids")
    with torch.no_grad():
        ref = transformers.DistilBertForSequenceClassification.from_pretrained(str(model_dir)).eval()(**enc).logits
        got = quantkit.load(out)(**enc)["logits"]
    assert got.shape == ref.shape == (4, 4)
    assert torch.nn.functional.cosine_similarity(ref.double(), got.double(), dim=-1).min() >= 0.99
