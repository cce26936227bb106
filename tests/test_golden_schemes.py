"""Every scheme's numbers on the bundled model are frozen: the quantized tensors and the outputs.

Recorded before the registry redesign (issue 27) from the public API of that time, and kept
so that any later change to the stages shows up as a changed hash. For each scheme the test
quantizes all-MiniLM-L6-v2 on the bundled sentences (32 calibrate, 16 held out, seq_len 32,
one thread) and hashes:

- ``names``: every tensor of the converted module (parameters, buffers and constants) with its
  name, dtype, shape and bytes, in name order;
- ``tensors``: the same without the names (a pure renaming changes ``names`` only);
- ``weights``: the integer tensors alone (the codes). For round-to-nearest schemes these follow
  from the checkpoint alone, so they are compared on every CPU;
- ``outputs``: ``last_hidden_state`` of the held-out batches, run through the converted graph.

Calibrated scales and outputs go through float GEMMs whose last bits differ between CPU
kernels (AVX2, AVX-512, AMX), so ``names``/``tensors``/``outputs`` are compared only on the
CPU the file was recorded on (``cpu`` in the file); elsewhere those checks skip with the reason.

Record again (only when a change of numbers is intended and explained):
``python tests/test_golden_schemes.py --record``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).with_name("data") / "golden_schemes.json"
pytestmark = pytest.mark.slow


def _cpu_key() -> str:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = sorted(k for k, v in caps.items() if v is True)
    return f"torch {torch.__version__.split('+')[0]}; " + ",".join(flags)


def _schemes():
    """name -> (quantizer factory, smooth_quant alpha or None). Public API only."""
    from quantkit.quantizers import FP8Quantizer, QuantConfig, W8A8Quantizer, WeightOnlyQuantizer

    return {
        "w8a8": (lambda: W8A8Quantizer(), None, False),
        "w8a8-hist": (lambda: W8A8Quantizer(QuantConfig(act_observer="histogram")), None, False),
        "w8a8-dynamic": (lambda: W8A8Quantizer(QuantConfig(dynamic=True)), None, True),
        "w8a8-per-token": (lambda: W8A8Quantizer(QuantConfig(dynamic=True, granularity="per-token")), None, True),
        "w8a8-gptq": (lambda: W8A8Quantizer(QuantConfig(weight_algorithm="gptq")), None, False),
        "smoothquant-per-token": (lambda: W8A8Quantizer(QuantConfig(dynamic=True, granularity="per-token")),
                                  0.5, False),
        "w4a16": (lambda: WeightOnlyQuantizer(bits=4, group_size=128), None, True),
        "w4a16-sym-g32": (lambda: WeightOnlyQuantizer(bits=4, group_size=32, symmetric=True), None, True),
        # recorded before clip_search became GPTQ's default: pinned off, these numbers still hold
        "w4a16-gptq": (lambda: WeightOnlyQuantizer(bits=4, group_size=128, algorithm="gptq", clip_search=False),
                       None, False),
        "w4a16-awq": (lambda: WeightOnlyQuantizer(bits=4, group_size=128, algorithm="awq"), None, False),
        "w8a16": (lambda: WeightOnlyQuantizer(bits=8, group_size=None, symmetric=True), None, True),
        "nf4": (lambda: WeightOnlyQuantizer(bits=4, group_size=64, scheme="nf4"), None, True),
        "fp8": (lambda: FP8Quantizer(), None, False),
        "fp8-dynamic": (lambda: FP8Quantizer(dynamic=True, granularity="per-token"), None, False),
    }


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        if name is not None:
            h.update(name.encode())
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


def _module_tensors(gm) -> list[tuple[str, torch.Tensor]]:
    seen = {}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        seen[name] = t
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                seen[str(node.target)] = obj
    return sorted(seen.items())


def _hashes(qmodel, held) -> dict[str, str]:
    tensors = _module_tensors(qmodel)
    ints = [(n, t) for n, t in tensors if not (t.is_floating_point() or t.is_complex())]
    with torch.no_grad():
        outs = [qmodel(**b)[0] for b in held]
    return {
        "names": _digest(tensors),
        "tensors": _digest(sorted(((None, t) for _, t in tensors), key=lambda p: _digest([p]))),
        "weights": _digest(ints),
        "outputs": _digest([(None, o) for o in outs]),
    }


def compute(names=None) -> dict[str, dict[str, str]]:
    import quantkit
    from quantkit import _hf

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model, tok = _hf.load_hf_model(_hf.default_model_path())
        sents = _hf.read_sentences(_hf.default_calibration_file())
        calib = _hf.tokenize(tok, sents[:32], seq_len=32, batch_size=16)
        held = _hf.tokenize(tok, sents[-16:], seq_len=32, batch_size=16)
        out = {}
        for name, (make, alpha, _rtn) in _schemes().items():
            if names is not None and name not in names:
                continue
            gm = quantkit.capture(model, calib[0])
            if alpha is not None:
                gm = quantkit.smooth_quant(gm, calib, alpha=alpha)
            prepared = quantkit.prepare(gm, make())
            quantkit.calibrate(prepared, calib, progress=False)
            out[name] = _hashes(quantkit.convert(prepared), held)
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recorded():
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def computed():
    return compute()


@pytest.mark.parametrize("scheme", sorted(_schemes()))
def test_scheme_is_unchanged(scheme, recorded, computed):
    want, got = recorded["schemes"][scheme], computed[scheme]
    if _schemes()[scheme][2]:
        assert got["weights"] == want["weights"], f"{scheme}: the integer weights changed"
    if recorded["cpu"] != _cpu_key():
        pytest.skip(f"scales and outputs were recorded on another CPU/torch ({recorded['cpu'][:60]}...)")
    for part in ("weights", "tensors", "names", "outputs"):
        assert got[part] == want[part], f"{scheme}: {part} changed (recorded {want[part]}, now {got[part]})"


def test_every_scheme_is_recorded(recorded):
    assert sorted(recorded["schemes"]) == sorted(_schemes())


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_golden_schemes.py --record")
    GOLDEN.parent.mkdir(exist_ok=True)
    data = {"cpu": _cpu_key(), "schemes": compute()}
    tmp = GOLDEN.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(GOLDEN)
    print(json.dumps(data, indent=1))
