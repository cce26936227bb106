"""Adversarial torchrun runs (issue 26, item 5): ranks that disagree, fail or stop.

Each test starts ``torchrun --nproc-per-node 2`` (gloo) on a tiny factory model
(:func:`tests.dist_factories.sqrt_mlp`) through a launcher that gives each rank its own
arguments (``A@@B``: rank 0 gets A, rank 1 gets B) or its own fault. torchrun writes each
rank's stderr to its own file (``--log-dir``, ``--redirects 3``), so every rank's line is
checked on its own: exactly one ``quantkit: error:`` line that names the rank and what
differs, a non-zero exit, the inputs unchanged and nothing written.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._hostile import _error, _no_leftovers, _tree
from tests.test_distributed import _port

pytestmark = pytest.mark.skipif(not dist.is_available() or not hasattr(os, "fork"),
                                reason="needs torch.distributed (gloo) and fork")

ROOT = Path(__file__).resolve().parents[1]
# QUANTKIT_DIST_TIMEOUT in these runs: a silent rank is named after 10 s, not 600; long enough for two ranks
# started together to reach calibration apart on a loaded machine
TIMEOUT_S = 10

# rank 0 takes "A", rank 1 "B" from each "A@@B" argument; QK_FAULT ("RANK:what") injects a fault
LAUNCHER = '''
import os, sys, time
rank = int(os.environ["RANK"])
where, _, fault = os.environ.get("QK_FAULT", "").partition(":")
fault = fault if where == str(rank) else ""
if fault == "never-starts":
    sys.exit(0)
if fault in ("exits-in-calibration", "hangs-in-calibration"):
    import quantkit.pipeline._calibrate as calibrate

    def call_model(model, batch):
        if fault == "exits-in-calibration":
            os._exit(0)
        time.sleep(120)

    calibrate.call_model = call_model
if fault == "fails-writing":
    from quantkit._errors import QuantkitError
    from quantkit.export import _artifact

    def write_program(program, directory):
        raise QuantkitError("no space left on the device holding --out (simulated)")

    _artifact.write_program = write_program
from quantkit.cli import main
sys.exit(main([a.split("@@")[rank] if "@@" in a else a for a in sys.argv[1:]]))
'''


def _write_calib(directory: Path, scale: float = 1.0, seed: int = 0, files: int = 4) -> Path:
    directory.mkdir()
    g = torch.Generator().manual_seed(seed)
    for i in range(files):
        torch.save(torch.rand(4, 16, generator=g) * scale, directory / f"b{i}.pt")
    return directory


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """One model's weights (and a copy with one weight changed) and calibration sets."""
    from safetensors.torch import save_file

    from tests.dist_factories import sqrt_mlp

    root = tmp_path_factory.mktemp("dist_inputs")
    (root / "launch.py").write_text(LAUNCHER, encoding="utf-8")
    sd = {k: v.contiguous() for k, v in sqrt_mlp().state_dict().items()}
    save_file(sd, str(root / "w0.safetensors"))
    other = dict(sd)
    other["fc2.weight"] = sd["fc2.weight"].clone()
    other["fc2.weight"][0, 0] += 0.5  # one number of 264
    save_file(other, str(root / "w1.safetensors"))
    calib = {
        "same": _write_calib(root / "calib"),
        "other": _write_calib(root / "calib_other", seed=1),
        "scaled": _write_calib(root / "calib_scaled", scale=5.0),
    }
    nan = _write_calib(root / "calib_nan")
    x = torch.load(nan / "b3.pt")
    x[1, 2] = float("nan")
    torch.save(x, nan / "b3.pt")
    calib["nan"] = nan
    return root, calib


def _run(inputs, tmp_path: Path, *, weights="w0.safetensors", calib="same", observer="minmax", fault=""):
    """torchrun on two ranks; returns (exit code, [rank 0's stderr, rank 1's stderr], out, seconds)."""
    root, sets = inputs
    pick = lambda v, f: "@@".join(f(x) for x in v.split("@@"))  # noqa: E731
    out = tmp_path / "out"
    logs = tmp_path / "logs"
    args = ["quantize", "tests.dist_factories:sqrt_mlp", "--example-input", "4x16:float32",
            "--weights", pick(weights, lambda w: str(root / w)), "--calib", pick(calib, lambda c: str(sets[c])),
            "--batch-size", "4", "--observer", observer, "--out", str(out), "--quiet"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", QUANTKIT_DIST_TIMEOUT=str(TIMEOUT_S),
               QK_FAULT=fault)  # no PYTHONPATH: the installed quantkit (a wheel in CI), never the source folders
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_port()), "--log-dir", str(logs), "--redirects", "3",
                           str(root / "launch.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    seconds = time.monotonic() - start
    errs = []
    for r in range(2):
        found = sorted(logs.glob(f"**/attempt_0/{r}/stderr.log"))
        assert len(found) == 1, (found, proc.stderr[-2000:])
        errs.append(found[0].read_text(encoding="utf-8", errors="replace"))
    return proc.returncode, errs, out, seconds


def _lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def _check_failed(inputs, rc, errs, out, before) -> list[str]:
    """Each given rank's stderr is one quantkit error line (nothing else: no c10d warnings either)."""
    assert rc != 0
    lines = [_error(err) for err in errs]
    _no_leftovers(out)
    assert _hashes(inputs) == before, "an input changed"
    return lines


def _hashes(inputs):
    root, sets = inputs
    return {p.name: _tree(p) for p in [root, *sets.values()]}


def test_ranks_with_the_same_inputs_succeed(inputs, tmp_path):
    """Positive control: the launcher and the per-rank arguments alone change nothing."""
    rc, errs, out, _ = _run(inputs, tmp_path, weights="w0.safetensors@@w0.safetensors", calib="same@@same")
    assert rc == 0, errs
    assert all(not _lines(e) for e in errs), errs
    assert (out / "quantization.json").is_file()


def test_other_weights_on_rank_1_fail_every_rank(inputs, tmp_path):
    before = _hashes(inputs)
    rc, errs, out, _ = _run(inputs, tmp_path, weights="w0.safetensors@@w1.safetensors")
    for line in _check_failed(inputs, rc, errs, out, before):
        assert "rank 1's model weights differ from rank 0's" in line and "fc2.weight" in line, line


def test_other_data_on_rank_1_fails_every_rank(inputs, tmp_path):
    before = _hashes(inputs)
    rc, errs, out, _ = _run(inputs, tmp_path, calib="same@@other")
    for line in _check_failed(inputs, rc, errs, out, before):
        assert "rank 1's calibration data differs from rank 0's" in line and "batch 0 of" in line, line


def test_scaled_data_on_rank_1_fails_every_rank(inputs, tmp_path):
    """5x the data on rank 1 moved every activation scale 5x before (issue 26)."""
    before = _hashes(inputs)
    rc, errs, out, _ = _run(inputs, tmp_path, calib="same@@scaled")
    for line in _check_failed(inputs, rc, errs, out, before):
        assert "rank 1's calibration data differs from rank 0's" in line, line


def test_another_recipe_on_rank_1_fails_every_rank(inputs, tmp_path):
    before = _hashes(inputs)
    rc, errs, out, _ = _run(inputs, tmp_path, observer="minmax@@mse")
    for line in _check_failed(inputs, rc, errs, out, before):
        assert "rank 1's recipe differs from rank 0's: --observer \"mse\" vs \"minmax\"" in line, line


def test_nan_sample_on_one_rank_gives_every_rank_a_line(inputs, tmp_path):
    before = _hashes(inputs)
    rc, errs, out, seconds = _run(inputs, tmp_path, calib="same@@nan")
    zero, one = _check_failed(inputs, rc, errs, out, before)
    assert one.startswith("quantkit: error: rank 1 of 2: calibration sample") and "b3.pt" in one, one
    assert "NaN or inf" in one, one
    assert zero.startswith("quantkit: error: rank 1 of 2 failed before calibration (") and "b3.pt" in zero, zero
    assert "unexpected failure" not in zero + one
    assert seconds < 60, seconds  # not torchrun's kill after a timeout


def test_a_rank_that_ends_during_calibration_is_named(inputs, tmp_path):
    before = _hashes(inputs)
    rc, errs, out, seconds = _run(inputs, tmp_path, fault="1:exits-in-calibration")
    assert rc != 0
    assert not _lines(errs[1]), errs[1]  # rank 1 ended without a word (os._exit)
    zero = _check_failed(inputs, rc, errs[:1], out, before)[0]
    assert "rank 1 of 2 stopped answering at the exchange after a calibration pass" in zero, zero
    assert "its process ended" in zero and "unexpected failure" not in zero, zero
    assert seconds < 60, seconds


def test_a_rank_that_hangs_during_calibration_is_named_after_the_timeout(inputs, tmp_path):
    before = _hashes(inputs)
    rc, errs, out, seconds = _run(inputs, tmp_path, fault="1:hangs-in-calibration")
    zero = _check_failed(inputs, rc, errs[:1], out, before)[0]
    assert "rank 1 of 2 stopped answering at the exchange after a calibration pass" in zero, zero
    assert f"no answer within {TIMEOUT_S} s" in zero and "QUANTKIT_DIST_TIMEOUT" in zero, zero
    assert "unexpected failure" not in zero
    # rank 1 is stuck in its batch until torchrun stops it: at most torchrun's SIGTERM line
    assert _lines(errs[1]) in ([], ["quantkit: interrupted (SIGTERM)"]), errs[1]
    assert seconds < 90, seconds


def test_a_rank_that_never_starts_is_named_after_the_timeout(inputs, tmp_path):
    before = _hashes(inputs)
    rc, errs, out, seconds = _run(inputs, tmp_path, fault="1:never-starts")
    zero = _check_failed(inputs, rc, errs[:1], out, before)[0]
    assert f"rank 1 of 2 did not reach calibration within {TIMEOUT_S} s" in zero, zero
    assert "unexpected failure" not in zero and "wait timeout" not in zero, zero
    assert seconds < 90, seconds


def test_rank_0_failing_to_write_fails_the_other_ranks_too(inputs, tmp_path):
    """Rank 0 alone writes, after calibration: the other ranks wait for its outcome."""
    before = _hashes(inputs)
    rc, errs, out, seconds = _run(inputs, tmp_path, fault="0:fails-writing")
    zero, one = _check_failed(inputs, rc, errs, out, before)
    assert zero == "quantkit: error: rank 0 of 2: no space left on the device holding --out (simulated)", zero
    assert one.startswith("quantkit: error: rank 0 of 2 failed after calibration (no space left"), one
    assert seconds < 60, seconds


# --- the Python API: quantkit.calibrate under an initialised process group -----------------------

@pytest.fixture(scope="module")
def api_ranks(tmp_path_factory):
    """Two forked gloo ranks calibrate a tiny captured model, once per disagreement."""
    import quantkit
    from quantkit.pipeline import _distributed as agreement
    from quantkit.quantizers import QuantConfig, W8A8Quantizer
    from tests.dist_factories import sqrt_mlp
    from tests.test_distributed import run_ranks

    gm = quantkit.capture(sqrt_mlp().eval(), (torch.rand(4, 16),))
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(4, 16, generator=g),) for _ in range(5)]

    def prepared(observer="minmax"):
        return quantkit.prepare(gm, W8A8Quantizer(QuantConfig(act_observer=observer)))

    def outcome(fn) -> str:
        try:
            fn()
            return "ok"
        except Exception as exc:  # noqa: BLE001 (type and message are checked by the tests)
            return f"{type(exc).__name__}: {exc}"

    def work(rank: int) -> dict:
        res = {}
        p = quantkit.prepare(copy.deepcopy(gm), W8A8Quantizer(QuantConfig()))  # prepare shares gm's weights
        if rank == 1:
            with torch.no_grad():
                p.fc1.weight[3, 4] += 1.0
        res["weights"] = outcome(lambda: quantkit.calibrate(p, quantkit.shard(data), progress=False))
        mine = data if rank == 0 else [(x * 5,) for (x,) in data]
        res["data"] = outcome(lambda: quantkit.calibrate(prepared(), quantkit.shard(mine), progress=False))
        res["shard"] = outcome(lambda: quantkit.calibrate(prepared(), quantkit.shard(data, 0, 2), progress=False))
        res["recipe"] = outcome(lambda: quantkit.calibrate(prepared("minmax" if rank == 0 else "mse"),
                                                           quantkit.shard(data), progress=False))
        more = data + [data[0]] if rank == 1 else data  # one batch more on rank 1
        res["count"] = outcome(lambda: quantkit.calibrate(prepared(), quantkit.shard(more), progress=False))
        versions = agreement._versions
        if rank == 1:
            agreement._versions = lambda: {**versions(), "torch": "9.9.9"}
        res["versions"] = outcome(lambda: quantkit.calibrate(prepared(), quantkit.shard(data), progress=False))
        agreement._versions = versions
        res["same"] = outcome(lambda: quantkit.calibrate(prepared(), quantkit.shard(data), progress=False))
        return res

    return run_ranks(work, tmp_path_factory.mktemp("api_ranks"))


@pytest.mark.parametrize("case,expected", [
    ("weights", "DistributedError: rank 1's model weights differ from rank 0's: fc1.weight (sha256 "),
    ("data", "DistributedError: rank 1's calibration data differs from rank 0's: batch 0 of 5 (sha256 "),
    ("shard", "DistributedError: rank 1 of 2 calibrates on shard 0 of 2; let quantkit.shard(data) choose"),
    ("count", "DistributedError: rank 1's calibration data differs from rank 0's: 6 batches vs 5 on rank 0; "),
    ("versions", f"DistributedError: rank 1 runs torch 9.9.9, rank 0 runs torch {torch.__version__}; install "),
    ("recipe", "DistributedError: rank 1's quantization recipe differs from rank 0's: activation_post_process_0 "
               "(HistogramObserver vs MinMaxObserver on rank 0; 2 of 4 observers differ); prepare the same model"),
])
def test_api_ranks_that_disagree_fail_every_rank(api_ranks, case, expected):
    for rank in range(2):
        got = api_ranks[rank][case]
        assert got.startswith(expected), (rank, got)
        assert "\n" not in got
    assert api_ranks[0][case] == api_ranks[1][case]  # every rank, the same line


def test_api_ranks_that_agree_still_calibrate_after_a_refusal(api_ranks):
    """Positive control: the refusals above leave the process group usable, and agreeing ranks pass."""
    assert [api_ranks[r]["same"] for r in range(2)] == ["ok", "ok"]
