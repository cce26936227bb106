"""Distributed calibration (issue 16): two gloo processes against one process on all the data.

The API tests share one start of two ranks (forked from this process, so the captured graphs
are not captured again): every rank calibrates its contiguous shard (``quantkit.shard``), and
each observer's qparams must be ``torch.equal`` to those of one process that calibrated on
all the batches in the same order, for min/max, moving averages, per-channel and every
histogram method, on a transformer block and on the bundled MiniLM. The CLI tests run
``torchrun`` (``python -m torch.distributed.run``) on the bundled model and on a factory
model whose rank 1 sees NaN. GPTQ, AWQ and SmoothQuant under two ranks: test_distributed_rounding.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import quantkit
from quantkit import _hf
from quantkit.observers import sync
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import TransformerBlock

pytestmark = pytest.mark.skipif(not dist.is_available() or not hasattr(os, "fork"),
                                reason="needs torch.distributed (gloo) and fork")

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
_QUANTKIT = shutil.which("quantkit", path=os.path.dirname(sys.executable)) or shutil.which("quantkit") or "quantkit"

# (activation observer, weight observer): every observer kind at least once
BLOCK_CONFIGS = [
    ("minmax", "per_channel_minmax"),
    ("moving_average_minmax", "moving_average_per_channel_minmax"),
    ("kl", "per_channel_mse"),
    ("mse", "per_channel_minmax"),
    ("l2", "per_channel_minmax"),
    ("percentile", "per_channel_minmax"),
]
# on MiniLM the per-channel MSE weight search (its slowest part, 4 s) is left to the block
MINILM_CONFIGS = [(a, "per_channel_minmax" if w == "per_channel_mse" else w) for a, w in BLOCK_CONFIGS]
CONFIGS = [("block", a, w) for a, w in BLOCK_CONFIGS] + [("minilm", a, w) for a, w in MINILM_CONFIGS]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out: str, work) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from datetime import timedelta

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        torch.save(work(rank), out)
    finally:
        dist.destroy_process_group()


def run_ranks(work, tmp: Path) -> list[dict]:
    """``work(rank)`` on two forked gloo ranks; their results (dicts of tensors and strings)."""
    ctx = multiprocessing.get_context("fork")
    port = _port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(tmp / f"rank{r}.pt"), work)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * WORLD, f"rank exit codes {codes}"
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def qparams(prepared) -> dict[str, list[torch.Tensor]]:
    out = {}
    for name, m in prepared.named_modules():
        if name and isinstance(m, quantkit.observers.QuantkitObserver) and not m.is_dynamic and m.calibrated:
            try:
                out[name] = [torch.as_tensor(t).clone() for t in m.calculate_qparams()]
            except NotImplementedError:
                continue
    return out


def _prepare(gm, act: str, weight: str):
    return quantkit.prepare(gm, W8A8Quantizer(QuantConfig(act_observer=act, weight_observer=weight)))


class _Counting:
    """Counts torch.distributed.all_reduce calls (the collectives of one sync)."""

    def __enter__(self):
        self.calls, self._orig = 0, dist.all_reduce

        def counted(*a, **k):
            self.calls += 1
            return self._orig(*a, **k)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    block = quantkit.capture(TransformerBlock().eval(), (torch.randn(2, 8, 64),))
    g = torch.Generator().manual_seed(1)
    # 5 batches: rank 0 takes 2, rank 1 takes 3 (uneven shards); growing scales make ranges move
    block_data = [(torch.randn(2, 8, 64, generator=g) * (1 + 0.5 * i),) for i in range(5)]
    model, tok = _hf.load_hf_model(_hf.default_model_path(), progress=False)
    sents = _hf.read_sentences(_hf.default_calibration_file())[:10]
    minilm_data = _hf.tokenize(tok, sents, seq_len=32, batch_size=2)  # 5 padded batches
    minilm = quantkit.capture(model, minilm_data[0], dynamic_shapes=_hf.dynamic_shapes(minilm_data[0]))
    return {"block": (block, block_data), "minilm": (minilm, minilm_data)}


class _Declared(quantkit.observers.QuantkitObserver):
    """An observer of another kind that declares its reduction (``sync_ops``)."""

    sync_ops = {"total": "sum", "peak": "max"}

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(3, dtype=torch.float64))
        self.register_buffer("peak", torch.full((3,), float("-inf")))

    calibrated = True

    def _observe(self, x):
        self.total += x.round().double().sum(0)[:3]  # integer-valued: sums are exact in any order
        self.peak.copy_(torch.maximum(self.peak, x.amax(0)[:3]))


def _observer_set(rank: int | None):
    """Observers fed directly (no graph): torchao's min/max ones beside quantkit's; the per-channel
    ones see rank 0's shard only (rank 1's stay empty: the sync sizes their state from rank 0's).
    ``rank=None``: one process, all the batches."""
    from torchao.quantization.pt2e import observer as ao

    from quantkit import observers as qo

    mods = torch.nn.ModuleDict({
        "ao_minmax": ao.MinMaxObserver(dtype=torch.quint8),
        "ao_per_channel": ao.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8,
                                                       qscheme=torch.per_channel_symmetric),
        "qk_per_channel": qo.PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8,
                                                      qscheme=torch.per_channel_symmetric),
        "qk_hist": qo.HistogramObserver(method="mse"),
        "declared": _Declared(),
    })
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(6, 10, generator=g) * (i + 1) - i for i in range(4)]
    for x in batches if rank is None else quantkit.shard(batches, rank, WORLD):
        mods["ao_minmax"](x)
        mods["qk_hist"](x)
        mods["declared"](x)
    for x in quantkit.shard(batches, 0, WORLD) if rank in (None, 0) else []:
        mods["ao_per_channel"](x)
        mods["qk_per_channel"](x)
    return mods


def _state(mods) -> dict:
    return {f"{k}.{n}": b.clone() for k, m in mods.items() for n, b in m.named_buffers()}


@pytest.fixture(scope="module")
def ranks(setup, tmp_path_factory):
    def work(rank: int) -> dict:
        res: dict = {}
        for model in ("block", "minilm"):
            gm, data = setup[model]
            for act, weight in (BLOCK_CONFIGS if model == "block" else MINILM_CONFIGS):
                prepared = _prepare(gm, act, weight)
                with _Counting() as c:
                    quantkit.calibrate(prepared, quantkit.shard(data), progress=False)
                res[f"{model}/{act}/{weight}"] = qparams(prepared)
                res[f"calls/{model}/{act}"] = torch.tensor(c.calls)
                res[f"observers/{model}/{act}"] = torch.tensor(len(res[f"{model}/{act}/{weight}"]))
        gm, data = setup["block"]
        # negative control: the same shard without the reduction
        for act in ("kl", "moving_average_minmax"):
            prepared = _prepare(gm, act, "per_channel_minmax")
            quantkit.calibrate(prepared, quantkit.shard(data), progress=False, distributed=False)
            res[f"local/{act}"] = qparams(prepared)
        # calibrate twice: the second sync adds only the new batches
        for act, weight in (("kl", "per_channel_mse"), ("moving_average_minmax", "moving_average_per_channel_minmax")):
            prepared = _prepare(gm, act, weight)
            quantkit.calibrate(prepared, quantkit.shard(data[:3]), progress=False)
            quantkit.calibrate(prepared, quantkit.shard(data[3:]), progress=False)
            res[f"twice/{act}"] = qparams(prepared)
        # an iterable without len is split by stride (batches 0, 2, 4 | 1, 3)
        prepared = _prepare(gm, "moving_average_minmax", "moving_average_per_channel_minmax")
        quantkit.calibrate(prepared, quantkit.shard(iter(data)), progress=False)
        res["strided"] = qparams(prepared)
        # observers outside a graph, torchao's among them; one rank without data for some
        res["direct"] = _state(sync(_observer_set(rank)))
        # a rank whose shard holds NaN: every rank fails, each with one line
        prepared = _prepare(gm, "minmax", "per_channel_minmax")
        bad = [b if i != 4 else (b[0] * float("nan"),) for i, b in enumerate(data)]  # batch 4: rank 1's shard
        try:
            quantkit.calibrate(prepared, quantkit.shard(bad), progress=False)
            res["nan"] = "no error"
        except Exception as exc:  # noqa: BLE001 (type and message are checked by the test)
            res["nan"] = f"{type(exc).__name__}: {exc}"
        # the process group still works afterwards
        prepared = _prepare(gm, "minmax", "per_channel_minmax")
        quantkit.calibrate(prepared, quantkit.shard(data), progress=False)
        res["after_nan"] = qparams(prepared)
        return res

    return run_ranks(work, tmp_path_factory.mktemp("ranks"))


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread, as on the ranks: GEMMs may round differently with another thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(gm, data, act, weight, chunks=None):
    prepared = _prepare(gm, act, weight)
    for part in chunks or [data]:
        quantkit.calibrate(prepared, part, progress=False, distributed=False)
    return qparams(prepared)


def _assert_equal(ref: dict, got: dict, what: str) -> None:
    assert ref.keys() == got.keys(), what
    bad = [n for n in ref if not all(torch.equal(a, b) for a, b in zip(ref[n], got[n]))]
    assert not bad, f"{what}: qparams differ from one process at {bad[:5]} ({len(bad)} of {len(ref)})"


@pytest.mark.parametrize("model,act,weight", CONFIGS)
def test_two_ranks_equal_one_process(ranks, setup, model, act, weight):
    gm, data = setup[model]
    ref = _reference(gm, data, act, weight)
    assert len(ref) >= 10
    for rank in range(WORLD):
        _assert_equal(ref, ranks[rank][f"{model}/{act}/{weight}"], f"{model} {act}/{weight} rank {rank}")


def test_reduction_is_a_few_collectives_whatever_the_observer_count(ranks):
    for act, _ in BLOCK_CONFIGS:
        block, minilm = ranks[0][f"calls/block/{act}"], ranks[0][f"calls/minilm/{act}"]
        n_block, n_minilm = int(ranks[0][f"observers/block/{act}"]), int(ranks[0][f"observers/minilm/{act}"])
        assert n_minilm > 5 * n_block
        # error flag + observer check + shapes + at most 2 (MIN/MAX) + 3 (SUM f64/f32/i64) groups
        assert int(block) <= 8 and int(minilm) <= 8 and int(block) == int(minilm), (act, block, minilm)


def test_without_the_reduction_ranks_differ(ranks, setup):
    """The check above can fail: each rank's own shard gives other qparams."""
    gm, data = setup["block"]
    for act in ("kl", "moving_average_minmax"):
        ref = _reference(gm, data, act, "per_channel_minmax")
        local = ranks[0][f"local/{act}"]
        assert any(not torch.equal(ref[n][0], local[n][0]) for n in ref), act


@pytest.mark.parametrize("act,weight", [("kl", "per_channel_mse"),
                                        ("moving_average_minmax", "moving_average_per_channel_minmax")])
def test_calibrating_twice_adds_only_new_batches(ranks, setup, act, weight):
    gm, data = setup["block"]
    ref = _reference(gm, data, act, weight, chunks=[data[:3], data[3:]])
    for rank in range(WORLD):
        _assert_equal(ref, ranks[rank][f"twice/{act}"], f"twice {act} rank {rank}")


def test_moving_average_of_a_strided_split_is_one_process_in_rank_major_order(ranks, setup):
    """The documented equivalence where the order changes: rank 0's batches, then rank 1's."""
    gm, data = setup["block"]
    act, weight = "moving_average_minmax", "moving_average_per_channel_minmax"
    ref = _reference(gm, data[0::2] + data[1::2], act, weight)
    for rank in range(WORLD):
        _assert_equal(ref, ranks[rank]["strided"], f"strided rank {rank}")
    original = _reference(gm, data, act, weight)  # a moving average depends on the order
    assert any(not torch.equal(ref[n][0], original[n][0]) for n in ref)


def test_sync_of_observers_outside_a_graph_torchao_included(ranks):
    ref = _state(_observer_set(None))
    for rank in range(WORLD):
        got = ranks[rank]["direct"]
        for key in ("ao_minmax.min_val", "ao_minmax.max_val", "ao_per_channel.min_val", "ao_per_channel.max_val",
                    "qk_per_channel.min_val", "qk_hist.histogram", "qk_hist.bin_exp", "qk_hist.min_val",
                    "declared.total", "declared.peak"):
            assert torch.equal(ref[key], got[key]), (rank, key)


def test_a_rank_with_nan_fails_every_rank(ranks, setup):
    r0, r1 = ranks[0]["nan"], ranks[1]["nan"]
    assert r1.startswith("CalibrationError: observer at node") and "NaN or inf" in r1, r1
    assert r0 == "CalibrationError: calibration failed on rank 1 of 2 (see that rank's error); every rank stops", r0
    assert "\n" not in r0 + r1
    gm, data = setup["block"]
    _assert_equal(_reference(gm, data, "minmax", "per_channel_minmax"), ranks[0]["after_nan"], "after a failure")


def test_unsyncable_observer_is_named():
    from torchao.quantization.pt2e.observer import HistogramObserver, MovingAverageMinMaxObserver

    from quantkit.observers._sync import _adapter

    for obs, why in ((HistogramObserver(), "no exactly mergeable grid"),
                     (MovingAverageMinMaxObserver(), "keeps no batch history")):
        with pytest.raises(ValueError) as err:
            _adapter(obs, "act_post_3", 0, 2)
        msg = str(err.value)
        assert f"cannot sync the {type(obs).__name__} at 'act_post_3'" in msg and why in msg and "\n" not in msg


def test_shard():
    data = list(range(7))
    parts = [quantkit.shard(data, r, 3) for r in range(3)]
    assert parts == [[0, 1], [2, 3], [4, 5, 6]] and sum(parts, []) == data  # contiguous, rank order = order
    assert [list(quantkit.shard(iter(data), r, 3)) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert quantkit.shard(tuple(data), 1, 2) == (3, 4, 5, 6)
    assert quantkit.shard(data) == data  # one process
    with pytest.raises(ValueError, match="need 0 <= rank < world_size, got rank=2, world_size=2"):
        quantkit.shard(data, 2, 2)
    with pytest.raises(TypeError, match="shard splits an iterable of batches, got Tensor"):
        quantkit.shard(torch.zeros(3))


def test_distributed_argument(setup):
    gm, data = setup["block"]
    prepared = _prepare(gm, "minmax", "per_channel_minmax")
    with pytest.raises(ValueError, match="distributed=True needs an initialised torch.distributed process group"):
        quantkit.calibrate(prepared, data, progress=False, distributed=True)
    with pytest.raises(ValueError, match="distributed must be 'auto', True or False, got 'yes'"):
        quantkit.calibrate(prepared, data, progress=False, distributed="yes")
    assert sync(prepared) is prepared  # no process group: nothing to do


# --- torchrun ------------------------------------------------------------------------

def _torchrun(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", QUANTKIT_DIST_TIMEOUT="120")
    target = [script] if script else ["-m", "quantkit"]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                           "--master-port", str(_port()), *target, *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def _scales(out: Path) -> list:
    doc = json.loads((out / "quantization.json").read_text())
    return [(t["node"], t["scale"], t["zero_point"]) for t in doc["tensors"]]


def test_torchrun_cli_equals_one_process(tmp_path):
    from quantkit.cli import main

    text = tmp_path / "sentences.txt"  # 10 calibration sentences in 5 batches (2 and 3 per rank), 2 held out
    text.write_text("\n".join(_hf.read_sentences(_hf.default_calibration_file())[:12]) + "\n", encoding="utf-8")
    args = ["quantize", "--calib", str(text), "--batch-size", "2", "--observer", "mse"]
    proc = _torchrun(*args, "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1, proc.stdout  # rank 0 alone prints
    assert main([*args, "--out", str(tmp_path / "one"), "--quiet"]) == 0
    one, two = _scales(tmp_path / "one"), _scales(tmp_path / "two")
    assert len(one) > 50 and one == two


def test_torchrun_cli_a_failing_rank_fails_the_run(tmp_path):
    """NaN in an activation of rank 1's shard only (sqrt of a negative input): both ranks fail with
    one line each, and nothing is written."""
    calib = tmp_path / "calib"
    calib.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(5):
        x = torch.rand(4, 16, generator=g)
        torch.save(-x if i >= 3 else x, calib / f"b{i}.pt")  # the last 8 samples: in rank 1's shard only
    out = tmp_path / "o"
    proc = _torchrun("quantize", "tests.dist_factories:sqrt_mlp", "--example-input", "4x16:float32",
                     "--calib", str(calib), "--batch-size", "4", "--observer", "minmax", "--out", str(out),
                     "--quiet", script=_QUANTKIT)
    assert proc.returncode != 0
    # torchrun relays the two ranks' stderr through one pipe, so one rank's line can arrive glued to the
    # other's (seen in CI): count the messages, not the lines
    ours = re.findall(r"quantkit: error: .*?(?=quantkit: error:|[\r\n]|$)", proc.stderr)
    assert len(ours) == 2, proc.stderr[-3000:]
    assert any("calibration failed on rank 1 of 2" in ln for ln in ours), ours
    assert any("saw NaN or inf values" in ln for ln in ours), ours
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".o.")]
