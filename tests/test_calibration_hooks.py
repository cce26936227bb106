"""Calibration hooks (quantkit.pipeline._hooks): registration, order around calibrate's pass,
early checks, and the library's own GPTQ/AWQ hooks registered whatever the user imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import quantkit
from quantkit.quantizers import W8A8Quantizer
from quantkit.pipeline import _hooks
from quantkit.pipeline import calibration_hooks, register_calibration_hook


@pytest.fixture
def registry():
    """Hooks a test registers are gone afterwards."""
    saved = {when: dict(hooks) for when, hooks in _hooks._HOOKS.items()}
    yield
    for when, hooks in saved.items():
        _hooks._HOOKS[when].clear()
        _hooks._HOOKS[when].update(hooks)


def _prepared():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    data = [torch.randn(3, 8) for _ in range(4)]
    return quantkit.prepare(quantkit.capture(model, data[0]), W8A8Quantizer()), data


def test_when_must_be_a_known_point():
    with pytest.raises(ValueError, match="when must be one of before_pass, after_block, after_pass, got 'after_all'"):
        register_calibration_hook("probe", when="after_all")
    with pytest.raises(ValueError, match="when must be one of"):
        calibration_hooks("during")


def test_the_library_registers_gptq_and_awq():
    assert "awq" in dict(calibration_hooks("before_pass"))
    assert "gptq" in dict(calibration_hooks("after_pass"))
    assert "gptq" in dict(calibration_hooks("after_block"))


def test_importing_only_pipeline_registers_them():
    """Python imports the quantkit package (which imports accuracy) before quantkit.pipeline."""
    code = ("from quantkit.pipeline._hooks import calibration_hooks as h; "
            "print(sorted(n for w in ('before_pass', 'after_block', 'after_pass') for n, _ in h(w)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "['awq', 'gptq', 'gptq']"


def test_steps_run_around_the_pass_and_meta_is_written(registry):
    prepared, data = _prepared()
    events = []

    @register_calibration_hook("probe", when="before_pass")
    def before(cal):
        events.append(("asked before", cal.max_batches))

        def step():
            events.append(("before", prepared.meta.get("quantkit_calibrated_batches")))
        return step

    @register_calibration_hook("probe", when="after_pass")
    def after(cal):
        events.append(("asked after", None))

        def step():
            events.append(("after", cal.seen))
            cal.meta["probe"] = ["done"]
        return step

    @register_calibration_hook("idle", when="after_pass")
    def idle(cal):
        return None  # nothing to do for this model

    quantkit.calibrate(prepared, data, progress=False, max_batches=3)
    assert events == [("asked before", 3), ("asked after", None), ("before", None), ("after", 3)]
    assert prepared.meta["probe"] == ["done"] and prepared.meta["quantkit_calibrated_batches"] == 3


def test_a_hook_check_fails_before_any_pass(registry):
    prepared, data = _prepared()
    ran = []

    @register_calibration_hook("probe", when="before_pass")
    def first(cal):
        return lambda: ran.append("step")

    @register_calibration_hook("refuses", when="after_pass")
    def refuses(cal):
        raise ValueError("probe refuses this model")

    with pytest.raises(ValueError, match="probe refuses this model"):
        quantkit.calibrate(prepared, data, progress=False)
    assert ran == [] and "quantkit_calibrated_batches" not in prepared.meta
