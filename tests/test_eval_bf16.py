"""``quantkit eval`` compares with the float model compiled in bf16 where the CPU has native BF16
(issue 28), and says in one line why not elsewhere.

Both branches run on any CPU: ``bf16_supported`` is patched, and ``torch.compile`` is replaced by
the eager module (the branch logic and the report are under test, not Inductor; the compiled
paths are timed in test_cli.py's slow test and in benchmarks).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from quantkit.cli import _eval as cli_eval, main
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalhalf")
    weights, calib = write_mlp_inputs(d, calib_rows=24)
    out = d / "int8"
    assert main(mlp_quantize_args(weights, calib, out, "--recipe", "static")) == 0
    return weights, out


def _run_eval(artifact, capsys, *extra):
    weights, out = artifact
    capsys.readouterr()
    assert main(["eval", str(out), "--model", "tests.cli_factories:mlp", "--weights", str(weights), "--quiet",
                 *extra]) == 0
    return capsys.readouterr()


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile -> the module itself; records the dtype of every model it is asked to compile."""
    dtypes = []

    def fake(model, **kw):
        dtypes.append(next(model.parameters()).dtype)
        return model

    monkeypatch.setattr(torch, "compile", fake)
    return dtypes


def test_without_native_bf16_eval_says_so_in_one_line(artifact, capsys, monkeypatch, eager_compile):
    monkeypatch.setattr(cli_eval, "bf16_supported", lambda: False)
    printed = _run_eval(artifact, capsys)
    lines = [ln for ln in printed.out.splitlines() if "bf16" in ln]
    assert lines == [cli_eval.NO_BF16], printed.out
    assert torch.bfloat16 not in eager_compile  # nothing compiled (or timed) in bf16
    res = json.loads(_run_eval(artifact, capsys, "--json").out)
    assert res["bf16"] == {"note": cli_eval.NO_BF16}
    assert set(res["latency"]) == {"float (compiled)", "int8 (compiled)"}


def test_with_native_bf16_eval_times_the_bf16_model_too(artifact, capsys, monkeypatch, eager_compile):
    monkeypatch.setattr(cli_eval, "bf16_supported", lambda: True)
    res = json.loads(_run_eval(artifact, capsys, "--json").out)
    assert torch.bfloat16 in eager_compile
    bf16, int8 = res["bf16"], res["latency"]["int8 (compiled)"]
    assert bf16["batches"] == int8["batches"] >= 12  # interleaved with the other two, batch by batch
    assert bf16["int8_speedup"] == pytest.approx(bf16["median_ms_per_batch"] / int8["median_ms_per_batch"], rel=2e-3)
    assert set(res["latency"]) == {"float (compiled)", "int8 (compiled)"}  # the fp32 comparison is unchanged
    printed = _run_eval(artifact, capsys).out
    [line] = [ln for ln in printed.splitlines() if "bf16" in ln]
    assert re.fullmatch(r"float compiled in bf16: [0-9.]+ ms per batch; int8 speedup over it: [0-9.]+x"
                        r"( \(slower than bf16\))?", line), line


def test_no_compile_has_no_bf16_comparison(artifact, capsys, monkeypatch):
    monkeypatch.setattr(cli_eval, "bf16_supported", lambda: True)
    res = json.loads(_run_eval(artifact, capsys, "--json", "--no-compile").out)
    assert "bf16" not in res and res["compiled"] is False
